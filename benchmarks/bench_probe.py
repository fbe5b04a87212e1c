"""The one-time cost of the batch probe against a private step, on the backend of ``KERAS_BACKEND``.

Before its first private step a private model runs the batch probe once per ``compile``
(``keras_noisecurve.backend.common.batch_probe``: k + 2 = 10 training-mode forward passes of the
wrapped model on 8 examples, outside any compiled step, every non-trainable variable saved
and restored). This prints, per model, in ONE process: the probe's seconds (median over
``--repeats``), the steady-state private step (``train_on_batch`` at B = ``--batch-size``,
after two warm-up steps, DP-SGD noise, ``clipping="auto"``) and their ratio — how many steps
the probe costs, once::

    python benchmarks/bench_probe.py                                   # TensorFlow
    KERAS_BACKEND=jax python benchmarks/bench_probe.py --models cnn gpt2

Models: ``cnn`` (the demo's GroupNorm CNN, 28×28×1), ``mobilenet`` (MobileNetV2,
``weights=None``, α = 0.35, 32×32×3, BatchNormalization replaced by GroupNormalization),
``gpt2`` (a KerasHub GPT-2 backbone from a small config: 2 layers, width 64, 64 tokens).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_noisecurve as knc  # noqa: E402
from keras_noisecurve.apps.models import small_groupnorm_cnn  # noqa: E402
from keras_noisecurve.backend.common import batch_probe  # noqa: E402


def _cnn(rng, batch):
    model = small_groupnorm_cnn((28, 28, 1), 10, dense_size=32, seed=0)
    return model, rng.normal(size=(batch, 28, 28, 1)).astype("float32"), rng.integers(0, 10, batch), \
        keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _mobilenet(rng, batch):
    base = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=10)
    model = knc.replace_batch_normalization(base)
    return model, rng.normal(size=(batch, 32, 32, 3)).astype("float32"), rng.integers(0, 10, batch), \
        keras.losses.SparseCategoricalCrossentropy()


def _gpt2(rng, batch):
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=1000, num_layers=2, num_heads=2, hidden_dim=64,
                                             intermediate_dim=128, max_sequence_length=64)
    tokens = keras.Input((64,), dtype="int32", name="token_ids")
    mask = keras.Input((64,), dtype="int32", name="padding_mask")
    hidden = backbone({"token_ids": tokens, "padding_mask": mask})
    model = keras.Model({"token_ids": tokens, "padding_mask": mask},
                        keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(hidden)))
    x = {"token_ids": rng.integers(1, 1000, (batch, 64)).astype("int32"),
         "padding_mask": np.ones((batch, 64), "int32")}
    return model, x, rng.integers(0, 2, batch), keras.losses.SparseCategoricalCrossentropy(from_logits=True)


MODELS = {"cnn": _cnn, "mobilenet": _mobilenet, "gpt2": _gpt2}


def measure(name, *, batch, repeats, steps):
    keras.utils.set_random_seed(0)
    model, x, y, loss = MODELS[name](np.random.default_rng(0), batch)
    private = knc.make_private(model)
    private.compile(optimizer=knc.NoiseCurveOptimizer(learning_rate=0.01, noise_multiplier=1.0, l2_norm_clip=1.0,
                                                      expected_batch_size=batch), loss=loss)
    for _ in range(2):  # warm-up: traces the step (and runs the probe once)
        private.train_on_batch(x, y)
    probe, step = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        batch_probe.check_examples_apart(private, x, y, loss_fn=private._dp_loss_fn)
        probe.append(time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(steps):
            private.train_on_batch(x, y)
        step.append((time.perf_counter() - start) / steps)
    return statistics.median(probe), statistics.median(step)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "mobilenet", "gpt2"], choices=sorted(MODELS))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per repeat")
    args = parser.parse_args(argv)
    if min(args.batch_size, args.repeats, args.steps) < 1:
        parser.error("--batch-size, --repeats and --steps must be at least 1")
    print(f"Keras {keras.__version__}, backend {keras.backend.backend()}, B = {args.batch_size}", flush=True)
    print("| model | probe s (once) | private step s | probe / step |")
    print("|---|---|---|---|")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # epsilon is not tracked on this low-level path
        for name in args.models:
            probe, step = measure(name, batch=args.batch_size, repeats=args.repeats, steps=args.steps)
            print(f"| {name} | {probe:.3f} | {step:.4f} | {probe / step:.1f} |", flush=True)


if __name__ == "__main__":
    main()
