"""Shared by every worker of ``bench_peers.py``: the model definitions, the data and the timer.

Imported by interpreters of several virtual environments (Python 3.11 and 3.13; Keras 3
with TensorFlow or JAX, and Keras 2 as ``tf.keras``), so it imports no framework itself:
each builder takes the ``keras`` module to build with.

The CNN and the transformer block are the functions ``groupnorm_cnn`` and
``transformer_block`` of ``benchmarks/bench_step.py``, read from that file's source (with
``ast``) and evaluated with the given ``keras`` module, so every library trains the very
same definition without importing bench_step (which imports TensorFlow and this library).
The MLP is 784 → 512 → 512 → 10 (ReLU; 669,706 parameters).

Timing: one ``fit`` over ``warmup + steps`` batches with a callback that, at the end of
every batch, waits for the batch's loss (``float(logs["loss"])``) and reads
``time.perf_counter()``; the step time of batch i is the time between the ends of batches
i − 1 and i, so it covers everything ``fit`` does per step (data, step, callbacks). The
first ``warmup`` batches (compilation included) are dropped; the median of the rest is
reported. Peak memory is the process's ``ru_maxrss`` (framework and interpreter included).
"""

from __future__ import annotations

import ast
import json
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

#: model name -> (batch size, input shape of one example)
MODELS = {
    "mlp": (256, (784,)),
    "cnn": (128, (32, 32, 3)),
    "transformer": (64, (64, 64)),
}
MODEL_TITLES = {
    "mlp": "MLP 784-512-512-10, B = 256",
    "cnn": "GroupNorm CNN, B = 128",
    "transformer": "1-block transformer, L = 64, B = 64",
}
LEARNING_RATE = 0.05
L2_NORM_CLIP = 1.0
NOISE_MULTIPLIER = 1.0


def _bench_step_functions(names, keras_module):
    """Evaluate the named top-level functions of bench_step.py with ``keras`` = ``keras_module``."""
    path = os.path.join(HERE, "bench_step.py")
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), filename=path)
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    missing = set(names) - {node.name for node in wanted}
    if missing:
        raise RuntimeError(f"bench_step.py defines no function(s) {sorted(missing)}")
    namespace = {"keras": keras_module}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), path, "exec"), namespace)  # noqa: S102
    return {name: namespace[name] for name in names}


def build_model(name, keras_module):
    """The model ``name`` ('mlp', 'cnn', 'transformer') built with ``keras_module``; logits out."""
    if name == "mlp":
        layers = keras_module.layers
        return keras_module.Sequential(
            [keras_module.Input((784,)), layers.Dense(512, activation="relu"),
             layers.Dense(512, activation="relu"), layers.Dense(10)],
            name="mlp512",
        )
    functions = _bench_step_functions(("groupnorm_cnn", "transformer_block"), keras_module)
    if name == "cnn":
        return functions["groupnorm_cnn"]()
    if name == "transformer":
        return functions["transformer_block"](length=MODELS["transformer"][1][0])
    raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")


def make_data(name, batches, seed=0):
    """``batches`` batches of Gaussian inputs and uniform labels in 0..9 (float32 / int32 numpy)."""
    import numpy as np

    batch_size, shape = MODELS[name]
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batches * batch_size, *shape)).astype("float32")
    y = rng.integers(0, 10, size=batches * batch_size).astype("int32")
    return x, y


def step_timer(keras_module):
    """A callback recording the end time of every training batch (after its loss is ready)."""

    class StepTimer(keras_module.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends = []

        def on_train_begin(self, logs=None):
            self.ends = [time.perf_counter()]

        def on_train_batch_end(self, batch, logs=None):
            if logs and "loss" in logs:
                float(logs["loss"])
            self.ends.append(time.perf_counter())

    return StepTimer()


def summarise(ends, warmup):
    """Median step time (ms) of the batches after the first ``warmup`` ones, and all of them."""
    steps = [1000.0 * (b - a) for a, b in zip(ends[:-1], ends[1:])]
    timed = sorted(steps[warmup:])
    if not timed:
        raise RuntimeError(f"no timed steps: {len(steps)} step(s) recorded, warm-up {warmup}")
    mid = len(timed) // 2
    median = timed[mid] if len(timed) % 2 else 0.5 * (timed[mid - 1] + timed[mid])
    return median, steps


def peak_rss_mib():
    """This process's peak resident set size in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def write_result(path, **result):
    """Write the worker's result as JSON (``path``) and echo it on stdout."""
    result.setdefault("peak_rss_mib", peak_rss_mib())
    result.setdefault("python", sys.version.split()[0])
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    print(json.dumps(result))


def parse_worker_args(argv, choices):
    """Common worker arguments: --model, --config, --warmup, --steps, --out."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, choices=sorted(MODELS))
    parser.add_argument("--config", required=True, choices=choices)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)
