"""Ghost-norm clipping equals per-example clipping, layer type by layer type.

Every check compares ``ghost_clipped_sum`` against two independent computations:
a Python loop over single examples with ``tf.GradientTape`` written here, and the
vectorized engine of ``clipping.py``. Models are float64 so the tolerance (rtol 1e-5)
measures the method, not round-off. The clip ζ is set to the median norm so that
some examples are clipped and some are not; weights include zeros (padding of the
batch sampler) and non-unit sample weights.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf
import keras

from tests.training.helpers import noiseless
from keras_noisecurve.backend.tensorflow.clipping import vectorized_clipped_sum
from keras_noisecurve.backend.tensorflow.ghost import describe, ghost_clipped_sum, supports
from keras_noisecurve.backend.tensorflow import ghost_conv, engine_rules, kernels
from tests.training.helpers import float64_layers, loop_reference, mse, set_precision

P = 6
RTOL = 1e-5


float64 = pytest.fixture(autouse=True)(float64_layers)


def weights_with_padding(rng, n=P):
    w = rng.uniform(0.5, 2.0, size=n)
    w[1] = 0.0  # a padded example
    return w


def assert_close_grads(got, want):
    scale = max(np.max(np.abs(g)) for g in want)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), r, rtol=RTOL, atol=RTOL * scale)


def check_model(model, x, y, *, loss_fn=mse, seed=0, engine_kwargs=None, vectorized=True):
    rng = np.random.default_rng(seed)
    w = weights_with_padding(rng)
    ok, reason = supports(model)
    assert ok, reason
    norms_unclipped, _ = loop_reference(model, loss_fn, x, y, w, np.inf)
    assert np.count_nonzero(norms_unclipped) == P - 1  # only the padded example has norm 0
    clip = float(np.median(norms_unclipped[norms_unclipped > 0]))
    norms_ref, sum_ref = loop_reference(model, loss_fn, x, y, w, clip)
    got = ghost_clipped_sum(model, loss_fn, x, y, w, l2_norm_clip=clip, training=False, **(engine_kwargs or {}))
    np.testing.assert_allclose(got.norms.numpy(), norms_ref, rtol=RTOL, atol=1e-12)
    assert got.norms.numpy()[1] == 0.0
    assert_close_grads(got.grads, sum_ref)
    np.testing.assert_allclose(got.per_example_loss.numpy(), mse(y, model(x)).numpy() if loss_fn is mse else
                               loss_fn(y, model(x)).numpy(), rtol=1e-12)
    assert len(got.grads) == len(model.trainable_variables)
    if vectorized:
        vec = vectorized_clipped_sum(model, loss_fn, x, y, w, l2_norm_clip=clip, training=False)
        np.testing.assert_allclose(got.norms.numpy(), vec.norms.numpy(), rtol=RTOL, atol=1e-12)
        assert_close_grads(got.grads, [np.asarray(g) for g in vec.grads])
    return got


# ----------------------------------------------------------------- layer types


def test_dense_rank2_fused_activations():
    rng = np.random.default_rng(1)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(7, activation="tanh"),
            keras.layers.Dense(4, activation="softplus", use_bias=False),
            keras.layers.Dense(3),
        ]
    )
    check_model(model, rng.normal(size=(P, 5)), rng.normal(size=(P, 3)))


@pytest.mark.parametrize("length,width", [(3, 16), (12, 2)], ids=["gram", "materialised"])
def test_dense_and_einsum_dense_on_sequences(length, width):
    # L² < d_in·d_out selects the Gram form, else the per-example gradient.
    rng = np.random.default_rng(2)
    d_in = width
    model = keras.Sequential(
        [
            keras.Input((length, d_in)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.EinsumDense("abc,cd->abd", output_shape=(None, width), bias_axes="d", activation="tanh"),
            keras.layers.EinsumDense("...b,bc->...c", output_shape=3, bias_axes="c"),
        ]
    )
    first = model.layers[0]
    d = first.kernel.shape[0] * first.kernel.shape[1]
    assert (length * length < d) == (length == 3)
    check_model(model, rng.normal(size=(P, length, d_in)), rng.normal(size=(P, length, 3)))


def test_einsum_dense_multi_axis_and_partial_bias():
    # input (P, L, c) -> (P, L, h, k) with bias on one output axis only, then back.
    rng = np.random.default_rng(3)
    model = keras.Sequential(
        [
            keras.Input((4, 5)),
            keras.layers.EinsumDense("abc,cde->abde", output_shape=(4, 2, 3), bias_axes="e"),
            keras.layers.EinsumDense("abde,dec->abc", output_shape=(4, 2), bias_axes="bc"),
        ]
    )
    check_model(model, rng.normal(size=(P, 4, 5)), rng.normal(size=(P, 4, 2)))


@pytest.mark.parametrize("length,vocab", [(9, 5), (30, 3)], ids=["gram", "segment-sum"])
def test_embedding_with_repeated_tokens(length, vocab):
    rng = np.random.default_rng(4)
    ids = rng.integers(0, vocab, size=(P, length)).astype("int32")
    assert all(len(set(row)) < length for row in ids)  # every example repeats tokens
    model = keras.Sequential(
        [
            keras.Input((length,), dtype="int32"),
            keras.layers.Embedding(vocab, 4),
            keras.layers.Dense(2, activation="tanh"),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    check_model(model, ids, rng.normal(size=(P, 2)))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(strides=1, padding="valid"),
        dict(strides=2, padding="same"),
        dict(strides=1, padding="causal", dilation_rate=2),
    ],
    ids=["valid", "stride2-same", "causal-dilated"],
)
def test_conv1d(kwargs):
    rng = np.random.default_rng(5)
    model = keras.Sequential(
        [
            keras.Input((10, 3)),
            keras.layers.Conv1D(4, 3, activation="tanh", **kwargs),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    check_model(model, rng.normal(size=(P, 10, 3)), rng.normal(size=(P, 2)))


@pytest.mark.parametrize(
    "strides,padding,dilation",
    [(1, "same", 1), (1, "valid", 1), (2, "same", 1), (2, "valid", 1), (1, "same", 2)],
)
def test_conv2d(strides, padding, dilation):
    rng = np.random.default_rng(6)
    model = keras.Sequential(
        [
            keras.Input((7, 8, 3)),
            keras.layers.Conv2D(
                8, (3, 2), strides=strides, padding=padding, dilation_rate=dilation, activation="relu"
            ),
            # 8 input channels: patches by tf.image.extract_patches (3 above: one-hot conv)
            keras.layers.Conv2D(2, 2, strides=strides, padding=padding, use_bias=False),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    check_model(model, rng.normal(size=(P, 7, 8, 3)), rng.normal(size=(P, 2)))


def test_layer_and_group_normalization():
    rng = np.random.default_rng(7)
    model = keras.Sequential(
        [
            keras.Input((6, 6, 4)),
            keras.layers.Conv2D(6, 3, padding="same"),
            keras.layers.GroupNormalization(groups=3),
            keras.layers.Activation("relu"),
            keras.layers.LayerNormalization(axis=[-2, -1]),
            keras.layers.LayerNormalization(center=False),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(2),
        ]
    )
    # non-trivial gamma/beta so every term of the normalisation gradients matters
    for layer in model.layers:
        for v in layer.trainable_variables:
            if "gamma" in v.path or "beta" in v.path:
                v.assign(rng.normal(1.0, 0.5, size=v.shape))
    check_model(model, rng.normal(size=(P, 6, 6, 4)), rng.normal(size=(P, 2)))


def test_multi_head_attention_transformer_block():
    rng = np.random.default_rng(8)
    inputs = keras.Input((5, 8))
    h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(inputs, inputs)
    h = keras.layers.LayerNormalization()(inputs + h)
    f = keras.layers.Dense(16, activation="gelu")(h)
    f = keras.layers.Dense(8)(f)
    h = keras.layers.LayerNormalization()(h + f)
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model(inputs, outputs)
    check_model(model, rng.normal(size=(P, 5, 8)), rng.normal(size=(P, 2)))


def test_shared_layer_and_nested_sequential():
    # A Dense applied twice (its per-example gradient is the sum over both calls) and
    # a nested Sequential block.
    rng = np.random.default_rng(9)
    shared = keras.layers.Dense(4, activation="tanh")
    block = keras.Sequential([keras.layers.Dense(5), keras.layers.LayerNormalization()])
    a, b = keras.Input((3,)), keras.Input((3,))
    h = keras.layers.Concatenate()([shared(a), shared(b)])
    outputs = keras.layers.Dense(2)(block(h))
    model = keras.Model([a, b], outputs)
    x = [rng.normal(size=(P, 3)), rng.normal(size=(P, 3))]
    check_model(model, x, rng.normal(size=(P, 2)))


def test_sparse_categorical_crossentropy_and_sample_weights():
    rng = np.random.default_rng(10)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    check_model(model, rng.normal(size=(P, 4)), rng.integers(0, 3, size=(P,)), loss_fn=loss)


# --------------------------------------------------------- refusals and support


class Scale(keras.layers.Layer):
    """A custom layer with its own trainable weight (no ghost rule: x·s² is not affine in s,
    so it is not recognised as a scale by what it computes either)."""

    def build(self, input_shape):
        self.s = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.s * self.s


def test_custom_layer_takes_the_per_layer_fallback_and_is_exact():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), Scale(name="my_scale"), keras.layers.Dense(2)])
    assert ("my_scale", "Scale", "generic") in describe(model)
    rng = np.random.default_rng(3)
    check_model(model, rng.normal(size=(P, 3)), rng.normal(size=(P, 2)))


class Tied(keras.layers.Layer):
    """Reads another layer's kernel directly: that use escapes the kernel's own layer."""

    def __init__(self, other, **kwargs):
        super().__init__(**kwargs)
        self.other = other

    def call(self, x):
        return tf.matmul(x, self.other.kernel, transpose_b=True)


def test_a_weight_read_outside_its_layer_is_clipped_through_the_model_enclosing_the_read():
    # only the model encloses the read (in 'tied') and the kernel's own layer 'enc': its
    # outputs are one row per example, so the model is clipped whole by the fallback
    # (tests/training/test_ghost_reads.py: the refusals, and readers inside a layer)
    encoder = keras.layers.Dense(4, name="enc")
    inputs = keras.Input((3,))
    model = keras.Model(inputs, Tied(encoder, name="tied")(encoder(inputs)), name="tied_model")
    assert describe(model) == [("tied_model", "Functional", "generic")]
    rng = np.random.default_rng(12)
    check_model(model, rng.normal(size=(P, 3)), rng.normal(size=(P, 3)))
    # the same weights read through their own layers' calls keep their rules
    fine = keras.Model(inputs, keras.layers.Dense(3, name="dec")(encoder(inputs)))
    assert [how for _, _, how in describe(fine)] == ["Dense", "Dense"]


def test_frozen_custom_layer_is_fine():
    custom = Scale(name="frozen_scale")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), custom, keras.layers.Dense(1)])
    custom.trainable = False
    assert supports(model) == (True, "")


def test_batch_norm_refused_in_supports_and_at_call():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), keras.layers.BatchNormalization(name="bn")])
    ok, reason = supports(model)
    assert not ok and "BatchNormalization" in reason and "'bn'" in reason and "mixes examples" in reason
    with pytest.raises(ValueError, match="mixes examples"):
        ghost_clipped_sum(model, mse, np.zeros((2, 3)), np.zeros((2, 3)), None, l2_norm_clip=1.0)


def test_configurations_without_a_fast_rule_take_the_fallback_and_are_exact_and_per_head_weights_are_ghosted():
    # a causal grouped Conv1D takes its kernel, a transposed convolution with an output_padding the fallback
    rng = np.random.default_rng(4)
    grouped = keras.Sequential([keras.Input((8, 4)), keras.layers.Conv1D(4, 3, groups=2, padding="causal", name="gconv")])
    depthwise = keras.Sequential(
        [keras.Input((4, 4, 2)), keras.layers.Conv2DTranspose(2, 3, strides=2, output_padding=1, name="dw")]
    )
    per_head = keras.Sequential(
        [keras.Input((2, 3)), keras.layers.EinsumDense("abc,bcd->abd", output_shape=(2, 4), name="perhead")]
    )
    # (per-head weights: G_i materialised by the EinsumDense kernel, the same on both backends)
    for model, name, how in ((grouped, "gconv", "GroupedConv"), (depthwise, "dw", "generic"),
                             (per_head, "perhead", "EinsumDense")):
        assert dict((n, h) for n, _, h in describe(model))[name] == how
        shape = (P,) + tuple(model.input_shape[1:])
        # (the whole-model vectorized reference fails on the grouped kernel without oneDNN)
        check_model(model, rng.normal(size=shape), rng.normal(size=(P,) + tuple(model.output_shape[1:])),
                    vectorized=False)


def test_argument_validation():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    x, y = np.zeros((2, 3)), np.zeros((2, 1))
    with pytest.raises(ValueError, match="l2_norm_clip"):
        ghost_clipped_sum(model, mse, x, y, None, l2_norm_clip=0.0)
    with pytest.raises(ValueError, match="microbatch_size"):
        ghost_clipped_sum(model, mse, x, y, None, l2_norm_clip=1.0, microbatch_size=0)
    with pytest.raises(ValueError, match=r"shape \(P,\)"):
        ghost_clipped_sum(model, lambda yt, yp: yp, x, y, None, l2_norm_clip=1.0)


# ------------------------------------------------ graph mode, chunks, replicas


def _small_seq_model():
    return keras.Sequential(
        [
            keras.Input((None, 4)),
            keras.layers.Dense(6, activation="tanh"),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(2),
        ]
    )


def test_tf_function_with_unknown_batch_and_length_matches_eager():
    # dynamic L exercises the tf.cond choice between the Gram and materialised forms
    rng = np.random.default_rng(11)
    model = _small_seq_model()
    x, y = rng.normal(size=(P, 5, 4)), rng.normal(size=(P, 5, 2))
    w = weights_with_padding(rng)
    spec = [tf.TensorSpec([None, None, 4], tf.float64), tf.TensorSpec([None, None, 2], tf.float64),
            tf.TensorSpec([None], tf.float64)]

    @tf.function(input_signature=spec)
    def step(x, y, w):
        out = ghost_clipped_sum(model, mse, x, y, w, l2_norm_clip=0.3)
        return out.grads, out.norms

    grads, norms = step(x, y, w)
    norms_ref, sum_ref = loop_reference(model, mse, x, y, w, 0.3)
    np.testing.assert_allclose(norms.numpy(), norms_ref, rtol=RTOL)
    assert_close_grads(grads, sum_ref)
    assert "call" not in model.layers[0].__dict__  # wrappers removed after tracing


def test_microbatches_give_the_same_result():
    rng = np.random.default_rng(12)
    model = _small_seq_model()
    x, y = rng.normal(size=(P, 5, 4)), rng.normal(size=(P, 5, 2))
    w = weights_with_padding(rng)
    full = ghost_clipped_sum(model, mse, x, y, w, l2_norm_clip=0.3)
    chunked = tf.function(
        lambda: ghost_clipped_sum(model, mse, x, y, w, l2_norm_clip=0.3, microbatch_size=4)
    )()
    np.testing.assert_allclose(chunked.norms.numpy(), full.norms.numpy(), rtol=1e-10)
    np.testing.assert_allclose(chunked.y_pred.numpy(), full.y_pred.numpy(), rtol=1e-10)
    assert_close_grads(chunked.grads, [g.numpy() for g in full.grads])


def test_mirrored_strategy_replica_sums_equal_the_full_batch():
    devices = tf.config.list_logical_devices("CPU")
    if len(devices) < 2:
        pytest.skip("needs the two logical CPU devices of tests/conftest.py")
    rng = np.random.default_rng(13)
    strategy = tf.distribute.MirroredStrategy([d.name for d in devices[:2]])
    with strategy.scope():
        model = _small_seq_model()
    x, y = rng.normal(size=(8, 5, 4)), rng.normal(size=(8, 5, 2))
    w = weights_with_padding(rng, 8)

    @tf.function
    def replica_step(x, y, w):
        return ghost_clipped_sum(model, mse, x, y, w, l2_norm_clip=0.3).grads

    def value_fn(ctx):
        i = ctx.replica_id_in_sync_group
        s = slice(4 * i, 4 * i + 4)
        return x[s], y[s], w[s]

    args = strategy.experimental_distribute_values_from_function(
        lambda ctx: tuple(tf.constant(a) for a in value_fn(ctx))
    )
    per_replica = strategy.run(replica_step, args=args)
    summed = [strategy.reduce(tf.distribute.ReduceOp.SUM, g, axis=None).numpy() for g in per_replica]
    _, sum_ref = loop_reference(model, mse, x, y, w, 0.3)
    assert_close_grads(summed, sum_ref)


def test_sequence_sq_norms_both_forms_agree_with_materialised():
    rng = np.random.default_rng(14)
    a = tf.constant(rng.normal(size=(3, 4, 5)))
    g = tf.constant(rng.normal(size=(3, 4, 2)))
    want = np.array([np.sum((a.numpy()[i].T @ g.numpy()[i]) ** 2) for i in range(3)])
    np.testing.assert_allclose(engine_rules.sequence_sq_norms(a, g).numpy(), want, rtol=1e-12)  # materialised
    np.testing.assert_allclose(
        engine_rules.sequence_sq_norms(a[:, :3], g[:, :3]).numpy(),
        [np.sum((a.numpy()[i, :3].T @ g.numpy()[i, :3]) ** 2) for i in range(3)],
        rtol=1e-12,
    )  # Gram (9 < 10)


def test_paper_cnn_with_its_groupnorm_layer():
    # keras_noisecurve.apps.models.small_groupnorm_cnn uses its own GroupNorm layer (exact
    # second derivatives); ghost clipping has a rule for it, so "auto" picks ghost.
    from keras_noisecurve.apps.models import small_groupnorm_cnn

    rng = np.random.default_rng(15)
    model = small_groupnorm_cnn(input_shape=(8, 8, 3), num_classes=3, dense_size=8, groups=4, seed=1)
    for v in model.trainable_variables:
        if "gamma" in v.path or "beta" in v.path:
            v.assign(rng.normal(1.0, 0.5, size=v.shape))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    check_model(model, rng.normal(size=(P, 8, 8, 3)), rng.integers(0, 3, size=(P,)), loss_fn=loss)


# ---------------------------------------------------------- make_private integration


def test_make_private_fit_with_ghost_takes_the_clipped_sgd_step():
    # One fit step with σ = 0 must move the weights by exactly −η·Σ_i clip(g_i)/B,
    # with the clipped sum from the independent per-example loop.
    from keras_noisecurve.training import NoiseCurveOptimizer, make_private

    set_precision("float32")
    rng = np.random.default_rng(16)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.LayerNormalization(),
         keras.layers.Dense(2)]
    )
    x, y = rng.normal(size=(P, 4)).astype("float32"), rng.normal(size=(P, 2)).astype("float32")
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    norms, _ = loop_reference(model, mse, x, y, np.ones(P), np.inf)
    clip = float(np.median(norms))
    _, total = loop_reference(model, mse, x, y, np.ones(P), clip)
    private = make_private(model, clipping="ghost")
    lr = 0.5
    private.compile(
        optimizer=noiseless(NoiseCurveOptimizer(learning_rate=lr, l2_norm_clip=clip, noise_multiplier=1.0,
                                                expected_batch_size=P, seed=0)),
        loss="mse",
    )
    private.fit(x, y, batch_size=P, epochs=1, shuffle=False, verbose=0)
    assert private._engine() is ghost_clipped_sum
    for v, w0, s in zip(model.trainable_variables, before, total):
        np.testing.assert_allclose(v.numpy(), w0 - lr * s / P, rtol=1e-4, atol=1e-5)


def test_auto_engine_is_the_per_layer_engine_and_never_the_whole_model_one():
    from keras_noisecurve.training import make_private
    from keras_noisecurve.backend.tensorflow.clipping import get_engine

    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    custom = keras.Sequential([keras.Input((3,)), Scale(), keras.layers.Dense(2)])
    for model in (plain, custom, make_private(plain), make_private(custom)):
        assert get_engine("auto", model) is ghost_clipped_sum
    assert get_engine("vectorized", custom) is vectorized_clipped_sum  # the reference, only when asked
    bn = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(name="bn")])
    with pytest.raises(ValueError, match="'bn'.*mixes examples"):
        get_engine("auto", bn)


class FoldTime(keras.layers.Layer):
    """Applies a Dense to (P·T, d) rows: the Dense's rows are not examples."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        rows = tf.reshape(x, [-1, x.shape[-1]])
        return tf.reshape(self.dense(rows), [tf.shape(x)[0], -1, 2])


