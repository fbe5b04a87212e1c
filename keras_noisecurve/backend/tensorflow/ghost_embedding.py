"""Ghost-clipping rules for the embeddings and scales of language models.

- :class:`ReversibleEmbeddingRule`: ``keras.layers.ReversibleEmbedding`` (KerasHub's
  ``token_embedding``), one table used as the token lookup and, transposed, as the
  output projection to the vocabulary (tied), or with a separate
  ``reverse_embeddings`` kernel (untied).
- :class:`PositionEmbeddingRule`: KerasHub's ``PositionEmbedding``, a table whose first
  L rows are added to every example.
- :class:`DiagonalScaleRule`: layers whose output element ``(…, k)`` depends on the
  weight only through its entry ``k`` (RMS normalisations: Keras's
  ``RMSNormalization``, KerasHub's Llama and Gemma RMS norms).

Shapes: P examples, L positions, V the vocabulary, d the embedding width.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_noisecurve import _compat
from keras_noisecurve.backend.common import affine_scale, layer_classes
from keras_noisecurve.backend.tensorflow.ghost_forms import (
    Rule,
    concat_positions,
    norm_dtype,
    per_example_sq,
    scale_rows,
    sequence_sq_norms,
    weighted_outer,
    weighted_sum,
)
from keras_noisecurve.backend.common.norm_forms import token_sq_norms

__all__ = ["DiagonalScaleRule", "PositionEmbeddingRule", "ReversibleEmbeddingRule", "tied_cross_term"]


def tied_cross_term(ids, g_lookup, h, g_logits):
    """Per-example ``2⟨A_i, B_i⟩`` of a tied table's two gradients (P,).

    ``A_i = Σ_l e_{id_l} g_lookup_lᵀ`` (lookup part, (V, d)) and
    ``B_i = Σ_m g_logits_m h_mᵀ`` (projection part: logits = h·Eᵀ, (V, d)), so
    ``⟨A_i, B_i⟩ = Σ_{l,m} g_logits[m, id_l]·(g_lookup_l · h_m)``: a gather of the logit
    gradients at the looked-up ids, (P, M, L), times the (P, M, L) inner products.
    ``ids`` (P, L), ``g_lookup`` (P, L, d), ``h`` (P, M, d), ``g_logits`` (P, M, V).
    """
    at_ids = tf.gather(g_logits, ids, axis=2, batch_dims=1)  # (P, M, L)
    dots = tf.einsum("pmd,pld->pml", h, g_lookup)
    return 2.0 * tf.reduce_sum(at_ids * dots, axis=[1, 2])


class ReversibleEmbeddingRule(Rule):
    """``keras.layers.ReversibleEmbedding`` (lookup with ``reverse=False``, logits with ``reverse=True``).

    Per example, the table's gradient is the lookup part ``A_i`` (rows gathered by token
    id) plus, when tied, the projection part ``B_i``; ``‖A_i + B_i‖² = ‖A_i‖² + ‖B_i‖² +
    2⟨A_i, B_i⟩`` with each term in Gram form (:func:`token_sq_norms`,
    :func:`sequence_sq_norms`, :func:`tied_cross_term`): nothing of size V·d per example
    is formed. The logits' soft cap is applied after the recorded pre-cap logits.
    """

    classes = (keras.layers.ReversibleEmbedding,)
    kind = "ReversibleEmbedding"
    #: KerasHub releases before Keras had the layer ship their own class, same semantics
    hub = ("keras_hub.src.layers.modeling.reversible_embedding", "ReversibleEmbedding")

    def matches(self, layer) -> bool:
        if super().matches(layer):
            return True
        cls = layer_classes.loaded_class(*self.hub)
        return cls not in self.classes and layer_classes.runs_call_of(layer, cls)

    def expected_variables(self, layer):
        return [layer.embeddings] + ([] if layer.tie_weights else [layer.reverse_embeddings])

    def forward(self, layer, original_call, record, inputs, reverse=False):
        if not reverse:
            out = original_call(inputs)
            record(out=out, ids=inputs)
            return out
        kernel = keras.ops.transpose(layer.embeddings) if layer.tie_weights else layer.reverse_embeddings
        h = inputs
        if layer.reverse_dtype is not None:
            h, kernel = keras.ops.cast(h, layer.reverse_dtype), keras.ops.cast(kernel, layer.reverse_dtype)
        logits = keras.ops.matmul(h, kernel)
        record(out=logits, h=h)
        if layer.logit_soft_cap is not None:
            cap = layer.logit_soft_cap
            logits = keras.ops.multiply(keras.ops.tanh(keras.ops.divide(logits, cap)), cap)
        return logits

    def analyse(self, layer, calls):
        dtype = norm_dtype(calls[0]["g"].dtype)
        vocabulary, d = (int(n) for n in layer.embeddings.shape)
        lookups = [c for c in calls if "ids" in c]
        reverses = [c for c in calls if "h" in c]
        total = 0.0
        ids = g_lookup = h = g_logits = None
        if lookups:
            ids = concat_positions([tf.reshape(tf.cast(c["ids"], tf.int64), [tf.shape(c["g"])[0], -1]) for c in lookups])
            g_lookup = concat_positions([tf.reshape(tf.cast(c["g"], dtype), [tf.shape(c["g"])[0], -1, d]) for c in lookups])
            total += token_sq_norms(ids, g_lookup, vocabulary)
        if reverses:
            h = concat_positions([tf.reshape(tf.cast(tf.stop_gradient(c["h"]), dtype), [tf.shape(c["g"])[0], -1, d])
                                  for c in reverses])
            g_logits = concat_positions([tf.reshape(tf.cast(c["g"], dtype), [tf.shape(c["g"])[0], -1, vocabulary])
                                         for c in reverses])
            total += sequence_sq_norms(h, g_logits)  # ‖Σ_m h_m g_mᵀ‖², the same norm tied or not
            if lookups and layer.tie_weights:
                total += tied_cross_term(ids, g_lookup, h, g_logits)

        def grads(scale):
            table = tf.zeros([vocabulary, d], dtype)
            if lookups:
                rows = tf.reshape(scale_rows(g_lookup, scale), [-1, d])  # a row with scale 0 is exactly 0
                table += tf.math.unsorted_segment_sum(rows, tf.reshape(ids, [-1]), vocabulary)
            out = []
            if reverses:
                projection = weighted_outer(h, g_logits, tf.cast(scale, dtype))  # (d, V)
                if layer.tie_weights:
                    table += tf.transpose(projection)
                else:
                    out.append((layer.reverse_embeddings, projection))
            return [(layer.embeddings, table)] + out

        return total, grads


class PositionEmbeddingRule(Rule):
    """KerasHub's ``PositionEmbedding``: rows ``start … start+L-1`` of the table, broadcast
    to the (P, L, d) input. Example i's gradient of those rows is its output gradient
    ``g_i`` (L, d), so ``‖G_i‖² = ‖g_i‖²`` and the sum places ``Σ_i c_i g_i`` in those rows."""

    kind = "PositionEmbedding"
    module = "keras_hub.src.layers.modeling.position_embedding"

    def matches(self, layer) -> bool:
        return layer_classes.is_loaded_instance(layer, self.module, "PositionEmbedding")

    def expected_variables(self, layer):
        return [layer.position_embeddings]

    def forward(self, layer, original_call, record, inputs, start_index=0, positions=None):
        if positions is not None or inputs.shape.rank != 3:
            raise ValueError(f"PositionEmbedding layer '{layer.name}': ghost clipping supports inputs of shape "
                             "(batch, length, features) without explicit positions; use clipping='vectorized' (the reference engine: an exact "
                             "per-example loop, about P times a single gradient's cost).")
        out = original_call(inputs, start_index=start_index)
        record(out=out, start=start_index)
        return out

    def analyse(self, layer, calls):
        dtype = norm_dtype(calls[0]["g"].dtype)
        gs = [tf.cast(c["g"], dtype) for c in calls]
        # one call (the usual case): rows are distinct, ‖G_i‖² = ‖g_i‖²; several calls may
        # overlap, so their rows are added up per example first (tables are small)
        rows, width = (int(n) for n in layer.position_embeddings.shape)

        def placed(g, start, scale=None):
            g = g if scale is None else scale_rows(g, scale)  # a row with scale 0 is exactly 0
            length = tf.shape(g)[1]
            before = tf.cast(start, tf.int32)
            return tf.pad(g, [[0, 0], [before, rows - before - length], [0, 0]])  # (P, rows, d)

        if len(calls) == 1:
            total = per_example_sq(gs[0])
        else:
            total = per_example_sq(tf.add_n([placed(g, c["start"]) for g, c in zip(gs, calls)]))

        def grads(scale):
            scale = tf.cast(scale, dtype)
            table = tf.add_n([tf.reduce_sum(placed(g, c["start"], scale), axis=0) for g, c in zip(gs, calls)])
            return [(layer.position_embeddings, tf.reshape(table, [rows, width]))]

        return total, grads


class DiagonalScaleRule(Rule):
    """A layer whose output element ``(…, k)`` depends on its weight ``s`` (d,) through
    ``s_k`` alone, with ∂out/∂s_k not depending on s (RMS norms: ``x̂·s`` or ``x̂·(1 + s)``).

    The layer's own call runs again, on detached inputs, under a forward-mode accumulator
    with tangent 1 on ``s``: its JVP is ``J = ∂out/∂s_k`` elementwise (x̂), so example i's gradient is
    ``Σ_positions g_i ⊙ J_i`` (d,). No layer math is re-written here.
    """

    kind = "RMS scale"
    classes = (keras.layers.RMSNormalization,)
    hub = affine_scale.KNOWN_RMS_NORMS[1:]

    def matches(self, layer) -> bool:
        return affine_scale.known_rms_norm(layer)

    def expected_variables(self, layer):
        return [layer.scale]

    def check(self, layer):
        axis = getattr(layer, "axis", [-1])
        if list(axis if isinstance(axis, (list, tuple)) else [axis]) != [-1]:
            return f"normalises over axis {axis} (the rule takes the last axis only)"
        return super().check(layer)

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        out = original_call(inputs, *args, **kwargs)
        # The JVP from a second, detached call: outputs computed under a forward
        # accumulator are not differentiated by the enclosing GradientTape.
        scale = _compat.unautocast_variable(layer.scale)  # not a fresh autocast copy (mixed precision)
        with tf.autodiff.ForwardAccumulator(primals=scale, tangents=tf.ones_like(scale)) as acc:
            detached = original_call(tf.stop_gradient(inputs), *args, **kwargs)
        jvp = acc.jvp(detached)
        if jvp is None:
            raise ValueError(f"{type(layer).__name__} layer '{layer.name}': its output does not depend on its scale.")
        record(out=out, jvp=tf.stop_gradient(jvp))
        return out

    def analyse(self, layer, calls):
        dtype = norm_dtype(calls[0]["g"].dtype)
        d = int(layer.scale.shape[0])
        per_example = tf.add_n([
            tf.reduce_sum(tf.reshape(tf.cast(c["g"], dtype) * tf.cast(c["jvp"], dtype), [tf.shape(c["g"])[0], -1, d]),
                          axis=1)
            for c in calls
        ])

        def grads(scale):
            return [(layer.scale, weighted_sum(per_example, tf.cast(scale, dtype)))]

        return per_example_sq(per_example), grads
