"""The convolution kernels (keras_noisecurve.backend.common.ghost_conv, with the keras.ops windows and
filter gradients of keras_noisecurve.backend.common.defaults.ghost_conv) inside the JAX ghost engine,
against the INDEPENDENT per-example loop of tests/jax/helpers.reference_clipped_sum (one
``jax.grad`` of the model's ``stateless_call`` per example, clipping in float64 numpy).

Every test also records which layers went through the engine's per-layer fallback (the
``fallbacks`` fixture of tests/jax/conftest.py): a ruled layer must not, an unruled one
(a subclass) must, and stay exact.

Tolerance: float32. The ghost engine computes its norms in float32 by design (``ghost.py``
accumulates ``sq`` in float32), so running the models in float64 would not test more digits
of the rules. The rules and the loop sum the same products in different orders (Gram forms,
patches, per-group contractions over ≤ 64 positions): agreement to a few hundred float32
ulps, norms rtol 1e-4, sums atol 1e-4 × the largest reference entry. A missing tap, a wrong
padding offset or a swapped (channel, tap) order changes them by far more than 1e-2 relative.
Mixed precision (bfloat16 compute, float32 variables): the forward pass itself is rounded to
8 bits of mantissa on BOTH sides, in different orders (the loop's batch of one vs the
engine's batch), so norms and sums are compared at rtol 3e-2 (bfloat16's ε = 2^-7 ≈ 8e-3
over a few roundings); a wrong rule is still off by > 0.1.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from keras_noisecurve.backend.jax.ghost import ghost_clipped_sum
from keras_noisecurve.backend.common.defaults.ghost_conv import window_patches
from keras_noisecurve.backend.common.geometry import explicit_padding
from keras_noisecurve.backend.common.ghost_conv import grouped_sq_norms
from tests.jax.helpers import mse_per_example, reference_clipped_sum


def _vectorized(*args, **kwargs):
    from keras_noisecurve.backend.jax.clipping import clipped_sum
    return clipped_sum(*args, **kwargs)


def _compare(model, x, y, rtol=1e-4):
    weights = np.ones(len(y), np.float32)
    weights[1], weights[2] = 0.0, 0.5  # a padding row and a sample weight
    _, free = reference_clipped_sum(model, x, y, weights, 1e9)
    clip = float(np.median(free[free > 0]))  # both regimes: some examples clipped, some not
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    step = jax.jit(lambda tv, ntv, x, y, w: ghost_clipped_sum(
        model, mse_per_example, tv, ntv, x, y, w, l2_norm_clip=clip, clipping="ghost", vectorized=_vectorized)[:2])
    sums, norms = step(trainable, non_trainable, x, y, jnp.asarray(weights))
    ref_sums, ref_norms = reference_clipped_sum(model, x, y, weights, clip)
    np.testing.assert_allclose(np.asarray(norms), ref_norms, rtol=rtol, atol=1e-6)
    scale = max(np.max(np.abs(r)) for r in ref_sums)
    for s, r, v in zip(sums, ref_sums, model.trainable_variables):
        assert s.shape == v.shape and s.dtype == v.dtype
        np.testing.assert_allclose(np.asarray(s), r, rtol=rtol, atol=rtol * scale, err_msg=v.path)
    assert np.sum(ref_norms > clip) >= 1 and np.sum((ref_norms < clip) & (ref_norms > 0)) >= 1


def _model(input_shape, *layers, outputs=3, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(input_shape)
    h = inputs
    for layer in layers:
        h = layer(h)
    return keras.Model(inputs, keras.layers.Dense(outputs)(keras.layers.Flatten()(h)))


def _data(model, n=7, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *model.input_shape[1:])).astype("float32")
    y = rng.normal(size=(n, model.output_shape[-1])).astype("float32")
    return x, y


CONV2D = {
    # 6×6×4 input: L² < d_in·d_out (Gram) for "valid" 3×3 (L = 16, 36·8), materialised for "same" (L = 36)
    "valid-gram": dict(filters=8, kernel_size=3),
    "same-materialised-relu": dict(filters=8, kernel_size=3, padding="same", activation="relu"),
    "strides-2x1-same-tanh-no-bias": dict(filters=5, kernel_size=(3, 2), strides=(2, 1), padding="same",
                                         activation="tanh", use_bias=False),
    "dilation-2-valid": dict(filters=4, kernel_size=2, dilation_rate=2),
    "dilation-same-odd": dict(filters=3, kernel_size=(2, 3), dilation_rate=(2, 1), padding="same"),
    "strides-3-same-even-kernel": dict(filters=4, kernel_size=4, strides=3, padding="same"),
    "groups-2": dict(filters=6, kernel_size=3, groups=2, padding="same", activation="gelu"),
    "groups-4-valid": dict(filters=8, kernel_size=2, groups=4, strides=2),
    "pointwise": dict(filters=5, kernel_size=1, activation="relu"),
    "pointwise-strided-grouped": dict(filters=6, kernel_size=1, strides=2, groups=2, padding="same"),
}


@pytest.mark.parametrize("case", sorted(CONV2D))
def test_conv2d_rule_equals_the_per_example_loop(case, fallbacks):
    model = _model((6, 6, 4), keras.layers.Conv2D(**CONV2D[case]), seed=1)
    _compare(model, *_data(model, seed=1))
    assert fallbacks == []


CONV1D = {
    "causal-dilation-2": dict(filters=4, kernel_size=3, padding="causal", dilation_rate=2, activation="relu"),
    "causal-grouped": dict(filters=4, kernel_size=3, padding="causal", groups=2),
    "same-stride-2": dict(filters=5, kernel_size=4, padding="same", strides=2),
    "valid-groups-3-no-bias": dict(filters=6, kernel_size=2, groups=3, use_bias=False),
    "long-sequence-gram": dict(filters=2, kernel_size=5, padding="valid"),
    "pointwise": dict(filters=3, kernel_size=1, activation="tanh"),
}


@pytest.mark.parametrize("case", sorted(CONV1D))
def test_conv1d_rule_equals_the_per_example_loop(case, fallbacks):
    model = _model((9, 6), keras.layers.Conv1D(**CONV1D[case]), seed=2)
    _compare(model, *_data(model, seed=2))
    assert fallbacks == []


DEPTHWISE = {
    "2d-same-multiplier-2-stride-2": (2, dict(kernel_size=3, depth_multiplier=2, strides=2, padding="same",
                                              activation="relu")),
    "2d-valid-dilation-2-no-bias": (2, dict(kernel_size=2, dilation_rate=2, use_bias=False)),
    "2d-5x5-same-on-small-map": (2, dict(kernel_size=5, padding="same")),
    "1d-valid-dilation": (1, dict(kernel_size=3, dilation_rate=2, depth_multiplier=3)),
    "1d-same-stride-2": (1, dict(kernel_size=4, strides=2, padding="same", activation="tanh")),
}


@pytest.mark.parametrize("case", sorted(DEPTHWISE))
def test_depthwise_rule_equals_the_per_example_loop(case, fallbacks):
    rank, kwargs = DEPTHWISE[case]
    layer = keras.layers.DepthwiseConv2D(**kwargs) if rank == 2 else keras.layers.DepthwiseConv1D(**kwargs)
    model = _model((5, 5, 3) if rank == 2 else (9, 3), layer, seed=3)
    _compare(model, *_data(model, seed=3))
    assert fallbacks == []


SEPARABLE = {
    # 6×6×3 (2-D) / 9×3 (1-D) inputs. Pointwise stage: materialised when L² ≥ C·M·filters, else Gram;
    # depthwise stage on (a, g·P_wᵀ): example_grads when L² ≥ K·M, else Gram ("strided-gram": L = 4)
    "2d-same-stride-2-multiplier-2-relu": (2, dict(filters=4, kernel_size=3, strides=2, padding="same",
                                                   depth_multiplier=2, activation="relu")),
    "2d-valid-dilation-2-no-bias": (2, dict(filters=3, kernel_size=2, dilation_rate=2, use_bias=False)),
    "2d-valid-3x2-tanh": (2, dict(filters=5, kernel_size=(3, 2), activation="tanh")),
    "2d-strided-gram": (2, dict(filters=8, kernel_size=3, strides=2, depth_multiplier=2)),
    "2d-same-dilation-odd-strides": (2, dict(filters=4, kernel_size=(2, 3), dilation_rate=(2, 1), padding="same",
                                             activation="gelu")),
    "2d-pointwise-1x1-strided": (2, dict(filters=4, kernel_size=1, strides=2, depth_multiplier=2)),
    "1d-same-stride-2-multiplier-2": (1, dict(filters=4, kernel_size=4, strides=2, padding="same",
                                              depth_multiplier=2)),
    "1d-valid-dilation-2-no-bias-relu": (1, dict(filters=2, kernel_size=3, dilation_rate=2, use_bias=False,
                                                 activation="relu")),
    "1d-gram": (1, dict(filters=6, kernel_size=5, strides=3, depth_multiplier=2, activation="tanh")),
}


@pytest.mark.parametrize("case", sorted(SEPARABLE))
def test_separable_rule_equals_the_per_example_loop(case, fallbacks):
    """The separable rule (pointwise kernel as a Dense map of the recomputed depthwise output,
    depthwise kernel on (a, g·P_wᵀ), bias Σ_l g): norms and clipped sums of all three weights."""
    rank, kwargs = SEPARABLE[case]
    layer = keras.layers.SeparableConv2D(**kwargs) if rank == 2 else keras.layers.SeparableConv1D(**kwargs)
    model = _model((6, 6, 3) if rank == 2 else (9, 3), layer, seed=10)
    _compare(model, *_data(model, seed=10))
    assert fallbacks == []


def test_a_shared_separable_layer_reads_the_steps_weight_values(fallbacks):
    """One SeparableConv2D called on two map sizes (its positions add up), and the step's weight
    values differ from the variables' stored ones: the rule must read the traced values (the
    engine's stateless scope), not the variables."""
    keras.utils.set_random_seed(11)
    inputs = keras.Input((6, 6, 3))
    shared = keras.layers.SeparableConv2D(3, 3, padding="same", depth_multiplier=2, activation="relu")
    a = shared(inputs)
    b = shared(keras.layers.MaxPooling2D()(inputs))
    h = keras.layers.Concatenate()([keras.layers.Flatten()(a), keras.layers.Flatten()(b)])
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    x, y = _data(model, n=8, seed=11)
    rng = np.random.default_rng(11)
    step_values = [np.asarray(v.value) + 0.3 * rng.normal(size=v.shape).astype("float32")
                   for v in model.trainable_variables]
    weights = np.ones(len(y), np.float32)
    for v, value in zip(model.trainable_variables, step_values):
        v.assign(value)
    ref_sums, ref_norms = reference_clipped_sum(model, x, y, weights, 1e9)
    clip = float(np.median(ref_norms))
    ref_sums, ref_norms = reference_clipped_sum(model, x, y, weights, clip)
    for v in model.trainable_variables:  # the stored values are now not the step's
        v.assign(np.asarray(v.value) * 0.5 + 0.1)
    non_trainable = [v.value for v in model.non_trainable_variables]
    sums, norms = jax.jit(lambda tv, x, y, w: ghost_clipped_sum(
        model, mse_per_example, tv, non_trainable, x, y, w, l2_norm_clip=clip, clipping="ghost")[:2])(
        [jnp.asarray(v) for v in step_values], x, y, jnp.asarray(weights))
    np.testing.assert_allclose(np.asarray(norms), ref_norms, rtol=1e-4)
    scale = max(np.max(np.abs(r)) for r in ref_sums)
    for s, r in zip(sums, ref_sums):
        np.testing.assert_allclose(np.asarray(s), r, rtol=1e-4, atol=1e-4 * scale)
    assert fallbacks == []


