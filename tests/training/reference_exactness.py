"""Relative error of the reference engine (``clipping="vectorized"``, a per-example loop)
and of ``"auto"`` against a float64 per-example Python loop on the paper's GroupNorm CNN.

Run as ``python -m tests.training.reference_exactness`` with ``TF_ENABLE_ONEDNN_OPTS`` set
either way (oneDNN's kernels are chosen when TensorFlow starts, hence a process per
setting); prints one JSON line ``{"onednn": ..., "vectorized": err, "auto": err}`` where
err = ‖sum − reference‖₂ / ‖reference‖₂ over all variables of the clipped sum of a
training step (the engines inside ``tf.function``, as ``fit`` runs them).
"""

import json
import os

import numpy as np

P, CLIP = int(os.environ.get("REFERENCE_P", "8")), 1.0


def main():
    import keras
    import tensorflow as tf

    from keras_noisecurve.apps.models import small_groupnorm_cnn
    from keras_noisecurve.backend.tensorflow.clipping import get_engine, per_example_loss_fn

    rng = np.random.default_rng(0)
    x = rng.normal(size=(P, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, P)
    w = np.ones(P, np.float32)
    model = small_groupnorm_cnn((28, 28, 1), 10, dense_size=32, seed=0)
    model(x[:1])
    keras.config.set_floatx("float64")
    try:
        wide = small_groupnorm_cnn((28, 28, 1), 10, dense_size=32, seed=0)
        wide(x[:1].astype("float64"))
    finally:
        keras.config.set_floatx("float32")
    wide.set_weights([v.astype("float64") for v in model.get_weights()])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    reference = [np.zeros(v.shape, np.float64) for v in wide.trainable_variables]
    for i in range(P):
        with tf.GradientTape() as tape:
            value = loss(y[i : i + 1], wide(x[i : i + 1].astype("float64"), training=True))
        g = [t.numpy() for t in tape.gradient(value, wide.trainable_variables)]
        norm = np.sqrt(sum(np.sum(t**2) for t in g))
        reference = [r + t * min(1.0, CLIP / norm) for r, t in zip(reference, g)]
    ref = np.concatenate([r.ravel() for r in reference])

    errors = {}
    for name in ("vectorized", "auto"):
        engine = get_engine(name, model)
        step = tf.function(lambda a, b, c, e=engine: e(model, per_example_loss_fn(loss), a, b, c, l2_norm_clip=CLIP).grads)
        got = np.concatenate([g.numpy().astype(np.float64).ravel() for g in step(x, y, w)])
        errors[name] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    print(json.dumps({"onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS"), **errors}))


if __name__ == "__main__":
    main()
