"""Ghost-norm rules of the JAX engine for the embeddings of language models (KerasHub's and
Keras's ``ReversibleEmbedding``, KerasHub's ``PositionEmbedding``), in ``jax.numpy``.
Each rule is ``rule(layer, calls) -> (sq, sums)`` or ``None``, the contract of
:mod:`~keras_noisecurve.backend.jax.ghost_rules` (which lists the rules, in order).
Its ``calls`` also carry ``"args"`` and it runs under the step's weight values (see
:mod:`~keras_noisecurve.backend.jax.ghost_rules`).

* ReversibleEmbedding (Keras's and KerasHub's; lookup ``reverse=False``, logits ``h·Eᵀ`` with
  ``reverse=True``): the table's gradient of example i is the lookup part
  ``L_i = Σ_l e_{id_l} g_lᵀ`` plus, when tied, the projection part ``R_i = Σ_m g'_m h_mᵀ`` (V, d),
  summed over all calls of the layer; ``‖L_i + R_i‖² = ‖L_i‖² + ‖R_i‖² + 2⟨L_i, R_i⟩`` with
  ``⟨L_i, R_i⟩ = Σ_{l,m} g'_m[id_l]·(g_l·h_m)`` (a gather (P, M, L)). Untied: the reverse
  kernel (d, V) gets ``Σ_m h_m g'_mᵀ``. A soft-capped reverse call is left to the fallback.
* KerasHub's PositionEmbedding (``start_index`` 0, no ``positions``): the output is the
  table's first L rows broadcast over the batch, so example i's gradient is ``g_i`` summed over
  any axes before the L positions, in rows 0..L−1 of the table.

The TensorFlow engine's rules: ``keras_noisecurve/backend/tensorflow/ghost_embedding.py``.
"""

from __future__ import annotations

import jax.numpy as jnp
import keras

from keras_noisecurve.backend.common import layer_classes
from keras_noisecurve.backend.jax.ghost_forms import (
    F32,
    call_args,
    cat,
    kept,
    scaled,
    sequence_sq_norms,
    single,
    token_sq_norms,
)

__all__ = ["position_embedding_rule", "reversible_embedding_rule"]


def _call_flag(call, name, position, default):
    args, kwargs = call_args(call)
    return kwargs[name] if name in kwargs else (args[position] if len(args) > position else default)


def reversible_embedding_rule(layer, calls):
    """Keras's / KerasHub's ReversibleEmbedding, lookup and reverse calls (see the module docstring)."""
    cls = getattr(keras.layers, "ReversibleEmbedding", None)
    if cls is None or not isinstance(layer, cls) or type(layer).call is not cls.call:
        return None
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None) is not None:
        return None
    if not single(calls):
        return None
    flags = [_call_flag(c, "reverse", 1, False) for c in calls]
    if any(not isinstance(f, bool) for f in flags):
        return None  # a traced or unusual flag
    if any(flags) and layer.logit_soft_cap is not None:
        return None  # the recorded g is after the soft cap
    vocabulary, d = layer.embeddings.shape
    p = calls[0]["g"].shape[0]
    look = [c for c, f in zip(calls, flags) if not f]
    back = [c for c, f in zip(calls, flags) if f]
    sq = jnp.zeros((p,), F32)
    ids = ge = h = gr = None
    if look:
        ids = cat([jnp.reshape(c["a"].astype(jnp.int32), (p, -1)) for c in look])
        ge = cat([jnp.reshape(c["g"].astype(F32), (p, -1, d)) for c in look])
        sq = sq + token_sq_norms(ids, ge, vocabulary)
    if back:
        h = cat([jnp.reshape(c["a"].astype(F32), (p, -1, d)) for c in back])
        gr = cat([jnp.reshape(c["g"].astype(F32), (p, -1, vocabulary)) for c in back])
        sq = sq + sequence_sq_norms(h, gr)
        if look and layer.tie_weights:  # 2⟨L_i, R_i⟩ = 2 Σ_{l,m} g'_m[id_l]·(g_l·h_m)
            at_ids = jnp.take_along_axis(gr, jnp.broadcast_to(ids[:, None, :], (p, gr.shape[1], ids.shape[1])), axis=2)
            sq = sq + 2.0 * jnp.sum(at_ids * jnp.einsum("pmd,pld->pml", h, ge), axis=(1, 2))

    def sums(c, keep=None):
        table = jnp.zeros((vocabulary, d), F32)
        if look:
            table = table.at[jnp.reshape(ids, (-1,))].add(jnp.reshape(scaled(c, kept(ge, keep)), (-1, d)))
        result = {}
        if back:
            projection = jnp.einsum("pmd,pmv->dv", kept(h, keep), scaled(c, kept(gr, keep)))
            if layer.tie_weights:
                table = table + projection.T
            else:
                result[id(layer.reverse_embeddings)] = projection
        elif not layer.tie_weights:
            result[id(layer.reverse_embeddings)] = jnp.zeros(tuple(layer.reverse_embeddings.shape), F32)
        result[id(layer.embeddings)] = table
        return result

    return sq, sums


def position_embedding_rule(layer, calls):
    """KerasHub's PositionEmbedding called with ``start_index=0`` and no ``positions``."""
    if not layer_classes.is_loaded_instance(layer, "keras_hub.src.layers.modeling.position_embedding",
                                            "PositionEmbedding") or not single(calls):
        return None
    for c in calls:
        args, kwargs = call_args(c)
        start = kwargs.get("start_index", args[1] if len(args) > 1 else 0)
        positions = kwargs.get("positions", args[2] if len(args) > 2 else None)
        if not (isinstance(start, int) and start == 0) or positions is not None:
            return None
        if c["a"].ndim < 3 or tuple(c["g"].shape) != tuple(c["a"].shape):
            return None
    table = layer.position_embeddings
    rows, d = table.shape
    per = {}
    for c in calls:
        g = c["g"].astype(F32)
        length = g.shape[-2]
        g = jnp.sum(g, axis=tuple(range(1, g.ndim - 2))) if g.ndim > 3 else g  # (P, L, d)
        per[length] = per[length] + g if length in per else g
    sq = sum(jnp.sum(x * x, axis=(1, 2)) for x in _padded(per, rows))

    def sums(c, keep=None):
        total = jnp.zeros((rows, d), F32)
        for length, x in per.items():
            total = total.at[:length].add(jnp.tensordot(c.astype(F32), kept(x, keep), axes=1))
        return {id(table): total}

    return sq, sums


def _padded(per, rows):
    """The per-length gradients (P, L, d) summed into one (P, max L, d) (a single entry as is)."""
    if len(per) == 1:
        return list(per.values())
    longest = max(per)
    total = sum(jnp.pad(x, ((0, 0), (0, longest - x.shape[1]), (0, 0))) for x in per.values())
    return [total]
