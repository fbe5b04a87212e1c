"""Ghost-norm rules of the JAX clipping engine (:mod:`keras_noisecurve.backend.jax.ghost`),
in ``jax.numpy``: per-example squared gradient norms and the clipped sum of one layer's
weights from its recorded input ``a`` and the gradient ``g`` at its output, without
forming per-example weight gradients (where that is cheaper).

Notation: P examples; a call's input ``a`` (P, ..., d_in) and output gradient ``g``
(P, ..., d_out), ``g = ∂(Σ_i w_i·loss_i)/∂z`` with ``z`` the layer's (pre-activation)
output; ``c`` (P,) the clipping factors ``min(1, ζ/‖w_i·∇loss_i‖)``. A layer called
several times (a shared layer) has its calls' positions concatenated: its per-example
gradient is the sum over all its calls.

Each rule is a function ``rule(layer, calls) -> (sq, sums)`` or ``None`` (the engine then
uses the exact per-layer fallback): ``sq`` (P,) float32 per-example squared norms of the
gradient of the layer's own weights, ``sums(c, keep=None)`` a dict ``{id(variable): Σ_i c_i·G_i}``
(with ``keep`` (P,) bool: the rows of examples not kept zeroed first, see :func:`kept`).
``calls`` is a list of dicts with ``"a"`` (the first positional argument of ``call``) and
``"g"`` (the gradient at the call's single output).

* Dense (exact type, no LoRA, not quantized): kernel gradient ``G_i = Σ_l a_il g_ilᵀ``,
  ``‖G_i‖² = ‖a_i‖²‖g_i‖²`` for one position, else the Gram form
  ``Σ_{l,l'} (a_il·a_il')(g_il·g_il')`` (memory P·L²) when L² < d_in·d_out, else ``G_i``
  itself (memory P·d_in·d_out); bias ``Σ_l g_il``. Sum: ``Σ_{i,l} a_il (c_i g_il)ᵀ``.
* EinsumDense: the same after bringing the equation to (examples, positions,
  contracted) × (examples, positions, kernel outputs); an axis shared by input, kernel
  and output (per-head weights) makes ``G_i = einsum(input, output -> example, kernel)``
  materialised.
* Embedding: row v of example i's gradient is ``Σ_{l: id_il = v} g_il``;
  ``‖G_i‖² = Σ_{l,l'} [id_il = id_il'] (g_il·g_il')`` (memory P·L²) when
  L² < vocabulary·d, else a segment sum per example (memory P·vocabulary·d).
* LayerNormalization over the last axis (no RMS scaling): ``x̂ = (a − mean)/√(var + ε)``,
  gamma gradient ``Σ_l x̂_il ⊙ g_il``, beta ``Σ_l g_il``.
* GroupNormalization with channels last: the same, with mean and variance over the
  positions and the channels of each group.

Registered from other modules: convolutions (:mod:`~keras_noisecurve.backend.jax.ghost_conv`),
LoRA, RMS norms and KerasHub's embeddings (:mod:`~keras_noisecurve.backend.jax.ghost_hub`) and
recurrent layers (:mod:`~keras_noisecurve.backend.jax.ghost_rnn`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras

from keras_noisecurve.backend.jax.ghost_conv import CONV_RULES, PRE_ACTIVATION
from keras_noisecurve.backend.jax.ghost_forms import kept, parse_einsum, sequence_sq_norms, token_sq_norms
from keras_noisecurve.backend.jax.ghost_hub import HUB_RULES
from keras_noisecurve.backend.jax.ghost_rnn import RNN_RULES

__all__ = ["RULES", "find_rule", "kept", "sequence_sq_norms", "token_sq_norms", "uses_pre_activation"]

_F32 = jnp.float32


def _plain(layer) -> bool:
    """No LoRA, no quantization: the layer's ``call`` is the textbook one."""
    return not getattr(layer, "lora_enabled", False) and getattr(layer, "quantization_mode", None) is None


def uses_pre_activation(layer) -> bool:
    """Whether the engine records ``layer``'s output before its fused activation (Dense, EinsumDense
    and ``ghost_conv.PRE_ACTIVATION`` of exact type, whose ``call`` is ``activation(linear(x))``;
    LoRA-enabled or not, not quantized)."""
    return (type(layer) in (keras.layers.Dense, keras.layers.EinsumDense, *PRE_ACTIVATION)
            and getattr(layer, "quantization_mode", None) is None)


