"""The ghost-norm rules of both clipping engines, as one table (no framework import).

A rule is a :class:`LayerRule`: the name of a layer family (``kind``, what
``keras_noisecurve.training.describe`` reports for a layer it clips, the same on every backend)
and its kernel, given as a function of no arguments that returns it (so that a rule names its
kernel without importing it): one kernel for every backend (``common``), written in
``keras.ops`` and declared with :func:`layer_kernel`, or, where a family truly needs its
framework, one kernel per backend:

- ``tensorflow``: a ``keras_noisecurve.backend.tensorflow.engine_forms.Rule`` instance (which
  layers: ``matches``/``check``; what it records: ``forward``; the norms and the clipped sum:
  ``analyse``);
- ``jax``: a function ``rule(layer, calls) -> (sq, sums)`` or ``None`` (the contract of
  ``keras_noisecurve.backend.common.kernel_rules``).

A backend without a kernel clips the family's layers exactly with its per-layer fallback
(``"generic"``). :data:`BUILTIN` lists the built-in rules in the order both engines try them;
each engine makes its registry from it (TensorFlow's ``engine_rules``; JAX's, and any engine whose
kernels are functions, ``kernel_rules``), and ``register_rule`` puts a rule of
one's own before them. The table is also the documentation's list of rules
(:func:`table`), with a column per backend.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Callable, Optional

from keras_noisecurve import _compat
from keras_noisecurve.backend.common.layer_classes import runs_call_of

__all__ = ["BACKENDS", "BUILTIN", "GENERIC", "LayerRule", "group_norm_rule", "layer_kernel", "table"]

#: the backends a rule can have a kernel for
BACKENDS = ("tensorflow", "jax")

#: what ``describe`` reports for a layer clipped by the exact per-layer fallback, on every backend
GENERIC = "generic"


@dataclasses.dataclass(frozen=True)
class LayerRule:
    """One layer family's ghost-norm rule, with a kernel per backend.

    Args:
      kind: the family's name, what ``describe(model)`` reports for a layer the rule clips.
      tensorflow: a function of no arguments returning the TensorFlow engine's kernel (a
        ``Rule`` instance), or ``None`` (the fallback clips these layers on TensorFlow).
      jax: a function of no arguments returning the JAX engine's kernel (a function
        ``rule(layer, calls) -> (sq, sums)`` or ``None``), or ``None``.
      common: a function of no arguments returning the kernel of every backend that has no
        kernel of its own here: a function declared with :func:`layer_kernel`.

    Raises:
      TypeError / ValueError: ``kind`` is not a non-empty string other than ``"generic"``,
        a kernel is neither callable nor ``None``, or both are ``None``.
    """

    kind: str
    tensorflow: Optional[Callable[[], object]] = None
    jax: Optional[Callable[[], object]] = None
    common: Optional[Callable[[], object]] = None

    def __post_init__(self):
        if not isinstance(self.kind, str) or not self.kind.strip():
            raise TypeError(f"kind must be a non-empty string, got {self.kind!r}")
        if self.kind == GENERIC:
            raise ValueError(f"kind {GENERIC!r} names the per-layer fallback; give the rule a name of its own")
        for name in (*BACKENDS, "common"):
            factory = getattr(self, name)
            if factory is not None and not callable(factory):
                raise TypeError(f"{name} must be a function of no arguments returning the {name} kernel, "
                                f"or None; got {factory!r}")
        if all(getattr(self, name) is None for name in (*BACKENDS, "common")):
            raise ValueError(f"rule {self.kind!r} has no kernel: give common=, tensorflow=, jax= or both")

    def kernel(self, backend: str):
        """The kernel for ``backend`` (one of :data:`BACKENDS`; its factory is called now): the
        backend's own, else the ``common`` one, else ``None``."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        factory = getattr(self, backend) or self.common
        return None if factory is None else factory()


