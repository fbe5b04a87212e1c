"""The rule registry of an engine whose kernels are functions (``layer_rules.layer_kernel``), written
once in ``keras.ops``: the JAX engine's (:mod:`keras_noisecurve.backend.jax.ghost`), and a new backend's.
It gives the kernels of ``layer_rules.BUILTIN`` for the backend in use, in the order they are tried,
with the rules registered by :func:`register_rule` before them: per-example squared gradient norms and
the clipped sum of one layer's weights from its recorded input ``a`` and the gradient ``g`` at its
output, without forming per-example weight gradients (where that is cheaper).

Notation: P examples; a call's input ``a`` (P, ..., d_in) and output gradient ``g``
(P, ..., d_out), ``g = ∂(Σ_i w_i·loss_i)/∂z`` with ``z`` the layer's (pre-activation)
output; ``c`` (P,) the clipping factors ``min(1, ζ/‖w_i·∇loss_i‖)``. A layer called
several times (a shared layer) has its calls' positions concatenated: its per-example
gradient is the sum over all its calls.

Each rule is a function ``rule(layer, calls) -> (sq, sums)`` or ``None`` (the engine then uses the
exact per-layer fallback): ``sq`` (P,) float32 per-example squared norms of the gradient of the
layer's own weights, ``sums(c, keep=None)`` a dict ``{id(variable): Σ_i c_i·G_i}`` (with ``keep``
(P,) bool: the rows of examples not kept zeroed first, ``norm_forms.kept``). ``calls`` is a list of
dicts with ``"a"`` (the first positional argument of ``call``) and ``"g"`` (the gradient at the
call's single output), and ``"args"``, the call's ``(args, kwargs)`` as recorded; a rule runs under a
``keras.StatelessScope`` mapping every model variable to its traced value (``variable.value`` is the
step's value, read at rule time).

One module per layer family, written once in ``backend/common/``: ``ghost_dense`` (Dense,
EinsumDense, Embedding), ``ghost_norm`` (LayerNormalization, GroupNormalization), ``ghost_conv``
(convolutions; its windows and filter gradients from the backend's ``ghost_conv`` or
``backend/common/defaults/ghost_conv``), ``ghost_lora`` (LoRA-enabled Dense and EinsumDense),
``ghost_embedding`` (KerasHub's embeddings), ``ghost_scale`` (RMS-type norms, recognised by what they
compute: :func:`affine_scale_probe`), ``ghost_rnn`` (recurrent layers). A kernel with a ``forward``
(:func:`forward_of`) has it run in place of the layer's call while the step is recorded: its ``"g"``
is the gradient at the forward's ``z``, its ``"saved"`` what the forward saved.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_noisecurve import backend
from keras_noisecurve.backend.common import affine_scale, layer_rules
from keras_noisecurve.backend.common.layer_classes import runs_call_of
from keras_noisecurve.backend.common.ghost_conv import PRE_ACTIVATION

__all__ = ["RULES", "affine_scale_probe", "find_rule", "forward_of", "is_registered", "register_rule", "rule_table",
           "uses_pre_activation"]


def _outputs(layer, weight, value, x):
    """The layer's output (float64 numpy) on ``x`` in its compute dtype, ``weight`` read as ``value``."""
    mapping = [(weight, keras.ops.convert_to_tensor(value, dtype=weight.dtype))]
    with keras.StatelessScope(state_mapping=mapping):
        y = layer.call(keras.ops.convert_to_tensor(x, dtype=layer.compute_dtype))
    if not hasattr(y, "shape"):
        raise TypeError("not one array output")
    return np.asarray(keras.ops.convert_to_numpy(y), np.float64)


def affine_scale_probe(*, scope):
    """The backend's ``probe_affine_scale(layer) -> bool``: whether ``layer`` computes
    ``y = u(x) ⊙ (α + w)`` with its one weight ``w`` (d,) along the last axis and ``u`` independent of
    ``w`` (cached per layer and weight), as
    :class:`~keras_noisecurve.backend.common.affine_scale.AffineScaleProbe` says; the layer's ``call``
    runs on concrete arrays under ``scope()``, a context manager factory that keeps it out of a traced
    step (JAX: ``jax.ensure_compile_time_eval``; a backend that runs eagerly:
    ``contextlib.nullcontext``). Any exception of the call counts as "no" (the per-layer fallback)."""
    return affine_scale.AffineScaleProbe(outputs=_outputs, scope=scope)


def uses_pre_activation(layer) -> bool:
    """Whether the engine records ``layer``'s output before its fused activation (Dense and
    EinsumDense running their class's ``call``, ``ghost_conv.PRE_ACTIVATION`` of exact type: their
    ``call`` is ``activation(linear(x))``; LoRA-enabled or not, not quantized)."""
    return ((type(layer) in PRE_ACTIVATION or any(runs_call_of(layer, cls) for cls in _LINEAR))
            and getattr(layer, "quantization_mode", None) is None)


