"""One private step vs plain Keras-JAX ``train_on_batch`` on CPU (or whatever JAX runs on).

    KERAS_BACKEND=jax python benchmarks/bench_jax_step.py [--batch-size 256] [--steps 20]

A small MLP (64-128-128-10, 6 variables) at batch size B; both steps are
``train_on_batch`` (jit-compiled by Keras's JAX trainer); the private one clips per
example (``vmap`` of ``jax.grad``) and adds DP-SGD noise (``NoiseCurveOptimizer``,
C = I). Prints the median wall time of ``--steps`` steps after 3 warm-up steps (the
first compiles) and the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_noisecurve as knc  # noqa: E402


def _model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                             keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])


def _median_step(step, steps):
    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch_size, 64)).astype("float32")
    y = rng.integers(0, 10, size=(args.batch_size,)).astype("int32")
    mask = np.ones(args.batch_size, np.float32)

    plain = _model(0)
    plain.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    plain_s = _median_step(lambda: plain.train_on_batch(x, y), args.steps)

    private = knc.make_private(_model(0))
    private.compile(optimizer=knc.NoiseCurveOptimizer(learning_rate=0.01, noise_multiplier=1.0,
                                                      expected_batch_size=args.batch_size),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    private_s = _median_step(lambda: private.train_on_batch(x, y, sample_weight=mask), args.steps)
    print(f"backend {keras.backend.backend()}, B = {args.batch_size}, median of {args.steps} steps after 3 warm-ups")
    print(f"plain train_on_batch:   {plain_s * 1e3:8.2f} ms")
    print(f"private (DP-SGD) step:  {private_s * 1e3:8.2f} ms  ({private_s / plain_s:.2f}x)")


if __name__ == "__main__":
    main()
