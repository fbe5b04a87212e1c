"""The JAX ghost-norm engine (keras_noisecurve.backend.jax.ghost) against an INDEPENDENT
per-example loop (tests/jax/helpers.reference_clipped_sum: one ``jax.grad`` of the
model's ``stateless_call`` per example, clipping in float64 numpy).

Tolerance: float32 throughout (no x64). The engine and the loop sum the same products
in different orders (Gram forms, segment sums, einsums over positions), so they agree
to a few hundred float32 ulps of the largest term: norms rtol 1e-4; sums atol
1e-4 × the largest entry of the reference sums (the
key projection's bias has an exactly zero gradient: its entries are pure rounding). A wrong rule (a missing position, a
double-counted path, a wrong clip factor) changes them by > 1e-2 relative.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from keras_noisecurve import NoiseCurveOptimizer, make_private
from keras_noisecurve.backend.jax.ghost import ghost_clipped_sum
from tests.jax.helpers import mlp, mse_per_example, reference_clipped_sum, weights_of


def _sce(y_true, y_pred):
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


def _compare(model, x, y, weights, clip, loss=mse_per_example, clipping="ghost"):
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    step = jax.jit(lambda tv, ntv, x, y, w: ghost_clipped_sum(
        model, loss, tv, ntv, x, y, w, l2_norm_clip=clip, clipping=clipping,
        vectorized=_vectorized)[:2])
    sums, norms = step(trainable, non_trainable, x, y, jnp.asarray(weights))
    ref_sums, ref_norms = reference_clipped_sum(model, x, y, weights, clip, loss=loss)
    np.testing.assert_allclose(np.asarray(norms), ref_norms, rtol=1e-4, atol=1e-6)
    scale = max(np.max(np.abs(r)) for r in ref_sums)  # a key bias's gradient is 0 up to rounding
    for s, r in zip(sums, ref_sums):
        np.testing.assert_allclose(np.asarray(s), r, rtol=1e-4, atol=1e-4 * scale)
    assert np.sum(ref_norms > clip) >= 1 and np.sum((ref_norms < clip) & (ref_norms > 0)) >= 1  # both regimes
    return ref_norms


def _vectorized(*args, **kwargs):
    from keras_noisecurve.backend.jax.clipping import clipped_sum
    return clipped_sum(*args, **kwargs)


def _weights(n, zero=(1,), half=(2,)):
    w = np.ones(n, np.float32)
    w[list(zero)] = 0.0  # padding rows
    w[list(half)] = 0.5  # sample weights
    return w


def _median_clip(model, x, y, weights, loss=mse_per_example):
    _, norms = reference_clipped_sum(model, x, y, weights, 1e9, loss=loss)
    return float(np.median(norms[norms > 0]))


def _rng(seed=0):
    return np.random.default_rng(seed)


def test_mlp_with_fused_activation_layer_norm_and_sample_weights():
    model = mlp()  # Dense(tanh) -> LayerNormalization -> Dense
    rng = _rng()
    x = rng.normal(size=(9, 6)).astype("float32") * 2
    y = rng.normal(size=(9, 3)).astype("float32")
    w = _weights(9)
    norms = _compare(model, x, y, w, _median_clip(model, x, y, w))
    assert norms[1] == 0.0


def test_cnn_convolutions_and_group_norm():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.GroupNormalization(groups=2),  # its rule
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(4),
    ])
    rng = _rng(1)
    x = rng.normal(size=(7, 6, 6, 2)).astype("float32")
    y = rng.normal(size=(7, 4)).astype("float32")
    w = _weights(7)
    _compare(model, x, y, w, _median_clip(model, x, y, w))


@pytest.mark.parametrize("vocabulary", [5, 60])  # 5·4 < 7²: segment sums; 60·4 > 7²: Gram with id mask
def test_embedding_with_repeated_token_ids(vocabulary):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((7,), dtype="int32")
    h = keras.layers.Embedding(vocabulary, 4)(inputs)
    h = keras.layers.Dense(5, activation="gelu")(h)  # Dense on a sequence: Gram or materialised
    h = keras.layers.GlobalAveragePooling1D()(h)
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    rng = _rng(2)
    x = rng.integers(0, min(vocabulary, 4), size=(8, 7)).astype("int32")  # ids repeat within a row
    y = rng.integers(0, 3, size=(8,)).astype("int32")
    w = _weights(8)
    _compare(model, x, y, w, _median_clip(model, x, y, w, loss=_sce), loss=_sce)


def test_multi_head_attention_and_per_head_einsum_dense():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5, 8))
    h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(inputs, inputs)
    h = keras.layers.LayerNormalization()(h + inputs)
    h = keras.layers.Reshape((5, 2, 4))(h)
    h = keras.layers.EinsumDense("blnd,nde->blne", output_shape=(5, 2, 3), bias_axes="e",
                                 activation="tanh")(h)  # n in input, kernel and output
    h = keras.layers.Flatten()(h)
    model = keras.Model(inputs, keras.layers.Dense(2)(h))
    rng = _rng(3)
    x = rng.normal(size=(6, 5, 8)).astype("float32")
    y = rng.normal(size=(6, 2)).astype("float32")
    w = _weights(6)
    _compare(model, x, y, w, _median_clip(model, x, y, w))


class _Reuse(keras.layers.Layer):
    """Returns ``h = x W`` AND ``tanh(h) V``: h is an output and is also used inside."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 4), initializer="glorot_uniform")
        self.v = self.add_weight(shape=(4, 4), initializer="glorot_uniform")

    def call(self, x):
        h = keras.ops.matmul(x, self.w)
        return h, keras.ops.matmul(keras.ops.tanh(h), self.v)