_LINEAR = (keras.layers.Dense, keras.layers.EinsumDense)


def _builtin(name):
    kernels = ((spec.kind, spec.kernel(name)) for spec in layer_rules.BUILTIN)
    return tuple((kind, kernel) for kind, kernel in kernels if kernel is not None)


#: The built-in rules with a kernel for the backend in use, ``(kind, function)`` in the order of
#: ``layer_rules.BUILTIN``; the first that returns a result is used. Made for the backend in use when
#: this module is first imported; an engine whose kernels are functions uses it (JAX's; TensorFlow's
#: engine has its own registry, ``backend/tensorflow/engine_rules.py``, whose kernels are ``Rule``
#: instances).
RULES = _builtin(backend.name())


_REGISTERED: list = []  # (kind, function, key)


def register_rule(rule) -> None:
    """Put ``rule`` before the built-in :data:`RULES`: a ``layer_rules.LayerRule`` (its kernel for the backend in use;
    one without is skipped: the fallback clips its layers here), or a function
    ``rule(layer, calls) -> (sq, sums)`` or ``None`` (the contract above; its kind is its name).
    Registered rules are tried in the order they were registered; registering a rule of the same
    kind (a ``LayerRule``) or the same function (module and qualified name) again replaces it, so a
    module that registers its rule at import may be reloaded.

    Raises:
      TypeError: ``rule`` is neither.
    """
    if isinstance(rule, layer_rules.LayerRule):
        function = rule.kernel(backend.name())
        if function is None:
            return
        if not callable(function):
            raise TypeError(f"the {backend.name()} kernel of rule {rule.kind!r} must be a function rule(layer, calls), "
                            f"got {function!r}")
        kind, key = rule.kind, ("kind", rule.kind)
    elif callable(rule) and hasattr(rule, "__name__"):
        function, kind = rule, rule.__name__
        key = (getattr(rule, "__module__", None), getattr(rule, "__qualname__", rule.__name__))
    else:
        raise TypeError(f"rule must be a LayerRule or a function rule(layer, calls) -> (sq, sums) or None, "
                        f"got {rule!r}")
    _REGISTERED[:] = [entry for entry in _REGISTERED if entry[2] != key]
    _REGISTERED.append((kind, function, key))


def is_registered(kind: str) -> bool:
    """Whether a rule registered by :func:`register_rule` has the kind ``kind`` (then a layer of
    that kind may be clipped by a user's kernel, not the library's)."""
    return any(k == kind for k, _, _ in _REGISTERED)


def _rules():
    return (*((k, f) for k, f, _ in _REGISTERED), *RULES)


def forward_of(layer):
    """The ``forward`` of the first kernel (``layer_rules.layer_kernel``, registered ones first) that
    takes ``layer``, or ``None`` (no kernel takes it, or it has no forward)."""
    for _, rule in _rules():
        reason = getattr(rule, "reason", None)  # a function rule of one's own has none: asked later
        if reason is not None and reason(layer) is None:
            return rule.forward
    return None


def _at_outputs(calls):
    """The calls as a function rule of one's own reads them: ``"g"`` at the layer's one output, also
    where a kernel's forward recorded them (``"g_out"``), nothing saved; ``None`` for several outputs."""
    if any("g_out" in c and c["g_out"] is None for c in calls):
        return None
    return [{"a": c["a"], "g": c.get("g_out", c["g"]), "args": c.get("args"), "saved": None} for c in calls]


def find_rule(layer, calls):
    """``(kind, (sq, sums))`` of the first rule, registered (:func:`register_rule`) then built in,
    that handles ``layer``'s calls, else ``None``. The kernel whose forward recorded the calls
    (:func:`forward_of`) is the last one asked: no other kernel reads its ``z``."""
    for kind, rule in _rules():
        declared = hasattr(rule, "reason")
        asked = calls if declared else _at_outputs(calls)
        result = None if asked is None else rule(layer, asked)
        if result is not None:
            return kind, result
        if declared and rule.forward is not None and rule.reason(layer) is None:
            return None
    return None


def rule_table(*, registered: bool = True) -> list:
    """One row per rule the engine tries, in order (registered rules first; ``registered=False``:
    the built-in :data:`RULES` only): ``{"kind", "summary"}``, ``kind`` what
    the backend's ``ghost.describe`` reports for a layer the rule takes,
    ``summary`` the first paragraph of its function's docstring."""
    rows = []
    for kind, rule in (*((k, f) for k, f, _ in (_REGISTERED if registered else ())), *RULES):
        doc = (rule.__doc__ or "").strip().split("\n\n")[0]
        rows.append({"kind": kind, "summary": " ".join(doc.split())})
    return rows
