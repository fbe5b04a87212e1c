"""MirroredStrategy on the 2 logical CPU devices of tests/conftest.py: replica sums are
added, the noise is drawn once, and the run equals the single-device run."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.training import NoiseCurveOptimizer, make_private
from tests.training.helpers import random_banded_c

B, STEPS, SEED = 8, 4, 23
C = random_banded_c(STEPS, 2, rng=np.random.default_rng(4), diag_scale=0.5)


def _build(weights):
    base = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.05)),
         keras.layers.Dense(3)]
    )
    base.set_weights(weights)
    model = make_private(base, clipping="vectorized")
    model.compile(
        optimizer=NoiseCurveOptimizer(learning_rate=0.2, mixing=C, l2_norm_clip=0.3, noise_multiplier=1.0,
                                      expected_batch_size=B, seed=SEED),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def test_mirrored_equals_single_device():
    devices = tf.config.list_logical_devices("CPU")
    if len(devices) < 2:
        pytest.skip("needs the 2 logical CPU devices created by tests/conftest.py")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * B, 5)).astype("float32")
    y = rng.integers(0, 3, STEPS * B)
    w = (rng.random(STEPS * B) > 0.25).astype("float32")  # a padding mask
    keras.utils.set_random_seed(1)
    init = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(3)]).get_weights()

    single = _build(init)
    h1 = single.fit(x, y, sample_weight=w, batch_size=B, epochs=1, shuffle=False, verbose=0)

    strategy = tf.distribute.MirroredStrategy([d.name for d in devices[:2]])
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        mirrored = _build(init)
    h2 = mirrored.fit(x, y, sample_weight=w, batch_size=B, epochs=1, shuffle=False, verbose=0)

    assert int(mirrored.optimizer.iterations.numpy()) == STEPS
    for var, ref in zip(mirrored.trainable_variables, single.trainable_variables):
        copies = [c.numpy() for c in var.value.values]
        assert len(copies) == 2
        np.testing.assert_array_equal(copies[0], copies[1])  # every replica identical
        np.testing.assert_allclose(copies[0], ref.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h2.history["loss"], h1.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(h2.history["accuracy"], h1.history["accuracy"], rtol=1e-6)
