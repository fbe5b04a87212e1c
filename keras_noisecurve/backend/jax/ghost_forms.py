"""Norm and sum forms shared by the JAX ghost-norm rules (the ``ghost_*`` rule modules listed in
:mod:`~keras_noisecurve.backend.jax.ghost_rules`), in ``jax.numpy``: the per-example squared norm of a
sum of outer products over positions, of an embedding table's gradient, the zeroing of dropped
examples' rows, the parsing of an EinsumDense equation, and the small helpers every rule uses
on its recorded calls.

Shapes: P examples, L positions.
"""

from __future__ import annotations

import jax.numpy as jnp

from keras_noisecurve.backend.geometry import parse_einsum

__all__ = ["F32", "call_args", "cat", "kept", "parse_einsum", "plain", "scaled", "sequence_sq_norms", "single",
           "token_sq_norms"]

#: the dtype of the norms and sums
F32 = jnp.float32


def plain(layer) -> bool:
    """No LoRA, no quantization: the layer's ``call`` is the textbook one."""
    return not getattr(layer, "lora_enabled", False) and getattr(layer, "quantization_mode", None) is None


def single(calls) -> bool:
    """Every call has one array input and one array output with the examples first."""
    return all(hasattr(c["a"], "shape") and hasattr(c["g"], "shape") for c in calls)


def call_args(call):
    """``(args, kwargs)`` of a recorded call (``((a,), {})`` when the engine gave none)."""
    return call.get("args") or ((call["a"],), {})


def cat(parts):
    """The calls of a shared layer, concatenated along the positions (axis 1)."""
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def scaled(c, g):
    """``g`` with example i's rows multiplied by ``c[i]``; ``c`` (P,), ``g`` (P, ...)."""
    return g * jnp.reshape(c, (-1,) + (1,) * (g.ndim - 1)).astype(g.dtype)


def sequence_sq_norms(a, g):
    """Per-example ``‖Σ_l a_il g_ilᵀ‖²_F``; ``a`` (P, L, d_in), ``g`` (P, L, d_out) -> (P,)."""
    length, d_in, d_out = a.shape[1], a.shape[2], g.shape[2]
    if length == 1:
        return jnp.sum(a * a, axis=(1, 2)) * jnp.sum(g * g, axis=(1, 2))
    if length * length < d_in * d_out:
        aa = jnp.einsum("pli,pmi->plm", a, a)
        gg = jnp.einsum("plj,pmj->plm", g, g)
        return jnp.sum(aa * gg, axis=(1, 2))
    per_example = jnp.einsum("pli,plj->pij", a, g)
    return jnp.sum(per_example * per_example, axis=(1, 2))


def token_sq_norms(ids, g, vocabulary):
    """Per-example squared norm of an embedding table's gradient.

    ``ids`` (P, L) int, ``g`` (P, L, d) -> (P,): ``Σ_{l,l'} [id_l = id_l'] (g_l·g_l')`` when
    L² < vocabulary·d, else ``‖segment_sum(g by id)‖²`` per example.
    """
    p, length, d = g.shape
    if length * length < vocabulary * d:
        same = (ids[:, :, None] == ids[:, None, :]).astype(g.dtype)
        return jnp.sum(same * jnp.einsum("pld,pmd->plm", g, g), axis=(1, 2))
    rows = jnp.zeros((p, vocabulary, d), g.dtype).at[jnp.arange(p)[:, None], ids].add(g)
    return jnp.sum(rows * rows, axis=(1, 2))


def kept(x, keep):
    """``x`` (P, ...) with the rows of dropped examples (``keep`` (P,) bool false) set to 0, so that
    a non-finite example's 0 factor cannot give 0·inf = nan in a sum; ``keep=None``: ``x``."""
    if keep is None:
        return x
    return jnp.where(jnp.reshape(keep, (-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros_like(x))