def test_a_small_cnn_with_a_shared_convolution_called_on_two_map_sizes(fallbacks):
    """A mobile-style stack (conv, depthwise, 1×1, GroupNorm, pooling) and one Conv2D called
    twice on different map sizes: its positions from both calls add up."""
    keras.utils.set_random_seed(4)
    inputs = keras.Input((8, 8, 3))
    shared = keras.layers.Conv2D(4, 3, padding="same", activation="relu")
    h = keras.layers.Conv2D(4, 3, strides=2, padding="same", activation="relu")(inputs)
    h = keras.layers.DepthwiseConv2D(3, padding="same", activation="relu")(h)
    h = keras.layers.GroupNormalization(groups=2)(keras.layers.Conv2D(4, 1)(h))
    a = shared(h)
    b = shared(keras.layers.MaxPooling2D()(h))
    h = keras.layers.Concatenate()([keras.layers.GlobalAveragePooling2D()(a), keras.layers.Flatten()(b)])
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    _compare(model, *_data(model, n=8, seed=4))
    assert fallbacks == []


def test_layers_without_a_rule_take_the_exact_fallback(fallbacks):
    """A subclass of a convolution (it may change the convolution) is not ruled: the fallback clips
    it, exactly, before the activation; a channels_first convolution and the SeparableConv layers
    around it take their rule."""

    class Subclassed(keras.layers.Conv2D):
        pass

    keras.utils.set_random_seed(5)
    inputs = keras.Input((6, 6, 3))
    h = keras.layers.SeparableConv2D(4, 3, padding="same", depth_multiplier=2, activation="relu",
                                     name="separable")(inputs)
    h = keras.layers.Permute((3, 1, 2))(h)
    h = keras.layers.Conv2D(4, 1, data_format="channels_first", activation="relu", name="ruled")(h)
    h = Subclassed(3, 2, data_format="channels_first", activation="tanh", name="first")(h)
    h = keras.layers.SeparableConv1D(2, 3, name="separable1d")(keras.layers.Reshape((15, 5))(h))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    _compare(model, *_data(model, seed=5))
    assert sorted(set(fallbacks)) == ["first"]


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_norms_and_sums(policy, fallbacks):
    """bfloat16/float16 compute with float32 variables: the rules cast (a, g) to float32. (Private
    training under mixed_float16 is refused on JAX, it needs loss scaling; the engine itself is tested.)"""
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(6)
        inputs = keras.Input((8, 8, 3))
        h = keras.layers.Conv2D(6, 3, strides=2, padding="same", activation="relu")(inputs)
        h = keras.layers.DepthwiseConv2D(3, padding="same", depth_multiplier=2, activation="relu")(h)
        h = keras.layers.Conv2D(4, 1, groups=2)(keras.layers.GroupNormalization(groups=3)(h))
        h = keras.layers.SeparableConv2D(4, 3, padding="same", depth_multiplier=2, activation="relu")(h)
        h = keras.layers.Conv1D(3, 3, padding="causal")(keras.layers.Reshape((16, 4))(h))
        outputs = keras.layers.Dense(3, dtype="float32")(keras.layers.Flatten()(h))
        model = keras.Model(inputs, outputs)
        assert model.layers[1].compute_dtype == policy.split("_")[1]
        _compare(model, *_data(model, n=8, seed=6), rtol=3e-2)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert fallbacks == []


