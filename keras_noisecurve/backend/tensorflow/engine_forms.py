"""Tensor math shared by the ghost-clipping layer rules, and the rule interface.

Per-example squared norms of bilinear weight gradients (``sequence_sq_norms``: the forms of
``keras_noisecurve.backend.common.norm_forms``, shared with the JAX engine, chosen also for an unknown
sequence length), the
book-keeping sums that assemble the clipped gradient from the same (input,
output-gradient) pairs, and :class:`Rule`, the base class of this engine's own
rules (``ghost_t5``, ``ghost_timedist``, ``engine_fallback``; the contract is described in
:mod:`keras_noisecurve.backend.tensorflow.engine_rules`). Shapes: ``P`` examples, ``L``
positions. Only TensorFlow is imported here.
"""

from __future__ import annotations

import tensorflow as tf

from keras_noisecurve import _compat
from keras_noisecurve.backend.common import layer_classes, norm_forms


def norm_dtype(dtype) -> tf.DType:
    """float64 stays float64; everything else is computed in float32."""
    dtype = tf.as_dtype(dtype)
    return tf.float64 if dtype == tf.float64 else tf.float32


def sequence_sq_norms(a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """Per-example ``‖Σ_l a_il g_ilᵀ‖²_F`` (P,) without forming it when that is dearer:
    ``norm_forms.sequence_sq_norms`` (``a`` (P, L, d_in), ``g`` (P, L, d_out)) when the shapes
    are known; for an unknown L a ``tf.cond`` between its two forms, and the Gram form for an
    unknown width."""
    d_in, d_out = a.shape[-1], g.shape[-1]
    length = a.shape[1]
    if length == 1 or None not in (length, d_in, d_out):
        return norm_forms.sequence_sq_norms(a, g)
    if d_in is None or d_out is None:
        return norm_forms.gram_sq_norms(a, g)
    dyn = tf.shape(a)[1]
    return tf.cond(dyn * dyn < d_in * d_out, lambda: norm_forms.gram_sq_norms(a, g),
                   lambda: norm_forms.outer_sq_norms(a, g))


def concat_positions(tensors):
    return tensors[0] if len(tensors) == 1 else tf.concat(tensors, axis=1)


def sum_over(t: tf.Tensor, keep_axes) -> tf.Tensor:
    """Sum ``t`` over every axis except 0 and ``keep_axes`` (sorted, positive)."""
    axes = [k for k in range(1, t.shape.rank) if k not in keep_axes]
    return tf.reduce_sum(t, axis=axes) if axes else t


def per_example_sq(t: tf.Tensor) -> tf.Tensor:
    """Per-example sum of squares of a (P, ...) tensor."""
    return tf.reduce_sum(tf.square(tf.reshape(t, [tf.shape(t)[0], -1])), axis=1)


def bias_grad(g: tf.Tensor, bias_shape) -> tf.Tensor:
    """Per-example gradient of a bias broadcast-added to an output with gradient ``g``.

    ``bias_shape`` is right-aligned against ``g.shape[1:]``; axes where the bias is
    absent or has size 1 are summed. Returns (P, ...) (kept axes in order).
    """
    rank = g.shape.rank
    offset = rank - len(bias_shape)
    keep = []
    for k in range(1, rank):
        j = k - offset
        if j >= 0 and bias_shape[j] != 1:
            keep.append(k)
    return sum_over(g, keep)


def keep_rows(t: tf.Tensor, scale: tf.Tensor) -> tf.Tensor:
    """``t`` (P, ...) with the rows of the examples whose ``scale_i`` is exactly 0 set to 0.

    A row with scale 0 contributes 0 to every weighted sum over the batch; replacing it
    by ``tf.where`` (never by a product) keeps that exact when the row is not finite
    (0·inf = nan would otherwise reach every example's sum). The clipping engine gives a
    dropped example (non-finite loss or gradient) the scale 0; a finite row with scale 0
    contributed 0 before, so finite results are unchanged. A ``tf.cond`` skips the pass
    over ``t`` when no scale is 0.
    """
    keep = tf.not_equal(scale, tf.zeros_like(scale))

    def masked():
        return tf.where(tf.reshape(keep, [-1] + [1] * (t.shape.rank - 1)), t, tf.zeros_like(t))

    # no example dropped (the usual step): no pass over t
    return tf.cond(tf.reduce_all(keep), lambda: tf.identity(t), masked)


def scale_rows(t: tf.Tensor, scale: tf.Tensor) -> tf.Tensor:
    """``scale_i · t_i`` for a (P, ...) tensor, exactly 0 where ``scale_i == 0`` (:func:`keep_rows`)."""
    scaled = t * tf.reshape(tf.cast(scale, t.dtype), [-1] + [1] * (t.shape.rank - 1))
    return keep_rows(scaled, scale)


def scale_smaller(a: tf.Tensor, g: tf.Tensor, scale: tf.Tensor):
    """``(a, g)`` with the one of fewer entries per example multiplied by ``scale_i``.

    ``a`` (P, ...), ``g`` (P, ...), ``scale`` (P,). A bilinear weight gradient
    Σ_i (a_i ⊗ g_i) scaled per example is the same whichever factor carries the scale;
    scaling the smaller one is one cheaper pass (e.g. the first conv's 3-channel input
    rather than its 16-channel output gradient). The rows of examples with ``scale_i = 0``
    are exactly 0 in BOTH factors (:func:`keep_rows`), so a non-finite row of either
    factor cannot reach the contraction over the batch.
    """
    size_a, size_g = (t.shape[1:].num_elements() for t in (a, g))
    if size_a is not None and size_g is not None and size_a < size_g:
        return scale_rows(a, scale), keep_rows(g, scale)
    return keep_rows(a, scale), scale_rows(g, scale)


def weighted_outer(a: tf.Tensor, g: tf.Tensor, scale: tf.Tensor) -> tf.Tensor:
    """``Σ_i scale_i Σ_l a_il g_ilᵀ`` (d_in, d_out) from a (P, L, d_in), g (P, L, d_out);
    examples with ``scale_i = 0`` contribute exactly 0 (:func:`scale_smaller`)."""
    d_in, d_out = a.shape[-1], g.shape[-1]
    a, g = scale_smaller(a, g, scale)
    return tf.matmul(tf.reshape(a, [-1, d_in]), tf.reshape(g, [-1, d_out]), transpose_a=True)


def weighted_sum(per_example: tf.Tensor, scale: tf.Tensor) -> tf.Tensor:
    """``Σ_i scale_i · per_example_i`` for a (P, ...) tensor; rows with ``scale_i = 0``
    contribute exactly 0 even when not finite (:func:`keep_rows`). ``scale`` is cast to the
    gradients' dtype (a float32 layer in a model whose loss is float64)."""
    return tf.tensordot(tf.cast(scale, per_example.dtype), keep_rows(per_example, scale), axes=1)


def dims(t: tf.Tensor) -> list:
    """The shape of ``t``: static sizes where known, scalar tensors elsewhere."""
    dynamic = tf.shape(t)
    return [dynamic[k] if d is None else d for k, d in enumerate(t.shape.as_list())]


# ---------------------------------------------------------------------- rules


class Rule:
    classes: tuple = ()
    kind = ""
    #: True: the layer's sublayers' weights count as its own (e.g. an RNN's cell), and the
    #: sublayers are not planned separately
    covers_sublayers = False

    def variables(self, layer, trainable_ids):
        """The trainable variables this rule clips for ``layer``, among ``trainable_ids``."""
        source = layer.trainable_variables if self.covers_sublayers else _compat.own_trainable_variables(layer)
        return [v for v in source if id(v) in trainable_ids]

    def matches(self, layer) -> bool:
        return any(layer_classes.runs_call_of(layer, cls) for cls in self.classes)

    def expected_variables(self, layer):
        raise NotImplementedError

    def check(self, layer):
        if getattr(layer, "quantization_mode", None) is not None:
            return f"quantized ({layer.quantization_mode})"
        if getattr(layer, "lora_enabled", False):
            return "LoRA is enabled"
        expected = {id(v) for v in self.expected_variables(layer) if v is not None}
        extra = [v.path for v in _compat.own_trainable_variables(layer) if id(v) not in expected]
        if extra:
            return f"unexpected own trainable variables {extra}"
        return None



class KernelRule(Rule):
    """A backend-neutral kernel (``layer_rules.layer_kernel``, written in ``keras.ops``) in this
    engine: ``matches`` and ``check`` are the kernel's; ``forward`` records the call's first
    argument ``a``, its ``(args, kwargs)`` and its output (with ``pre_activation``, the output of
    the kernel's ``linear(layer, inputs)``, then the activation is applied to it; with
    ``forward``, its ``z`` and the detached ``saved`` of its ``after``); ``analyse`` runs the kernel
    on the recorded calls. A kernel of weights that live in sublayers (``sublayers``: an RNN's cell)
    covers them."""

    def __init__(self, kernel, kind=None):
        self.kernel = kernel
        self.classes = kernel.classes
        self.covers_sublayers = kernel.sublayers
        self.kind = kind or kernel.__name__

    def matches(self, layer) -> bool:
        return self.kernel.matches(layer)

    def expected_variables(self, layer):
        return self.kernel.weights(layer)

    def check(self, layer):
        return self.kernel.reason(layer)

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        args_kwargs = ((inputs, *args), kwargs)
        if self.kernel.forward is not None:
            z, after = self.kernel.forward(layer, original_call, inputs, *args, **kwargs)
            out, saved = after(z)
            saved = None if saved is None else {k: tf.stop_gradient(v) for k, v in saved.items()}
            record(out=z, a=inputs, args=args_kwargs, saved=saved)
            return out
        linear = self.kernel.pre_activation
        if linear:
            out = linear(layer, inputs)
            record(out=out, a=inputs, args=args_kwargs)
            return layer.activation(out) if layer.activation is not None else out
        out = original_call(inputs, *args, **kwargs)
        record(out=out, a=inputs, args=args_kwargs)
        return out

    def analyse(self, layer, calls):
        result = self.kernel(layer, [{"a": c["a"], "g": c["g"], "args": c.get("args"), "saved": c.get("saved")}
                                     for c in calls])
        if result is None:
            raise ValueError(f"{type(layer).__name__} layer '{layer.name}' is not supported by the {self.kind} "
                             "kernel in the configuration it was called in; use clipping='vectorized'")
        sq, sums = result
        variables = {id(v): v for v in self.expected_variables(layer) if v is not None}

        def grads(scale):
            return [(variables[key], grad) for key, grad in sums(scale, tf.not_equal(scale, 0)).items()]

        return sq, grads
