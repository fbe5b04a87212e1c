"""The JAX ghost engine's rules for LoRA, RMS-type norms and KerasHub layers
(keras_noisecurve.backend.common.ghost_lora, ghost_scale, ghost_embedding, ghost_norm) against an INDEPENDENT per-example loop
(tests/jax/helpers.reference_clipped_sum: one ``jax.grad`` of the model's ``stateless_call``
per example, clipping in float64 numpy), and checks that the rules, not the per-layer
fallback, handled the layers.

Tolerance: the engine computes its norms and sums in float32 whatever the model's dtype
(float64 would not make the comparison tighter), so as in test_jax_ghost.py: norms rtol
1e-4; sums atol 1e-4 × the largest entry of the reference sums. A wrong rule (a missing
call of a tied table, a missing cross term, a wrong LoRA scale s) changes them by > 1e-2
relative; the clip is the median norm, so both regimes (clipped, not clipped) occur.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from keras_noisecurve.backend.jax import ghost
from keras_noisecurve.backend.jax.ghost import ghost_clipped_sum
from keras_noisecurve.backend.jax.ghost import probe_affine_scale
from tests.jax.helpers import mse_per_example, reference_clipped_sum, spy_fallback


@pytest.fixture
def handled(monkeypatch):
    """``{id(layer): rule kind or "generic"}`` of the next traced steps."""
    seen = {}
    find_rule = ghost.find_rule

    def spy_rule(layer, calls):
        result = find_rule(layer, calls)
        seen[id(layer)] = result[0] if result is not None else "generic"
        return result

    monkeypatch.setattr(ghost, "find_rule", spy_rule)
    spy_fallback(monkeypatch, lambda layer: seen.__setitem__(id(layer), "generic"))
    return seen


def _compare(model, x, y, weights, loss=mse_per_example):
    _, free = reference_clipped_sum(model, x, y, weights, 1e9, loss=loss)
    clip = float(np.median(free[free > 0]))
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    step = jax.jit(lambda tv, ntv, x, y, w: ghost_clipped_sum(model, loss, tv, ntv, x, y, w, l2_norm_clip=clip)[:2])
    sums, norms = step(trainable, non_trainable, x, y, jnp.asarray(weights))
    ref_sums, ref_norms = reference_clipped_sum(model, x, y, weights, clip, loss=loss)
    np.testing.assert_allclose(np.asarray(norms), ref_norms, rtol=1e-4, atol=1e-6)
    scale = max(np.max(np.abs(r)) for r in ref_sums)
    for s, r, v in zip(sums, ref_sums, model.trainable_variables):
        np.testing.assert_allclose(np.asarray(s), r, rtol=1e-4, atol=1e-4 * scale, err_msg=v.path)
    assert np.sum(ref_norms > clip) >= 1 and np.sum((ref_norms < clip) & (ref_norms > 0)) >= 1


def _weights(n):
    w = np.ones(n, np.float32)
    w[1], w[2] = 0.0, 0.5  # a padding row, a sample weight
    return w


def _randomise_lora_b(model, seed=0):
    """``enable_lora`` starts B at zero (then A's gradient is 0): give B random values."""
    rng = np.random.default_rng(seed)
    for v in model.trainable_variables:
        if "lora_kernel_b" in v.path:
            v.assign(rng.normal(size=v.shape).astype(v.dtype) * 0.5)


def _lm_loss(y_true, logits):
    """Per-example mean over positions of the token cross-entropy, (P,)."""
    per_token = keras.losses.sparse_categorical_crossentropy(y_true, logits, from_logits=True)
    return jnp.mean(jnp.reshape(per_token, (per_token.shape[0], -1)), axis=1)


@pytest.mark.parametrize("length", [1, 5, 30])  # one position; Gram (L² < d_in·d_out); materialised
def test_lora_dense_and_einsum_dense_with_activation_and_per_head_axes(handled, length):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((length, 6))
    dense = keras.layers.Dense(7, activation="tanh")
    per_head = keras.layers.EinsumDense("bld,dhe->blhe", output_shape=(length, 2, 3), bias_axes="e")
    shared = keras.layers.EinsumDense("blhe,hef->blhf", output_shape=(length, 2, 4), activation="relu")
    h = shared(per_head(dense(inputs)))
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
    for layer in (dense, per_head, shared):
        layer.enable_lora(2, lora_alpha=3)  # s = 3/2
    _randomise_lora_b(model)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, length, 6)).astype("float32")
    y = rng.normal(size=(7, 3)).astype("float32")
    _compare(model, x, y, _weights(7))
    assert {handled[id(layer)] for layer in (dense, per_head, shared)} == {"LoRA"}
    assert "generic" not in handled.values()


