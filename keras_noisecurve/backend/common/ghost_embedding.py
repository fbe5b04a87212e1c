"""Ghost-norm kernels of the embeddings of language models (Keras's and KerasHub's
``ReversibleEmbedding``, KerasHub's ``PositionEmbedding``), one for every backend, in
``keras.ops`` (the contract of :func:`~keras_noisecurve.backend.common.layer_rules.layer_kernel`).
Shapes: P examples, L positions, V the vocabulary, d the embedding width.

* ReversibleEmbedding (lookup ``reverse=False``, logits ``h·Eᵀ`` with ``reverse=True``): the
  table's gradient of example i is the lookup part ``A_i = Σ_l e_{id_l} g_lᵀ`` plus, when tied,
  the projection part ``B_i = Σ_m g'_m h_mᵀ`` (V, d), summed over all calls of the layer;
  ``‖A_i + B_i‖² = ‖A_i‖² + ‖B_i‖² + 2⟨A_i, B_i⟩`` with each term in Gram form
  (``norm_forms.token_sq_norms``, ``sequence_sq_norms``, :func:`tied_cross_term`): nothing of size
  V·d per example is formed. Untied: the reverse kernel (d, V) gets ``Σ_m h_m g'_mᵀ``. A
  soft-capped reverse call needs the gradient before the cap: the kernel's ``forward`` records it;
  where the forward did not run, the layer goes to the fallback.
* PositionEmbedding called with an integer ``start_index`` and no ``positions``: rows
  ``start … start+L−1`` of the table broadcast over the batch, so example i's gradient is ``g_i``
  (summed over any axes before the L positions) in those rows.
"""

from __future__ import annotations

import keras
from keras import ops

from keras_noisecurve.backend.common import layer_classes
from keras_noisecurve.backend.common.layer_rules import layer_kernel
from keras_noisecurve.backend.common.norm_forms import (
    cat, kept, scaled, sequence_sq_norms, sum_dtype, token_sq_norms, weighted_outer)

__all__ = ["position_embedding", "reversible_embedding", "tied_cross_term"]

#: KerasHub releases before Keras had the layer ship their own class, same semantics
_HUB_REVERSIBLE = ("keras_hub.src.layers.modeling.reversible_embedding", "ReversibleEmbedding")
_POSITION = ("keras_hub.src.layers.modeling.position_embedding", "PositionEmbedding")


def tied_cross_term(ids, g_lookup, h, g_logits):
    """Per-example ``2⟨A_i, B_i⟩`` (P,) of a tied table's two gradients: ``⟨A_i, B_i⟩ =
    Σ_{l,m} g_logits[m, id_l]·(g_lookup_l · h_m)``, a gather of the logit gradients at the
    looked-up ids (P, M, L) times the (P, M, L) inner products. ``ids`` (P, L), ``g_lookup``
    (P, L, d), ``h`` (P, M, d), ``g_logits`` (P, M, V)."""
    m = ops.shape(g_logits)[1]
    at_ids = ops.take_along_axis(g_logits, ops.broadcast_to(ids[:, None, :], (ops.shape(ids)[0], m, ops.shape(ids)[1])),
                                 axis=2)
    return 2.0 * ops.sum(at_ids * ops.einsum("pmd,pld->pml", h, g_lookup), axis=(1, 2))


def _is_reversible(layer) -> bool:
    cls = getattr(keras.layers, "ReversibleEmbedding", None)
    return ((cls is not None and layer_classes.runs_call_of(layer, cls))
            or layer_classes.is_loaded_instance(layer, *_HUB_REVERSIBLE))


def _reversible_weights(layer):
    return [layer.embeddings] + ([] if layer.tie_weights else [layer.reverse_embeddings])


def _argument(call, name, position, default):
    args, kwargs = call["args"] or ((call["a"],), {})
    return kwargs[name] if name in kwargs else (args[position] if len(args) > position else default)


def _reversible_forward(layer, call, x, reverse=False):
    if not reverse or layer.logit_soft_cap is None:
        return call(x, reverse=reverse), lambda z: (z, None)
    kernel = ops.transpose(layer.embeddings) if layer.tie_weights else layer.reverse_embeddings
    h = x
    if layer.reverse_dtype is not None:
        h, kernel = ops.cast(h, layer.reverse_dtype), ops.cast(kernel, layer.reverse_dtype)
    cap = layer.logit_soft_cap
    return ops.matmul(h, kernel), lambda logits: (ops.multiply(ops.tanh(ops.divide(logits, cap)), cap), {"h": h})


@layer_kernel(matches=_is_reversible, names=("ReversibleEmbedding",), weights=_reversible_weights,
              forward=_reversible_forward)
