"""The per-layer ghost-norm rules of the backend in use: which layer each clips
(:func:`describe`) and how to add one for a layer of your own (:func:`register_rule`).

One registry per backend (``keras_noisecurve.backend.<name>.ghost_rules``), each with the same
two entry points; what a rule is differs, because a rule computes in its framework:

- TensorFlow: an instance of ``keras_noisecurve.backend.tensorflow.ghost_forms.Rule``
  (``classes``, ``check``, ``forward``, ``analyse``; the bundled ``GroupNorm`` registers
  one, ``keras_noisecurve/apps/layers.py``);
- JAX: a function ``rule(layer, calls) -> (sq, sums)`` or ``None``
  (``keras_noisecurve.backend.jax.ghost_rules`` states the contract).

A layer no rule takes is clipped exactly by the per-layer fallback on both backends.
"""

from __future__ import annotations

import numpy as np

from keras_noisecurve import backend as _backend

__all__ = ["describe", "register_rule"]


def register_rule(rule) -> None:
    """Add ``rule`` to the ghost engine of the backend in use; registered rules are tried
    before the built-in ones (see the module docstring for what a rule is on each backend).

    Raises:
      TypeError: ``rule`` is not a rule of this backend.
    """
    _backend.module("ghost_rules").register_rule(rule)


def _input_batch(model):
    """Two examples of zeros shaped like a functional model's inputs, or ``None``."""
    inputs = getattr(model, "inputs", None)
    try:
        specs = list(inputs) if inputs else None
    except TypeError:
        return None
    if not specs or any(None in tuple(s.shape)[1:] for s in specs):
        return None
    batch = [np.zeros((2, *tuple(s.shape)[1:]), dtype=str(getattr(s.dtype, "name", s.dtype))) for s in specs]
    return batch[0] if len(batch) == 1 else batch


def describe(model, x=None, *, inside: bool = False) -> list:
    """``[(layer name, class, how)]``: how the ghost engine (``make_private``'s
    ``clipping="auto"``) clips each layer with trainable weights, on the backend in use.

    ``how`` names the rule (TensorFlow: its kind, e.g. ``"Dense"``; JAX: its function, e.g.
    ``"dense_rule"``), or the per-layer fallback (``"generic"`` on TensorFlow, ``"fallback"``
    on JAX), or a caller that clips the layers under it whole (``"caller"`` on JAX); JAX's
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
    ghost = _backend.module("ghost")
    if _backend.name() == "tensorflow":
        return ghost.describe(model, inside=inside)
    if x is None:
        x = _input_batch(model)
        if x is None:
            raise ValueError(
                f"describe(model) on {_backend.name()} traces one step: pass a batch of the model's inputs, "
                f"describe(model, x[:2]) (model {getattr(model, 'name', model)!r} has no inputs of known shape)."
            )
    return ghost.describe(model, x, inside=inside)
