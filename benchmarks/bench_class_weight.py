"""``train_on_batch(..., class_weight=...)`` of a private model against a plain Keras model's
``train_on_batch`` on the same small model and batch (the backend of ``KERAS_BACKEND``).

The private step is traced once per class-weight table (``PrivateModel._dp_use_class_weight``
keeps each table's traced step), so repeated calls with the same table cost one step each.
Prints the median per-call time (ms) of ``--calls`` calls after ``--warmup`` calls, for:
plain Keras, private without class_weight, private with class_weight, and their ratio.

    KERAS_BACKEND=jax python benchmarks/bench_class_weight.py
"""

import argparse
import time

import keras
import numpy as np

import keras_noisecurve as knc


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(3)])


def _time(call, warmup, calls):
    for _ in range(warmup):
        call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, 20)).astype("float32")
    y = rng.integers(0, 3, args.batch).astype("int32")
    table = {0: 1.0, 1: 2.0, 2: 0.5}
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    plain = _model()
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    private = knc.make_private(_model())
    private.compile(optimizer=knc.NoiseCurveOptimizer(noise_multiplier=1.0, expected_batch_size=args.batch,
                                                      learning_rate=0.1), loss=loss)
    results = {
        "plain Keras": _time(lambda: plain.train_on_batch(x, y, class_weight=table), args.warmup, args.calls),
        "private": _time(lambda: private.train_on_batch(x, y), args.warmup, args.calls),
        "private, class_weight": _time(lambda: private.train_on_batch(x, y, class_weight=table),
                                       args.warmup, args.calls),
    }
    print(f"backend {keras.backend.backend()}, batch {args.batch}, median of {args.calls} calls")
    for name, ms in results.items():
        print(f"  {name:24s} {ms:8.2f} ms/call")
    ratio = results["private, class_weight"] / results["plain Keras"]
    print(f"  private with class_weight / plain Keras: {ratio:.2f}x")


if __name__ == "__main__":
    main()
