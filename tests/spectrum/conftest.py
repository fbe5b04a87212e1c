"""Small float64 models and data shared by the spectrum tests."""

import numpy as np
import pytest


def tanh_mlp(inputs=8, hidden=(16,), outputs=3, seed=0):
    import keras

    keras.utils.set_random_seed(seed)
    inp = keras.Input((inputs,), dtype="float64")
    h = inp
    for width in hidden:
        h = keras.layers.Dense(width, activation="tanh", dtype="float64")(h)
    out = keras.layers.Dense(outputs, dtype="float64")(h)
    return keras.Model(inp, out)


def groupnorm_cnn(seed=0, size=6, channels=2, filters=4, groups=2, classes=3):
    import keras

    keras.utils.set_random_seed(seed)
    inp = keras.Input((size, size, channels), dtype="float64")
    h = keras.layers.Conv2D(filters, 3, padding="same", dtype="float64")(inp)
    h = keras.layers.GroupNormalization(groups=groups, dtype="float64")(h)
    h = keras.layers.Activation("tanh", dtype="float64")(h)
    h = keras.layers.GlobalAveragePooling2D(dtype="float64")(h)
    out = keras.layers.Dense(classes, dtype="float64")(h)
    return keras.Model(inp, out)


def reference_hessian(model, x, y, loss_fn):
    """Dense Hessian by tf.GradientTape.jacobian of the flat gradient (independent path)."""
    import tensorflow as tf

    variables = model.trainable_variables
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            value = tf.reduce_mean(loss_fn(tf.constant(y), model(tf.constant(x), training=False)))
        g = tf.concat([tf.reshape(t, [-1]) for t in inner.gradient(value, variables)], 0)
    blocks = outer.jacobian(g, variables)
    return np.concatenate([np.reshape(b.numpy(), (g.shape[0], -1)) for b in blocks], axis=1)


@pytest.fixture
def rng():
    return np.random.default_rng(0)
