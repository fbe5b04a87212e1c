"""The per-layer ghost-norm rules: which rule clips each layer (:func:`describe`) and how to
add one for a layer of your own (:func:`register_rule`, :class:`LayerRule`).

One table of rules serves both engines (``keras_noisecurve.backend.common.layer_rules.BUILTIN``): a rule
is a :class:`LayerRule`, the name of a layer family (its ``kind``, what :func:`describe` reports,
the same on every backend) with one kernel per backend, the code that computes in that framework:

- TensorFlow: an instance of ``keras_noisecurve.backend.tensorflow.engine_forms.Rule``
  (``classes``, ``check``, ``forward``, ``analyse``);
- JAX: a function ``rule(layer, calls) -> (sq, sums)`` or ``None``
  (``keras_noisecurve.backend.common.kernel_rules`` states the contract).

A layer no rule takes, or whose rule has no kernel on the backend in use, is clipped exactly by
the per-layer fallback (``"generic"``) on both backends. The bundled ``GroupNorm`` registers one
rule with both kernels (``keras_noisecurve/apps/layers.py``).
"""

from __future__ import annotations

from keras_noisecurve import backend as _backend
from keras_noisecurve.backend.common.layer_rules import LayerRule, layer_kernel

__all__ = ["LayerRule", "describe", "layer_kernel", "register_rule"]


def register_rule(rule) -> None:
    """Add ``rule`` to the ghost engine of the backend in use, before the built-in rules.

    Args:
      rule: a :class:`LayerRule` (its kernel for the backend in use is made now; a rule without
        one changes nothing here: the fallback clips its layers), or a kernel of the backend in
        use (see the module docstring), registered under its own kind (TensorFlow: the rule's
        ``kind``; JAX: the function's name).

    Raises:
      TypeError: ``rule`` is neither, or its kernel is not a kernel of this backend.
    """
    _backend.module("ghost").register_rule(rule)


def describe(model, x=None, *, inside: bool = False) -> list:
    """``[(layer name, class, how)]``: how the ghost engine (``make_private``'s
    ``clipping="auto"``) clips each layer with trainable weights, on the backend in use.

    ``how`` is the rule's kind (e.g. ``"Dense"``, the same on both backends), or ``"generic"``
    (the per-layer fallback), or a caller that clips the layers under it whole (``"caller"`` on
    JAX; TensorFlow reports such a caller under its own kind); JAX's
    ``"vectorized"`` means the whole model goes to the vectorized engine. ``inside=True`` lists
    the layers under such a caller too, right after it, with ``how`` = ``"through '<caller>'"``.

    Args:
      model: a built Keras model.
      x: a batch of the model's inputs (a few examples are enough). TensorFlow plans without
        one; JAX traces one step on abstract values shaped like it, and makes two examples of
        zeros from a functional model's inputs when ``x`` is ``None``.
      inside: also list the layers under a caller.

    Raises:
      ValueError: on JAX, ``x`` is ``None`` and the model has no inputs of known shape.
    """
    return _backend.module("ghost").describe(model, x, inside=inside)
