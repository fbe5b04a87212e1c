"""Ghost-clipping rules for per-example normalisation layers (scale ``gamma``, offset ``beta``).

``LayerNormalization`` and ``GroupNormalization``; BatchNormalization mixes examples and
has no rule. Another channels-last group normalisation class gets its rule from
:func:`grouped_norm_rule` (``keras_noisecurve.backend.common.layer_rules.group_norm_rule``, as the
bundled ``keras_noisecurve.apps.layers.GroupNorm`` does), a subclass of :class:`GroupNormalizationRule`.
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf

from keras_noisecurve.backend.common import norm_forms
from keras_noisecurve.backend.tensorflow.ghost_forms import Rule, norm_dtype, per_example_sq, weighted_sum


class _NormalizationRule(Rule):
    """Scale ``gamma`` and offset ``beta`` of a per-example normalisation.

    The per-example gradients are ``Σ_positions g ⊙ x̂`` (gamma) and ``Σ_positions g``
    (beta) per parameter entry (``norm_forms.scale_offset_grads``, shared with the JAX
    engine), with x̂ the normalised input computed in this rule's forward.
    """

    def expected_variables(self, layer):
        return [layer.gamma, layer.beta]

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        # x̂ is computed once (differentiably) and reused by the norms: out = x̂·γ + β,
        # the layer's own output up to round-off (first derivatives identical).
        xhat = self.normalised(layer, inputs)
        rank = xhat.shape.rank
        shape = [1] * rank
        for axis in self.param_axes(layer, rank):
            shape[axis] = xhat.shape[axis]
        out = xhat
        if layer.gamma is not None:
            out = out * tf.reshape(tf.cast(layer.gamma, xhat.dtype), shape)
        if layer.beta is not None:
            out = out + tf.reshape(tf.cast(layer.beta, xhat.dtype), shape)
        out = tf.cast(out, layer.compute_dtype)
        record(out=out, xhat=tf.stop_gradient(xhat))
        return out

    def param_axes(self, layer, rank):
        raise NotImplementedError

    def analyse(self, layer, calls):
        dtype = norm_dtype(calls[0]["g"].dtype)
        gamma_grads, beta_grads = [], []
        for c in calls:
            g = tf.cast(c["g"], dtype)
            gamma, beta = norm_forms.scale_offset_grads(tf.cast(c["xhat"], dtype), g,
                                                        self.param_axes(layer, g.shape.rank))
            gamma_grads.append(gamma)
            beta_grads.append(beta)
        total = 0.0
        per_example = []
        if layer.gamma is not None:
            per_example.append((layer.gamma, tf.add_n(gamma_grads)))
        if layer.beta is not None:
            per_example.append((layer.beta, tf.add_n(beta_grads)))
        for _, grad in per_example:
            total += per_example_sq(grad)

        def grads(scale):
            return [(v, tf.reshape(weighted_sum(grad, scale), v.shape)) for v, grad in per_example]

        return total, grads


def _positive_axes(axis, rank):
    axes = [axis] if isinstance(axis, int) else list(axis)
    return sorted(a % rank for a in axes)


class LayerNormalizationRule(_NormalizationRule):
    """``keras.layers.LayerNormalization`` (also ``rms_scaling=True``)."""

    classes = (keras.layers.LayerNormalization,)
    kind = "LayerNormalization"

    def check(self, layer):
        reason = super().check(layer)
        if reason:
            return reason
        axes = [layer.axis] if isinstance(layer.axis, int) else list(layer.axis)
        if any(a == 0 for a in axes):
            return "normalises over the example axis 0 (mixes examples)"
        return None

    def param_axes(self, layer, rank):
        return _positive_axes(layer.axis, rank)

    def normalised(self, layer, inputs):
        compute = tf.float64 if tf.as_dtype(inputs.dtype) == tf.float64 else tf.float32
        x = tf.cast(inputs, compute)
        axes = _positive_axes(layer.axis, x.shape.rank)
        if 0 in axes:
            raise ValueError(f"LayerNormalization '{layer.name}' normalises over the example axis.")
        return norm_forms.layer_norm_hat(x, axes, layer.epsilon, rms=layer.rms_scaling)


class _ChannelsLastGroupsRule(_NormalizationRule):
    """Group normalisation over the LAST axis (channels), with a cheaper forward/backward.

    The forward is ``out = x·s + t`` with ``s = γ·inv``, ``t = β − μ·s`` per example and
    group (inv = 1/√(var + ε)): two passes over x, as Keras' own layer, instead of
    forming x̂ = (x − μ)·inv differentiably (whose backward needs two more reductions
    over x). The norms do not need x̂ either: per example and channel c of group k,
    ``∇γ_c = Σ_s g_sc x̂_sc = inv_k·(Σ_s g_sc x_sc − μ_k·Σ_s g_sc)`` and ``∇β_c = Σ_s g_sc``
    (s: positions). Layers normalising another axis use the generic rule.
    """

    def channels_last(self, layer, rank) -> bool:
        return self.param_axes(layer, rank) == [rank - 1]

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        rank = inputs.shape.rank
        if rank is None or rank < 2 or not self.channels_last(layer, rank):
            return super().forward(layer, original_call, record, inputs, *args, **kwargs)
        compute = tf.float64 if tf.as_dtype(inputs.dtype) == tf.float64 else tf.float32
        grouped, mean, inv = self.group_stats(layer, tf.cast(inputs, compute))
        groups, width = grouped.shape[-2], grouped.shape[-1]
        scale = inv if layer.gamma is None else inv * tf.reshape(tf.cast(layer.gamma, compute), [groups, width])
        shift = -mean * scale
        if layer.beta is not None:
            shift += tf.reshape(tf.cast(layer.beta, compute), [groups, width])
        out = tf.reshape(grouped * scale + shift, tf.shape(inputs))
        out = tf.cast(out, layer.compute_dtype)
        record(out=out, x=tf.stop_gradient(grouped), mean=tf.stop_gradient(mean), inv=tf.stop_gradient(inv))
        return out

    def group_stats(self, layer, x):
        """x (P, ..., C) → grouped (P, ..., G, C/G), mean and inv (P, 1…1, G, 1)."""
        static = x.shape.as_list()
        channels = static[-1]
        spatial = [tf.shape(x)[k] if static[k] is None else static[k] for k in range(1, len(static) - 1)]
        grouped = tf.reshape(x, [-1, *spatial, layer.groups, channels // layer.groups])
        axes = [*range(1, len(spatial) + 1), len(spatial) + 2]
        mean, variance = self.moments(grouped, axes)
        return grouped, mean, tf.math.rsqrt(variance + layer.epsilon)

    def moments(self, grouped, axes):
        return tf.nn.moments(grouped, axes=axes, keepdims=True)

    def analyse(self, layer, calls):
        if "xhat" in calls[0]:
            return super().analyse(layer, calls)
        dtype = norm_dtype(calls[0]["g"].dtype)
        gamma_grads, beta_grads = [], []
        for c in calls:
            x = tf.cast(c["x"], dtype)
            g = tf.reshape(tf.cast(c["g"], dtype), tf.shape(x))
            positions = list(range(1, x.shape.rank - 2))
            g_sum = tf.reduce_sum(g, axis=positions) if positions else g  # (P, G, C/G)
            beta_grads.append(g_sum)
            if layer.gamma is not None:
                gx = tf.reduce_sum(g * x, axis=positions) if positions else g * x
                mean = tf.reshape(tf.cast(c["mean"], dtype), [-1, x.shape[-2], 1])
                inv = tf.reshape(tf.cast(c["inv"], dtype), [-1, x.shape[-2], 1])
                gamma_grads.append(inv * (gx - mean * g_sum))
        per_example = []
        if layer.gamma is not None:
            per_example.append((layer.gamma, tf.reshape(tf.add_n(gamma_grads), [-1, layer.gamma.shape[0]])))
        if layer.beta is not None:
            per_example.append((layer.beta, tf.reshape(tf.add_n(beta_grads), [-1, layer.beta.shape[0]])))
        total = tf.add_n([per_example_sq(grad) for _, grad in per_example]) if per_example else 0.0

        def grads(scale):
            return [(v, tf.reshape(weighted_sum(grad, scale), v.shape)) for v, grad in per_example]

        return total, grads


class GroupNormalizationRule(_ChannelsLastGroupsRule):
    """``keras.layers.GroupNormalization`` (groups along ``axis``, one gamma per channel)."""

    classes = (keras.layers.GroupNormalization,)
    kind = "GroupNormalization"

    def param_axes(self, layer, rank):
        return [layer.axis % rank]

    def normalised(self, layer, inputs):
        compute = tf.float64 if tf.as_dtype(inputs.dtype) == tf.float64 else tf.float32
        x = tf.cast(inputs, compute)
        rank = x.shape.rank
        axis = layer.axis % rank
        if axis == 0:
            raise ValueError(f"GroupNormalization '{layer.name}' groups along the example axis.")
        shape = tf.shape(x)
        static = x.shape.as_list()
        group_shape = [shape[k] if static[k] is None else static[k] for k in range(rank)]
        channels = group_shape[axis]
        group_shape[0] = -1
        group_shape[axis] = channels // layer.groups
        group_shape.insert(axis, layer.groups)
        grouped = tf.reshape(x, group_shape)
        reduce_axes = [k for k in range(1, rank + 1) if k != axis]
        mean, variance = tf.nn.moments(grouped, axes=reduce_axes, keepdims=True)
        xhat = (grouped - mean) * tf.math.rsqrt(variance + layer.epsilon)
        return tf.reshape(xhat, shape)


@functools.lru_cache(maxsize=None)
def _grouped_rule_class(cls, name: str) -> type:
    """The rule class of :func:`grouped_norm_rule` (one per layer class and name, so that a rule
    registered again is the same rule)."""

    class Grouped(GroupNormalizationRule):
        """Ghost-norm rule of a group normalisation over the channels (last axis), as
        ``keras.layers.GroupNormalization`` computes it: ``(x − mean_g) / sqrt(var_g + ε)`` over the
        positions and the channels of each group; ``gamma``/``beta`` per channel."""

        kind = name
        classes = (cls,)

        def param_axes(self, layer, rank):
            return [rank - 1]

        def normalised(self, layer, inputs):
            x = inputs if keras.backend.standardize_dtype(inputs.dtype) == "float64" else keras.ops.cast(
                inputs, "float32")
            channels = x.shape[-1]
            spatial = list(x.shape[1:-1])
            grouped = keras.ops.reshape(x, [-1, *spatial, layer.groups, channels // layer.groups])
            axes = tuple(range(1, len(spatial) + 1)) + (len(spatial) + 2,)
            mean = keras.ops.mean(grouped, axis=axes, keepdims=True)
            centred = grouped - mean
            var = keras.ops.mean(centred * centred, axis=axes, keepdims=True)
            return keras.ops.reshape(centred / keras.ops.sqrt(var + layer.epsilon), keras.ops.shape(x))

    Grouped.__name__ = Grouped.__qualname__ = f"{cls.__name__}Rule"
    return Grouped


def grouped_norm_rule(cls, *, name: str):
    """The rule of a group normalisation layer class ``cls`` (exact type; a subclass is not
    taken): channels on the last axis, ``layer.groups`` groups, mean and variance over the
    positions and each group's channels, ``layer.epsilon``, and ``gamma``/``beta`` per channel
    (either may be ``None``), as ``keras.layers.GroupNormalization`` computes. ``name``: the
    rule's kind (what ``describe`` reports). The JAX engine's function of the same name takes the
    same arguments."""
    return _grouped_rule_class(cls, name)()
