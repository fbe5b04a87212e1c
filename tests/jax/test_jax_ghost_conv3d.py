"""The JAX ``Conv3D`` rule and the transposed-convolution rule (``Conv1DTranspose``,
``Conv2DTranspose``, ``Conv3DTranspose``) of keras_noisecurve.backend.common.ghost_conv inside the
JAX ghost engine, against the INDEPENDENT per-example loop of tests/jax/helpers.reference_clipped_sum
(one ``jax.grad`` of the model's ``stateless_call`` per example, clipping in float64 numpy),
with the ``fallbacks`` fixture of tests/jax/conftest.py: a ruled layer must not reach the
engine's per-layer fallback, an unruled one (an ``output_padding``) must, and stay exact.

Tolerances as in tests/jax/test_jax_ghost_conv.py (its ``_compare``): float32, norms rtol 1e-4,
sums atol 1e-4 × the largest reference entry; bfloat16 compute at 3e-2. The input volume is
4×5×6 (three different sizes: a swapped depth/height/width axis changes the windows); the
transposed layers take inputs of unequal sides too.
"""

import keras
import pytest

from tests.jax.test_jax_ghost_conv import _compare, _data, _model

SHAPE = (4, 5, 6, 4)

CONV3D = {
    # L = output positions, d_in = c_in/G·K, d_out = filters/G: Gram form when L² < d_in·d_out
    "valid-materialised": dict(filters=3, kernel_size=2),  # L = 60, L² ≥ 4·8·3
    "valid-strided-gram-relu": dict(filters=4, kernel_size=3, strides=2, activation="relu"),  # L = 4
    "same-strides-2x1x2-tanh-no-bias": dict(filters=3, kernel_size=(3, 2, 3), strides=(2, 1, 2), padding="same",
                                           activation="tanh", use_bias=False),
    "dilation-2-same": dict(filters=2, kernel_size=(2, 3, 2), dilation_rate=2, padding="same"),
    "groups-2-valid-gelu": dict(filters=4, kernel_size=(2, 2, 3), groups=2, activation="gelu"),
    "groups-2-strided-gram": dict(filters=4, kernel_size=3, strides=2, groups=2),  # L = 4 (Keras refuses strides with dilation)
    "pointwise-strided-groups-2": dict(filters=4, kernel_size=1, strides=2, groups=2, padding="same"),
}


@pytest.mark.parametrize("case", sorted(CONV3D))
def test_conv3d_rule_equals_the_per_example_loop(case, fallbacks):
    model = _model(SHAPE, keras.layers.Conv3D(**CONV3D[case]), seed=21)
    _compare(model, *_data(model, seed=21))
    assert fallbacks == []


def test_a_shared_conv3d_on_two_sizes_beside_a_channels_first_one(fallbacks):
    """One Conv3D called on two volume sizes (its positions from both calls add up), and a
    channels_first Conv3D: both ruled, nothing on the fallback."""
    keras.utils.set_random_seed(22)
    inputs = keras.Input(SHAPE)
    shared = keras.layers.Conv3D(3, 2, padding="same", activation="relu", name="shared")
    a = shared(inputs)
    b = shared(keras.layers.MaxPooling3D(pool_size=2, padding="same")(inputs))
    first = keras.layers.Conv3D(2, 2, data_format="channels_first", name="first")(keras.layers.Permute((4, 1, 2, 3))(a))
    h = keras.layers.Concatenate()([keras.layers.Flatten()(first), keras.layers.Flatten()(b)])
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    _compare(model, *_data(model, n=8, seed=22))
    assert fallbacks == []


