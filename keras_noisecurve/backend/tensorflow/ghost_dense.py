"""Ghost-clipping rules for layers that multiply by a matrix or gather rows of one.

``Dense`` and ``EinsumDense`` (a batched dense map: every input axis contracted with
the kernel or carried to the output as a position) and ``Embedding``.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_noisecurve.backend.common import norm_forms
from keras_noisecurve.backend.common.geometry import parse_einsum
from keras_noisecurve.backend.tensorflow.ghost_forms import (
    Rule,
    bias_grad,
    concat_positions,
    norm_dtype,
    per_example_sq,
    scale_rows,
    sequence_sq_norms,
    weighted_outer,
    weighted_sum,
)


def token_sq_norms(ids: tf.Tensor, g: tf.Tensor, vocabulary: int) -> tf.Tensor:
    """Per-example squared norm (P,) of an embedding table's gradient, ``ids`` (P, L) integer
    token ids, ``g`` (P, L, d): ``norm_forms.token_sq_norms`` when L is known, else a
    ``tf.cond`` between its two forms."""
    if ids.shape[1] is not None:
        return norm_forms.token_sq_norms(ids, g, vocabulary)
    dyn = tf.shape(ids)[1]
    return tf.cond(dyn * dyn < vocabulary * g.shape[-1], lambda: norm_forms.token_gram_sq_norms(ids, g),
                   lambda: norm_forms.token_rows_sq_norms(ids, g, vocabulary))


class DenseRule(Rule):
    """``keras.layers.Dense`` on inputs of any rank ≥ 2 (positions = middle axes)."""

    classes = (keras.layers.Dense,)
    kind = "Dense"

    def expected_variables(self, layer):
        return [layer.kernel, layer.bias]

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        z = keras.ops.matmul(inputs, layer.kernel)
        if layer.bias is not None:
            z = keras.ops.add(z, layer.bias)
        record(out=z, a=inputs)
        return layer.activation(z) if layer.activation is not None else z

    def _sequence(self, layer, a, g):
        d_in, d_out = layer.kernel.shape
        p = tf.shape(a)[0]
        return tf.reshape(a, [p, -1, d_in]), tf.reshape(g, [p, -1, d_out])

    def _gathered(self, layer, calls):
        """(dtype, a, g): every call's input and output gradient as (P, positions, d) sequences."""
        dtype = norm_dtype(calls[0]["g"].dtype)
        pairs = [
            self._sequence(layer, tf.cast(tf.stop_gradient(c["a"]), dtype), tf.cast(c["g"], dtype))
            for c in calls
        ]
        return dtype, concat_positions([p[0] for p in pairs]), concat_positions([p[1] for p in pairs])

    def analyse(self, layer, calls):
        dtype, a, g = self._gathered(layer, calls)
        total = sequence_sq_norms(a, g)
        bias_grads = None
        if layer.bias is not None:
            bias_grads = tf.reduce_sum(g, axis=1)
            total += per_example_sq(bias_grads)

        def grads(scale):
            out = [(layer.kernel, weighted_outer(a, g, scale))]
            if bias_grads is not None:
                out.append((layer.bias, weighted_sum(bias_grads, scale)))
            return out

        return total, grads


def einsum_structure(equation: str, input_rank: int):
    """Classify the axes of an EinsumDense equation, or say why it is unsupported.

    Returns ``(structure, reason)``: ``structure`` is a dict with the example letter,
    position letters (input & output, not kernel), contracted letters (input &
    kernel) and kernel-output letters (kernel & output); ``reason`` is ``None`` when
    the equation is a batched dense map of that form, else a message.
    """
    try:
        inp, ker, out = parse_einsum(equation, input_rank)
    except ValueError as err:
        return None, str(err)
    example = inp[0]
    if not out or out[0] != example or example in ker:
        return None, f"equation {equation!r}: the first (example) axis must map to the first output axis"
    positions, contracted, kernel_out = [], [], []
    for c in inp[1:]:
        in_k, in_o = c in ker, c in out
        if in_k and not in_o:
            contracted.append(c)
        elif in_o and not in_k:
            positions.append(c)
        else:
            return None, f"equation {equation!r}: axis {c!r} is shared by input, kernel and output or summed away"
    for c in ker:
        if c in out and c not in inp:
            kernel_out.append(c)
        elif c not in inp:
            return None, f"equation {equation!r}: kernel axis {c!r} is summed away"
    return {
        "input": inp,
        "output": out,
        "example": example,
        "positions": positions,
        "contracted": contracted,
        "kernel_out": kernel_out,
    }, None