def reversible_embedding(layer, calls):
    """``keras.layers.ReversibleEmbedding`` (lookup with ``reverse=False``, logits with
    ``reverse=True``; KerasHub's before Keras had it)."""
    flags = [_argument(c, "reverse", 1, False) for c in calls]
    if any(not isinstance(f, bool) for f in flags):
        return None  # a traced or unusual flag
    if any(f and layer.logit_soft_cap is not None and not c["saved"] for c, f in zip(calls, flags)):
        return None  # the recorded g is after the soft cap
    vocabulary, d = (int(n) for n in layer.embeddings.shape)
    dtype = sum_dtype(calls[0]["g"])
    p = ops.shape(calls[0]["g"])[0]
    look = [c for c, f in zip(calls, flags) if not f]
    back = [c for c, f in zip(calls, flags) if f]
    sq = 0.0
    ids = ge = h = gr = None
    if look:
        ids = cat([ops.reshape(ops.cast(c["a"], "int32"), (p, -1)) for c in look])
        ge = cat([ops.reshape(ops.cast(c["g"], dtype), (p, -1, d)) for c in look])
        sq = sq + token_sq_norms(ids, ge, vocabulary)
    if back:
        h = cat([ops.reshape(ops.cast(ops.stop_gradient(c["saved"]["h"] if c["saved"] else c["a"]), dtype), (p, -1, d))
                 for c in back])
        gr = cat([ops.reshape(ops.cast(c["g"], dtype), (p, -1, vocabulary)) for c in back])
        sq = sq + sequence_sq_norms(h, gr)  # ‖Σ_m h_m g_mᵀ‖², the same norm tied or not
        if look and layer.tie_weights:
            sq = sq + tied_cross_term(ids, ge, h, gr)

    def sums(c, keep=None):
        table = ops.zeros((vocabulary, d), dtype)
        if look:
            rows = ops.reshape(scaled(c, kept(ge, keep)), (-1, d))
            table = table + ops.segment_sum(rows, ops.reshape(ids, (-1,)), num_segments=vocabulary)
        result = {}
        if back:
            projection = weighted_outer(h, gr, c, keep)  # (d, V)
            if layer.tie_weights:
                table = table + ops.transpose(projection)
            else:
                result[id(layer.reverse_embeddings)] = projection
        elif not layer.tie_weights:
            result[id(layer.reverse_embeddings)] = ops.zeros(tuple(layer.reverse_embeddings.shape), dtype)
        result[id(layer.embeddings)] = table
        return result

    return sq, sums


@layer_kernel(matches=lambda layer: layer_classes.is_loaded_instance(layer, *_POSITION),
              names=("PositionEmbedding (KerasHub)",), weights=("position_embeddings",))
def position_embedding(layer, calls):
    """KerasHub's ``PositionEmbedding`` called with an integer ``start_index`` and no
    ``positions``: rows ``start … start+L−1`` of the table, broadcast to the (P, ..., L, d) input;
    example i's gradient of those rows is its output gradient ``g_i`` (L, d)."""
    table = layer.position_embeddings
    rows, d = (int(n) for n in table.shape)
    dtype = sum_dtype(calls[0]["g"])
    parts = []  # (start, g (P, L, d))
    for c in calls:
        start = _argument(c, "start_index", 1, 0)
        if not isinstance(start, int) or start < 0 or _argument(c, "positions", 2, None) is not None:
            return None
        if len(c["a"].shape) < 3 or tuple(c["g"].shape) != tuple(c["a"].shape):
            return None
        g = ops.cast(c["g"], dtype)
        if len(g.shape) > 3:
            g = ops.sum(g, axis=tuple(range(1, len(g.shape) - 2)))  # (P, L, d)
        if g.shape[1] is not None and start + g.shape[1] > rows:
            return None
        parts.append((start, g))

    def placed(start, x):  # x (..., L, d) in rows start … start+L−1 of (..., rows, d); L may be unknown (TensorFlow)
        pad = [(0, 0)] * (len(x.shape) - 2) + [(start, rows - start - ops.shape(x)[-2]), (0, 0)]
        return ops.pad(x, pad)

    # one call (the usual case): its rows are distinct, ‖G_i‖² = ‖g_i‖²; several calls may overlap,
    # so their rows are added up per example first (tables are small)
    per = parts[0][1] if len(parts) == 1 else sum(placed(start, g) for start, g in parts)
    sq = ops.sum(per * per, axis=(1, 2))

    def sums(c, keep=None):
        total = ops.tensordot(ops.cast(c, dtype), kept(per, keep), axes=1)
        return {id(table): placed(parts[0][0], total) if len(parts) == 1 else total}

    return sq, sums