TRANSPOSE = {
    # (rank, kwargs); inputs 3×4 (1-D), 3×4×2 (2-D), 2×3×2×2 (3-D). L = the INPUT positions,
    # d_in = filters·K, d_out = c_in: Gram form when L² < d_in·d_out
    "1d-valid-stride-2-relu": (1, dict(filters=3, kernel_size=3, strides=2, activation="relu")),
    "1d-same-dilation-2-no-bias": (1, dict(filters=2, kernel_size=3, dilation_rate=2, padding="same",
                                           use_bias=False)),
    "1d-valid-kernel-below-stride": (1, dict(filters=2, kernel_size=2, strides=3)),  # output wider than the windows
    "2d-same-strides-2x1-tanh": (2, dict(filters=3, kernel_size=(3, 2), strides=(2, 1), padding="same",
                                         activation="tanh")),
    "2d-valid-strides-2-even-kernel": (2, dict(filters=2, kernel_size=4, strides=2)),
    "2d-same-strides-3-pointwise": (2, dict(filters=3, kernel_size=1, strides=3, padding="same")),
    "2d-valid-kernel-below-stride": (2, dict(filters=2, kernel_size=2, strides=3)),  # materialised
    # "same" with an odd total padding k_eff − s: ⌊total/2⌋ zeros before (not ⌈total/2⌉)
    "1d-same-kernel-4-odd-padding": (1, dict(filters=2, kernel_size=4, padding="same")),
    "2d-same-kernel-5-stride-2-odd-padding": (2, dict(filters=2, kernel_size=(5, 3), strides=2, padding="same")),
    "3d-same-strides-2x1x2": (3, dict(filters=2, kernel_size=(3, 2, 3), strides=(2, 1, 2), padding="same")),
    "3d-valid-dilation-2-gelu": (3, dict(filters=2, kernel_size=2, dilation_rate=2, activation="gelu")),
}
_TRANSPOSE_LAYERS = {1: (keras.layers.Conv1DTranspose, (3, 4)), 2: (keras.layers.Conv2DTranspose, (3, 4, 2)),
                     3: (keras.layers.Conv3DTranspose, (2, 3, 2, 2))}


@pytest.mark.parametrize("case", sorted(TRANSPOSE))
def test_conv_transpose_rule_equals_the_per_example_loop(case, fallbacks):
    """The transposed rule (the forward convolution's filter gradient with the roles swapped: the
    windows of g at the layer's strides, the input a as the output gradient)."""
    rank, kwargs = TRANSPOSE[case]
    cls, shape = _TRANSPOSE_LAYERS[rank]
    model = _model(shape, cls(**kwargs), seed=24)
    _compare(model, *_data(model, seed=24))
    assert fallbacks == []


def test_output_padding_transposed_layers_take_the_fallback(fallbacks):
    """``output_padding`` set: not ruled, clipped exactly by the fallback (the ruled transposed
    layers beside it, channels_first too, are not)."""
    keras.utils.set_random_seed(25)
    inputs = keras.Input((3, 4, 2))
    h = keras.layers.Conv2DTranspose(2, 3, strides=2, output_padding=1, name="padded")(inputs)
    h = keras.layers.Conv2DTranspose(3, 2, data_format="channels_first", name="first")(h)
    h = keras.layers.Conv2DTranspose(2, 2, strides=2, padding="same", activation="relu", name="ruled")(h)
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
    _compare(model, *_data(model, seed=25))
    assert sorted(set(fallbacks)) == ["padded"]


def test_mixed_bfloat16_norms_and_sums_of_conv3d_and_a_transposed_one(fallbacks):
    """bfloat16 compute with float32 variables: the rules cast (a, g) to float32 (a whole private
    step under mixed_bfloat16 is tested with the 2-D rules in tests/jax/test_jax_ghost_conv.py)."""
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        keras.utils.set_random_seed(23)
        inputs = keras.Input((4, 4, 4, 2))
        h = keras.layers.Conv3D(4, 3, strides=2, padding="same", activation="relu")(inputs)
        h = keras.layers.Conv3DTranspose(4, 2, strides=2, padding="same", activation="relu")(h)
        h = keras.layers.Conv3D(2, 2, strides=2, groups=2)(h)
        model = keras.Model(inputs, keras.layers.Dense(3, dtype="float32")(keras.layers.Flatten()(h)))
        assert model.layers[1].compute_dtype == model.layers[2].compute_dtype == "bfloat16"
        _compare(model, *_data(model, n=8, seed=23), rtol=3e-2)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert fallbacks == []


def test_a_shared_transposed_convolution_on_two_sizes(fallbacks):
    """One Conv2DTranspose called on two map sizes: the windows of both calls' g add up."""
    keras.utils.set_random_seed(26)
    inputs = keras.Input((4, 4, 2))
    shared = keras.layers.Conv2DTranspose(2, 3, strides=2, padding="same", activation="tanh")
    a = shared(inputs)
    b = shared(keras.layers.MaxPooling2D()(inputs))
    h = keras.layers.Concatenate()([keras.layers.Flatten()(a), keras.layers.Flatten()(b)])
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    _compare(model, *_data(model, n=8, seed=26))
    assert fallbacks == []
