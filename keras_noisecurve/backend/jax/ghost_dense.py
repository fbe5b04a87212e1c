"""Ghost-norm rules of the JAX engine for layers that multiply by a matrix or gather rows of one
(``Dense``, ``EinsumDense``, ``Embedding``; exact classes, no LoRA, not quantized), in ``jax.numpy``.
Each rule is ``rule(layer, calls) -> (sq, sums)`` or ``None``, the contract of
:mod:`~keras_noisecurve.backend.jax.ghost_rules` (which lists the rules, in order).

Notation: P examples; a call's input ``a`` (P, ..., d_in), the gradient ``g`` (P, ..., d_out) at its
(pre-activation) output; ``c`` (P,) the clipping factors. A shared layer's calls are concatenated
along the positions.

* Dense: kernel gradient ``G_i = Σ_l a_il g_ilᵀ``, ``‖G_i‖² = ‖a_i‖²‖g_i‖²`` for one position, else
  the Gram form ``Σ_{l,l'} (a_il·a_il')(g_il·g_il')`` (memory P·L²) when L² < d_in·d_out, else
  ``G_i`` itself (memory P·d_in·d_out); bias ``Σ_l g_il``. Sum: ``Σ_{i,l} a_il (c_i g_il)ᵀ``.
* EinsumDense: the same after bringing the equation to (examples, positions, contracted) ×
  (examples, positions, kernel outputs); an axis shared by input, kernel and output (per-head
  weights) makes ``G_i = einsum(input, output -> example, kernel)`` materialised.
* Embedding: row v of example i's gradient is ``Σ_{l: id_il = v} g_il``;
  ``‖G_i‖² = Σ_{l,l'} [id_il = id_il'] (g_il·g_il')`` (memory P·L²) when L² < vocabulary·d, else
  a segment sum per example (memory P·vocabulary·d).

The TensorFlow engine's rules of the same layers: ``keras_noisecurve/backend/tensorflow/ghost_dense.py``.
"""

from __future__ import annotations

import jax.numpy as jnp
import keras

from keras_noisecurve.backend.jax.ghost_forms import (
    F32,
    cat,
    kept,
    parse_einsum,
    plain,
    scaled,
    sequence_sq_norms,
    single,
    token_sq_norms,
)

__all__ = ["dense_rule", "einsum_dense_rule", "embedding_rule"]


def dense_rule(layer, calls):
    if type(layer) is not keras.layers.Dense or not plain(layer) or not single(calls):
        return None
    d_in, d_out = layer.kernel.shape
    p = calls[0]["g"].shape[0]
    a = cat([jnp.reshape(c["a"].astype(F32), (p, -1, d_in)) for c in calls])
    g = cat([jnp.reshape(c["g"].astype(F32), (p, -1, d_out)) for c in calls])
    sq = sequence_sq_norms(a, g)
    bias_i = None
    if layer.bias is not None:
        bias_i = jnp.sum(g, axis=1)
        sq = sq + jnp.sum(bias_i * bias_i, axis=1)

    def sums(c, keep=None):
        out = {id(layer.kernel): jnp.einsum("pli,plj->ij", kept(a, keep), scaled(c, kept(g, keep)))}
        if bias_i is not None:
            out[id(layer.bias)] = jnp.tensordot(c.astype(F32), kept(bias_i, keep), axes=1)
        return out

    return sq, sums


def einsum_dense_rule(layer, calls):
    if type(layer) is not keras.layers.EinsumDense or not plain(layer) or not single(calls):
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
    a_parts = [c["a"].astype(F32) for c in calls]
    g_parts = [c["g"].astype(F32) for c in calls]
    if shared:  # per-head weights: materialise G_i
        per = sum(jnp.einsum(f"{inp},{out}->{ex}{ker}", a, g) for a, g in zip(a_parts, g_parts))
        sq = jnp.sum(jnp.reshape(per * per, (p, -1)), axis=1)
    else:
        pos = "".join(ch for ch in inp[1:] if ch in out and ch not in ker)
        con = "".join(ch for ch in inp[1:] if ch in ker)
        kout = "".join(ch for ch in out[1:] if ch in ker)
        a = cat([jnp.reshape(jnp.einsum(f"{inp}->{ex}{pos}{con}", x), (p, -1, max(1, _size(x, inp, con))))
                  for x in a_parts])
        g = cat([jnp.reshape(jnp.einsum(f"{out}->{ex}{pos}{kout}", y), (p, -1, max(1, _size(y, out, kout))))
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
        result = {id(layer.kernel): sum(jnp.einsum(f"{inp},{out}->{ker}", kept(x, keep), scaled(c, kept(y, keep)))
                                        for x, y in zip(a_parts, g_parts))}
        if bias_letters is not None:
            result[id(layer.bias)] = jnp.reshape(jnp.tensordot(c.astype(F32), kept(bias_i, keep), axes=1),
                                                 bias_shape)
        return result

    return sq, sums


def _size(x, letters, chosen):
    n = 1
    for ch in chosen:
        n *= x.shape[letters.index(ch)]
    return n


def embedding_rule(layer, calls):
    if type(layer) is not keras.layers.Embedding or not plain(layer) or not single(calls):
        return None
    vocabulary, d = layer.embeddings.shape
    p = calls[0]["g"].shape[0]
    ids = cat([jnp.reshape(c["a"].astype(jnp.int32), (p, -1)) for c in calls])
    g = cat([jnp.reshape(c["g"].astype(F32), (p, -1, d)) for c in calls])
    sq = token_sq_norms(ids, g, vocabulary)

    def sums(c, keep=None):
        rows = jnp.reshape(scaled(c, kept(g, keep)), (-1, d))
        return {id(layer.embeddings): jnp.zeros((vocabulary, d), F32).at[jnp.reshape(ids, (-1,))].add(rows)}

    return sq, sums
