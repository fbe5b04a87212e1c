"""What user-level clipping costs: the ghost engine's clipped sum of one batch of P rows, clipped
per example (``unit_rows=1``) and per user (``unit_rows=k``: P/k users of k rows), measured in one
run, interleaved (A B A B …), on the backend in use.

The models: a small transformer block on token ids (Embedding, MultiHeadAttention, LayerNorm,
Dense: every layer keeps its ghost rule per user, on rows merged per user) and the demo's GroupNorm
CNN (its convolutions and GroupNorm take the exact per-layer fallback per user). Each round times
``--steps`` calls of the compiled step (``jax.jit`` / ``tf.function``; the first, which compiles,
left out) per variant and reports the median milliseconds per step and the ratio user / example.

    python benchmarks/bench_user_level.py                    # TensorFlow
    KERAS_BACKEND=jax python benchmarks/bench_user_level.py  # JAX
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def transformer(seed=0, vocabulary=1000, length=32, width=64):
    import keras

    keras.utils.set_random_seed(seed)
    ids = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocabulary, width)(ids)
    a = keras.layers.MultiHeadAttention(num_heads=4, key_dim=width // 4)(h, h)
    h = keras.layers.LayerNormalization()(h + a)
    f = keras.layers.Dense(width)(keras.layers.Dense(2 * width, activation="gelu")(h))
    h = keras.layers.LayerNormalization()(h + f)
    out = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(ids, out)


def batch(name, rows, rng):
    if name == "transformer":
        return transformer(), rng.integers(0, 1000, size=(rows, 32)).astype("int32")
    from keras_noisecurve.apps.models import small_groupnorm_cnn

    return (small_groupnorm_cnn((28, 28, 1), num_classes=10, dense_size=32, seed=0),
            rng.normal(size=(rows, 28, 28, 1)).astype("float32"))


def compiled_step(model, unit_rows):
    """``step(x, y, w) -> clipped sums`` of the ghost engine, compiled."""
    import keras

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    if keras.backend.backend() == "jax":
        import jax

        from keras_noisecurve.backend.jax.ghost import ghost_clipped_sum

        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        fn = jax.jit(lambda tv, x, y, w: ghost_clipped_sum(model, loss, tv, non_trainable, x, y, w, l2_norm_clip=1.0,
                                                           clipping="ghost", unit_rows=unit_rows)[0])
        return lambda x, y, w: jax.block_until_ready(fn(trainable, x, y, w))
    import tensorflow as tf

    from keras_noisecurve.backend.tensorflow.ghost import ghost_clipped_sum

    fn = tf.function(lambda x, y, w: ghost_clipped_sum(model, loss, x, y, w, l2_norm_clip=1.0,
                                                       unit_rows=unit_rows).grads)
    return lambda x, y, w: [g.numpy() for g in fn(x, y, w)]


def timed(step, args, x, y, w):
    step(x, y, w)  # compile
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step(x, y, w)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=256, help="P, the rows of the batch (the same for both)")
    p.add_argument("--examples-per-user", type=int, default=8, help="k (P/k users)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", default="transformer,cnn")
    args = p.parse_args(argv)
    import keras

    rng = np.random.default_rng(0)
    k = args.examples_per_user
    for name in args.models.split(","):
        model, x = batch(name, args.rows, rng)
        y = rng.integers(0, 10, size=args.rows).astype("int32")
        w = np.ones(args.rows, np.float32)
        example, user = compiled_step(model, 1), compiled_step(model, k)
        per_example, per_user = [], []
        for r in range(args.rounds):
            per_example.append(timed(example, args, x, y, w))
            per_user.append(timed(user, args, x, y, w / k))
            print(f"{name} round {r}: example {1e3 * per_example[-1]:.1f} ms, user {1e3 * per_user[-1]:.1f} ms",
                  flush=True)
        e, u = float(np.median(per_example)), float(np.median(per_user))
        print(f"{keras.backend.backend()}: {name}, P = {args.rows} rows, k = {k} ({args.rows // k} users), median of "
              f"{args.rounds} interleaved rounds of {args.steps} steps: example-level {1e3 * e:.1f} ms/step, "
              f"user-level {1e3 * u:.1f} ms/step, ratio user / example = {u / e:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
