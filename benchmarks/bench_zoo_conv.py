"""Benchmark-only models of ``bench_zoo.py``: every convolution kind, MobileNetV2, EfficientNetB0.

Each builder has the signature of ``tests/training/zoo.py``'s (``rng, dtype, size``) and
returns a ``zoo.Case``; only ``size.batch`` is read (the image sizes are fixed: 32×32×3,
16×16×16×3 for the 3-D model). ``keras.applications`` networks are built with
``weights=None`` and their BatchNormalization replaced by GroupNormalization
(``replace_batch_normalization``), as a user must before private training.
"""

from __future__ import annotations

import keras

from keras_noisecurve.training.batchnorm import replace_batch_normalization
from tests.training import zoo

L = keras.layers
CLASSES = 10


def _case(rng, model, size, shape):
    x = rng.normal(size=(size.batch, *shape)).astype("float32")
    return zoo.Case(model, x, rng.integers(0, CLASSES, size.batch),
                    keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _cnn(rng, size, body, shape=(32, 32, 3), stem=True):
    """Input → (a 3×3 Conv2D stem with 16 filters) → ``body`` layers → global pool → Dense."""
    inputs = keras.Input(shape)
    h = L.Conv2D(16, 3, padding="same", activation="relu")(inputs) if stem else inputs
    for layer in body:
        h = layer(h)
    pool = L.GlobalAveragePooling3D() if len(shape) == 4 else L.GlobalAveragePooling2D()
    return _case(rng, keras.Model(inputs, L.Dense(CLASSES)(pool(h))), size, shape)


def depthwise_cnn(rng, dtype="float32", size=zoo.SMALL):
    return _cnn(rng, size, [L.DepthwiseConv2D(3, padding="same", activation="relu"),
                            L.DepthwiseConv2D(3, strides=2, padding="same", depth_multiplier=2, activation="relu"),
                            L.DepthwiseConv2D(3, padding="same", activation="relu")])


def separable_cnn(rng, dtype="float32", size=zoo.SMALL):
    return _cnn(rng, size, [L.SeparableConv2D(32, 3, padding="same", activation="relu"),
                            L.SeparableConv2D(64, 3, strides=2, padding="same", activation="relu"),
                            L.SeparableConv2D(64, 3, padding="same", activation="relu")])


def grouped_cnn(rng, dtype="float32", size=zoo.SMALL):
    return _cnn(rng, size, [L.Conv2D(32, 3, padding="same", groups=4, activation="relu"),
                            L.Conv2D(64, 3, strides=2, padding="same", groups=4, activation="relu"),
                            L.Conv2D(64, 3, padding="same", groups=8, activation="relu")])


def conv3d_cnn(rng, dtype="float32", size=zoo.SMALL):
    return _cnn(rng, size, [L.Conv3D(8, 3, padding="same", activation="relu"),
                            L.Conv3D(16, 3, strides=2, padding="same", activation="relu"),
                            L.Conv3D(16, 3, padding="same", activation="relu")], shape=(16, 16, 16, 3), stem=False)


def transpose_cnn(rng, dtype="float32", size=zoo.SMALL):
    """A decoder: strided convolutions down, transposed convolutions back up."""
    return _cnn(rng, size, [L.Conv2D(32, 3, strides=2, padding="same", activation="relu"),
                            L.Conv2DTranspose(32, 3, strides=2, padding="same", activation="relu"),
                            L.Conv2DTranspose(16, 3, padding="same", activation="relu")])


def mobilenet_v2(rng, dtype="float32", size=zoo.SMALL):
    model = keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=CLASSES,
                                           classifier_activation=None)
    return _case(rng, replace_batch_normalization(model), size, (32, 32, 3))


def efficientnet_b0(rng, dtype="float32", size=zoo.SMALL):
    model = keras.applications.EfficientNetB0(weights=None, input_shape=(32, 32, 3), classes=CLASSES,
                                              classifier_activation=None)
    return _case(rng, replace_batch_normalization(model), size, (32, 32, 3))


CONV_ZOO = {
    "depthwise-conv": depthwise_cnn,
    "separable-conv": separable_cnn,
    "grouped-conv": grouped_cnn,
    "conv3d": conv3d_cnn,
    "conv2d-transpose": transpose_cnn,
    "mobilenetv2": mobilenet_v2,
    "efficientnetb0": efficientnet_b0,
}

#: targets of private / non-private on this CPU (issue 32, item 4)
CONV_TARGETS = {**{name: 1.8 for name in CONV_ZOO}, "mobilenetv2": 1.6, "efficientnetb0": 1.6}
