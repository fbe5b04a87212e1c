"""The ghost-norm rules of the JAX clipping engine (:mod:`keras_noisecurve.backend.jax.ghost`), in the
order they are tried: per-example squared gradient norms and the clipped sum of one layer's weights
from its recorded input ``a`` and the gradient ``g`` at its output, without forming per-example
weight gradients (where that is cheaper).

Notation: P examples; a call's input ``a`` (P, ..., d_in) and output gradient ``g``
(P, ..., d_out), ``g = ∂(Σ_i w_i·loss_i)/∂z`` with ``z`` the layer's (pre-activation)
output; ``c`` (P,) the clipping factors ``min(1, ζ/‖w_i·∇loss_i‖)``. A layer called
several times (a shared layer) has its calls' positions concatenated: its per-example
gradient is the sum over all its calls.

Each rule is a function ``rule(layer, calls) -> (sq, sums)`` or ``None`` (the engine then
uses the exact per-layer fallback): ``sq`` (P,) float32 per-example squared norms of the
gradient of the layer's own weights, ``sums(c, keep=None)`` a dict ``{id(variable): Σ_i c_i·G_i}``
(with ``keep`` (P,) bool: the rows of examples not kept zeroed first, see :func:`kept`).
``calls`` is a list of dicts with ``"a"`` (the first positional argument of ``call``) and
``"g"`` (the gradient at the call's single output), and ``"args"``, the call's ``(args, kwargs)`` as
recorded; a rule runs under a ``keras.StatelessScope`` mapping every model variable to its traced
value (``variable.value`` is the step's value, read at rule time).

One module per layer family, named as the TensorFlow engine's (``backend/tensorflow/``):
``ghost_dense`` (Dense, EinsumDense, Embedding), ``ghost_norm`` (LayerNormalization,
GroupNormalization), ``ghost_conv`` (convolutions), ``ghost_lora`` (LoRA-enabled Dense and
EinsumDense), ``ghost_embedding`` (KerasHub's embeddings), ``ghost_scale`` (RMS-type norms,
recognised by what they compute), ``ghost_rnn`` (recurrent layers).
"""

from __future__ import annotations

import keras

from keras_noisecurve.backend.jax.ghost_conv import CONV_RULES, PRE_ACTIVATION
from keras_noisecurve.backend.jax.ghost_dense import DENSE_RULES
from keras_noisecurve.backend.jax.ghost_embedding import position_embedding_rule, reversible_embedding_rule
from keras_noisecurve.backend.jax.ghost_forms import kept, sequence_sq_norms, token_sq_norms
from keras_noisecurve.backend.jax.ghost_lora import lora_rule
from keras_noisecurve.backend.jax.ghost_norm import NORM_RULES
from keras_noisecurve.backend.jax.ghost_rnn import RNN_RULES
from keras_noisecurve.backend.jax.ghost_scale import rms_scale_rule

__all__ = ["RULES", "find_rule", "kept", "register_rule", "rule_table", "sequence_sq_norms", "token_sq_norms",
           "uses_pre_activation"]


def uses_pre_activation(layer) -> bool:
    """Whether the engine records ``layer``'s output before its fused activation (Dense, EinsumDense
    and ``ghost_conv.PRE_ACTIVATION`` of exact type, whose ``call`` is ``activation(linear(x))``;
    LoRA-enabled or not, not quantized)."""
    return (type(layer) in (keras.layers.Dense, keras.layers.EinsumDense, *PRE_ACTIVATION)
            and getattr(layer, "quantization_mode", None) is None)


#: The rules, tried in order; the first that returns a result is used.
RULES = (*DENSE_RULES, *NORM_RULES, *CONV_RULES, lora_rule, reversible_embedding_rule, position_embedding_rule,
         rms_scale_rule, *RNN_RULES)


_REGISTERED: list = []


def register_rule(rule) -> None:
    """Add a ghost-norm ``rule``, a function ``rule(layer, calls) -> (sq, sums)`` or ``None`` (the
    contract above), for a layer the built-in :data:`RULES` do not take. Registered rules are
    tried first, in the order they were registered; registering a function of the same module
    and qualified name again replaces it (a module that registers its rule at import may be
    reloaded)."""
    if not callable(rule) or not hasattr(rule, "__name__"):
        raise TypeError(f"rule must be a function rule(layer, calls) -> (sq, sums) or None, got {rule!r}")
    key = (getattr(rule, "__module__", None), getattr(rule, "__qualname__", rule.__name__))
    _REGISTERED[:] = [r for r in _REGISTERED
                      if (getattr(r, "__module__", None), getattr(r, "__qualname__", r.__name__)) != key]
    _REGISTERED.append(rule)


def find_rule(layer, calls):
    """``(name, (sq, sums))`` of the first rule, registered (:func:`register_rule`) then built in,
    that handles ``layer``'s calls, else ``None``."""
    for rule in (*_REGISTERED, *RULES):
        result = rule(layer, calls)
        if result is not None:
            return rule.__name__, result
    return None


def rule_table(*, registered: bool = True) -> list:
    """One row per rule the engine tries, in order (registered rules first; ``registered=False``:
    the built-in :data:`RULES` only): ``{"kind", "summary"}``, ``kind`` the rule's name as
    :func:`~keras_noisecurve.backend.jax.ghost.describe` reports it, ``summary`` the first paragraph
    of its docstring."""
    rows = []
    for rule in (*(_REGISTERED if registered else ()), *RULES):
        doc = (rule.__doc__ or "").strip().split("\n\n")[0]
        rows.append({"kind": rule.__name__, "summary": " ".join(doc.split())})
    return rows
