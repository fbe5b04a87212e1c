"""Step time of private (ghost clipping, DP-SGD noise) vs non-private recurrent text classifiers.

Models: ``Embedding(vocab, 64) → LSTM(64) | GRU(64) → Dense(2)`` on token sequences of
length L (no padding), batch B. Every configuration is built and warmed up in ONE
process, then timed interleaved (the order rotates each round); the median per-step
time over rounds is reported with the ratio private / non-private (target ≤ 3× on
CPU). The first call of each step function (trace + compile + one step) is reported as
"first call" (the first private model of the process also pays a one-time ~2–4 s
set-up: run with ``--cells gru lstm`` to see it move). ``--engine`` adds the clipping engine alone (``ghost_clipped_sum`` against a
plain gradient of the summed loss, no optimizer).

    python benchmarks/bench_rnn.py --cells lstm gru --batch-size 32 --length 32
    python benchmarks/bench_rnn.py --cells lstm gru --length 128 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_noisecurve.training import NoiseCurveOptimizer, make_private  # noqa: E402

LEARNING_RATE = 0.05
CELLS = {"lstm": keras.layers.LSTM, "gru": keras.layers.GRU, "simple": keras.layers.SimpleRNN}


def text_classifier(cell, vocab, width, length):
    return keras.Sequential(
        [
            keras.Input((length,), dtype="int32"),
            keras.layers.Embedding(vocab, width),
            CELLS[cell](width),
            keras.layers.Dense(2),
        ],
        name=f"{cell}_classifier",
    )


def build(cell, private, args):
    keras.utils.set_random_seed(0)
    model = text_classifier(cell, args.vocab, args.width, args.length)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if not private:
        model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=loss, jit_compile=False)
        return model
    dp = make_private(model, clipping="ghost")
    dp.compile(
        optimizer=NoiseCurveOptimizer(
            learning_rate=LEARNING_RATE, mixing="dpsgd", l2_norm_clip=1.0, noise_multiplier=1.0,
            expected_batch_size=args.batch_size,
        ),
        loss=loss,
    )
    return dp


def step_function(model):
    @tf.function(reduce_retracing=True)
    def step(x, y):
        return model.train_step((x, y))

    return step


def engine_functions(cell, args):
    from keras_noisecurve.backend.tensorflow.ghost import ghost_clipped_sum

    keras.utils.set_random_seed(0)
    model = text_classifier(cell, args.vocab, args.width, args.length)
    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    variables = model.trainable_variables

    @tf.function
    def plain(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(per_example(y, model(x, training=True)))
        return {"loss": loss, "grads": tape.gradient(loss, variables)}

    @tf.function
    def ghost(x, y):
        out = ghost_clipped_sum(model, per_example, x, y, None, l2_norm_clip=1.0)
        return {"loss": tf.reduce_sum(out.per_example_loss), "grads": out.grads}

    return {f"{cell} gradient": plain, f"{cell} ghost clipped sum": ghost}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", default=["lstm", "gru"], choices=sorted(CELLS))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--width", type=int, default=64, help="embedding width = recurrent units")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--engine", action="store_true", help="also time the clipping engine alone")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    x = tf.constant(rng.integers(0, args.vocab, size=(args.batch_size, args.length)), tf.int32)
    y = tf.constant(rng.integers(0, 2, size=args.batch_size))
    fns, first = {}, {}
    for cell in args.cells:
        for private in (False, True):
            name = f"{cell} {'private' if private else 'non-private'}"
            step = step_function(build(cell, private, args))
            start = time.perf_counter()
            float(step(x, y)["loss"])
            first[name] = time.perf_counter() - start
            fns[name] = step
        if args.engine:
            for name, fn in engine_functions(cell, args).items():
                start = time.perf_counter()
                float(fn(x, y)["loss"])
                first[name] = time.perf_counter() - start
                fns[name] = fn
    for fn in fns.values():
        for _ in range(args.warmup):
            fn(x, y)
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(args.repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            for _ in range(args.steps):
                out = fns[name](x, y)
            float(out["loss"])
            times[name].append((time.perf_counter() - start) / args.steps)
    median = {name: float(np.median(t)) for name, t in times.items()}
    print(f"B = {args.batch_size}, L = {args.length}, vocab {args.vocab}, width {args.width}; "
          f"medians of {args.repeats} interleaved rounds of {args.steps} steps")
    for name in names:
        print(f"{name:>28}: {1000 * median[name]:8.2f} ms/step   first call {first[name]:6.2f} s")
    for cell in args.cells:
        private, base = f"{cell} private", f"{cell} non-private"
        print(f"{cell}: private / non-private = {median[private] / median[base]:.2f}x (target <= 3)   "
              f"first call {first[private] / first[base]:.2f}x")
        if args.engine:
            engine = median[f"{cell} ghost clipped sum"] / median[f"{cell} gradient"]
            print(f"{cell}: engine only, ghost clipped sum / gradient = {engine:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