@pytest.mark.parametrize("padding,size,kernel,stride,dilation", [
    ("same", 6, 3, 1, 1), ("same", 7, 4, 3, 1), ("same", 5, 2, 1, 2), ("valid", 7, 3, 2, 1),
    ("valid", 9, 3, 1, 2), ("causal", 9, 3, 1, 2), ("causal", 8, 2, 3, 1),
])
def test_window_patches_are_the_windows_of_keras_conv(padding, size, kernel, stride, dilation):
    """Each patch row dotted with a flattened kernel is Keras's own convolution output: the
    (tap, channel) order, the padding offsets and the strides of :func:`window_patches`."""
    rng = np.random.default_rng(7)
    a = rng.normal(size=(2, size, 3)).astype("float32")
    kernel_values = rng.normal(size=(kernel, 3, 1)).astype("float32")
    layer = keras.layers.Conv1D(1, kernel, strides=stride, padding=padding, dilation_rate=dilation, use_bias=False)
    layer.build(a.shape)
    layer.kernel.assign(kernel_values)
    want = np.asarray(layer(a))[..., 0]
    x = window_patches(jnp.asarray(a), out_shape=want.shape[1:], kernel_size=(kernel,), strides=(stride,),
                       dilation_rate=(dilation,), padding=padding)
    got = np.einsum("pltc,tc->pl", np.asarray(x), kernel_values[..., 0])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert explicit_padding(size, want.shape[1], kernel, stride, dilation, "reflect") is None


