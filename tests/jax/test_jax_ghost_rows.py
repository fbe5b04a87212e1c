"""Layers whose rows are not examples, clipped exactly by the JAX ghost engine through their
caller (keras_noisecurve.backend.common.row_probe), against the INDEPENDENT per-example loop
of tests/jax/helpers.reference_clipped_sum (one ``jax.grad`` of the model's
``stateless_call`` per example, batch of 1, no vmap; clipping in float64 numpy).

Every case runs with ``clipping="ghost"``, which refuses rather than hand a model to the
vectorized engine: a case that passes was clipped by the ghost engine. Where it matters,
the test also checks WHICH layer was clipped whole (the caller), by watching the engine's
per-layer fallback.

Tolerance: float32 (no x64; the engine's fallback contracts in float32 anyway), as in
tests/jax/test_jax_ghost.py: norms rtol 1e-4, sums atol 1e-4 × the largest reference
entry. A row attributed to the wrong example, a broadcast gradient counted once per
example, or a dropped sublayer weight changes them by > 1e-2 relative.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from keras_noisecurve import NoiseCurveOptimizer, make_private
from keras_noisecurve.backend.jax.ghost import ghost_clipped_sum
from tests.jax.helpers import mse_per_example, reference_clipped_sum, spy_fallback, weights_of


def _sce(y_true, y_pred):
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


def _weights(n):
    w = np.ones(n, np.float32)
    w[1] = 0.0  # a padding row
    w[2] = 0.5  # a sample weight
    return w


def _compare(model, x, y, weights, loss=mse_per_example, clip=None):
    """The ghost engine's norms and clipped sum against the per-example loop, at a clip
    between the norms (both regimes); returns the reference norms."""
    if clip is None:
        _, free = reference_clipped_sum(model, x, y, weights, 1e9, loss=loss)
        clip = float(np.median(free[free > 0]))
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    step = jax.jit(lambda tv, ntv, x, y, w: ghost_clipped_sum(
        model, loss, tv, ntv, x, y, w, l2_norm_clip=clip, clipping="ghost")[:2])
    sums, norms = step(trainable, non_trainable, x, y, jnp.asarray(weights))
    ref_sums, ref_norms = reference_clipped_sum(model, x, y, weights, clip, loss=loss)
    np.testing.assert_allclose(np.asarray(norms), ref_norms, rtol=1e-4, atol=1e-6)
    scale = max(np.max(np.abs(r)) for r in ref_sums)
    for v, s, r in zip(model.trainable_variables, sums, ref_sums):
        np.testing.assert_allclose(np.asarray(s), r, rtol=1e-4, atol=1e-4 * scale, err_msg=v.path)
    assert np.sum(ref_norms > clip) >= 1 and np.sum((ref_norms < clip) & (ref_norms > 0)) >= 1
    return ref_norms


# ---------------------------------------------------------------- custom layers


class _TokenRows(keras.layers.Layer):
    """A Dense on the (P·L, d) token rows (a Reshape to rows inside the block)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3, activation="tanh")

    def call(self, x):
        p, length = keras.ops.shape(x)[0], keras.ops.shape(x)[1]
        rows = self.dense(keras.ops.reshape(x, (-1, x.shape[-1])))
        return keras.ops.reshape(rows, (p, length, 3))


class _Broadcast(keras.layers.Layer):
    """Adds a position Embedding on constant ids (1, L) and a LayerNormalization of a (1, L, d)
    table of its own, both broadcast over the batch (ViT's and DeBERTa's pattern)."""

    def __init__(self, length, width, **kwargs):
        super().__init__(**kwargs)
        self.length, self.width = length, width
        self.positions = keras.layers.Embedding(length, width)
        self.norm = keras.layers.LayerNormalization()

    def build(self, shape):
        self.table = self.add_weight(shape=(1, self.length, self.width), initializer="random_normal", name="table")

    def call(self, x):
        ids = keras.ops.expand_dims(keras.ops.arange(self.length), 0)  # (1, L)
        return x + self.positions(ids) + self.norm(self.table) * x


class _Loop(keras.layers.Layer):
    """Applies its Dense three times inside ``keras.ops.fori_loop``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(5, activation="tanh")

    def build(self, shape):
        self.dense.build(shape)

    def call(self, x):
        return keras.ops.fori_loop(0, 3, lambda i, h: self.dense(h), x)


class _TiedBlock(keras.layers.Layer):
    """An Embedding and a head reading the embedding table in the block's own call (tied)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(7, 5)
        self.mix = keras.layers.Dense(5, activation="tanh")

    def call(self, ids):
        h = keras.ops.mean(self.mix(self.embedding(ids)), axis=1)
        return keras.ops.matmul(h, keras.ops.transpose(self.embedding.embeddings))