def layer_kernel(*classes, weights, matches=None, names=(), pre_activation=None, forward=None, lora: bool = False,
                 check=None, sublayers: bool = False):
    """Declare a backend-neutral ghost-norm kernel (written in ``keras.ops``) of the layers of
    ``classes`` that run the class's own ``call`` (or that ``matches``), not quantized, LoRA
    enabled if and only if ``lora``, with no trainable weight but ``weights``::

        @layer_kernel(keras.layers.Dense, weights=("kernel", "bias"), pre_activation=linear)
        def dense(layer, calls):
            ...
            return sq, sums

    The kernel takes the layer and its recorded ``calls`` (dicts: ``"a"`` the call's first
    positional argument (P, ...), ``"g"`` the gradient (P, ...) of ``Σ_i w_i·loss_i`` at its
    single output, ``"args"`` the call's ``(args, kwargs)``, ``"saved"`` what ``forward`` saved or
    ``None``) and returns ``(sq, sums)`` or ``None`` (the engine's exact per-layer fallback then
    clips the layer): ``sq`` (P,) the per-example squared norms of the gradient of the layer's
    weights, ``sums(c, keep=None)`` the dict ``{id(weight): Σ_i c_i·G_i}`` (``c`` (P,) clipping
    factors; ``keep`` (P,) bool, the examples whose rows enter the sum:
    :func:`~keras_noisecurve.backend.common.norm_forms.kept`).

    Args:
      classes: the layer classes (a layer running one of their own ``call``).
      weights: the attribute names of the weights the kernel clips, or a function
        ``weights(layer) -> list`` of them.
      matches: instead of ``classes``, a function ``matches(layer) -> bool`` (a class found by
        module name, a layer recognised by what it computes).
      names: class names the documentation lists besides ``classes``.
      pre_activation: ``None``, or a function ``linear(layer, x)``: the layer's call is
        ``layer.activation(linear(layer, x))`` and ``"g"`` is the gradient at ``linear(layer, x)``.
      forward: ``None``, or a function ``forward(layer, call, x, *args, **kwargs) -> (z, after)``
        that the engines run in place of ``call(x, ...)`` (``call`` the layer's own): ``"g"`` is
        then the gradient at ``z``, and ``after(z) -> (output, saved)`` gives the layer's output
        and the dict ``"saved"`` (detached; ``None``: nothing) of what the kernel would otherwise
        recompute from ``"a"`` (a norm's x̂, a recurrence's states). An engine runs the forward of
        the first kernel that takes the layer, and only that kernel reads its calls. It may get
        them with ``"saved"`` ``None`` (rows merged per user, an engine that does not run the
        forward): it then recomputes what it needs, or returns ``None`` (the fallback).
      lora: whether the kernel takes LoRA-enabled layers (and only those).
      check: ``check(layer)``: a reason the kernel refuses the layer's configuration, or
        ``None``; it is asked when a model is planned and again before each call.
      sublayers: the weights live in sublayers of the layer (an RNN's cell): every trainable
        weight under the layer counts as its own, and its sublayers are not clipped apart.

    The declared kernel has the attributes ``classes``, ``matches(layer)``, ``layer_names``,
    ``weights(layer)`` (the variables), ``pre_activation``, ``forward``, ``sublayers`` and
    ``reason(layer)`` (all these checks).

    Raises:
      TypeError: both or neither of ``classes`` and ``matches``, something else than classes in
        ``classes``, ``weights`` neither attribute names nor a function, ``matches``,
        ``pre_activation``, ``forward`` or ``check`` neither a function nor ``None``, or the
        decorated object not a function.
    """
    if bool(classes) == (matches is not None) or not all(isinstance(cls, type) for cls in classes):
        raise TypeError(f"layer_kernel takes one or more layer classes or matches=, not both; got classes "
                        f"{classes!r} and matches={matches!r}")
    if not callable(weights) and (isinstance(weights, str) or not isinstance(weights, (tuple, list)) or not weights
                                  or not all(isinstance(name, str) and name for name in weights)):
        raise TypeError(f"weights must be a tuple of the layer's weight attribute names, e.g. ('kernel', 'bias'), "
                        f"or a function weights(layer); got {weights!r}")
    for name, value in (("matches", matches), ("pre_activation", pre_activation), ("forward", forward),
                        ("check", check)):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be a function or None, got {value!r}")
    if callable(weights):
        variables = weights
    else:
        names_of = tuple(weights)

        def variables(layer):
            return [getattr(layer, name, None) for name in names_of]

    def matching(layer):
        return matches(layer) if matches is not None else any(runs_call_of(layer, cls) for cls in classes)

    def declare(function):
        if not callable(function):
            raise TypeError(f"layer_kernel decorates a function kernel(layer, calls), got {function!r}")

        def reason(layer):
            if not matching(layer):
                return (f"not one of {[cls.__name__ for cls in classes]} running its own call" if classes
                        else f"not a layer {function.__name__} takes")
            if getattr(layer, "quantization_mode", None) is not None:
                return f"quantized ({layer.quantization_mode})"
            if bool(getattr(layer, "lora_enabled", False)) != lora:
                return "LoRA is not enabled" if lora else "LoRA is enabled"
            refused = check(layer) if check is not None else None
            if refused:
                return refused
            expected = {id(v) for v in variables(layer)}
            present = layer.trainable_variables if sublayers else _compat.own_trainable_variables(layer)
            extra = [v.path for v in present if v.trainable and id(v) not in expected]
            return f"unexpected {'' if sublayers else 'own '}trainable variables {extra}" if extra else None

        @functools.wraps(function)
        def kernel(layer, calls):
            if reason(layer) is not None or not all(hasattr(c["a"], "shape") and hasattr(c["g"], "shape")
                                                    for c in calls):
                return None
            return function(layer, [{"saved": None, **c} for c in calls])

        kernel.classes, kernel.matches, kernel.weights, kernel.reason = classes, matching, variables, reason
        kernel.layer_names = (*(cls.__name__ for cls in classes), *names)
        kernel.pre_activation, kernel.forward, kernel.sublayers = pre_activation, forward, bool(sublayers)
        return kernel

    return declare