def test_a_layer_returning_a_tensor_it_also_uses_and_a_shared_layer_called_twice():
    keras.utils.set_random_seed(4)
    a, b = keras.Input((5,)), keras.Input((5,))
    shared = keras.layers.Dense(5, activation="tanh")
    ha, hb = shared(a), shared(b)  # one kernel, two calls per example
    h, k = _Reuse()(keras.layers.Concatenate()([ha, hb]))
    out = keras.layers.Dense(2)(keras.layers.Concatenate()([h, k]))
    model = keras.Model([a, b], out)
    rng = _rng(4)
    x = [rng.normal(size=(7, 5)).astype("float32") for _ in range(2)]
    y = rng.normal(size=(7, 2)).astype("float32")
    w = _weights(7)
    _compare(model, x, y, w, _median_clip(model, x, y, w))


def _tiny_bert():
    import keras_hub

    keras.utils.set_random_seed(5)
    backbone = keras_hub.models.BertBackbone(vocabulary_size=40, num_layers=2, num_heads=2, hidden_dim=32,
                                             intermediate_dim=64, max_sequence_length=8, num_segments=2,
                                             dropout=0.0)  # dropout masks depend on the batch shape
    inputs = {k: keras.Input((8,), dtype="int32", name=k) for k in ("token_ids", "segment_ids", "padding_mask")}
    out = keras.layers.Dense(2)(backbone(inputs)["pooled_output"])
    return keras.Model(inputs, out)


def test_a_tiny_keras_hub_bert_backbone():
    pytest.importorskip("keras_hub")
    model = _tiny_bert()
    rng = _rng(5)
    ids = rng.integers(1, 40, size=(4, 8)).astype("int32")
    ids[:, 0] = 2  # a repeated token in every row
    mask = np.ones((4, 8), "int32")
    mask[1, 6:] = 0
    x = {"token_ids": ids, "segment_ids": np.zeros((4, 8), "int32"), "padding_mask": mask}
    y = rng.integers(0, 2, size=(4,)).astype("int32")
    w = np.array([1, 0, 1, 0.5], np.float32)
    _compare(model, x, y, w, _median_clip(model, x, y, w, loss=_sce), loss=_sce)


class _RowsModel(keras.Model):
    """Applies a Dense to the (P·L, d) token rows in the model's own call: rows that are not
    examples, with no layer between the Dense and the model to clip it through."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)
        self.head = keras.layers.Dense(2)

    def call(self, x, training=None):
        p = keras.ops.shape(x)[0]
        rows = self.dense(keras.ops.reshape(x, (-1, x.shape[-1])))
        return self.head(keras.ops.reshape(rows, (p, -1)))


def test_rows_that_are_not_examples_without_a_caller_are_refused_by_ghost_and_exact_under_auto():
    """The model itself is the only caller: "ghost" refuses, "auto" uses the vectorized engine
    (tests/jax/test_jax_ghost_rows.py: the same rows inside a layer are clipped through it)."""
    keras.utils.set_random_seed(6)
    model = _RowsModel()
    rng = _rng(6)
    x = rng.normal(size=(5, 4, 5)).astype("float32")
    model(x[:1])
    y = rng.normal(size=(5, 2)).astype("float32")
    w = _weights(5)
    clip = _median_clip(model, x, y, w)
    with pytest.raises(ValueError, match="rows that are not the batch's 5 examples.*no layer calling it.*"
                                         "clipping='auto'"):
        _compare(model, x, y, w, clip, clipping="ghost")
    _compare(model, x, y, w, clip, clipping="auto")  # the exact vectorized engine


class _TiedHead(keras.layers.Layer):
    """Logits from another layer's table (a tied output projection): no weights of its own."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h):
        return keras.ops.matmul(h, keras.ops.transpose(self.embedding.embeddings))


