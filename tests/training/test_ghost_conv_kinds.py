"""The depthwise, separable, grouped, 3-D and transposed convolution rules are exact.

Each configuration (strides, padding, dilation, data format, bias, fused activation,
depth multiplier, groups) is compared in float64 against an independent per-example
``tf.GradientTape`` loop (``loop_reference``): per-example norms and the clipped sum,
with the clip at the median norm so that some examples are clipped. ``describe`` must
report the new rule, not the per-layer fallback.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import keras

from keras_noisecurve.backend.tensorflow.ghost import describe, ghost_clipped_sum, supports
from keras_noisecurve.backend.tensorflow import kernels as _kernels
from keras_noisecurve.backend.common.ghost_conv import _gram_sum, grouped_sq_norms
from keras_noisecurve.backend.tensorflow.ghost_conv import _example_grads_3d_grouped, example_grads_3d, patches
from keras_noisecurve.backend.tensorflow.ghost_conv import LiveTapGrads, correlation_example_grads, tap_example_grads
from tests.training.helpers import float64_layers, loop_reference, mse

P = 5
RTOL = 1e-6

float64 = pytest.fixture(autouse=True)(float64_layers)

L = keras.layers


def _check(model, kind, layer_name="conv", seed=0):
    rng = np.random.default_rng(seed)
    try:
        model(np.zeros((1,) + tuple(model.input_shape[1:])))
    except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as error:
        pytest.skip(f"the layer itself does not run on this device: {str(error).splitlines()[0][:120]}")
    assert dict((n, how) for n, _, how in describe(model))[layer_name] == kind
    assert supports(model) == (True, "")
    x = rng.normal(size=(P,) + tuple(model.input_shape[1:]))
    y = rng.normal(size=(P,) + tuple(model.output_shape[1:]))
    w = rng.uniform(0.5, 2.0, size=P)
    w[1] = 0.0  # a padded example
    norms, _ = loop_reference(model, mse, x, y, w, np.inf)
    clip = float(np.median(norms[norms > 0]))
    norms_ref, sum_ref = loop_reference(model, mse, x, y, w, clip)
    got = ghost_clipped_sum(model, mse, x, y, w, l2_norm_clip=clip, training=False)
    np.testing.assert_allclose(got.norms.numpy(), norms_ref, rtol=RTOL, atol=1e-12)
    assert got.norms.numpy()[1] == 0.0
    scale = max(np.max(np.abs(g)) for g in sum_ref)
    for v, g, r in zip(model.trainable_variables, got.grads, sum_ref):
        np.testing.assert_allclose(np.asarray(g), r, rtol=RTOL, atol=RTOL * scale, err_msg=v.path)


def _model(shape, layer, head=True):
    layers = [keras.Input(shape), layer]
    if head:
        layers += [L.Flatten(), L.Dense(2)]
    return keras.Sequential(layers)


def _cf(shape):
    """A channels-last input shape moved to channels-first."""
    return (shape[-1], *shape[:-1])


DEPTHWISE = {
    "2d-valid-mult2-tanh": ((7, 6, 3), lambda: L.DepthwiseConv2D(3, depth_multiplier=2, activation="tanh", name="conv")),
    "2d-same-stride2-nobias": ((7, 6, 3), lambda: L.DepthwiseConv2D((3, 2), strides=2, padding="same", use_bias=False,
                                                                    name="conv")),
    "2d-same-dilated": ((7, 7, 2), lambda: L.DepthwiseConv2D(3, dilation_rate=2, padding="same", name="conv")),
    "2d-channels-first": (_cf((6, 6, 3)), lambda: L.DepthwiseConv2D(3, strides=2, data_format="channels_first",
                                                                    activation="relu", name="conv")),
    "1d-same-stride2": ((9, 3), lambda: L.DepthwiseConv1D(3, strides=2, padding="same", depth_multiplier=3,
                                                          name="conv")),
    "1d-valid-dilated": ((9, 2), lambda: L.DepthwiseConv1D(2, dilation_rate=3, activation="tanh", name="conv")),
    # small maps (the taps form): dead taps, strided phases, both products
    "2d-1x1-map-5x5-same": ((1, 1, 4), lambda: L.DepthwiseConv2D(5, padding="same", name="conv")),
    "2d-2x2-map-5x5-same-mult2": ((2, 2, 3), lambda: L.DepthwiseConv2D(5, padding="same", depth_multiplier=2,
                                                                       activation="tanh", name="conv")),
    "2d-8x8-5x5-stride2-same": ((8, 8, 2), lambda: L.DepthwiseConv2D(5, strides=2, padding="same", name="conv")),
    "2d-11x11-5x5-stride2-valid": ((11, 11, 2), lambda: L.DepthwiseConv2D(5, strides=2, name="conv")),
    "2d-7x8-3x3-stride3-mult2": ((7, 8, 2), lambda: L.DepthwiseConv2D(3, strides=3, padding="same",
                                                                      depth_multiplier=2, name="conv")),
    # depth multiplier 1 on 2×2 output positions or more (the correlation form): unequal
    # kernel, 1-D, every tap live, padding cut to the windows
    "2d-4x4-map-5x5-same": ((4, 4, 3), lambda: L.DepthwiseConv2D(5, padding="same", activation="tanh", name="conv")),
    "2d-5x5-3x2-stride2-valid": ((5, 5, 2), lambda: L.DepthwiseConv2D((3, 2), strides=2, name="conv")),
    "1d-valid-stride2": ((9, 2), lambda: L.DepthwiseConv1D(3, strides=2, name="conv")),
    # a large map and a 3×3 kernel: TensorFlow's depthwise filter gradient
    "2d-8x8-3x3-native": ((8, 8, 2), lambda: L.DepthwiseConv2D(3, padding="same", activation="relu", name="conv")),
}


@pytest.mark.parametrize("case", sorted(DEPTHWISE))
def test_depthwise(case):
    shape, build = DEPTHWISE[case]
    _check(_model(shape, build()), "DepthwiseConv")


TAPS = [  # (input shape, kernel, strides, dilation, padding, multiplier)
    ((1, 1, 3), (5, 5), (1, 1), (1, 1), "same", 1),
    ((2, 3, 2), (5, 3), (1, 1), (1, 1), "same", 2),
    ((8, 8, 2), (5, 5), (2, 2), (1, 1), "same", 1),
    ((11, 9, 2), (5, 3), (2, 2), (1, 1), "valid", 1),
    ((7, 7, 2), (3, 3), (1, 1), (2, 2), "same", 1),
    ((6, 5, 2), (3, 2), (2, 1), (1, 2), "same", 3),
    ((9, 2), (3,), (2,), (1,), "same", 2),
    ((12, 2), (2,), (1,), (3,), "valid", 1),
]


@pytest.mark.parametrize("shape,kernel,strides,dilation,padding,mult", TAPS)
def test_tap_example_grads_equal_a_per_example_loop(shape, kernel, strides, dilation, padding, mult):
    # the live taps' per-example gradients, the norms and the scattered clipped sum against
    # float64 GradientTape gradients of Σ depthwise_conv(a_i, W)·g_i, one example at a time
    rng = np.random.default_rng(len(shape) * 100 + kernel[0] * 10 + mult)
    c = shape[-1]
    a = rng.normal(size=(P, *shape))
    w = tf.Variable(rng.normal(size=(*kernel, c, mult)))
    out = keras.ops.depthwise_conv(a[:1], w, strides=strides, padding=padding, dilation_rate=dilation)
    g = rng.normal(size=(P, *out.shape[1:]))
    want = []
    for i in range(P):
        with tf.GradientTape() as tape:
            z = keras.ops.depthwise_conv(a[i : i + 1], w, strides=strides, padding=padding, dilation_rate=dilation)
            loss = tf.reduce_sum(z * g[i : i + 1])
        want.append(tape.gradient(loss, w).numpy().reshape(-1, c, mult))  # (K, C, M)
    want = np.stack(want)
    per_example, live = tap_example_grads(tf.constant(a), tf.constant(g), kernel_size=kernel, strides=strides,
                                          dilation_rate=dilation, padding=padding, multiplier=mult)
    np.testing.assert_allclose(per_example.numpy(), want[:, live], rtol=1e-12, atol=1e-12)
    dead = [t for t in range(int(np.prod(kernel))) if t not in live]
    assert np.all(want[:, dead] == 0.0)
    grads = LiveTapGrads([(per_example, live)], int(np.prod(kernel)))
    np.testing.assert_allclose(grads.sq_norms().numpy(), np.sum(want**2, axis=(1, 2, 3)), rtol=1e-12)
    scale = rng.uniform(size=P)
    scale[2] = 0.0
    np.testing.assert_allclose(grads.weighted_sum(tf.constant(scale)).numpy(),
                               np.einsum("p,pkcm->ckm", scale, want), rtol=1e-12, atol=1e-12)


CORRELATION = [  # (input shape, kernel, strides, padding)
    ((4, 4, 3), (5, 5), (1, 1), "same"),
    ((11, 11, 2), (5, 5), (2, 2), "valid"),
    ((8, 7, 2), (5, 3), (2, 2), "same"),
    ((9, 9, 2), (3, 3), (3, 3), "valid"),  # the last row and column are read by no window
    ((2, 2, 4), (3, 3), (1, 1), "same"),
    ((10, 2), (5,), (2,), "same"),
]


@pytest.mark.parametrize("shape,kernel,strides,padding", CORRELATION)
def test_correlation_example_grads_equal_a_per_example_loop(shape, kernel, strides, padding):
    # every tap's per-example gradient against float64 GradientTape gradients of
    # Σ depthwise_conv(a_i, W)·g_i, one example at a time
    rng = np.random.default_rng(len(shape) * 100 + kernel[0] * 10 + strides[0])
    c = shape[-1]
    a = rng.normal(size=(P, *shape))
    w = tf.Variable(rng.normal(size=(*kernel, c, 1)))
    out = keras.ops.depthwise_conv(a[:1], w, strides=strides, padding=padding)
    g = rng.normal(size=(P, *out.shape[1:]))
    want = []
    for i in range(P):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(keras.ops.depthwise_conv(a[i : i + 1], w, strides=strides, padding=padding) * g[i])
        want.append(tape.gradient(loss, w).numpy().reshape(-1, c))  # (K, C)
    got = correlation_example_grads(tf.constant(a), tf.constant(g), kernel_size=kernel, strides=strides,
                                    padding=padding)
    assert got.shape == (P, int(np.prod(kernel)), c)
    np.testing.assert_allclose(got.numpy(), np.stack(want), rtol=1e-12, atol=1e-12)


def test_correlation_example_grads_validates_its_arguments():
    a, g = tf.zeros([2, 3, 3, 2]), tf.zeros([2, 3, 3, 4])
    kw = dict(kernel_size=(3, 3), strides=(1, 1), padding="same")
    with pytest.raises(ValueError, match="C = 2 channels of a \\(depth multiplier 1\\), got 4"):
        correlation_example_grads(a, g, **kw)
    with pytest.raises(ValueError, match="rank-1 or rank-2"):
        correlation_example_grads(tf.zeros([2, 3, 3, 3, 2]), g, **kw)


def test_tap_example_grads_validates_its_arguments():
    a, g = tf.zeros([2, 3, 3, 2]), tf.zeros([2, 3, 3, 2])
    kw = dict(kernel_size=(3, 3), strides=(1, 1), dilation_rate=(1, 1), multiplier=1)
    with pytest.raises(ValueError, match="padding must be 'same' or 'valid', got 'causal'"):
        tap_example_grads(a, g, padding="causal", **kw)
    with pytest.raises(ValueError, match="C·M = 2·2 channels, got 2"):
        tap_example_grads(a, g, padding="same", **{**kw, "multiplier": 2})
    with pytest.raises(ValueError, match="rank-1 or rank-2"):
        tap_example_grads(tf.zeros([2, 3, 3, 3, 2]), g, padding="same", **kw)


def test_shared_depthwise_layer_with_different_live_taps():
    # a 5×5 kernel on a 4×4 map (every tap live) and on a 1×1 map (the centre tap only)
    shared = L.DepthwiseConv2D(5, padding="same", name="conv")
    inp = keras.Input((4, 4, 3))
    small = shared(L.GlobalAveragePooling2D(keepdims=True)(inp))
    out = L.Concatenate()([L.GlobalAveragePooling2D()(shared(inp)), L.Flatten()(small)])
    _check(keras.Model(inp, L.Dense(2)(out)), "DepthwiseConv")


def test_shared_depthwise_layer_on_two_map_sizes_by_correlation():
    # a 5×5 kernel on a 4×4 and a 2×2 map: both calls take the correlation form, summed
    shared = L.DepthwiseConv2D(5, padding="same", name="conv")
    inp = keras.Input((4, 4, 3))
    small = shared(L.AveragePooling2D(2)(inp))
    out = L.Concatenate()([L.GlobalAveragePooling2D()(shared(inp)), L.Flatten()(small)])
    _check(keras.Model(inp, L.Dense(2)(out)), "DepthwiseConv")


SEPARABLE = {
    "2d-same-stride2-mult2-relu": ((7, 6, 3), lambda: L.SeparableConv2D(4, 3, strides=2, padding="same",
                                                                        depth_multiplier=2, activation="relu",
                                                                        name="conv")),
    "2d-valid-dilated-nobias": ((8, 8, 2), lambda: L.SeparableConv2D(3, 3, dilation_rate=2, use_bias=False,
                                                                     name="conv")),
    "2d-channels-first": (_cf((6, 6, 3)), lambda: L.SeparableConv2D(4, 2, data_format="channels_first",
                                                                    activation="tanh", name="conv")),
    "1d-same": ((9, 3), lambda: L.SeparableConv1D(5, 3, padding="same", depth_multiplier=2, name="conv")),
    "1d-valid-stride2": ((9, 2), lambda: L.SeparableConv1D(3, 2, strides=2, activation="tanh", name="conv")),
}


@pytest.mark.parametrize("case", sorted(SEPARABLE))
def test_separable(case):
    shape, build = SEPARABLE[case]
    _check(_model(shape, build()), "SeparableConv")


GROUPED = {
    "2d-valid-groups2-tanh": ((6, 6, 4), lambda: L.Conv2D(6, 3, groups=2, activation="tanh", name="conv")),
    "2d-same-stride2-groups3-nobias": ((7, 6, 6), lambda: L.Conv2D(3, (2, 3), strides=2, padding="same", groups=3,
                                                                   use_bias=False, name="conv")),
    "2d-dilated": ((7, 7, 4), lambda: L.Conv2D(4, 2, dilation_rate=2, padding="same", groups=4, name="conv")),
    "1d-same-stride2": ((9, 4), lambda: L.Conv1D(6, 3, strides=2, padding="same", groups=2, name="conv")),
}


@pytest.mark.parametrize("case", sorted(GROUPED))
def test_grouped_conv(case):
    shape, build = GROUPED[case]
    _check(_model(shape, build()), "GroupedConv")


CONV3D = {
    "valid-relu": ((4, 5, 5, 2), lambda: L.Conv3D(3, 2, activation="relu", name="conv")),
    "same-stride2-nobias": ((5, 5, 4, 2), lambda: L.Conv3D(3, (3, 2, 3), strides=(2, 1, 2), padding="same",
                                                           use_bias=False, name="conv")),
    "groups2": ((4, 4, 4, 4), lambda: L.Conv3D(4, 2, groups=2, padding="same", name="conv")),
}


@pytest.mark.parametrize("case", sorted(CONV3D))
def test_conv3d(case):
    shape, build = CONV3D[case]
    _check(_model(shape, build()), "Conv3D")


GROUPED_RUNS = _kernels.grouped_conv_filter_gradient_runs(_kernels.device_type(), "float32")


@pytest.mark.parametrize("chunk", [1, 2, 16])
@pytest.mark.parametrize("padding, kernel, strides", [
    ("SAME", (3, 2, 3), (2, 1, 2)), ("VALID", (2, 3, 2), (2, 2, 1)), ("SAME", (3, 3, 3), (1, 1, 1)),
    ("VALID", (3, 2, 2), (2, 1, 1)),
])
def test_example_grads_3d_equal_a_per_example_tape_in_both_forms(chunk, padding, kernel, strides):
    # float32, where the grouped form runs (oneDNN CPU kernels, cuDNN); two calls of
    # different depths, P = 5 (a partly filled chunk), against one tape per example.
    # The grouped form is exact at any strides (example_grads_3d takes it at height and
    # width strides 1 only, where it is faster), so it is called directly here.
    if chunk > 1 and not GROUPED_RUNS:
        pytest.skip("TensorFlow's kernels here do not run a grouped Conv2DBackpropFilter (CPU without oneDNN)")
    rng = np.random.default_rng(3)
    c_in, c_out, p = 2, 3, 5
    w = tf.constant(rng.normal(size=(*kernel, c_in, c_out)), tf.float32)
    calls = []
    for size in [(5, 6, 7), (4, 5, 4)]:
        a = tf.constant(rng.normal(size=(p, *size, c_in)), tf.float32)
        out_shape = tf.nn.conv3d(a, w, strides=[1, *strides, 1], padding=padding).shape
        calls.append((a, tf.constant(rng.normal(size=out_shape), tf.float32)))
    form = example_grads_3d if chunk == 1 else _example_grads_3d_grouped
    got = form(calls, kernel, strides, padding, chunk=chunk).numpy()
    want = []
    for i in range(p):
        with tf.GradientTape() as tape:
            tape.watch(w)
            loss = tf.add_n([tf.reduce_sum(tf.nn.conv3d(a[i : i + 1], w, strides=[1, *strides, 1], padding=padding)
                                           * g[i : i + 1]) for a, g in calls])
        want.append(tape.gradient(loss, w).numpy().reshape(-1, c_out))
    assert got.shape == (p, np.prod(kernel) * c_in, c_out)
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-5, atol=1e-5)


TRANSPOSE = {
    "2d-valid-stride2-tanh": ((4, 3, 3), lambda: L.Conv2DTranspose(2, 3, strides=2, activation="tanh", name="conv")),
    "2d-same-stride2-nobias": ((3, 4, 2), lambda: L.Conv2DTranspose(3, (3, 2), strides=2, padding="same",
                                                                    use_bias=False, name="conv")),
    "2d-kernel-below-stride": ((3, 3, 2), lambda: L.Conv2DTranspose(2, 1, strides=2, name="conv")),
    "2d-same-dilated": ((4, 4, 2), lambda: L.Conv2DTranspose(2, 3, dilation_rate=2, padding="same", name="conv")),
    "2d-channels-first": (_cf((3, 3, 2)), lambda: L.Conv2DTranspose(2, 3, strides=2, padding="same",
                                                                    data_format="channels_first", name="conv")),
    "1d-same-stride3": ((4, 3), lambda: L.Conv1DTranspose(2, 4, strides=3, padding="same", name="conv")),
    "3d-valid-stride2": ((2, 3, 2, 2), lambda: L.Conv3DTranspose(2, 2, strides=(2, 1, 2), name="conv")),
}


@pytest.mark.parametrize("case", sorted(TRANSPOSE))
def test_conv_transpose(case):
    shape, build = TRANSPOSE[case]
    _check(_model(shape, build()), "ConvTranspose")


def test_shared_layers_called_on_two_sizes():
    # one layer of each kind called twice (different spatial sizes): its per-example
    # gradient is the sum over both calls
    for shared, kind in [
        (L.DepthwiseConv2D(3, padding="same", name="conv"), "DepthwiseConv"),
        (L.SeparableConv2D(3, 3, padding="same", name="conv"), "SeparableConv"),
        (L.Conv2D(4, 3, padding="same", groups=2, name="conv"), "GroupedConv"),
        (L.Conv2DTranspose(2, 3, strides=2, padding="same", name="conv"), "ConvTranspose"),
    ]:
        inp = keras.Input((6, 6, 2 if kind == "ConvTranspose" else 4))
        big = shared(inp)
        small = shared(L.AveragePooling2D(2)(inp) if kind != "ConvTranspose" else inp[:, :3, :3])
        out = L.Concatenate()([L.GlobalAveragePooling2D()(big), L.GlobalAveragePooling2D()(small)])
        _check(keras.Model(inp, L.Dense(2)(out)), kind)


@pytest.mark.parametrize("length", [4, 2], ids=["materialised", "gram"])
def test_grouped_forms_match_numpy(length):
    # L² ≥ I·O forms the per-example gradients, L² < I·O the Gram form; both against numpy's
    # definition, with a dropped example (factor 0) counting exactly 0
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(3, length, 2, 5)), rng.normal(size=(3, length, 2, 3))
    per_example = np.einsum("plgi,plgo->pgio", x, y)  # numpy, the definition
    x[1, 0, 0, 0] = np.nan  # the dropped example's rows are not finite: it must still add exactly 0
    sq, per = grouped_sq_norms(tf.constant(x), tf.constant(y))
    assert (per is not None) == (length * length >= 15)
    np.testing.assert_allclose(np.asarray(sq)[[0, 2]], np.sum(per_example**2, axis=(1, 2, 3))[[0, 2]], rtol=1e-12)
    scale = np.array([0.5, 0.0, 2.0])
    keep = tf.constant(scale != 0)
    got = per.weighted_sum(tf.constant(scale), keep) if per is not None else _gram_sum(
        tf.constant(x), tf.constant(y), tf.constant(scale), keep)
    np.testing.assert_allclose(np.asarray(got), np.einsum("p,pgio->gio", scale, per_example), rtol=1e-12)
    assert np.isfinite(np.asarray(got)).all()


def test_patches_are_the_windows_of_the_convolution():
    # convolving with a kernel K equals contracting the patches with K (rank 1, 2, 3)
    rng = np.random.default_rng(5)
    for shape, ks, st, dr, pad in [((2, 9, 3), (3,), (2,), (1,), "same"), ((2, 7, 6, 3), (3, 2), (1, 1), (1, 2), "valid"),
                                   ((2, 7, 6, 3), (3, 2), (2, 3), (1, 1), "same"),
                                   ((2, 5, 4, 6, 2), (2, 3, 2), (1, 2, 2), (1, 1, 1), "same")]:
        x = rng.normal(size=shape)
        kernel = rng.normal(size=(*ks, shape[-1], 4))
        want = keras.ops.conv(x, kernel, strides=st, padding=pad, dilation_rate=dr).numpy()
        got = patches(tf.constant(x), kernel_size=ks, strides=st, dilation_rate=dr, padding=pad).numpy()
        got = np.einsum("plkc,kco->plo", got, kernel.reshape(-1, shape[-1], 4))
        np.testing.assert_allclose(got, want.reshape(got.shape), rtol=1e-10, atol=1e-12)


def test_causal_grouped_conv1d_takes_its_kernel():
    # causal padding written out before the windows (the kernel is one for every backend), also
    # with one group per input channel (TensorFlow's depthwise filter gradients, after the padding)
    _check(_model((8, 4), L.Conv1D(4, 3, padding="causal", groups=2, dilation_rate=2, name="conv")), "GroupedConv")
    _check(_model((9, 3), L.Conv1D(6, 3, padding="causal", groups=3, name="conv")), "GroupedConv", seed=1)


@pytest.mark.parametrize("filters", [2, 24], ids=["materialised", "gram"])
def test_channels_first_plain_convolutions_take_their_kernel(filters):
    # channels_first Conv2D and Conv1D, groups=1: the kernel moves the channels last
    _check(_model(_cf((6, 5, 3)), L.Conv2D(filters, 3, strides=(2, 1), padding="same",
                                           data_format="channels_first", name="conv")), "Conv")
    _check(_model(_cf((7, 3)), L.Conv1D(filters, 2, data_format="channels_first", name="conv")), "Conv", seed=1)


def test_refused_configurations_take_the_exact_fallback():
    rng = np.random.default_rng(6)
    for layer in [L.Conv2DTranspose(2, 3, strides=2, output_padding=1, name="conv"),
                  L.Conv3D(2, 2, dilation_rate=2, name="conv")]:
        shape = {1: (8, 4), 2: (4, 4, 2), 3: (5, 5, 5, 2)}[layer.rank]
        model = _model(shape, layer)
        assert dict((n, how) for n, _, how in describe(model))["conv"] == "generic"
        _check(model, "generic", seed=int(rng.integers(100)))


def test_channels_first_grouped_and_3d_convolutions_take_the_fallback_on_cpu():
    # Keras runs them through XLA on CPU, where the layer's bias add does not follow its
    # definition for some shapes: the rule refuses, and the fallback matches the layer
    if tf.config.list_logical_devices("GPU"):
        pytest.skip("the refusal is for CPU devices")
    for shape, layer in [(_cf((6, 6, 4)), L.Conv2D(4, 3, groups=2, data_format="channels_first", name="conv")),
                         (_cf((4, 4, 4, 2)), L.Conv3D(3, 2, data_format="channels_first", name="conv"))]:
        _check(_model(shape, layer), "generic")


@pytest.mark.parametrize("build", [
    lambda: keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=4, alpha=0.35),
    lambda: keras.applications.EfficientNetB0(weights=None, input_shape=(32, 32, 3), classes=4),
], ids=["MobileNetV2", "EfficientNetB0"])
def test_mobile_networks_have_no_layer_on_the_fallback(build):
    from keras_noisecurve.training.batchnorm import replace_batch_normalization

    model = replace_batch_normalization(build())
    kinds = {how for _, _, how in describe(model)}
    assert "generic" not in kinds and "DepthwiseConv" in kinds, kinds


def test_convolutions_on_images_of_unknown_size_inside_a_traced_step():
    # A step traced for (None, None, None, C) images (fit on images of several sizes): the forms
    # whose choice needs the sizes (per-example gradients, the TensorFlow depthwise kernels, the
    # transposed convolution's length check) step aside for the windows' Gram form, still exact.
    rng = np.random.default_rng(12)
    inputs = keras.Input((None, None, 3))
    h = L.Conv2D(4, 3, padding="same", activation="tanh", name="conv")(inputs)
    h = L.DepthwiseConv2D(3, strides=2, padding="same", name="depthwise")(h)
    h = L.SeparableConv2D(3, 3, padding="same", depth_multiplier=2, name="separable")(h)
    h = L.Conv2DTranspose(2, 3, strides=2, padding="same", name="transpose")(h)
    h = L.Conv2D(3, 1, strides=2, name="pointwise")(h)
    model = keras.Model(inputs, L.Dense(2)(L.GlobalAveragePooling2D()(h)))
    kinds = {n: how for n, _, how in describe(model)}
    assert [kinds[n] for n in ("conv", "depthwise", "separable", "transpose", "pointwise")] == [
        "Conv", "DepthwiseConv", "SeparableConv", "ConvTranspose", "Conv"]
    x, y, w = rng.normal(size=(P, 6, 5, 3)), rng.normal(size=(P, 2)), np.ones(P)
    clip = 0.5
    norms_ref, sum_ref = loop_reference(model, mse, x, y, w, clip)
    spec = [tf.TensorSpec([None, None, None, 3], tf.float64), tf.TensorSpec([None, 2], tf.float64),
            tf.TensorSpec([None], tf.float64)]
    step = tf.function(lambda x, y, w: ghost_clipped_sum(model, mse, x, y, w, l2_norm_clip=clip, training=False),
                       input_signature=spec)
    got = step(x, y, w)
    np.testing.assert_allclose(got.norms.numpy(), norms_ref, rtol=RTOL)
    scale = max(np.max(np.abs(g)) for g in sum_ref)
    for v, g, r in zip(model.trainable_variables, got.grads, sum_ref):
        np.testing.assert_allclose(np.asarray(g), r, rtol=RTOL, atol=RTOL * scale, err_msg=v.path)
