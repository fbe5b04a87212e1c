"""The NoiseCurve optimizer without ``fit``: a custom training loop, then the same loop on 2 devices.

Part 1 writes the private step by hand — per-example clipping engine, regulariser,
``optimizer.apply_clipped_sum`` — exactly what ``a private model's ``train_step```` does.
Part 2 runs the same loop under ``tf.distribute.MirroredStrategy`` on two devices
(two logical CPU devices if the machine has no accelerators): each replica clips
its share of the global batch, the clipped sums are all-reduced, the correlated
noise is added once. With the same sampler and noise seeds both runs end with the
same weights; the script prints the largest difference.

Fixed seeds are used here so that the two runs can be compared; in real training
leave ``seed=None`` (OS entropy): a known noise seed voids the privacy guarantee.

    python examples/custom_loop.py            # about 1 min
    python examples/custom_loop.py --quick    # seconds
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def ensure_two_devices():
    """Split the CPU into 2 logical devices if there are fewer than 2 devices (before TF starts)."""
    import tensorflow as tf

    if len(tf.config.list_physical_devices("GPU")) >= 2:
        return
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
        )
    except RuntimeError:  # TensorFlow is already initialised (e.g. inside pytest): keep what exists
        pass


def build(seed):
    from keras_noisecurve.apps.models import mlp

    return mlp((28, 28, 1), 10, (64,), seed=seed)


def private_step_fn(model, optimizer, loss, batch_size):
    """The private train step of make_private, written out (docs/training.md, "Custom training loops")."""
    from keras_noisecurve.backend.tensorflow.clipping import add_regularization, get_engine, per_example_loss_fn

    engine = get_engine("vectorized")
    loss_fn = per_example_loss_fn(loss)

    def step(x, y, mask):
        clipped = engine(model, loss_fn, x, y, mask, l2_norm_clip=optimizer.l2_norm_clip)
        clipped = add_regularization(model, clipped, expected_batch_size=batch_size)
        optimizer.apply_clipped_sum(clipped.grads, model.trainable_variables)
        return clipped.per_example_loss

    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=56, help="T (default 56 = 4 epochs of B = 250)")
    parser.add_argument("--bands", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=250)
    parser.add_argument("--epsilon", type=float, default=2.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--learning-rate", type=float, default=0.5)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="T = 6, b = 2")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.bands = 6, 2
    if not 1 <= args.bands <= args.steps:
        parser.error(f"--bands must lie in [1, --steps], got {args.bands}")
    ensure_two_devices()

    import keras
    import numpy as np
    import tensorflow as tf

    import keras_noisecurve as knc
    from keras_noisecurve.apps import data

    splits = data.load_mnist5k()
    x, y = splits.x_train, splits.y_train
    n = len(y)
    B, T, b = args.batch_size, args.steps, args.bands
    mixing = knc.solve_mixing_matrix(steps=T, bands=b, objective="bandmf")
    sigma = knc.calibrate_noise_multiplier(epsilon=args.epsilon, delta=args.delta, num_examples=n,
                                           batch_size=B, steps=T, bands=b)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    init = build(args.seed).get_weights()

    def optimizer():
        return knc.NoiseCurveOptimizer(learning_rate=args.learning_rate, mixing=mixing, l2_norm_clip=args.clip,
                                       noise_multiplier=sigma, expected_batch_size=B, seed=args.seed + 1)

    def dataset(opt=None):
        # with optimizer=opt the batches start at opt's step: a restored opt continues the plan
        return knc.banded_poisson_dataset(x, y, batch_size=B, bands=b, steps=T, seed=args.seed + 2, optimizer=opt)

    # ---------------------------------------------------------- 1. one device
    start = time.perf_counter()
    model = build(args.seed)
    model.set_weights(init)
    opt = optimizer()
    step = tf.function(private_step_fn(model, opt, loss, B))
    for t, (xb, yb, mask) in enumerate(dataset(opt)):
        per_example = step(xb, yb, mask)
        if (t + 1) % max(1, T // 4) == 0 or t + 1 == T:
            mean_loss = float(tf.reduce_sum(per_example * mask) / tf.maximum(tf.reduce_sum(mask), 1.0))
            print(f"  step {t + 1}/{T}: batch loss {mean_loss:.3f}", flush=True)
    acc = float(np.mean(np.argmax(model.predict(splits.x_test, verbose=0), axis=1) == splits.y_test))
    print(f"custom loop, 1 device: T={T}, b={b}, sigma={sigma:.3f}, test accuracy {100 * acc:.2f} % "
          f"({time.perf_counter() - start:.0f}s)", flush=True)

    # ------------------------------------------------- 2. MirroredStrategy
    start = time.perf_counter()
    devices = [d.name for d in tf.config.list_logical_devices("GPU")] or [
        d.name for d in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.MirroredStrategy(devices[:2])
    with strategy.scope():
        replicated = build(args.seed)
        replicated.set_weights(init)
        opt2 = optimizer()
        opt2.build(replicated.trainable_variables)
    replica_step = private_step_fn(replicated, opt2, loss, B)

    @tf.function
    def distributed_step(batch):
        return strategy.run(replica_step, args=batch)

    for batch in strategy.experimental_distribute_dataset(dataset()):
        distributed_step(batch)
    diff = max(float(np.max(np.abs(a - c))) for a, c in zip(model.get_weights(), replicated.get_weights()))
    acc2 = float(np.mean(np.argmax(replicated.predict(splits.x_test, verbose=0), axis=1) == splits.y_test))
    print(f"custom loop, MirroredStrategy on {strategy.num_replicas_in_sync} devices: test accuracy "
          f"{100 * acc2:.2f} %, max |weight difference| vs 1 device = {diff:.2e} ({time.perf_counter() - start:.0f}s)",
          flush=True)
    if diff > 1e-4:
        print("ERROR: the distributed run does not reproduce the single-device run.", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