def _cat(parts):
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _scaled(c, g):
    return g * jnp.reshape(c, (-1,) + (1,) * (g.ndim - 1)).astype(g.dtype)


def _single(calls):
    """Every call has one array input and one array output with the examples first."""
    return all(hasattr(c["a"], "shape") and hasattr(c["g"], "shape") for c in calls)


def dense_rule(layer, calls):
    if type(layer) is not keras.layers.Dense or not _plain(layer) or not _single(calls):
        return None
    d_in, d_out = layer.kernel.shape
    p = calls[0]["g"].shape[0]
    a = _cat([jnp.reshape(c["a"].astype(_F32), (p, -1, d_in)) for c in calls])
    g = _cat([jnp.reshape(c["g"].astype(_F32), (p, -1, d_out)) for c in calls])
    sq = sequence_sq_norms(a, g)
    bias_i = None
    if layer.bias is not None:
        bias_i = jnp.sum(g, axis=1)
        sq = sq + jnp.sum(bias_i * bias_i, axis=1)

    def sums(c, keep=None):
        out = {id(layer.kernel): jnp.einsum("pli,plj->ij", kept(a, keep), _scaled(c, kept(g, keep)))}
        if bias_i is not None:
            out[id(layer.bias)] = jnp.tensordot(c.astype(_F32), kept(bias_i, keep), axes=1)
        return out

    return sq, sums


def einsum_dense_rule(layer, calls):
    if type(layer) is not keras.layers.EinsumDense or not _plain(layer) or not _single(calls):
        return None
    structures = {parse_einsum(layer.equation, c["a"].ndim) for c in calls}
    if len(structures) != 1:
        return None
    inp, ker, out = structures.pop()
    ex = inp[0]
    if out[:1] != ex or ex in ker or any(ch not in inp and ch not in out for ch in ker):
        return None  # the examples are not the leading axis, or a kernel axis is broadcast
    shared = [ch for ch in ker if ch in inp and ch in out]
    p = calls[0]["g"].shape[0]
    a_parts = [c["a"].astype(_F32) for c in calls]
    g_parts = [c["g"].astype(_F32) for c in calls]
    if shared:  # per-head weights: materialise G_i
        per = sum(jnp.einsum(f"{inp},{out}->{ex}{ker}", a, g) for a, g in zip(a_parts, g_parts))
        sq = jnp.sum(jnp.reshape(per * per, (p, -1)), axis=1)
    else:
        pos = "".join(ch for ch in inp[1:] if ch in out and ch not in ker)
        con = "".join(ch for ch in inp[1:] if ch in ker)
        kout = "".join(ch for ch in out[1:] if ch in ker)
        a = _cat([jnp.reshape(jnp.einsum(f"{inp}->{ex}{pos}{con}", x), (p, -1, max(1, _size(x, inp, con))))
                  for x in a_parts])
        g = _cat([jnp.reshape(jnp.einsum(f"{out}->{ex}{pos}{kout}", y), (p, -1, max(1, _size(y, out, kout))))
                  for y in g_parts])
        sq = sequence_sq_norms(a, g)
    bias_letters, bias_shape = None, None
    if layer.bias is not None:
        first = min(out.index(ch) for ch in layer.bias_axes)
        bias_letters = "".join(ch for ch in out[first:] if ch in layer.bias_axes)
        bias_shape = tuple(layer.bias.shape)
        bias_i = sum(jnp.einsum(f"{out}->{ex}{bias_letters}", y) for y in g_parts)
        bias_i = jnp.reshape(bias_i, (p, -1))
        sq = sq + jnp.sum(bias_i * bias_i, axis=1)

    def sums(c, keep=None):
        result = {id(layer.kernel): sum(jnp.einsum(f"{inp},{out}->{ker}", kept(x, keep), _scaled(c, kept(y, keep)))
                                        for x, y in zip(a_parts, g_parts))}
        if bias_letters is not None:
            result[id(layer.bias)] = jnp.reshape(jnp.tensordot(c.astype(_F32), kept(bias_i, keep), axes=1),
                                                 bias_shape)
        return result

    return sq, sums


