"""The ghost-norm rules of both clipping engines, as one table (no framework import).

A rule is a :class:`LayerRule`: the name of a layer family (``kind``, what
``keras_noisecurve.training.describe`` reports for a layer it clips, the same on every backend)
and one kernel per backend, each given as a function of no arguments that returns it, so
that a rule names its kernels without importing their framework:

- ``tensorflow``: a ``keras_noisecurve.backend.tensorflow.ghost_forms.Rule`` instance (which
  layers: ``matches``/``check``; what it records: ``forward``; the norms and the clipped sum:
  ``analyse``);
- ``jax``: a function ``rule(layer, calls) -> (sq, sums)`` or ``None`` (the contract of
  ``keras_noisecurve.backend.jax.ghost_rules``).

A backend without a kernel clips the family's layers exactly with its per-layer fallback
(``"generic"``). :data:`BUILTIN` lists the built-in rules in the order both engines try them;
each backend's ``ghost_rules`` makes its registry from it, and ``register_rule`` puts a rule of
one's own before them. The table is also the documentation's list of rules
(:func:`table`), with a column per backend.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Optional

__all__ = ["BACKENDS", "BUILTIN", "GENERIC", "LayerRule", "group_norm_rule", "table"]

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

    Raises:
      TypeError / ValueError: ``kind`` is not a non-empty string other than ``"generic"``,
        a kernel is neither callable nor ``None``, or both are ``None``.
    """

    kind: str
    tensorflow: Optional[Callable[[], object]] = None
    jax: Optional[Callable[[], object]] = None

    def __post_init__(self):
        if not isinstance(self.kind, str) or not self.kind.strip():
            raise TypeError(f"kind must be a non-empty string, got {self.kind!r}")
        if self.kind == GENERIC:
            raise ValueError(f"kind {GENERIC!r} names the per-layer fallback; give the rule a name of its own")
        for name in BACKENDS:
            factory = getattr(self, name)
            if factory is not None and not callable(factory):
                raise TypeError(f"{name} must be a function of no arguments returning the {name} kernel, "
                                f"or None; got {factory!r}")
        if all(getattr(self, name) is None for name in BACKENDS):
            raise ValueError(f"rule {self.kind!r} has no kernel: give tensorflow=, jax= or both")

    def kernel(self, backend: str):
        """The kernel for ``backend`` (one of :data:`BACKENDS`; its factory is called now), or
        ``None`` where the rule has none."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        factory = getattr(self, backend)
        return None if factory is None else factory()


def _builtin(backend: str, module: str, name: str):
    """A factory of the built-in kernel ``keras_noisecurve.backend.<backend>.<module>.<name>`` (a
    class is instantiated)."""

    def factory():
        kernel = getattr(importlib.import_module(f"keras_noisecurve.backend.{backend}.{module}"), name)
        return kernel() if isinstance(kernel, type) else kernel

    factory.__qualname__ = f"{backend}.{module}.{name}"
    return factory


def _made(backend: str, module: str, function: str, /, *args, **kwargs):
    """A factory of the kernel ``keras_noisecurve.backend.<backend>.<module>.<function>(*args, **kwargs)``."""

    def factory():
        return getattr(importlib.import_module(f"keras_noisecurve.backend.{backend}.{module}"), function)(
            *args, **kwargs)

    factory.__qualname__ = f"{backend}.{module}.{function}"
    return factory


def group_norm_rule(kind: str, cls) -> LayerRule:
    """The rule of a group normalisation layer class ``cls`` of one's own (exact type) that
    computes as ``keras.layers.GroupNormalization`` with channels last: attributes ``groups``,
    ``epsilon``, ``gamma`` and ``beta`` (per channel, either ``None``), mean and variance over the
    positions and each group's channels. ``kind``: the rule's name. Both backends' kernel is their
    ``ghost_norm.grouped_norm_rule(cls, name=kind)``, made when the rule is registered."""
    return LayerRule(kind, **{backend: _made(backend, "ghost_norm", "grouped_norm_rule", cls, name=kind)
                              for backend in BACKENDS})


def _rule(kind, tensorflow=None, jax=None):
    return LayerRule(kind, tensorflow=tensorflow and _builtin("tensorflow", *tensorflow),
                     jax=jax and _builtin("jax", *jax))


#: The built-in rules, in the order the engines try them (the first that takes a layer clips
#: it). A family with no kernel on a backend is clipped by that backend's per-layer fallback.
BUILTIN = (
    _rule("LoRA", ("ghost_lora", "LoRARule"), ("ghost_lora", "lora_rule")),
    _rule("EinsumDense", ("ghost_dense", "EinsumDenseRule"), ("ghost_dense", "einsum_dense_rule")),
    _rule("Dense", ("ghost_dense", "DenseRule"), ("ghost_dense", "dense_rule")),
    _rule("Embedding", ("ghost_dense", "EmbeddingRule"), ("ghost_dense", "embedding_rule")),
    _rule("ReversibleEmbedding", ("ghost_embedding", "ReversibleEmbeddingRule"),
          ("ghost_embedding", "reversible_embedding_rule")),
    _rule("PositionEmbedding", ("ghost_embedding", "PositionEmbeddingRule"),
          ("ghost_embedding", "position_embedding_rule")),
    _rule("RMS scale", ("ghost_embedding", "DiagonalScaleRule"), ("ghost_scale", "diagonal_scale_rule")),
    _rule("T5 relative-attention bias", ("ghost_t5", "RelativeAttentionBiasRule")),
    _rule("PReLU", ("ghost_scale", "PReLURule")),
    _rule("Conv", ("ghost_conv", "ConvRule"), ("ghost_conv", "conv_rule")),
    _rule("GroupedConv", ("ghost_conv_kinds", "GroupedConvRule"), ("ghost_conv", "grouped_conv_rule")),
    _rule("Conv3D", ("ghost_conv_kinds", "Conv3DRule"), ("ghost_conv", "conv3d_rule")),
    _rule("DepthwiseConv", ("ghost_conv_kinds", "DepthwiseConvRule"), ("ghost_conv", "depthwise_rule")),
    _rule("SeparableConv", ("ghost_conv_kinds", "SeparableConvRule"), ("ghost_conv", "separable_rule")),
    _rule("ConvTranspose", ("ghost_conv_kinds", "ConvTransposeRule"), ("ghost_conv", "conv_transpose_rule")),
    _rule("LayerNormalization", ("ghost_norm", "LayerNormalizationRule"), ("ghost_norm", "layer_norm_rule")),
    _rule("GroupNormalization", ("ghost_norm", "GroupNormalizationRule"), ("ghost_norm", "group_norm_rule")),
    _rule("Recurrent", ("ghost_rnn", "RecurrentRule"), ("ghost_rnn", "recurrent_rule")),
    _rule("TimeDistributed (folded)", ("ghost_timedist", "FoldedTimeDistributedRule")),
    _rule("TimeDistributed", ("ghost_generic", "TimeDistributedRule")),
    _rule("RMSNorm (by computation)", ("ghost_scale", "ComputedScaleRule"), ("ghost_scale", "rms_scale_rule")),
)


def table(rules=BUILTIN) -> list:
    """One row per rule, in order: ``{"kind", "tensorflow", "jax"}``, each backend's entry
    ``True`` where the rule has a kernel for it (no kernel is imported)."""
    return [{"kind": r.kind, **{name: getattr(r, name) is not None for name in BACKENDS}} for r in rules]
