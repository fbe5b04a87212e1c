"""replace_batch_normalization: keras.applications models become privately trainable."""

from __future__ import annotations

import numpy as np
import pytest
import keras

import tensorflow as tf

from keras_noisecurve._losses import per_example_loss_fn
from keras_noisecurve.training.batchnorm import replace_batch_normalization
from keras_noisecurve.backend.tensorflow.ghost import ghost_clipped_sum, supports
from keras_noisecurve.backend.tensorflow.clipping import check_model_is_clippable


@pytest.fixture
def float64():
    old = keras.config.floatx()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    yield
    keras.config.set_floatx(old)
    keras.config.set_dtype_policy(old)


def _count(model, cls):
    return sum(isinstance(layer, cls) for layer in model._flatten_layers(include_self=False))


@pytest.mark.slow
@pytest.mark.parametrize("build", [
    lambda: keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=4),
    lambda: keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=4, alpha=0.35),
], ids=["ResNet50", "MobileNetV2"])
def test_applications_become_clippable_and_keep_their_weights(build, float64):
    model = build()
    with pytest.raises(ValueError, match="BatchNormalization"):
        check_model_is_clippable(model)
    batch_norms = _count(model, keras.layers.BatchNormalization)
    fixed = replace_batch_normalization(model)
    assert _count(fixed, keras.layers.BatchNormalization) == 0
    assert _count(fixed, keras.layers.GroupNormalization) == batch_norms
    check_model_is_clippable(fixed)
    assert supports(fixed) == (True, "")
    # every other layer keeps its weights; each group norm starts from the batch norm's gamma/beta
    old = {layer.name: layer for layer in model.layers}
    for layer in fixed.layers:
        if isinstance(layer, keras.layers.GroupNormalization):
            bn = old[layer.name.removesuffix("_groupnorm")]
            np.testing.assert_array_equal(layer.gamma.numpy(), bn.gamma.numpy())
            assert bn.gamma.shape[0] % layer.groups == 0 and layer.groups <= 32
        elif layer.weights:
            for a, b in zip(layer.weights, old[layer.name].weights):
                np.testing.assert_array_equal(a.numpy(), b.numpy())
    # a private step of the fixed network: per-example norms equal a loop over single examples
    x, y = np.random.default_rng(0).normal(size=(3, 32, 32, 3)), np.array([0, 1, 3])
    loss_fn = per_example_loss_fn("sparse_categorical_crossentropy")
    got = tf.function(lambda x, y: ghost_clipped_sum(fixed, loss_fn, x, y, None, l2_norm_clip=1.0))(x, y)
    want = []
    for i in range(3):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[i : i + 1], fixed(x[i : i + 1]))[0]
        want.append(np.sqrt(sum(np.sum(g.numpy() ** 2) for g in tape.gradient(loss, fixed.trainable_variables))))
    np.testing.assert_allclose(got.norms.numpy(), want, rtol=1e-6)


def test_layer_norm_choice_and_argument_errors():
    model = keras.Sequential([keras.Input((5, 6)), keras.layers.Dense(6), keras.layers.BatchNormalization(name="bn")])
    fixed = replace_batch_normalization(model, norm="layer")
    assert [type(layer).__name__ for layer in fixed.layers] == ["Dense", "LayerNormalization"]
    groups = replace_batch_normalization(model, groups=4).layers[-1]
    assert groups.groups == 3  # the largest divisor of 6 channels that is <= 4
    with pytest.raises(ValueError, match="norm"):
        replace_batch_normalization(model, norm="batch")
    with pytest.raises(ValueError, match="groups"):
        replace_batch_normalization(model, groups=0)
    with pytest.raises(ValueError, match="keras.Model"):
        replace_batch_normalization("model")