class _Router(keras.layers.Layer):
    """Returns (P, L, d) and the (P·L, k) logits of a Dense on the token rows (an MoE router's
    shape), both used downstream: an output of the caller with k·P rows, split example-major."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.router = keras.layers.Dense(2)

    def call(self, x):
        logits = self.router(keras.ops.reshape(x, (-1, x.shape[-1])))
        gate = keras.ops.reshape(keras.ops.softmax(logits)[:, :1], keras.ops.shape(x)[:2] + (1,))
        return x * gate, logits


class _Unrows(keras.layers.Layer):
    """(P·L, k) rows back to (P, L·k) (no weights)."""

    def __init__(self, length, **kwargs):
        super().__init__(**kwargs)
        self.length = length

    def call(self, rows):
        return keras.ops.reshape(rows, (-1, self.length * rows.shape[-1]))

    def compute_output_shape(self, shape):
        return (None, self.length * shape[-1])


def test_a_reshape_to_token_rows_inside_a_block_is_clipped_through_the_block(fallbacks):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4, 5))
    h = keras.layers.Flatten()(_TokenRows(name="rows_block")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(h))
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(5, 4, 5)).astype("float32"), rng.normal(size=(5, 2)).astype("float32")
    _compare(model, x, y, _weights(5))
    assert fallbacks == ["rows_block"]  # the block clipped whole, with its Dense's weights; the head by its rule


def test_a_broadcast_batch_1_weighted_call_is_clipped_through_its_layer(fallbacks):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((4, 5))
    h = _Broadcast(4, 5, name="broadcast")(keras.layers.Dense(5)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(6, 4, 5)).astype("float32"), rng.normal(size=(6, 2)).astype("float32")
    _compare(model, x, y, _weights(6))
    assert fallbacks == ["broadcast"]


def test_a_weighted_layer_in_a_control_flow_body_is_clipped_through_the_looping_layer(fallbacks):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,))
    model = keras.Model(inputs, keras.layers.Dense(2)(_Loop(name="loop")(inputs)))
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(6, 5)).astype("float32"), rng.normal(size=(6, 2)).astype("float32")
    _compare(model, x, y, _weights(6))
    assert fallbacks == ["loop"]


def test_a_tied_head_inside_one_block_is_clipped_through_the_block(fallbacks):
    keras.utils.set_random_seed(4)
    tokens = keras.Input((4,), dtype="int32")
    model = keras.Model(tokens, _TiedBlock(name="tied")(tokens))
    rng = np.random.default_rng(4)
    x = rng.integers(0, 7, size=(6, 4)).astype("int32")
    x[:, 0] = 3  # a repeated token
    y = rng.normal(size=(6, 7)).astype("float32")
    _compare(model, x, y, _weights(6))
    assert fallbacks == ["tied"]


def test_a_caller_output_with_k_rows_per_example_is_split_example_major(fallbacks):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((3, 4))
    h, logits = _Router(name="router_block")(inputs)
    h = keras.layers.Concatenate()([keras.layers.Flatten()(h), _Unrows(3)(logits)])
    model = keras.Model(inputs, keras.layers.Dense(2)(h))
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(5, 3, 4)).astype("float32"), rng.normal(size=(5, 2)).astype("float32")
    _compare(model, x, y, _weights(5))
    assert fallbacks == ["router_block"]


def test_private_training_of_a_token_rows_model_with_ghost_equals_vectorized():
    rng = np.random.default_rng(6)
    x, y = rng.normal(size=(8, 4, 5)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")
    results = {}
    for clipping in ("ghost", "vectorized"):
        keras.utils.set_random_seed(6)
        inputs = keras.Input((4, 5))
        model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(_TokenRows()(inputs))))
        private = make_private(model, clipping=clipping)
        private.compile(optimizer=NoiseCurveOptimizer(
            learning_rate=0.1, l2_norm_clip=0.2, noise_multiplier=1e-9, expected_batch_size=8, seed=0), loss="mse")
        private.train_on_batch(x, y, sample_weight=_weights(8))
        results[clipping] = weights_of(model)
    for a, b in zip(results["ghost"], results["vectorized"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- KerasHub backbones


@pytest.mark.parametrize("name, caller_class", [
    ("ViTBackbone", "ViTPatchingAndEmbedding"),  # position Embedding on constant ids (1, L)
    ("DebertaV3Backbone", "RelativeEmbedding"),  # LayerNormalization of the (1, 2k, d) relative table
    ("MixtralBackbone", "MixtralSparseMoeBlock"),  # router Dense and expert bank on P·L token rows
])
def test_a_tiny_keras_hub_backbone_with_rows_that_are_not_examples(name, caller_class, monkeypatch):
    pytest.importorskip("keras_hub")
    from tests.training import catalogue

    case = catalogue.make_case(name, dtype="float32", seed=0)
    classes = []
    spy_fallback(monkeypatch, lambda layer: classes.append(type(layer).__name__))
    weights = _weights(catalogue.P)
    _compare(case.model, case.x, case.y.astype("int32"), weights, loss=_sce)
    assert caller_class in classes