def _size(x, letters, chosen):
    n = 1
    for ch in chosen:
        n *= x.shape[letters.index(ch)]
    return n


def embedding_rule(layer, calls):
    if type(layer) is not keras.layers.Embedding or not _plain(layer) or not _single(calls):
        return None
    vocabulary, d = layer.embeddings.shape
    p = calls[0]["g"].shape[0]
    ids = _cat([jnp.reshape(c["a"].astype(jnp.int32), (p, -1)) for c in calls])
    g = _cat([jnp.reshape(c["g"].astype(_F32), (p, -1, d)) for c in calls])
    sq = token_sq_norms(ids, g, vocabulary)

    def sums(c, keep=None):
        rows = jnp.reshape(_scaled(c, kept(g, keep)), (-1, d))
        return {id(layer.embeddings): jnp.zeros((vocabulary, d), _F32).at[jnp.reshape(ids, (-1,))].add(rows)}

    return sq, sums


def layer_norm_rule(layer, calls):
    if type(layer) is not keras.layers.LayerNormalization or getattr(layer, "rms_scaling", False):
        return None
    if not _single(calls):
        return None
    axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    if any(len({ax % c["a"].ndim for ax in axes} ^ {c["a"].ndim - 1}) for c in calls):
        return None  # normalised over more than the last axis
    d = calls[0]["a"].shape[-1]
    p = calls[0]["g"].shape[0]
    xs, gs = [], []
    for c in calls:
        a = c["a"].astype(_F32)
        mean = jnp.mean(a, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(a - mean), axis=-1, keepdims=True)
        xs.append(jnp.reshape((a - mean) * jax.lax.rsqrt(var + layer.epsilon), (p, -1, d)))
        gs.append(jnp.reshape(c["g"].astype(_F32), (p, -1, d)))
    return _affine(layer, _cat(xs), _cat(gs))


def group_norm_rule(layer, calls):
    if type(layer) is not keras.layers.GroupNormalization or not _single(calls):
        return None
    if any(layer.axis % c["a"].ndim != c["a"].ndim - 1 for c in calls):
        return None  # channels not on the last axis
    d = calls[0]["a"].shape[-1]
    p = calls[0]["g"].shape[0]
    groups = layer.groups
    xs, gs = [], []
    for c in calls:
        a = jnp.reshape(c["a"].astype(_F32), (p, -1, groups, d // groups))
        mean = jnp.mean(a, axis=(1, 3), keepdims=True)
        var = jnp.mean(jnp.square(a - mean), axis=(1, 3), keepdims=True)
        xs.append(jnp.reshape((a - mean) * jax.lax.rsqrt(var + layer.epsilon), (p, -1, d)))
        gs.append(jnp.reshape(c["g"].astype(_F32), (p, -1, d)))
    return _affine(layer, _cat(xs), _cat(gs))


def _affine(layer, x_hat, g):
    """Per-example gradients of ``gamma ⊙ x̂ + beta`` over the last axis: ``Σ_l x̂_l ⊙ g_l``, ``Σ_l g_l``."""
    per = {}
    if layer.gamma is not None:
        per[id(layer.gamma)] = jnp.sum(x_hat * g, axis=1)
    if layer.beta is not None:
        per[id(layer.beta)] = jnp.sum(g, axis=1)
    sq = sum(jnp.sum(v * v, axis=1) for v in per.values())

    def sums(c, keep=None):
        return {k: jnp.tensordot(c.astype(_F32), kept(v, keep), axes=1) for k, v in per.items()}

    return sq, sums


#: The rules, tried in order; the first that returns a result is used.
RULES = (dense_rule, einsum_dense_rule, embedding_rule, layer_norm_rule, group_norm_rule, *CONV_RULES, *HUB_RULES,
         *RNN_RULES)


def find_rule(layer, calls):
    """``(name, (sq, sums))`` of the first rule that handles ``layer``'s calls, else ``None``."""
    for rule in RULES:
        result = rule(layer, calls)
        if result is not None:
            return rule.__name__, result
    return None