def test_lora_einsum_dense_with_permuted_positions_and_a_summed_input_axis(handled):
    """Output axes in another order than the input's (``bld,de->bel``) and an input axis summed
    away (``blcd,de->ble``): the positions of ``a`` and ``g`` must be paired in one order."""
    keras.utils.set_random_seed(6)
    inputs = keras.Input((5, 2, 3))
    summed = keras.layers.EinsumDense("blcd,de->ble", output_shape=(5, 4), bias_axes="e")
    permuted = keras.layers.EinsumDense("bld,de->bel", output_shape=(3, 5), activation="tanh")
    h = permuted(summed(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    for layer in (summed, permuted):
        layer.enable_lora(2)
    _randomise_lora_b(model, seed=6)
    rng = np.random.default_rng(6)
    x = rng.normal(size=(7, 5, 2, 3)).astype("float32")
    y = rng.normal(size=(7, 2)).astype("float32")
    _compare(model, x, y, _weights(7))
    assert handled[id(summed)] == handled[id(permuted)] == "LoRA"


class _OnePlusScale(keras.layers.Layer):
    """A hand-written RMS norm with Gemma's ``(1 + w)`` scale (no known class name)."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="zeros")

    def call(self, x):
        x32 = keras.ops.cast(x, "float32")
        norm = x32 * keras.ops.rsqrt(keras.ops.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return norm * (1.0 + self.w)


class _SquaredScale(keras.layers.Layer):
    """``x ⊙ w²``: not affine in w, so the probe refuses it (the fallback clips it)."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.w * self.w


@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`:UserWarning")  # Keras deprecates the argument
def test_rms_norms_by_computation_and_layer_norm_variants(handled):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((4, 6))
    norms = [
        keras.layers.RMSNormalization(),
        keras.layers.LayerNormalization(rms_scaling=True),
        keras.layers.LayerNormalization(center=False),
        keras.layers.LayerNormalization(scale=False),
        _OnePlusScale(),
        _SquaredScale(),
    ]
    h = inputs
    for k, norm in enumerate(norms):
        h = keras.layers.Dense(6, activation="tanh", name=f"mix{k}")(h)
        h = norm(h)
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    rng = np.random.default_rng(1)
    for v in model.trainable_variables:  # scales away from their initial 1 / 0
        if len(v.shape) == 1:
            v.assign(rng.uniform(0.5, 1.5, size=v.shape).astype("float32"))
    x = rng.normal(size=(7, 4, 6)).astype("float32")
    y = rng.normal(size=(7, 2)).astype("float32")
    _compare(model, x, y, _weights(7))
    got = [handled[id(n)] for n in norms]
    # Keras's RMSNormalization is known by class, LayerNormalization (rms_scaling too) takes its own kernel, as
    # on TensorFlow; the custom scale is recognised by what it computes, and x ⊙ w² by nothing
    assert got == ["RMS scale", "LayerNormalization", "LayerNormalization", "LayerNormalization",
                   "RMSNorm (by computation)", "generic"]
    assert probe_affine_scale(norms[0]) and not probe_affine_scale(norms[-1])
    assert not probe_affine_scale(keras.layers.Dense(3))  # no weights yet (not built)


def _tied_lm(vocabulary, tie_weights=True, soft_cap=None, seed=2):
    keras.utils.set_random_seed(seed)
    table = keras.layers.ReversibleEmbedding(vocabulary, 4, tie_weights=tie_weights, logit_soft_cap=soft_cap)
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Dense(4, activation="tanh")(table(inputs))
    return keras.Model(inputs, table(h, reverse=True)), table


@pytest.mark.parametrize("vocabulary, tie_weights", [(5, True), (60, True), (60, False)])
def test_reversible_embedding_lookup_and_tied_or_untied_output_head(handled, vocabulary, tie_weights):
    model, table = _tied_lm(vocabulary, tie_weights)
    rng = np.random.default_rng(2)
    x = rng.integers(0, 4, size=(7, 6)).astype("int32")  # ids repeat within a row
    y = rng.integers(0, 4, size=(7, 6)).astype("int32")
    _compare(model, x, y, _weights(7), loss=_lm_loss)
    assert handled[id(table)] == "ReversibleEmbedding"


def test_a_soft_capped_output_head_is_taken_by_its_kernel_and_stays_exact(handled):
    """The kernel's forward records the logits before the soft cap (the engine runs it in place of
    the layer's call), so the tied table is clipped by the kernel, not the fallback."""
    model, table = _tied_lm(9, soft_cap=2.0)
    rng = np.random.default_rng(3)
    x = rng.integers(0, 9, size=(6, 6)).astype("int32")
    y = rng.integers(0, 9, size=(6, 6)).astype("int32")
    _compare(model, x, y, _weights(6), loss=_lm_loss)
    assert handled[id(table)] == "ReversibleEmbedding"


def _backbone(name, lora=False):
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(4)
    common = {"vocabulary_size": 30, "num_layers": 2, "hidden_dim": 16, "intermediate_dim": 32}
    if name == "gemma":
        backbone = keras_hub.models.GemmaBackbone(num_query_heads=2, num_key_value_heads=1, head_dim=8, **common)
    elif name == "llama":  # untied output head (reverse_embeddings)
        backbone = keras_hub.models.LlamaBackbone(num_query_heads=2, num_key_value_heads=1, **common)
    else:
        backbone = keras_hub.models.GPT2Backbone(num_heads=2, dropout=0.0, max_sequence_length=16, **common)
    if lora:
        backbone.enable_lora(2)
    ids = keras.Input((8,), dtype="int32", name="token_ids")
    mask = keras.Input((8,), dtype="int32", name="padding_mask")
    hidden = backbone({"token_ids": ids, "padding_mask": mask})
    model = keras.Model({"token_ids": ids, "padding_mask": mask}, backbone.token_embedding(hidden, reverse=True))
    if lora:
        _randomise_lora_b(model)
    return model, backbone


@pytest.mark.parametrize("name, lora", [("gemma", False), ("gemma", True), ("llama", False), ("llama", True),
                                        ("gpt2", False), ("gpt2", True)])
def test_tiny_keras_hub_language_models_are_clipped_by_rules_only(handled, name, lora):
    model, backbone = _backbone(name, lora)
    rng = np.random.default_rng(5)
    ids = rng.integers(1, 30, size=(4, 8)).astype("int32")
    ids[:, 0] = 2  # a repeated token in every row
    mask = np.ones((4, 8), "int32")
    mask[1, 6:] = 0
    y = rng.integers(0, 30, size=(4, 8)).astype("int32")
    _compare(model, {"token_ids": ids, "padding_mask": mask}, y, np.array([1, 0.5, 1, 1], np.float32),
             loss=_lm_loss)
    assert handled and "generic" not in handled.values(), handled
    if lora:  # enable_lora freezes everything but the LoRA factors
        assert set(handled.values()) == {"LoRA"} and len(handled) == 4  # query, value × 2 layers
    else:
        assert handled[id(backbone.token_embedding)] == "ReversibleEmbedding"
        assert ("PositionEmbedding" in handled.values()) == (name == "gpt2")
        assert ("RMS scale" in handled.values()) == (name != "gpt2")


def test_prelu_and_norms_over_other_axes_take_the_kernels_written_once(handled):
    """PReLU (shared axes or not), LayerNormalization over two axes and GroupNormalization with
    its channels on axis 1: the TensorFlow engine's kernels, now JAX's too (from the recorded
    input, no saved statistics), against the per-example loop."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4, 6))
    layers = [
        keras.layers.PReLU(alpha_initializer=keras.initializers.RandomUniform(0.1, 0.4)),
        keras.layers.PReLU(shared_axes=[1], alpha_initializer=keras.initializers.RandomUniform(0.1, 0.4)),
        keras.layers.LayerNormalization(axis=(1, 2)),
        keras.layers.GroupNormalization(groups=2, axis=1),
    ]
    h = inputs
    for k, layer in enumerate(layers):
        h = layer(keras.layers.Dense(6, name=f"mix{k}")(h))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    rng = np.random.default_rng(3)
    for v in model.trainable_variables:  # scales and offsets away from their initial 1 / 0
        if "gamma" in v.path or "beta" in v.path:
            v.assign(rng.uniform(0.5, 1.5, size=v.shape).astype("float32"))
    x = rng.normal(size=(7, 4, 6)).astype("float32")
    y = rng.normal(size=(7, 2)).astype("float32")
    _compare(model, x, y, _weights(7))
    assert [handled[id(layer)] for layer in layers] == ["PReLU", "PReLU", "LayerNormalization", "GroupNormalization"]