def test_gram_and_materialised_forms_agree_with_a_dense_loop():
    rng = np.random.default_rng(8)
    for length, d_in, d_out in [(3, 4, 5), (6, 2, 2)]:  # L² < d_in·d_out, and the other way
        x = rng.normal(size=(4, length, 2, d_in))
        y = rng.normal(size=(4, length, 2, d_out))
        sq, per = grouped_sq_norms(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
        assert (per is None) == (length * length < d_in * d_out)
        want = [sum(np.sum(sum(np.outer(x[i, l, g], y[i, l, g]) for l in range(length)) ** 2) for g in range(2))
                for i in range(4)]
        np.testing.assert_allclose(np.asarray(sq), want, rtol=1e-5)


def test_a_mixed_bfloat16_private_step_with_conv_rules_equals_the_vectorized_engine(fallbacks):
    """``make_private(clipping="ghost")`` under ``mixed_bfloat16`` (the JAX backend refuses
    mixed_float16 training: it needs loss scaling) takes one step whose update equals the exact
    vectorized engine's (``jax.vmap`` of the whole model's gradient) to bfloat16 rounding."""
    from keras_noisecurve import NoiseCurveOptimizer, make_private

    rng = np.random.default_rng(9)
    x = rng.normal(size=(8, 8, 8, 3)).astype("float32")
    y = rng.normal(size=(8, 3)).astype("float32")
    updates = {}
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        for clipping in ("ghost", "vectorized"):
            keras.utils.set_random_seed(9)
            inputs = keras.Input((8, 8, 3))
            h = keras.layers.Conv2D(6, 3, strides=2, padding="same", activation="relu")(inputs)
            h = keras.layers.DepthwiseConv2D(3, padding="same", activation="relu")(h)
            outputs = keras.layers.Dense(3, dtype="float32")(keras.layers.Flatten()(h))
            model = keras.Model(inputs, outputs)
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


def test_channels_first_layers_under_a_channels_first_default(fallbacks):
    """``keras.config.set_image_data_format("channels_first")``: the layers are channels first and
    the kernels' own convolutions (windows, filter gradients, a separable layer's recomputed
    depthwise stage) still read their channels-last arrays as such."""
    previous = keras.config.image_data_format()
    keras.config.set_image_data_format("channels_first")
    try:
        # per-example filter gradients (L = 36), then windows (L = 16, 4, 1: the Gram form)
        model = _model((3, 6, 6), keras.layers.Conv2D(2, 3, padding="same", activation="relu"),
                       keras.layers.Conv2D(32, 3), keras.layers.DepthwiseConv2D(3, strides=2, padding="same",
                                                                               depth_multiplier=2),
                       keras.layers.SeparableConv2D(3, 2, depth_multiplier=2), seed=9)
        assert all(layer.data_format == "channels_first" for layer in model.layers[1:5])
        _compare(model, *_data(model, seed=9))
    finally:
        keras.config.set_image_data_format(previous)
    assert fallbacks == []
