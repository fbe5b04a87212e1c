"""Per-layer rules for ghost (per-example) gradient norms.

Each rule knows, for one Keras 3 layer type with its own trainable weights,

1. ``check(layer)``: why the layer's configuration is not supported (``None`` if it is);
2. ``forward(layer, original_call, record, inputs, *args, **kwargs)``: the layer's
   forward computation, recording the tensor ``out`` whose gradient ``g`` is needed
   (the *pre-activation* output for layers with a fused ``activation=``) and the
   auxiliary tensors (input activation, token ids, normalised input) of that call;
3. ``analyse(layer, calls) -> (sq_norms, grads)``: from the recorded calls (each a
   dict with the recorded tensors and ``"g"``, the gradient of ``Σ_i w_i·loss_i``
   w.r.t. ``out``), the per-example squared norm (P,) of the gradient of the layer's
   own weights, and a function ``grads(scale)`` returning ``[(variable,
   Σ_i scale_i·∇_variable(w_i·loss_i))]``: with ``scale = c`` (the clip factors) this is
   the layer's part of the clipped sum, assembled from the same ``(a, g)`` as the
   norms ("book-keeping", Bu et al. 2022) instead of a second backward pass.

No per-example gradient of a weight is materialised unless it is the cheaper form
(see :func:`sequence_sq_norms`). A layer called several times (shared weights) has
its calls concatenated along the position axis: the per-example gradient of a weight
is the sum over calls and positions of the same outer products.

This module is the registry (:data:`RULES`, made from the table of both engines,
``keras_noisecurve.backend.common.layer_rules.BUILTIN``; :func:`find_rule`) and re-exports the
rules' public names: the shared math and :class:`Rule` live in ``engine_forms``, this engine's
own rules in ``ghost_t5`` (T5's relative-attention bias), ``ghost_timedist`` and ``engine_fallback``.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_noisecurve.backend.common import affine_scale, layer_rules
from keras_noisecurve.backend.tensorflow.engine_forms import KernelRule, Rule, sequence_sq_norms
from keras_noisecurve.backend.tensorflow.ghost_conv import CONV_CHUNK, conv_chunk, conv_sq_norms
from keras_noisecurve.backend.tensorflow.engine_fallback import GenericRule, RNNFallbackRule, TimeDistributedRule
from keras_noisecurve.backend.tensorflow.ghost_t5 import RelativeAttentionBiasRule
from keras_noisecurve.backend.tensorflow.ghost_timedist import FoldedTimeDistributedRule

__all__ = [
    "CONV_CHUNK", "RULES", "FoldedTimeDistributedRule", "GenericRule", "KernelRule",
    "RNNFallbackRule", "RelativeAttentionBiasRule", "Rule", "TimeDistributedRule",
    "conv_chunk", "conv_sq_norms", "find_rule", "probe_affine_scale", "register_rule", "sequence_sq_norms",
]

def _outputs(layer, weight, value, x):
    """The layer's output (float64 numpy) on ``x`` (float32) with ``weight`` read as ``value``."""
    with keras.StatelessScope(state_mapping=[(weight, tf.constant(value.astype(weight.dtype), dtype=weight.dtype))]):
        y = layer(x.astype("float32"))
    if isinstance(y, (list, tuple, dict)):
        raise TypeError("more than one output")
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(y, "float64")))


_PROBE = affine_scale.AffineScaleProbe(outputs=_outputs, scope=tf.init_scope)


def probe_affine_scale(layer) -> bool:
    """Whether ``layer`` computes ``y = u(x) ⊙ (α + w)`` with its one weight ``w`` (d,) along the
    last axis and ``u`` independent of ``w`` (cached per layer and weight): the layer's call runs
    eagerly (under ``tf.init_scope``, so never inside a traced step), as
    :class:`~keras_noisecurve.backend.common.affine_scale.AffineScaleProbe` says. Any exception of
    the call counts as "no" (the per-layer fallback)."""
    return _PROBE(layer)


def _builtin_rules():
    """The TensorFlow kernels of ``layer_rules.BUILTIN``, in its order, then the re-run fallback
    of the recurrent layers no rule takes (:class:`RNNFallbackRule`, this engine's own)."""
    rules = []
    for spec in layer_rules.BUILTIN:
        rule = spec.kernel("tensorflow")
        if rule is None:
            continue
        if not isinstance(rule, Rule):  # one kernel for every backend
            rule = KernelRule(rule, spec.kind)
        if rule.kind != spec.kind:  # a kernel reports its family's name (describe, the audit)
            raise RuntimeError(f"{type(rule).__name__}.kind is {rule.kind!r}; layer_rules.BUILTIN names it {spec.kind!r}")
        rules.append(rule)
    return (*rules, RNNFallbackRule())