class EinsumDenseRule(DenseRule):
    """``keras.layers.EinsumDense`` whose equation is a batched dense map.

    Every input axis other than the first (examples) is either contracted with the
    kernel or carried to the output (a position); every kernel axis is contracted or
    an output axis. The MultiHeadAttention projections are of this form.
    """

    classes = (keras.layers.EinsumDense,)
    kind = "EinsumDense"

    def check(self, layer):
        return super().check(layer) or self.equation_reason(layer)

    def equation_reason(self, layer):
        """Why the layer's equation is not a batched dense map (``None`` if it is)."""
        try:
            rank = len(layer.input.shape)
        except Exception:  # unbuilt graph, shared layer, ...
            rank = None
        if rank is None:
            inp = layer.equation.split(",")[0]
            if "..." in inp:
                return None  # checked again at call time
            rank = len(inp)
        _, reason = einsum_structure(layer.equation, rank)
        return reason

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        z = keras.ops.einsum(layer.equation, inputs, layer.kernel)
        if layer.bias is not None:
            z = keras.ops.add(z, layer.bias)
        record(out=z, a=inputs)
        return layer.activation(z) if layer.activation is not None else z

    def _sequence(self, layer, a, g):
        st, reason = einsum_structure(layer.equation, a.shape.rank)
        if reason:
            raise ValueError(f"EinsumDense layer '{layer.name}' is not supported by ghost clipping: {reason}")
        inp, out = st["input"], st["output"]
        a_perm = [inp.index(c) for c in [st["example"], *st["positions"], *st["contracted"]]]
        g_perm = [out.index(c) for c in [st["example"], *st["positions"], *st["kernel_out"]]]
        a = tf.transpose(a, a_perm)
        g = tf.transpose(g, g_perm)
        kshape = dict(zip(layer.equation.split("->")[0].split(",")[1], layer.kernel.shape))
        d_in = 1
        for c in st["contracted"]:
            d_in *= kshape[c]
        d_out = 1
        for c in st["kernel_out"]:
            d_out *= kshape[c]
        p = tf.shape(a)[0]
        return tf.reshape(a, [p, -1, d_in]), tf.reshape(g, [p, -1, d_out])

    def analyse(self, layer, calls):
        dtype, a, g = self._gathered(layer, calls)
        total = sequence_sq_norms(a, g)
        bias_grads = None
        if layer.bias is not None:
            bias_grads = tf.add_n(
                [bias_grad(tf.cast(c["g"], dtype), tuple(layer.bias.shape)) for c in calls]
            )
            total += per_example_sq(bias_grads)

        def grads(scale):
            st, _ = einsum_structure(layer.equation, calls[0]["a"].shape.rank)
            ker_spec = layer.equation.split("->")[0].split(",")[1]
            order = [*st["contracted"], *st["kernel_out"]]
            sizes = dict(zip(ker_spec, layer.kernel.shape))
            kernel = tf.reshape(weighted_outer(a, g, scale), [sizes[c] for c in order])
            out = [(layer.kernel, tf.transpose(kernel, [order.index(c) for c in ker_spec]))]
            if bias_grads is not None:  # a bias with size-1 axes, e.g. (1, d), keeps its shape
                out.append((layer.bias, tf.reshape(weighted_sum(bias_grads, scale), layer.bias.shape)))
            return out

        return total, grads


class EmbeddingRule(Rule):
    """``keras.layers.Embedding``: rows of the table are gathered by token id."""

    classes = (keras.layers.Embedding,)
    kind = "Embedding"

    def expected_variables(self, layer):
        return [layer.embeddings]

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        out = original_call(inputs, *args, **kwargs)
        record(out=out, ids=inputs)
        return out

    def analyse(self, layer, calls):
        dtype = norm_dtype(calls[0]["g"].dtype)
        vocabulary, d = layer.embeddings.shape
        ids, gs = [], []
        for c in calls:
            p = tf.shape(c["g"])[0]
            ids.append(tf.reshape(tf.cast(c["ids"], tf.int64), [p, -1]))
            gs.append(tf.reshape(tf.cast(c["g"], dtype), [p, -1, d]))
        ids, g = concat_positions(ids), concat_positions(gs)
        total = token_sq_norms(ids, g, int(vocabulary))

        def grads(scale):
            rows = tf.reshape(scale_rows(g, scale), [-1, d])  # a row with scale 0 is exactly 0
            table = tf.math.unsorted_segment_sum(rows, tf.reshape(ids, [-1]), int(vocabulary))
            return [(layer.embeddings, table)]

        return total, grads