class _Borrower(keras.layers.Layer):
    """Its own scale, times another Dense layer's kernel read directly."""

    def __init__(self, other, **kwargs):
        super().__init__(**kwargs)
        self.other = other

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")

    def call(self, h):
        return keras.ops.matmul(h * self.scale, self.other.kernel)


def _tied_model():
    keras.utils.set_random_seed(9)
    tokens = keras.Input((4,), dtype="int32")
    embedding = keras.layers.Embedding(7, 5)
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(5)(embedding(tokens)))
    return keras.Model(tokens, _TiedHead(embedding)(h))


def _borrower_model():
    keras.utils.set_random_seed(10)
    inputs = keras.Input((5,))
    dense = keras.layers.Dense(3)
    h = dense(inputs)
    return keras.Model(inputs, keras.layers.Add()([h, _Borrower(dense)(keras.layers.Dense(5)(inputs))]))


@pytest.mark.parametrize("case", ["tied", "borrowed"])
def test_a_weight_read_outside_its_layer_is_refused_by_ghost_and_exact_under_auto(case):
    rng = _rng(9)
    if case == "tied":
        model, x = _tied_model(), rng.integers(0, 7, size=(6, 4)).astype("int32")
        y, where = rng.normal(size=(6, 7)).astype("float32"), "outside any layer"  # the head owns no weight
    else:
        model, x = _borrower_model(), rng.normal(size=(6, 5)).astype("float32")
        y, where = rng.normal(size=(6, 3)).astype("float32"), "inside the call of '"
    w = _weights(6)
    clip = _median_clip(model, x, y, w)
    with pytest.raises(ValueError, match=f"is read {where}.*not by the layer that owns it.*clipping='auto'"):
        _compare(model, x, y, w, clip, clipping="ghost")
    _compare(model, x, y, w, clip, clipping="auto")  # the exact vectorized engine


