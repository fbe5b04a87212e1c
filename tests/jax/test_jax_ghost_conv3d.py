"""The JAX ``Conv3D`` rule (keras_noisecurve.backend.jax.ghost_conv, rank 3) inside the ghost
engine, against the INDEPENDENT per-example loop of tests/jax/helpers.reference_clipped_sum
(one ``jax.grad`` of the model's ``stateless_call`` per example, clipping in float64 numpy),
with the ``fallbacks`` fixture of tests/jax/conftest.py: a ruled layer must not reach the
engine's per-layer fallback, an unruled one (channels_first) must, and stay exact.

Tolerances as in tests/jax/test_jax_ghost_conv.py (its ``_compare``): float32, norms rtol 1e-4,
sums atol 1e-4 × the largest reference entry; bfloat16 compute at 3e-2. The input volume is
4×5×6 (three different sizes: a swapped depth/height/width axis changes the windows).
"""

import keras
import numpy as np
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


def test_a_shared_conv3d_on_two_sizes_beside_a_channels_first_one_on_the_fallback(fallbacks):
    """One Conv3D called on two volume sizes (its positions from both calls add up), and a
    channels_first Conv3D, not ruled, clipped exactly by the fallback."""
    keras.utils.set_random_seed(22)
    inputs = keras.Input(SHAPE)
    shared = keras.layers.Conv3D(3, 2, padding="same", activation="relu", name="shared")
    a = shared(inputs)
    b = shared(keras.layers.MaxPooling3D(pool_size=2, padding="same")(inputs))
    first = keras.layers.Conv3D(2, 2, data_format="channels_first", name="first")(keras.layers.Permute((4, 1, 2, 3))(a))
    h = keras.layers.Concatenate()([keras.layers.Flatten()(first), keras.layers.Flatten()(b)])
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    _compare(model, *_data(model, n=8, seed=22))
    assert sorted(set(fallbacks)) == ["first"]


def test_a_mixed_bfloat16_private_step_with_conv3d_equals_the_vectorized_engine(fallbacks):
    """``make_private(clipping="ghost")`` under ``mixed_bfloat16``: one step's update equals the
    exact vectorized engine's (``jax.vmap`` of the whole model's gradient) to bfloat16 rounding."""
    from keras_noisecurve import NoiseCurveOptimizer, make_private

    rng = np.random.default_rng(23)
    x = rng.normal(size=(8, *SHAPE)).astype("float32")
    y = rng.normal(size=(8, 3)).astype("float32")
    updates = {}
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        for clipping in ("ghost", "vectorized"):
            keras.utils.set_random_seed(23)
            inputs = keras.Input(SHAPE)
            h = keras.layers.Conv3D(4, 3, strides=2, padding="same", activation="relu")(inputs)
            h = keras.layers.Conv3D(2, 2, groups=2)(h)
            outputs = keras.layers.Dense(3, dtype="float32")(keras.layers.Flatten()(h))
            model = keras.Model(inputs, outputs)
            assert model.layers[1].compute_dtype == "bfloat16"
            before = [np.asarray(v.value, np.float64) for v in model.trainable_variables]
            private = make_private(model, clipping=clipping)
            private.compile(optimizer=NoiseCurveOptimizer(learning_rate=1.0, l2_norm_clip=0.05, noise_multiplier=1e-9,
                                                          expected_batch_size=8, seed=0), loss="mse")
            private.train_on_batch(x, y)
            updates[clipping] = [np.asarray(v.value, np.float64) - b for v, b in zip(model.trainable_variables, before)]
    finally:
        keras.mixed_precision.set_global_policy("float32")
    scale = max(np.max(np.abs(u)) for u in updates["vectorized"])
    assert scale > 1e-3
    for a, b in zip(updates["ghost"], updates["vectorized"]):
        np.testing.assert_allclose(a, b, rtol=3e-2, atol=3e-2 * scale)
    assert fallbacks == []
