"""Ghost clipping of ``keras.layers.TimeDistributed`` over a layer that has a rule.

``TimeDistributed(inner)`` applies ``inner`` to each of the T slices ``x[:, t]`` of a
(P, T, ...) input. When ``inner`` acts on the trailing axes of its input only, with any
number of leading axes (Dense and Embedding, LayerNormalization over negative axes, RMS
scales, PReLU), that is the same as one call of ``inner`` on the whole (P, T, ...) tensor:
example i owns its T rows, so the T axis is one more position axis, and the inner
layer's own rule clips its weights from that call (e.g. for a Dense kernel, example i's
gradient is ``Σ_{t, positions} a_it g_itᵀ``). :class:`FoldedTimeDistributedRule` does
exactly that: its forward is the inner rule's forward on the unreshaped input, its
analysis the inner rule's analysis of the same records. Exact, no per-example re-run.

Any other inner layer (convolutions, recurrent layers, LoRA, custom layers) keeps
:class:`~keras_noisecurve.backend.tensorflow.engine_fallback.TimeDistributedRule`, the per-layer
fallback through the wrapper's call.
"""

from __future__ import annotations

import keras

from keras_noisecurve.backend.common import ghost_dense, ghost_norm, ghost_scale
from keras_noisecurve.backend.tensorflow.engine_forms import KernelRule, Rule

__all__ = ["FoldedTimeDistributedRule", "foldable"]

#: the rules whose forward and analysis take any number of leading position axes, in the
#: registry's order (the registry's earlier rules, e.g. LoRA, never take these layers'
#: configurations that these rules accept)
_POSITIONWISE = tuple(KernelRule(kernel, kind) for kernel, kind in (
    (ghost_dense.dense, "Dense"), (ghost_dense.embedding, "Embedding"), (ghost_scale.rms_scale, "RMS scale"),
    (ghost_scale.prelu, "PReLU"), (ghost_norm.layer_norm, "LayerNormalization"),
    (ghost_scale.computed_scale, "RMSNorm (by computation)")))


def foldable(rule, layer) -> bool:
    """Whether ``rule`` (the rule of ``layer``) clips ``layer`` exactly when called on a
    (P, T, ...) tensor in place of T calls on (P, ...) slices."""
    if getattr(rule, "kernel", None) is ghost_norm.layer_norm:  # axes counted from the end only
        axes = [layer.axis] if isinstance(layer.axis, int) else list(layer.axis)
        return all(a < 0 for a in axes)
    return any(getattr(rule, "kernel", None) is r.kernel for r in _POSITIONWISE)


def _inner_rule(layer):
    """The position-wise rule that takes ``layer``, or ``None``."""
    for rule in _POSITIONWISE:
        if rule.matches(layer) and not rule.check(layer):
            return rule
    return None


class FoldedTimeDistributedRule(Rule):
    """``TimeDistributed(inner)`` with ``inner`` a ``Dense``, ``Embedding``, ``LayerNormalization`` over
    negative axes, an RMS norm or ``PReLU``: the inner rule on the whole (P, T, ...) input, T one more
    position axis of each example."""

    kind = "TimeDistributed (folded)"
    covers_sublayers = True

    def matches(self, layer) -> bool:
        return isinstance(layer, keras.layers.TimeDistributed) and type(layer).call is keras.layers.TimeDistributed.call

    def expected_variables(self, layer):
        return list(layer.trainable_variables)

    def check(self, layer):
        inner = layer.layer
        if inner.trainable_variables and not inner.trainable:
            return "its inner layer is frozen"
        rule = _inner_rule(inner)
        if rule is None:
            return f"no position-wise rule for its inner {type(inner).__name__}"
        if not foldable(rule, inner):
            return f"the rule of its inner {type(inner).__name__} ({rule.kind}) is not position-wise"
        return None

    def forward(self, layer, original_call, record, inputs, training=None, mask=None):
        inner = layer.layer
        # one call on the (P, T, ...) input: the inner layer acts on its trailing axes only
        return _inner_rule(inner).forward(inner, inner.call, record, inputs)

    def analyse(self, layer, calls):
        inner = layer.layer
        return _inner_rule(inner).analyse(inner, calls)
