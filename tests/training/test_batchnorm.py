"""replace_batch_normalization: keras.applications models become privately trainable."""

from __future__ import annotations

import numpy as np
import pytest
import keras

from keras_noisecurve.training.batchnorm import replace_batch_normalization
from keras_noisecurve.training.ghost import supports
from keras_noisecurve.training.clipping import check_model_is_clippable


def _count(model, cls):
    return sum(isinstance(layer, cls) for layer in model._flatten_layers(include_self=False))


@pytest.mark.parametrize("build", [
    lambda: keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=4),
    lambda: keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=4, alpha=0.35),
], ids=["ResNet50", "MobileNetV2"])
def test_applications_become_clippable_and_keep_their_weights(build):
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
    x = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype("float32")
    assert fixed(x).shape == (2, 4)


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
