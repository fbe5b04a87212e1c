"""Ghost-clipping rules for layers recognised by what they compute, and for ``PReLU``.

- :class:`ComputedScaleRule` ("RMSNorm (by computation)"): a layer with ONE weight
  ``w`` of shape (d,) whose output is ``y = u(x) ⊙ (α + w)`` along the last axis
  (α = 0 or 1), with ``u`` not depending on ``w``: every RMS normalisation whatever its
  class name (KerasHub's Phi-3, Qwen, Qwen3, T5 norms; Llama, Mistral and Gemma's
  ``(1 + w)`` scale; a custom layer written the same way). The layer is recognised by
  :func:`probe_affine_scale`, once per layer and never inside a traced step: its call is
  run eagerly on a small random input with four random values of ``w`` (substituted
  through ``keras.StatelessScope``, the variable itself is never assigned), and ``y``
  must be elementwise affine in ``w`` with one slope ``u`` whatever ``w``, and one row
  per example. What the probe cannot decide (a call that needs other arguments, fails,
  is not affine such as ``x ⊙ w²``, mixes examples) stays on the per-layer fallback.
  At each step the rule records ``u(x) = ∂y/∂w`` (a forward-mode derivative with
  tangent 1 on ``w``, from a second, detached call of the layer: an output computed
  under a forward accumulator is not differentiated by an eager ``GradientTape``) and
  the output gradient ``g``; example i's gradient of ``w`` is ``Σ_positions g_i ⊙ u_i`` (d,).
- :class:`PReLURule`: ``keras.layers.PReLU``, ``y = relu(x) − α ⊙ relu(−x)``, so
  ``∂y/∂α = min(x, 0)`` and example i's gradient of ``α`` (shape ``input_shape[1:]``
  with 1 on the shared axes) is ``Σ_{shared axes} min(x_i, 0) ⊙ g_i``.

Both rules accept extra leading position axes in what they record (a
``TimeDistributed`` wrapper's T axis, :mod:`keras_noisecurve.backend.tensorflow.ghost_timedist`).
Shapes: P examples, d the width of the last axis.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_noisecurve import _compat
from keras_noisecurve.backend.common import affine_scale
from keras_noisecurve.backend.tensorflow.ghost_forms import Rule, norm_dtype, per_example_sq, weighted_sum

__all__ = ["ComputedScaleRule", "PReLURule", "probe_affine_scale"]

#: the probing input: PROBE_SHAPE + (d,), P = 2 examples of 3 positions
PROBE_SHAPE = affine_scale.PROBE_SHAPE


def _outputs(layer, weight, value, x):
    """The layer's output (float64 numpy) on ``x`` (float32) with ``weight`` read as ``value``."""
    with keras.StatelessScope(state_mapping=[(weight, tf.constant(value.astype(weight.dtype), dtype=weight.dtype))]):
        y = layer(x.astype("float32"))
    if isinstance(y, (list, tuple, dict)):
        raise TypeError("more than one output")
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(y, "float64")))


_PROBE = affine_scale.AffineScaleProbe(outputs=_outputs, scope=tf.init_scope)


def probe_affine_scale(layer) -> bool:
    """Whether ``layer`` computes ``y = u(x) ⊙ (α + w)`` with its one weight ``w`` (d,)
    along the last axis and ``u`` independent of ``w`` (cached per layer and weight).

    Runs the layer's call eagerly (under ``tf.init_scope``, so never inside a traced
    step) on a (2, 3, d) normal input with four random ``w`` (``keras.StatelessScope``:
    the variable keeps its value): with ``u = (y_a − y_b)/(a − b)`` elementwise, the
    other two outputs must be ``y_a + u ⊙ (w − a)`` to a tolerance of the compute dtype
    (relative 1e-4 float64/float32, 3e-2 float16/bfloat16, of the largest output), the
    output must have the input's shape, and example 0 alone must give the same rows.
    Any exception of the call counts as "no" (the per-layer fallback). The decision is
    :func:`keras_noisecurve.backend.common.affine_scale.affine_in_weight`, shared with the JAX engine.
    """
    return _PROBE(layer)


