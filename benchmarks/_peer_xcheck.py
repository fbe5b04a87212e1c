"""Worker of ``crosscheck_peers.py``: train softmax regression with DP-SGD for many seeds, report test accuracy.

``--library ours``: ``keras_noisecurve`` (Keras 3, TensorFlow backend): ``make_private`` +
``NoiseCurveOptimizer(mixing="dpsgd", seed=s)``.
``--library tfp``: TensorFlow Privacy 0.9 (Keras 2 as ``tf.keras``): ``make_dp_model_class``
with the default fast-clipping registry (Dense), noise from ``tf.random`` seeded with s.
``--library jax-privacy``: jax_privacy 2.0's ``keras_api.make_private`` (Keras 3, JAX
backend), ``rescale_to_unit_norm=False``, ``seed=s``.

Both compute, for a batch of B examples, ``ĝ = (Σ_i clip(∇ℓ_i, ζ) + ζ·σ·z) / B`` with
z ~ N(0, I) and take ``w ← w − η·ĝ`` (plain SGD). The batches are given: ``--data`` is an
``.npz`` with ``x_train`` (n, 784) float32, ``y_train`` (n,), ``x_test``, ``y_test`` and
``batches`` (seeds, T, B) int, the training indices of every step of every seed, so both
libraries see the same examples in the same order and differ only in their noise draws.
The model starts at zero weights (no initialisation randomness). Writes
``{"accuracy": [...], "seeds": [...], ...}`` as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _model(keras_module):
    layers = keras_module.layers
    return keras_module.Sequential(
        [keras_module.Input((784,)), layers.Dense(10, kernel_initializer="zeros", bias_initializer="zeros")]
    )


def train_ours(x, y, x_test, y_test, order, seed, args):
    import keras

    from keras_noisecurve.training import NoiseCurveOptimizer, make_private

    private = make_private(_model(keras))
    private.compile(
        optimizer=NoiseCurveOptimizer(
            learning_rate=args.learning_rate, mixing="dpsgd", l2_norm_clip=args.clip,
            noise_multiplier=args.noise_multiplier, expected_batch_size=order.shape[1], seed=seed,
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    flat = order.reshape(-1)
    private.fit(x[flat], y[flat], batch_size=order.shape[1], epochs=1, shuffle=False, verbose=0)
    logits = private.predict(x_test, batch_size=1000, verbose=0)
    return float((logits.argmax(axis=1) == y_test).mean())


def train_tfp(x, y, x_test, y_test, order, seed, args):
    import tensorflow as tf
    from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry
    from tensorflow_privacy.privacy.keras_models.dp_keras_model import make_dp_model_class

    tf.keras.utils.set_random_seed(seed)
    inner = _model(tf.keras)
    model = make_dp_model_class(tf.keras.Model)(
        l2_norm_clip=args.clip, noise_multiplier=args.noise_multiplier, use_xla=False,
        layer_registry=layer_registry.make_default_layer_registry(), inputs=inner.inputs, outputs=inner.outputs,
    )
    if not getattr(model, "_enable_fast_peg_computation", False):
        raise RuntimeError("TF Privacy did not take its fast-clipping path for a Dense-only model")
    model.compile(optimizer=tf.keras.optimizers.SGD(args.learning_rate),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    flat = order.reshape(-1)
    model.fit(x[flat], y[flat], batch_size=order.shape[1], epochs=1, shuffle=False, verbose=0)
    logits = model.predict(x_test, batch_size=1000, verbose=0)
    return float((logits.argmax(axis=1) == y_test).mean())


def train_jax_privacy(x, y, x_test, y_test, order, seed, args):
    import keras
    from jax_privacy import keras_api

    steps, batch_size = order.shape
    params = keras_api.DPKerasConfig(
        epsilon=1e6, delta=1e-5, clipping_norm=args.clip, batch_size=batch_size, gradient_accumulation_steps=1,
        train_steps=steps, train_size=steps * batch_size, noise_multiplier=args.noise_multiplier,
        rescale_to_unit_norm=False, seed=seed,
    )
    model = keras_api.make_private(_model(keras), params)
    model.compile(optimizer=keras.optimizers.SGD(args.learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    flat = order.reshape(-1)
    model.fit(x[flat], y[flat], batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    logits = model.predict(x_test, batch_size=1000, verbose=0)
    return float((logits.argmax(axis=1) == y_test).mean())


TRAINERS = {"ours": train_ours, "tfp": train_tfp, "jax-privacy": train_jax_privacy}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--library", required=True, choices=tuple(TRAINERS))
    parser.add_argument("--data", required=True)
    parser.add_argument("--clip", type=float, required=True)
    parser.add_argument("--noise-multiplier", type=float, required=True)
    parser.add_argument("--learning-rate", type=float, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if args.library in ("ours", "jax-privacy"):
        os.environ["KERAS_BACKEND"] = "tensorflow" if args.library == "ours" else "jax"
    import numpy as np

    data = np.load(args.data)
    x, y, x_test, y_test, batches = (data[k] for k in ("x_train", "y_train", "x_test", "y_test", "batches"))
    train = TRAINERS[args.library]
    accuracy, start = [], time.perf_counter()
    for i, seed in enumerate(args.seeds):
        accuracy.append(train(x, y, x_test, y_test, batches[i], seed, args))
        print(f"{args.library} seed {seed}: test accuracy {accuracy[-1]:.4f}", flush=True)
    result = {"library": args.library, "seeds": list(args.seeds), "accuracy": accuracy,
              "seconds": time.perf_counter() - start}
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