#: The rules, tried in order: the TensorFlow kernels of ``keras_noisecurve.backend.common.layer_rules.BUILTIN``
#: (one table for both engines), then :class:`RNNFallbackRule`.
RULES = _builtin_rules()


#: rules added with :func:`register_rule`, tried before :data:`RULES`
_REGISTERED: list = []


def register_rule(rule) -> None:
    """Put ``rule`` before the built-in :data:`RULES`: a ``layer_rules.LayerRule`` (its TensorFlow
    kernel, with the rule's kind; one without is skipped: the fallback clips its layers here) or
    a :class:`Rule` instance for a layer class outside Keras.

    Registered rules are tried in the order they were registered; registering a rule of the
    same type and ``classes`` again is a no-op (a module that registers its rule at import may
    be reloaded).

    Raises:
      TypeError: ``rule`` is neither, or a ``LayerRule``'s TensorFlow kernel is not a :class:`Rule`.
      ValueError: the rule names no layer classes.
    """
    if isinstance(rule, layer_rules.LayerRule):
        spec, rule = rule, rule.kernel("tensorflow")
        if rule is None:
            return
        if spec.tensorflow is None and callable(getattr(rule, "reason", None)):  # one kernel for every backend
            rule = KernelRule(rule, spec.kind)
        if not isinstance(rule, Rule):
            raise TypeError(f"the tensorflow kernel of rule {spec.kind!r} must be a engine_rules.Rule instance, "
                            f"got {type(rule).__name__}")
        rule.kind = spec.kind
    if not isinstance(rule, Rule):
        raise TypeError(f"rule must be a LayerRule or a engine_rules.Rule instance, got {type(rule).__name__}")
    if not rule.classes and not isinstance(rule, KernelRule):
        raise ValueError(f"rule {type(rule).__name__} names no layer classes (its `classes` is empty)")
    if any(type(r) is type(rule) and r.classes == rule.classes and r.kind == rule.kind for r in _REGISTERED):
        return
    _REGISTERED.append(rule)


def find_rule(layer):
    """The first registered rule (:func:`register_rule`), then of :data:`RULES`, that matches
    ``layer`` and accepts its configuration (``check`` returns no reason), or ``None`` (the
    engine then uses :class:`GenericRule`)."""
    for rule in (*_REGISTERED, *RULES):
        if rule.matches(layer) and not rule.check(layer):
            return rule
    return None


def _rule_layers(rule) -> list:
    """The layer classes a rule names: its ``classes`` and the KerasHub classes it finds by
    module (``hub``, ``module``); empty when it matches by an ``isinstance`` of its own."""
    names = list(getattr(getattr(rule, "kernel", None), "layer_names", ())) or [cls.__name__ for cls in rule.classes]
    hub = getattr(rule, "hub", ())
    if hub and isinstance(hub[0], str):  # one (module, class name) pair
        hub = (hub,)
    for entry in hub:
        if isinstance(entry, (tuple, list)) and len(entry) >= 2 and isinstance(entry[1], str):
            names.append(entry[1])
    module = getattr(rule, "module", None)
    if module:
        names.append(f"{module.rsplit('.', 1)[-1].title().replace('_', '')} (KerasHub)")
    return list(dict.fromkeys(names))


def rule_table(*, registered: bool = True) -> list:
    """One row per rule the engine tries, in order (registered rules first, then
    :data:`RULES`; ``registered=False``: the built-in :data:`RULES` only, whatever modules
    registered their own): ``{"kind", "layers", "fallback", "summary"}``.

    ``kind`` is what :func:`~keras_noisecurve.backend.tensorflow.ghost.describe` reports for a layer the
    rule takes; ``layers`` the class names it names (empty: it matches by ``isinstance`` in its
    ``matches``, the summary says which); ``fallback`` True when the rule re-runs the layer per
    example (the per-layer fallback's cost); ``summary`` the first paragraph of its docstring.
    Documentation (docs/models.md) is rendered from this, so it follows the registry.
    """
    rows = []
    for rule in (*(_REGISTERED if registered else ()), *RULES):
        doc = ((rule.kernel if isinstance(rule, KernelRule) else type(rule)).__doc__ or "").strip().split("\n\n")[0]
        rows.append({
            "kind": rule.kind,
            "layers": _rule_layers(rule),
            "fallback": isinstance(rule, GenericRule),
            "summary": " ".join(doc.split()),
        })
    return rows