def _builtin(backend: str, module: str, name: str):
    """A factory of the built-in kernel ``keras_noisecurve.backend.<backend>.<module>.<name>`` (a
    class is instantiated)."""

    def factory():
        kernel = getattr(importlib.import_module(f"keras_noisecurve.backend.{backend}.{module}"), name)
        return kernel() if isinstance(kernel, type) else kernel

    factory.__qualname__ = f"{backend}.{module}.{name}"
    return factory


def group_norm_rule(kind: str, cls) -> LayerRule:
    """The rule of a group normalisation layer class ``cls`` of one's own that computes as
    ``keras.layers.GroupNormalization``: attributes ``groups``, ``epsilon``, ``gamma`` and ``beta``
    (per channel, either ``None``), channels along ``axis`` (last if it has none), mean and
    variance over the positions and each group's channels. ``kind``: the rule's name. Its kernel,
    for every backend, is ``backend.common.ghost_norm.grouped_norm(cls)``, made when the rule is
    registered."""

    def factory():
        return _builtin("common", "ghost_norm", "grouped_norm")()(cls)

    factory.__qualname__ = f"common.ghost_norm.grouped_norm({cls.__name__})"
    return LayerRule(kind, common=factory)


def _rule(kind, tensorflow=None, jax=None, common=None):
    return LayerRule(kind, tensorflow=tensorflow and _builtin("tensorflow", *tensorflow),
                     jax=jax and _builtin("jax", *jax), common=common and _builtin("common", *common))


#: The built-in rules, in the order the engines try them (the first that takes a layer clips
#: it). A family with no kernel on a backend is clipped by that backend's per-layer fallback.
BUILTIN = (
    _rule("LoRA", common=("ghost_lora", "lora")),
    _rule("EinsumDense", common=("ghost_dense", "einsum_dense")),
    _rule("Dense", common=("ghost_dense", "dense")),
    _rule("Embedding", common=("ghost_dense", "embedding")),
    _rule("ReversibleEmbedding", common=("ghost_embedding", "reversible_embedding")),
    _rule("PositionEmbedding", common=("ghost_embedding", "position_embedding")),
    _rule("RMS scale", common=("ghost_scale", "rms_scale")),
    _rule("T5 relative-attention bias", ("ghost_t5", "RelativeAttentionBiasRule")),
    _rule("PReLU", common=("ghost_scale", "prelu")),
    _rule("Conv", common=("ghost_conv", "conv")),
    _rule("GroupedConv", common=("ghost_conv", "grouped_conv")),
    _rule("Conv3D", common=("ghost_conv", "conv3d")),
    _rule("DepthwiseConv", common=("ghost_conv", "depthwise")),
    _rule("SeparableConv", common=("ghost_conv", "separable")),
    _rule("ConvTranspose", common=("ghost_conv", "conv_transpose")),
    _rule("LayerNormalization", common=("ghost_norm", "layer_norm")),
    _rule("GroupNormalization", common=("ghost_norm", "group_norm")),
    _rule("Recurrent", common=("ghost_rnn", "recurrent")),
    _rule("TimeDistributed (folded)", ("ghost_timedist", "FoldedTimeDistributedRule")),
    _rule("TimeDistributed", ("engine_fallback", "TimeDistributedRule")),
    _rule("RMSNorm (by computation)", common=("ghost_scale", "computed_scale")),
)


def table(rules=BUILTIN) -> list:
    """One row per rule, in order: ``{"kind", "tensorflow", "jax", "common"}``, each backend's
    entry ``True`` where the rule has a kernel for it (its own or the common one), ``common``
    ``True`` where one kernel serves every backend (no kernel is imported)."""
    return [{"kind": r.kind, **{name: getattr(r, name) is not None or r.common is not None for name in BACKENDS},
             "common": r.common is not None} for r in rules]
