"""Norm and sum forms shared by the JAX ghost-norm rules (:mod:`~keras_noisecurve.backend.jax.ghost_rules`,
:mod:`~keras_noisecurve.backend.jax.ghost_hub`), in ``jax.numpy``: the per-example squared norm of a
sum of outer products over positions, of an embedding table's gradient, the zeroing of dropped
examples' rows, and the parsing of an EinsumDense equation.

Shapes: P examples, L positions.
"""

from __future__ import annotations

import string

import jax.numpy as jnp

__all__ = ["kept", "parse_einsum", "sequence_sq_norms", "token_sq_norms"]


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


def parse_einsum(equation, input_rank):
    """``(input, kernel, output)`` letters of an EinsumDense equation, ``...`` expanded for an
    input of rank ``input_rank``."""
    lhs, out = equation.replace(" ", "").split("->")
    inp, ker = lhs.split(",")
    if "..." in inp:
        fresh = [ch for ch in string.ascii_letters if ch not in equation]
        filler = "".join(fresh[: input_rank - len(inp.replace("...", ""))])
        inp, out = inp.replace("...", filler), out.replace("...", filler)
    return inp, ker, out