def test_private_fit_with_ghost_equals_vectorized_and_ghost_refuses_microbatches():
    rng = _rng(7)
    x = rng.normal(size=(16, 6)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    results = {}
    for clipping in ("auto", "vectorized"):
        model = mlp(seed=7)
        private = make_private(model, clipping=clipping)
        private.compile(optimizer=NoiseCurveOptimizer(
            learning_rate=0.1, l2_norm_clip=0.3, noise_multiplier=1e-9, expected_batch_size=8, seed=0), loss="mse")
        private.train_on_batch(x[:8], y[:8])
        private.train_on_batch(x[8:], y[8:], sample_weight=_weights(8))
        results[clipping] = weights_of(model)
    for a, b in zip(results["auto"], results["vectorized"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    model = mlp(seed=7)
    private = make_private(model, clipping="ghost", microbatch_size=4)
    private.compile(optimizer=NoiseCurveOptimizer(learning_rate=0.1, l2_norm_clip=0.3, noise_multiplier=1.0,
                                                  expected_batch_size=8, seed=0), loss="mse")
    with pytest.raises(ValueError, match="microbatch_size=4 with the ghost engine"):
        private.train_on_batch(x[:8], y[:8])


def test_recurrent_layers_fed_by_a_dense_layer_equal_the_per_example_loop():
    """(The recurrent rule, tests/jax/test_jax_ghost_rnn.py, takes both; the fallback is tested there too.)"""
    keras.utils.set_random_seed(8)
    inputs = keras.Input((5, 3))
    h = keras.layers.LSTM(4, return_sequences=True)(inputs)
    h = keras.layers.SimpleRNN(3)(keras.layers.Dense(4, activation="relu")(h))
    model = keras.Model(inputs, keras.layers.Dense(2)(h))
    rng = _rng(8)
    x = rng.normal(size=(6, 5, 3)).astype("float32")
    y = rng.normal(size=(6, 2)).astype("float32")
    w = _weights(6)
    _compare(model, x, y, w, _median_clip(model, x, y, w))


class _LoopModel(keras.Model):
    """Applies its Dense three times inside ``keras.ops.fori_loop`` in the model's own call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4, activation="tanh")
        self.head = keras.layers.Dense(2)

    def call(self, x, training=None):
        return self.head(keras.ops.fori_loop(0, 3, lambda i, h: self.dense(h), x))


def test_a_weighted_layer_in_a_control_flow_body_of_the_model_is_refused_by_ghost_and_exact_under_auto():
    """No layer encloses the loop but the model (tests/jax/test_jax_ghost_rows.py: a loop inside
    a layer is clipped through that layer)."""
    keras.utils.set_random_seed(9)
    model = _LoopModel()
    rng = _rng(9)
    x = rng.normal(size=(6, 4)).astype("float32")
    model(x[:1])
    y = rng.normal(size=(6, 2)).astype("float32")
    w = _weights(6)
    clip = _median_clip(model, x, y, w)
    with pytest.raises(ValueError, match="inside a JAX control-flow body"):
        _compare(model, x, y, w, clip, clipping="ghost")
    _compare(model, x, y, w, clip, clipping="auto")


def test_every_layer_through_the_fallback_alone(monkeypatch):
    """No rule at all: every layer, the fused-activation Dense and EinsumDense included, goes
    through the per-layer fallback, which must re-run them as recorded (before the activation)."""
    from keras_noisecurve.backend.jax import ghost

    monkeypatch.setattr(ghost, "find_rule", lambda layer, calls: None)
    keras.utils.set_random_seed(10)
    inputs = keras.Input((3, 4))
    h = keras.layers.EinsumDense("abc,cd->abd", output_shape=(3, 5), bias_axes="d", activation="tanh")(inputs)
    h = keras.layers.LayerNormalization()(keras.layers.Dense(5, activation="relu")(h))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    rng = _rng(10)
    x = rng.normal(size=(6, 3, 4)).astype("float32")
    y = rng.normal(size=(6, 2)).astype("float32")
    w = _weights(6)
    _compare(model, x, y, w, _median_clip(model, x, y, w))


def test_a_non_finite_example_contributes_nothing():
    """An example with an infinite input: its norm is not finite and the sums equal the loop's
    over the other examples (its 0 factor must not give 0·inf = nan)."""
    model = mlp(seed=11)
    rng = _rng(11)
    x = rng.normal(size=(7, 6)).astype("float32") * 2
    y = rng.normal(size=(7, 3)).astype("float32")
    x[3, 2] = np.inf
    w = _weights(7)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    clip = 3.0
    sums, norms, _, _, _ = jax.jit(lambda tv, ntv: ghost_clipped_sum(
        model, mse_per_example, tv, ntv, jnp.asarray(x), jnp.asarray(y), jnp.asarray(w), l2_norm_clip=clip))(
        trainable, non_trainable)
    others = np.array([i for i in range(7) if i != 3])
    ref_sums, ref_norms = reference_clipped_sum(model, x[others], y[others], w[others], clip)
    assert not np.isfinite(np.asarray(norms)[3])
    np.testing.assert_allclose(np.asarray(norms)[others], ref_norms, rtol=1e-4, atol=1e-6)
    scale = max(np.max(np.abs(r)) for r in ref_sums)
    for s, r in zip(sums, ref_sums):
        np.testing.assert_allclose(np.asarray(s), r, rtol=1e-4, atol=1e-4 * scale)


def _dot_precisions(jaxpr):
    """The ``precision`` of every ``dot_general`` in ``jaxpr`` and the jaxprs nested in it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found.extend(_dot_precisions(inner))
    return found


def test_the_rules_products_run_at_full_float32_precision_and_the_model_at_the_users():
    """A rule's norm and its sum are different products of (a, g): under TensorFloat-32 (a GPU's
    default for float32) they would round differently and an example's clipped contribution
    could exceed ζ. Every product the rules add is HIGHEST; the model's own forward and
    backward products keep the default precision (None)."""
    model = mlp(seed=3)
    rng = _rng(3)
    x = jnp.asarray(rng.normal(size=(5, 6)).astype("float32"))
    y = jnp.asarray(rng.normal(size=(5, 3)).astype("float32"))
    w = jnp.ones((5,), jnp.float32)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def step(tv, ntv):
        return ghost_clipped_sum(model, mse_per_example, tv, ntv, x, y, w, l2_norm_clip=1.0)[:2]

    def plain(tv, ntv):
        return jax.grad(lambda t: jnp.sum(mse_per_example(y, model.stateless_call(t, ntv, x)[0])))(tv)

    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    model_products = _dot_precisions(jax.make_jaxpr(plain)(trainable, non_trainable).jaxpr)
    step_products = _dot_precisions(jax.make_jaxpr(step)(trainable, non_trainable).jaxpr)
    assert model_products and all(p is None for p in model_products)
    exact = [p for p in step_products if p == highest]
    # the step holds the model's forward/backward products (default precision) plus the rules' (HIGHEST)
    assert len(exact) >= 4, step_products  # two Dense kernels: a norm and a sum product each at least
    assert all(p in (None, highest) for p in step_products)
    assert len(step_products) - len(exact) <= len(model_products)