class ComputedScaleRule(Rule):
    """Any layer whose only weight w (d,) enters as ``y = u(x) ⊙ (α + w)`` (α = 0 or 1), recognised by
    probing its call once before training (RMS norms under any class name: Qwen, Qwen3, Phi-3, T5).

    Per example, ``G_i = Σ_positions g_i ⊙ u_i`` (d,) with ``u = ∂y/∂w`` recorded in
    the forward pass: the layer's call runs a second time, on its detached input, under a
    forward-mode accumulator with tangent 1 on ``w`` (an output computed under the
    accumulator is not differentiated by an eager ``GradientTape``, so the layer's own
    output comes from the first, ordinary call), and since ``y_k`` depends on ``w`` only
    through ``w_k``, the JVP is ``u`` itself. ``‖G_i‖²`` and ``Σ_i c_i·G_i`` follow.
    """

    kind = "RMSNorm (by computation)"

    def matches(self, layer) -> bool:
        return probe_affine_scale(layer)

    def weight(self, layer):
        return _compat.own_trainable_variables(layer)[0]

    def expected_variables(self, layer):
        return [self.weight(layer)]

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        weight = self.weight(layer)
        out = original_call(inputs, *args, **kwargs)
        # The slope from a second, detached call: an output computed under a forward
        # accumulator is not differentiated by the enclosing GradientTape when the step
        # runs eagerly (its gradient would come back as zeros: run_eagerly=True, the audit).
        primal = _compat.unautocast_variable(weight)  # not a fresh autocast copy (mixed precision)
        with tf.autodiff.ForwardAccumulator(primals=primal, tangents=tf.ones_like(primal)) as acc:
            detached = original_call(tf.stop_gradient(inputs), *args, **kwargs)
        slope = acc.jvp(detached)
        if slope is None:
            raise ValueError(f"{type(layer).__name__} layer '{layer.name}': its output does not depend on "
                             f"its weight '{weight.path}'.")
        record(out=out, slope=tf.stop_gradient(slope))
        return out

    def analyse(self, layer, calls):
        weight = self.weight(layer)
        dtype = norm_dtype(calls[0]["g"].dtype)
        d = int(weight.shape[0])
        per_example = tf.add_n([
            tf.reduce_sum(tf.reshape(tf.cast(c["g"], dtype) * tf.cast(c["slope"], dtype), [tf.shape(c["g"])[0], -1, d]),
                          axis=1)
            for c in calls
        ])

        def grads(scale):
            return [(weight, weighted_sum(per_example, tf.cast(scale, dtype)))]

        return per_example_sq(per_example), grads


class PReLURule(Rule):
    """``keras.layers.PReLU``: ``y = relu(x) − α ⊙ relu(−x)``, ``∂y/∂α = min(x, 0)``.

    ``α`` has the shape of one example's input with 1 on the ``shared_axes``; example i's
    gradient is ``Σ min(x_i, 0) ⊙ g_i`` over the shared axes (and over any extra leading
    position axes, e.g. a ``TimeDistributed`` T axis), shape ``α.shape``.
    """

    classes = (keras.layers.PReLU,)
    kind = "PReLU"

    def expected_variables(self, layer):
        return [layer.alpha]

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        out = original_call(inputs, *args, **kwargs)
        record(out=out, negative=tf.stop_gradient(tf.minimum(inputs, tf.zeros_like(inputs))))
        return out

    def analyse(self, layer, calls):
        alpha = layer.alpha
        shape = [int(n) for n in alpha.shape]
        dtype = norm_dtype(calls[0]["g"].dtype)
        parts = []
        for c in calls:
            t = tf.cast(c["g"], dtype) * tf.cast(c["negative"], dtype)  # (P, [T, …,] *input_shape)
            extra = t.shape.rank - 1 - len(shape)
            if extra > 0:  # leading position axes before one example's input axes
                t = tf.reduce_sum(t, axis=list(range(1, 1 + extra)))
            shared = [k + 1 for k, n in enumerate(shape) if n == 1 and t.shape[k + 1] != 1]
            if shared:
                t = tf.reduce_sum(t, axis=shared, keepdims=True)
            parts.append(t)
        per_example = tf.add_n(parts)

        def grads(scale):
            return [(alpha, tf.reshape(weighted_sum(per_example, tf.cast(scale, dtype)), shape))]

        return per_example_sq(per_example), grads