def test_time_distributed_is_clipped_through_the_wrapper_and_folding_layers_through_their_caller():
    wrapped = keras.Sequential([keras.Input((4, 3)), keras.layers.TimeDistributed(keras.layers.Dense(2), name="td")])
    # a Dense inside: the inner rule on the whole (P, T, ...) input (ghost_timedist)
    assert describe(wrapped) == [("td", "TimeDistributed", "TimeDistributed (folded)")]
    rng = np.random.default_rng(5)
    check_model(wrapped, rng.normal(size=(P, 4, 3)), rng.normal(size=(P, 4, 2)))
    folded = keras.Sequential([keras.Input((4, 3)), FoldTime()])
    # a Sequential has no input specs to probe before a step: its Dense on P·T rows is listed
    # under the Dense rule, and found when the step is traced (engine_rows.probe at the batch's
    # shapes), then clipped exactly through FoldTime, whose call takes one row per example
    assert supports(folded)[0] and describe(folded)[0][2] == "Dense"
    check_model(folded, rng.normal(size=(P, 4, 3)), rng.normal(size=(P, 4, 2)))


@pytest.mark.parametrize("channels", [3, 8], ids=["one-hot-patches", "extract-patches"])
def test_conv2d_gram_form_on_small_maps(channels):
    # L² < k²·c_in·c_out: the Gram form on unfolded patches (the other conv tests take
    # the per-example Conv2DBackpropFilter path).
    rng = np.random.default_rng(17)
    model = keras.Sequential(
        [
            keras.Input((3, 4, channels)),
            keras.layers.Conv2D(16, 3, padding="same", activation="tanh"),
            keras.layers.Conv2D(8, 2, strides=2, padding="valid"),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    check_model(model, rng.normal(size=(P, 3, 4, channels)), rng.normal(size=(P, 2)))


POINTWISE = {
    # (input shape, layer): L² against c_in·c_out picks the norms' form of the Dense map
    "5x5-same-materialised": ((5, 5, 3), lambda: keras.layers.Conv2D(4, 1, padding="same", activation="tanh")),
    "3x3-valid-gram": ((3, 3, 16), lambda: keras.layers.Conv2D(8, 1, activation="relu")),
    "1x1-map-product": ((1, 1, 6), lambda: keras.layers.Conv2D(5, 1)),
    "stride2-same-odd": ((5, 4, 3), lambda: keras.layers.Conv2D(4, 1, strides=2, padding="same", use_bias=False)),
    "stride-2x3-valid": ((7, 8, 2), lambda: keras.layers.Conv2D(3, 1, strides=(2, 3), activation="tanh")),
    "dilated": ((4, 4, 3), lambda: keras.layers.Conv2D(2, 1, dilation_rate=2, padding="same")),
    "conv1d-causal-stride2": ((9, 3), lambda: keras.layers.Conv1D(4, 1, strides=2, padding="causal")),
}


@pytest.mark.parametrize("case", sorted(POINTWISE))
def test_pointwise_conv_is_a_dense_map_of_pixels(case, monkeypatch):
    # a 1×1 convolution takes the Dense form (pixels at the strides × output gradients);
    # float64 per-example loop and vectorized engine
    taken = []
    for name in ("window_patches", "example_grads"):
        monkeypatch.setattr(ghost_conv, name, lambda *args, name=name, **kwargs: taken.append(name))
    shape, build = POINTWISE[case]
    rng = np.random.default_rng(sorted(POINTWISE).index(case))
    model = keras.Sequential([keras.Input(shape), build(), keras.layers.Flatten(), keras.layers.Dense(2)])
    check_model(model, rng.normal(size=(P, *shape)), rng.normal(size=(P, 2)))
    assert taken == []  # neither windows nor filter gradients: the pixels at the strides


def test_shared_pointwise_conv_on_two_map_sizes():
    # one 1×1 Conv2D called on a 4×4 and a 1×1 map: its per-example gradient sums both calls
    rng = np.random.default_rng(44)
    big, small = keras.Input((4, 4, 3)), keras.Input((1, 1, 3))
    shared = keras.layers.Conv2D(5, 1, activation="tanh")
    pooled = [keras.layers.GlobalAveragePooling2D()(shared(t)) for t in (big, small)]
    model = keras.Model([big, small], keras.layers.Dense(2)(keras.layers.Concatenate()(pooled)))
    check_model(model, [rng.normal(size=(P, 4, 4, 3)), rng.normal(size=(P, 1, 1, 3))], rng.normal(size=(P, 2)))


def test_group_normalization_fast_and_generic_paths():
    # channels last on a rank-3 input and without scale (fast path: out = x·s + t, no
    # x̂), on a rank-2 input (no positions), and along axis 1 (the generic x̂ path);
    # a layer called twice sums its per-example gradients over calls.
    rng = np.random.default_rng(23)
    inputs = keras.Input((5, 6))
    shared = keras.layers.GroupNormalization(groups=2)
    h = shared(keras.layers.Dense(6)(inputs))
    h = shared(keras.layers.Activation("tanh")(h))
    h = keras.layers.GroupNormalization(groups=3, scale=False)(h)
    h = keras.layers.GroupNormalization(groups=5, axis=1)(h)
    flat = keras.layers.Dense(6)(keras.layers.Flatten()(h))
    out = keras.layers.Dense(2)(keras.layers.GroupNormalization(groups=2)(flat))
    model = keras.Model(inputs, out)
    for v in model.trainable_variables:
        if "gamma" in v.path or "beta" in v.path:
            v.assign(rng.normal(1.0, 0.5, size=v.shape))
    # inputs with a large mean: the fast path's Σg·x − μ·Σg must not lose accuracy
    check_model(model, 3.0 + rng.normal(size=(P, 5, 6)), rng.normal(size=(P, 2)))


GROUPED_RUNS = kernels.grouped_conv_filter_gradient_runs(kernels.device_type(), "float32")
needs_grouped = pytest.mark.skipif(
    not GROUPED_RUNS, reason="TensorFlow's kernels here do not run a grouped Conv2DBackpropFilter "
    "(CPU without oneDNN); CI re-runs this file with TF_ENABLE_ONEDNN_OPTS=1"
)


def test_grouped_kernel_probe_follows_the_onednn_switch():
    # The probe must say what the kernels do: on CPU the grouped filter gradient runs
    # exactly when oneDNN is on. CI runs this file with the switch forced each way.
    if kernels.device_type() != "CPU":
        pytest.skip("the oneDNN switch concerns CPU kernels")
    switch = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
    if switch not in ("0", "1"):
        pytest.skip("TF_ENABLE_ONEDNN_OPTS not forced: TensorFlow chooses by the CPU's instructions")
    assert GROUPED_RUNS == (switch == "1")
    assert engine_rules.conv_chunk(tf.float32) == (engine_rules.CONV_CHUNK if switch == "1" else 1)
    # no CPU kernel runs it in float64, oneDNN or not
    assert engine_rules.conv_chunk(tf.float64) == 1


@pytest.mark.skipif(GROUPED_RUNS, reason="the grouped kernel runs here")
def test_explicit_grouped_chunk_is_refused_where_the_kernel_does_not_run():
    a, g = tf.zeros([2, 5, 5, 2]), tf.zeros([2, 5, 5, 3])
    with pytest.raises(ValueError, match=r"chunk=4.*TF_ENABLE_ONEDNN_OPTS=1.*chunk=1"):
        engine_rules.conv_sq_norms([(a, g)], [3, 3], [1, 1], "SAME", chunk=4)


@pytest.mark.parametrize("chunk", [None, 1, pytest.param(3, marks=needs_grouped)])
@pytest.mark.parametrize("strides, padding", [((1, 1), "SAME"), ((2, 1), "VALID"), ((2, 2), "SAME")])
def test_conv_sq_norms_grouped_chunks_equal_per_example_loop(chunk, strides, padding):
    # float32 runs the grouped Conv2DBackpropFilter where the kernels allow it (chunks
    # of examples as groups; 7 examples do not fill the last chunk), else one plain
    # call per example; the reference is a float64 loop over examples
    # differentiating tf.nn.conv2d, summed over two calls of the layer.
    rng = np.random.default_rng(29)
    n, c_in, c_out = 7, 3, 5
    kernel = tf.constant(rng.normal(size=(3, 2, c_in, c_out)))
    calls = []
    for size in [(9, 8), (6, 7)]:
        a = rng.normal(size=(n, *size, c_in))
        out_shape = tf.nn.conv2d(a[:1], kernel, [1, *strides, 1], padding).shape
        calls.append((a, rng.normal(size=(n, *out_shape[1:]))))
    want = []
    for i in range(n):
        with tf.GradientTape() as tape:
            tape.watch(kernel)
            total = sum(tf.reduce_sum(tf.nn.conv2d(a[i : i + 1], kernel, [1, *strides, 1], padding) * g[i : i + 1])
                        for a, g in calls)
        want.append(np.sum(tape.gradient(total, kernel).numpy() ** 2))
    images = [(tf.constant(a, tf.float32), tf.constant(g, tf.float32)) for a, g in calls]
    got = engine_rules.conv_sq_norms(images, [3, 2], list(strides), padding, chunk=chunk)
    assert got.dtype == tf.float32 and got.shape == (n,)
    np.testing.assert_allclose(got.numpy(), want, rtol=RTOL)
    got64 = engine_rules.conv_sq_norms([(tf.constant(a), tf.constant(g)) for a, g in calls], [3, 2],
                                       list(strides), padding)
    np.testing.assert_allclose(got64.numpy(), want, rtol=1e-12)


@pytest.mark.parametrize("chunk", [1, pytest.param(3, marks=needs_grouped), pytest.param(16, marks=needs_grouped)])
def test_conv_example_grads_and_their_weighted_sum_equal_per_example_loop(chunk):
    # The materialised form keeps the per-example kernel gradients and forms the
    # clipped sum Σ_i s_i ∂K_i from them (no second weight-gradient step): against a
    # float64 loop differentiating tf.nn.conv2d example by example, a layer called
    # twice, 7 examples (the last chunk padded; chunk 16 > 7: one padded chunk).
    rng = np.random.default_rng(41)
    n, c_in, c_out, strides = 7, 2, 3, [2, 1]
    kernel = tf.constant(rng.normal(size=(3, 2, c_in, c_out)))
    calls = []
    for size in [(8, 7), (5, 6)]:
        a = rng.normal(size=(n, *size, c_in))
        out_shape = tf.nn.conv2d(a[:1], kernel, [1, *strides, 1], "SAME").shape
        calls.append((a, rng.normal(size=(n, *out_shape[1:]))))
    scale = rng.uniform(0.0, 2.0, size=n)
    per_example = []
    for i in range(n):
        with tf.GradientTape() as tape:
            tape.watch(kernel)
            total = sum(tf.reduce_sum(tf.nn.conv2d(a[i : i + 1], kernel, [1, *strides, 1], "SAME") * g[i : i + 1])
                        for a, g in calls)
        per_example.append(tape.gradient(total, kernel).numpy())
    per_example = np.stack(per_example)
    want_sq = np.sum(per_example**2, axis=(1, 2, 3, 4))
    want_sum = np.tensordot(scale, per_example, axes=1).reshape(-1, c_out)
    images = [(tf.constant(a, tf.float32), tf.constant(g, tf.float32)) for a, g in calls]
    got = ghost_conv.conv_example_grads(images, [3, 2], strides, "SAME", chunk=chunk)
    np.testing.assert_allclose(got.sq_norms().numpy(), want_sq, rtol=RTOL)
    got_sum = got.weighted_sum(tf.constant(scale, tf.float32)).numpy()[0]  # (1, K·c_in, c_out): one group
    np.testing.assert_allclose(got_sum, want_sum, rtol=RTOL, atol=RTOL * np.max(np.abs(want_sum)))
    got64 = ghost_conv.conv_example_grads([(tf.constant(a), tf.constant(g)) for a, g in calls], [3, 2],
                                          strides, "SAME")
    np.testing.assert_allclose(got64.weighted_sum(tf.constant(scale)).numpy()[0], want_sum, rtol=1e-12)


@pytest.mark.parametrize("materialise", [True, False], ids=["per-example-grads", "gram"])
def test_shared_conv_layer_in_both_forms(materialise, monkeypatch):
    # A Conv2D called on two inputs of different sizes, each form of the conv rule
    # forced (the rule sums per-example gradients over calls; the materialised form's
    # clipped sum comes from the kept per-example gradients, the Gram form's from one
    # contraction of the windows with c ⊙ g): float64 loop and vectorized engine.
    calls = []
    original = ghost_conv.conv_example_grads

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(ghost_conv, "conv_example_grads", spy)
    chosen = ghost_conv.example_grads
    monkeypatch.setattr(ghost_conv, "example_grads", lambda pairs, **kw: chosen(pairs, **{**kw, "materialise": materialise}))
    rng = np.random.default_rng(43)
    big, small = keras.Input((7, 6, 3)), keras.Input((4, 5, 3))
    # L = 4·6 + 2·5 = 34 positions, 34² < 27·48: the Gram form unless materialising is forced
    shared = keras.layers.Conv2D(48, 3, strides=(2, 1), padding="same", activation="tanh")
    pooled = [keras.layers.GlobalAveragePooling2D()(shared(t)) for t in (big, small)]
    model = keras.Model([big, small], keras.layers.Dense(2)(keras.layers.Concatenate()(pooled)))
    x = [rng.normal(size=(P, 7, 6, 3)), rng.normal(size=(P, 4, 5, 3))]
    check_model(model, x, rng.normal(size=(P, 2)))
    assert len(calls) == (1 if materialise else 0)


def test_conv_sq_norms_with_unknown_batch_size():
    rng = np.random.default_rng(31)
    a, g = rng.normal(size=(5, 6, 6, 2)).astype("float32"), rng.normal(size=(5, 3, 3, 4)).astype("float32")
    fn = tf.function(
        lambda a, g: engine_rules.conv_sq_norms([(a, g)], [3, 3], [2, 2], "SAME"),
        input_signature=[tf.TensorSpec([None, 6, 6, 2], tf.float32), tf.TensorSpec([None, 3, 3, 4], tf.float32)],
    )
    images64 = [(tf.constant(a, tf.float64), tf.constant(g, tf.float64))]
    want = engine_rules.conv_sq_norms(images64, [3, 3], [2, 2], "SAME")
    np.testing.assert_allclose(fn(a, g).numpy(), want.numpy(), rtol=RTOL)


@pytest.mark.parametrize("form", ["per-example", pytest.param("grouped", marks=needs_grouped)])
@pytest.mark.parametrize("n", [1, 7, 9])
def test_float32_conv_model_any_batch_size_and_odd_images(n, form, monkeypatch):
    # Batch sizes that fill no chunk of 4 (1, 7, 9), odd image sizes (9×7, stride 2
    # gives 5×4), float32 as users train: each kernel path of the conv rule against a
    # loop over single examples. The conv layers are wide enough in positions that
    # the rule takes conv_sq_norms, not the patches.
    monkeypatch.setattr(ghost_conv, "conv_chunk",
                        lambda dtype, device=None: engine_rules.CONV_CHUNK if form == "grouped" else 1)
    set_precision("float32")
    rng = np.random.default_rng(37 + n)
    model = keras.Sequential(
        [
            keras.Input((9, 7, 3)),
            keras.layers.Conv2D(4, 3, padding="same", activation="tanh"),
            keras.layers.Conv2D(3, (3, 2), strides=2, padding="same"),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )
    x = rng.normal(size=(n, 9, 7, 3)).astype("float32")
    y = rng.normal(size=(n, 2)).astype("float32")
    w = rng.uniform(0.5, 2.0, size=n).astype("float32")
    norms, _ = loop_reference(model, mse, x, y, w, np.inf)
    clip = float(np.median(norms))
    norms_ref, sum_ref = loop_reference(model, mse, x, y, w, clip)
    got = ghost_clipped_sum(model, mse, x, y, w, l2_norm_clip=clip, training=False)
    np.testing.assert_allclose(got.norms.numpy(), norms_ref, rtol=1e-4)
    scale = max(np.max(np.abs(g)) for g in sum_ref)
    for g, r in zip(got.grads, sum_ref):
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-4, atol=1e-4 * scale)


# ------------------------------------------------- language-model embeddings and scales


def test_rms_normalization_rule():
    model = keras.Sequential([keras.Input((4, 3)), keras.layers.Dense(5), keras.layers.RMSNormalization(),
                              keras.layers.Dense(2)])
    assert [how for _, _, how in describe(model)] == ["Dense", "RMS scale", "Dense"]
    rng = np.random.default_rng(11)
    model.layers[1].scale.assign(rng.uniform(0.5, 1.5, size=5))
    check_model(model, rng.normal(size=(P, 4, 3)), rng.normal(size=(P, 4, 2)))


@pytest.mark.parametrize("tied", [True, False])
def test_reversible_embedding_lookup_and_projection(tied):
    # the table is used twice as a lookup (shared) and once, transposed, for the logits
    table = keras.layers.ReversibleEmbedding(7, 4, tie_weights=tied, logit_soft_cap=3.0, name="tok")
    ids = keras.Input((5,), dtype="int32")
    hidden = keras.layers.Dense(4, activation="tanh")(table(ids) + table(ids[:, ::-1]))
    model = keras.Model(ids, table(hidden, reverse=True))
    assert dict((n, how) for n, _, how in describe(model))["tok"] == "ReversibleEmbedding"
    rng = np.random.default_rng(12)
    x = rng.integers(0, 7, size=(P, 5)).astype("int32")
    x[0, :2] = 3  # repeated tokens
    check_model(model, x, rng.normal(size=(P, 5, 7)))


def test_tied_cross_term_equals_the_dense_inner_product():
    from keras_noisecurve.backend.common.ghost_embedding import tied_cross_term

    rng = np.random.default_rng(13)
    vocab, d, length, m = 6, 3, 4, 5
    ids = rng.integers(0, vocab, size=(2, length))
    g_lookup, h = rng.normal(size=(2, length, d)), rng.normal(size=(2, m, d))
    g_logits = rng.normal(size=(2, m, vocab))
    want = []
    for i in range(2):
        a = np.zeros((vocab, d))
        for l in range(length):
            a[ids[i, l]] += g_lookup[i, l]
        b = g_logits[i].T @ h[i]
        want.append(2 * np.sum(a * b))
    got = tied_cross_term(tf.constant(ids), tf.constant(g_lookup), tf.constant(h), tf.constant(g_logits))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)


@pytest.mark.parametrize("bias_trainable", [True, False])
def test_lora_dense_and_einsum_dense(bias_trainable):
    # only the low-rank factors (and a trainable bias) train; lora_alpha != rank scales them
    inputs = keras.Input((4, 6))
    query = keras.layers.EinsumDense("abc,cde->abde", output_shape=(4, 2, 3), bias_axes="de", name="q")
    dense = keras.layers.Dense(5, name="d")
    out = keras.layers.Dense(2)(dense(keras.layers.Reshape((4, 6))(query(inputs))))
    model = keras.Model(inputs, out)
    rng = np.random.default_rng(14)
    for layer in (query, dense):
        layer.enable_lora(rank=2, lora_alpha=3, b_initializer="random_normal")
        layer.bias.trainable = bias_trainable
    how = {n: how for n, _, how in describe(model)}
    assert how["q"] == how["d"] == "LoRA" and how[model.layers[-1].name] == "Dense"
    check_model(model, rng.normal(size=(P, 4, 6)), rng.normal(size=(P, 4, 2)))


def test_lora_with_a_contracted_last_kernel_axis_takes_the_fallback():
    proj = keras.layers.EinsumDense("abc,dc->abd", output_shape=(4, 3), name="proj")  # kernel (d, c): c contracted
    model = keras.Sequential([keras.Input((4, 5)), proj])
    proj.enable_lora(rank=2, b_initializer="random_normal")
    assert describe(model) == [("proj", "EinsumDense", "generic")]
    rng = np.random.default_rng(15)
    check_model(model, rng.normal(size=(P, 4, 5)), rng.normal(size=(P, 4, 3)))


def test_a_weight_in_two_plan_entries_is_an_internal_error_naming_both_layers():
    # a plan that clips one weight by two rules would count its per-example gradient twice
    from keras_noisecurve.backend.tensorflow.ghost import check_partition, plan

    shared = keras.layers.Dense(3, name="shared")
    outer = keras.layers.TimeDistributed(shared, name="td")
    model = keras.Sequential([keras.Input((4, 5)), outer, keras.layers.Flatten(), keras.layers.Dense(2)])
    entries = plan(model)
    assert check_partition(entries) is entries
    (td, td_rule, td_vars), = [e for e in entries if e[0] is outer]
    with pytest.raises(RuntimeError, match=r"td/shared/kernel' is clipped by two rules, those of TimeDistributed layer 'td' and Dense layer 'shared'"):
        check_partition(entries + [(shared, td_rule, [shared.kernel])])


def test_position_embedding_in_a_step_traced_for_any_length():
    """KerasHub's PositionEmbedding in a step whose sequence length is unknown when traced (Keras
    retraces fit's step with relaxed shapes): its kernel pads by the dynamic length, and the traced
    step gives the norms and sums of the eager one, which check_model compares with the loop."""
    keras_hub = pytest.importorskip("keras_hub")
    ids = keras.Input((None,), dtype="int32")
    embed = keras_hub.layers.TokenAndPositionEmbedding(vocabulary_size=9, sequence_length=8, embedding_dim=4)
    model = keras.Model(ids, keras.layers.Dense(2)(embed(ids)))
    rng = np.random.default_rng(21)
    x = rng.integers(0, 9, size=(P, 5)).astype("int32")
    y = rng.normal(size=(P, 5, 2))
    assert "PositionEmbedding" in [how for _, _, how in describe(model)]
    eager = check_model(model, x, y)
    w = weights_with_padding(np.random.default_rng(0))
    clip = float(np.median(eager.norms.numpy()[eager.norms.numpy() > 0]))
    traced = tf.function(lambda x, y, w: ghost_clipped_sum(model, mse, x, y, w, l2_norm_clip=clip, training=False),
                         input_signature=[tf.TensorSpec((None, None), tf.int32), tf.TensorSpec((None, None, 2), tf.float64),
                                          tf.TensorSpec((None,), tf.float64)])
    got = traced(tf.constant(x), tf.constant(y), tf.constant(w))
    np.testing.assert_allclose(got.norms.numpy(), eager.norms.numpy(), rtol=1e-10)
    assert_close_grads(got.grads, [g.numpy() for g in eager.grads])


def test_a_group_normalization_subclass_is_clipped_by_the_fallback():
    """Keras's GroupNormalization computes in helper methods a subclass may override without
    overriding ``call``: only the exact class takes the group-norm kernel."""

    class RMSGroups(keras.layers.GroupNormalization):
        def _apply_normalization(self, reshaped_inputs, input_shape):  # no mean subtracted
            variance = keras.ops.mean(keras.ops.square(reshaped_inputs), axis=(1, 3), keepdims=True)
            normalized = reshaped_inputs * keras.ops.rsqrt(variance + self.epsilon)
            return keras.ops.reshape(normalized, input_shape) * self.gamma + self.beta

    inputs = keras.Input((4, 6))
    model = keras.Model(inputs, keras.layers.Dense(2)(RMSGroups(groups=2, name="gn")(inputs)))
    assert dict((name, how) for name, _, how in describe(model))["gn"] == "generic"
    rng = np.random.default_rng(22)
    check_model(model, rng.normal(size=(P, 4, 6)), rng.normal(size=(P, 4, 2)))
