"""Private step time with and without XLA (``jit_compile``) and under the mixed-precision
policies, on the MLP and the transformer block of ``bench_step.py``.

Each configuration is a private model (``make_private``, clipping ``"auto"``) with a
``NoiseCurveOptimizer`` (DP-SGD, or a random banded C with b = 16 for ``--bands 16``);
its ``train_step`` is wrapped in ``tf.function`` as ``fit`` does it (``jit_compile=True``
for the XLA rows). All configurations of a model are timed in ONE process, interleaved
(each round runs every configuration once, the order rotating), and the median per-step
time over the rounds is reported with the ratio to float32 without XLA. The non-private
rows (plain Keras ``train_step``) are for reference::

    python benchmarks/bench_precision.py --models mlp transformer --batch-size 64

Policies are set with ``keras.config.set_dtype_policy`` before each model is built (no
``dtype=`` on layers); variables stay float32.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import bench_step  # noqa: E402
from keras_noisecurve.training import NoiseCurveOptimizer, make_private  # noqa: E402

#: name -> (private, dtype policy, jit_compile)
CONFIGS = {
    "non-private float32": (False, "float32", False),
    "non-private float32 XLA": (False, "float32", True),
    "float32": (True, "float32", False),
    "float32 XLA": (True, "float32", True),
    "mixed_bfloat16": (True, "mixed_bfloat16", False),
    "mixed_float16": (True, "mixed_float16", False),
    "mixed_bfloat16 XLA": (True, "mixed_bfloat16", True),
}


def build(model_name, config, batch_size, bands, steps_planned):
    private, policy, jit = config
    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        model = bench_step.MODELS[model_name][0]()
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        if not private:
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss, jit_compile=jit)
        else:
            mixing = "dpsgd" if bands == 1 else bench_step.banded_mixing(steps_planned, bands)
            model = make_private(model, clipping="auto")
            model.compile(
                optimizer=NoiseCurveOptimizer(learning_rate=0.05, mixing=mixing, l2_norm_clip=1.0,
                                              noise_multiplier=1.0, expected_batch_size=batch_size),
                loss=loss, jit_compile=jit,
            )
    finally:
        keras.config.set_dtype_policy("float32")
    step = tf.function(model.train_step, jit_compile=jit, reduce_retracing=True)
    return model, step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer"], choices=sorted(bench_step.MODELS))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--bands", type=int, default=1, help="1: DP-SGD; b > 1: a random banded C")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration per round")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, {os.cpu_count()} CPUs, "
          f"batch {args.batch_size}, bands {args.bands}, median of {args.repeats} rounds x {args.steps} steps")
    planned = (args.repeats * args.steps + args.warmup + 8) * len(args.configs)
    for model_name in args.models:
        rng = np.random.default_rng(1)
        x = tf.constant(rng.normal(size=(args.batch_size, *bench_step.MODELS[model_name][1])).astype("float32"))
        y = tf.constant(rng.integers(0, 10, args.batch_size))
        runs = {}
        for name in args.configs:
            model, step = build(model_name, CONFIGS[name], args.batch_size, args.bands, planned)
            start = time.perf_counter()
            step((x, y))
            compile_s = time.perf_counter() - start
            for _ in range(args.warmup):
                step((x, y))
            runs[name] = (step, compile_s)
        times = {name: [] for name in runs}
        names = list(runs)
        for r in range(args.repeats):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                step = runs[name][0]
                start = time.perf_counter()
                for _ in range(args.steps):
                    out = step((x, y))
                float(out["loss"])
                times[name].append((time.perf_counter() - start) / args.steps)
        median = {name: 1000 * float(np.median(t)) for name, t in times.items()}
        ref = median.get("float32")
        print(f"\n== {model_name}, batch {args.batch_size} ==")
        print(f"{'configuration':>26}  {'ms/step':>8}  {'/ float32':>9}  {'first call s':>12}")
        for name in names:
            ratio = f"{median[name] / ref:8.2f}x" if ref else ""
            print(f"{name:>26}  {median[name]:8.1f}  {ratio:>9}  {runs[name][1]:12.1f}")


if __name__ == "__main__":
    main()
