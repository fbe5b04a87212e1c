"""Ghost-clipping rule for T5's relative-attention bias (KerasHub ``T5MultiHeadAttention``).

The first self-attention layer of each T5 stack owns a table ``W`` (N buckets, H heads)
and reads it through a lookup that does not depend on the batch:

    bias[0, h, q, k] = W[b(q, k), h]                   (1, H, Lq, Lk)

with ``b(q, k)`` the bucket of the relative position ``k − q`` (``compute_bias``). The
bias, plus the folded padding mask, is added to every example's attention scores, and
the layer returns it as ``position_bias`` for the later layers of the stack to add to
theirs. The layer's q/k/v/o projections are ``Dense`` sublayers with their own rules;
the table is the layer's only own weight.

:class:`RelativeAttentionBiasRule` gives the bias a per-example copy: inside the
recorded call the layer's own ``compute_bias`` is broadcast to ``T`` (P, H, Lq, Lk)
(``T_i`` = bias for every i, so the forward values are unchanged), the padding mask is
folded into it as the layer folds it, and the layer's call runs with
``position_bias=T + mask``. ``T`` is recorded; its gradient ``g_i`` (H, Lq, Lk) from the
engine's one backward pass is example i's gradient at the bias, through this layer's
scores AND every later layer that reuses the returned ``position_bias`` (all of those
paths consume ``T``; the table is read nowhere else). Since the lookup is linear in W,

    G_i[n, h] = Σ_{(q, k): b(q, k) = n} g_i[h, q, k]    (a segment sum, (N, H))

gives ``‖G_i‖²`` and the clipped sum ``Σ_i c_i G_i``. The bucket ids ``b`` are read from
the layer's own ``compute_bias`` with the table replaced (``keras.StatelessScope``; the
variable is never assigned) by ``W[n, h] = n``: no bucket arithmetic is re-written here.
Cost: the (P, H, Lq, Lk) broadcast (the size of the scores the layer forms anyway) and
one segment sum; the layer is never re-run per example.

Refused (at the call, naming the layer): a key/value ``cache`` (decoding, not training).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_noisecurve.backend.tensorflow.engine_forms import Rule, norm_dtype, per_example_sq, weighted_sum
from keras_noisecurve.backend.common.layer_classes import loaded_class, runs_call_of

__all__ = ["RelativeAttentionBiasRule", "bucket_ids"]

_MODULE = "keras_hub.src.models.t5.t5_multi_head_attention"


def bucket_ids(layer, query_length, key_length) -> tf.Tensor:
    """The (Lq, Lk) int32 bucket of each (query, key) pair, read from ``layer.compute_bias``.

    ``compute_bias(Lq, Lk)`` gathers rows of ``layer.relative_attention_bias`` (N, H) into
    (1, H, Lq, Lk); run with the table replaced by ``W[n, h] = n`` (a
    ``keras.StatelessScope``, the variable keeps its value), head 0 of its output is the
    bucket index itself (exact in any float dtype for N ≤ 2048).
    """
    table = layer.relative_attention_bias
    rows, heads = (int(n) for n in table.shape)
    index = tf.tile(tf.range(rows, dtype=table.dtype)[:, None], [1, heads])
    with keras.StatelessScope(state_mapping=[(table, index)]):
        values = layer.compute_bias(query_length, key_length)
    return tf.cast(tf.round(tf.cast(values[0, 0], tf.float32)), tf.int32)


class RelativeAttentionBiasRule(Rule):
    """KerasHub's ``T5MultiHeadAttention`` owning the relative-attention bias table W (N, H): the bias
    is given a per-example copy (P, H, Lq, Lk) inside the call, and ``G_i`` is a segment sum of its gradient.

    Example i's gradient of ``W[n, h]`` is the sum of its bias gradient ``g_i[h, q, k]``
    over the (q, k) of bucket n, counted once whether the bias was used by this layer or
    reused by later layers; the q/k/v/o projections keep their own ``Dense`` rules.
    """

    kind = "T5 relative-attention bias"
    hub = (_MODULE, "T5MultiHeadAttention")

    def matches(self, layer) -> bool:
        cls = loaded_class(*self.hub)
        return (runs_call_of(layer, cls) and type(layer).compute_bias is cls.compute_bias
                and bool(getattr(layer, "use_relative_attention_bias", False)))

    def expected_variables(self, layer):
        return [layer.relative_attention_bias]

    def forward(self, layer, original_call, record, inputs, mask=None, key_value_states=None, position_bias=None,
                cache=None, cache_update_index=None, **kwargs):
        if cache is not None or cache_update_index is not None:
            raise ValueError(
                f"T5MultiHeadAttention layer '{layer.name}' was called with a key/value cache (decoding): "
                "ghost clipping clips training steps, which run without a cache; call the model without "
                "one, or use clipping='vectorized' (the reference engine: an exact per-example loop)."
            )
        if position_bias is not None:  # a bias passed in: the layer does not read its table
            return original_call(inputs, mask=mask, key_value_states=key_value_states,
                                 position_bias=position_bias, **kwargs)
        keys = inputs if key_value_states is None else key_value_states
        query_length, key_length = _length(inputs), _length(keys)
        bias = layer.compute_bias(query_length, key_length)  # (1, H, Lq, Lk), the table's only read
        examples = inputs.shape[0] if inputs.shape[0] is not None else tf.shape(inputs)[0]
        tiled = tf.broadcast_to(bias, tf.stack([examples, tf.shape(bias)[1], tf.shape(bias)[2], tf.shape(bias)[3]]))
        tiled = tf.ensure_shape(tiled, [inputs.shape[0], *bias.shape[1:]])
        record(out=tiled, ids=bucket_ids(layer, query_length, key_length))
        position_bias = tiled
        if mask is not None:  # folded as the layer folds it when it computes the bias itself
            mask = keras.ops.expand_dims(mask, 1)
            position_bias = position_bias + (1.0 - keras.ops.cast(mask, position_bias.dtype)) * -1e9
        return original_call(inputs, mask=None, key_value_states=key_value_states, position_bias=position_bias,
                             **kwargs)

    def analyse(self, layer, calls):
        table = layer.relative_attention_bias
        rows, heads = (int(n) for n in table.shape)
        dtype = norm_dtype(calls[0]["g"].dtype)
        parts = []
        for c in calls:
            g = tf.cast(c["g"], dtype)  # (P, H, Lq, Lk)
            p = tf.shape(g)[0]
            pairs = tf.reshape(tf.transpose(g, [2, 3, 0, 1]), [-1, p, heads])  # (Lq·Lk, P, H)
            summed = tf.math.unsorted_segment_sum(pairs, tf.reshape(c["ids"], [-1]), rows)  # (N, P, H)
            parts.append(tf.transpose(summed, [1, 0, 2]))  # (P, N, H)
        per_example = tf.add_n(parts) if len(parts) > 1 else parts[0]

        def grads(scale):
            return [(table, weighted_sum(per_example, tf.cast(scale, dtype)))]

        return per_example_sq(per_example), grads


def _length(t):
    """The static size of axis 1 of ``t`` where known, else a scalar tensor."""
    return t.shape[1] if t.shape[1] is not None else tf.shape(t)[1]
