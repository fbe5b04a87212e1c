"""Per-example losses from what a user passes as ``loss`` (Keras 3, TensorFlow backend).

One home for turning a loss name, a ``keras.losses.Loss`` (object or class) or a
function into ``(y_true, y_pred) -> (P,)``, one UNREDUCED value per example. Private
training clips per example, so it needs them
(:func:`keras_noisecurve.training.clipping.per_example_loss_fn` re-exports
:func:`per_example_loss_fn`); the spectrum estimators weight batches by their example
counts with them (:mod:`keras_noisecurve.spectrum.losses`).
"""

from __future__ import annotations

from typing import Callable

import keras
from keras import ops

__all__ = ["per_example_loss_fn", "single_loss"]


def single_loss(loss):
    """The one loss ``loss`` names, as a ``keras.losses.Loss`` instance or a function.

    Args:
      loss: a loss name (``"sparse_categorical_crossentropy"``), a ``keras.losses.Loss``
        object or class (a class is instantiated with its defaults), or a function
        ``(y_true, y_pred) -> values``.

    Raises:
      ValueError: for several losses (a list, tuple or dict: multi-output models are
        not supported), an unknown name, or anything else.
    """
    if isinstance(loss, (list, tuple, dict)):
        raise ValueError(
            "loss must be a single loss (one model output); got a "
            f"{type(loss).__name__} of losses. Combine the outputs into one loss function."
        )
    resolved = loss
    if isinstance(resolved, str):
        resolved = keras.losses.get(resolved)
        if resolved is None:
            raise ValueError(f"unknown loss {loss!r}.")
    if isinstance(resolved, type):
        resolved = resolved()
    if isinstance(resolved, keras.losses.Loss) or callable(resolved):
        return resolved
    raise ValueError(
        "loss must be a loss name, a keras.losses.Loss or a function (y_true, y_pred) -> "
        f"per-example values; got {loss!r} ({type(loss).__name__})."
    )


def _ignore_class(loss):
    """The ``ignore_class`` of a Keras loss object (e.g. SparseCategoricalCrossentropy), else None."""
    if not isinstance(loss, keras.losses.Loss):
        return None
    try:
        value = loss.get_config().get("ignore_class")
    except NotImplementedError:
        return None
    return None if value is None else int(value)


def per_example_loss_fn(loss, *, broadcast_scalar: bool = False) -> Callable:
    """A per-example loss ``(y_true, y_pred) -> (P,)`` from a compiled loss.

    Args:
      loss: as :func:`single_loss`. ``None`` is refused (a model to train privately
        must be compiled with a loss).
      broadcast_scalar: a loss function that returns one scalar for the batch is
        repeated for each of the P examples (the spectrum's mean-loss Hessian accepts
        that); ``False`` (private training) leaves the scalar as it is, and the
        clipping engines then refuse it, since a batch mean is not a per-example loss.

    Returns:
      ``fn(y_true, y_pred) -> (P,)``. Never reduced over the batch: a ``Loss`` object's
      ``call`` is used (its reduction is ignored); values with extra axes (e.g. per
      token of a sequence) are averaged over those axes, over the positions whose label
      is not the loss's ``ignore_class`` when it has one (a padded sequence is ONE
      example: its loss is the mean over its real tokens).
    """
    if loss is None:
        raise ValueError("the model must be compiled with a loss for private training.")
    resolved = single_loss(loss)
    fn = resolved.call if isinstance(resolved, keras.losses.Loss) else resolved
    ignore_class = _ignore_class(resolved)

    def per_example(y_true, y_pred):
        values = ops.convert_to_tensor(fn(y_true, y_pred))
        rank = len(values.shape)
        if rank > 1:
            axes = tuple(range(1, rank))
            if ignore_class is None:
                values = ops.mean(values, axis=axes)
            else:  # the mean over the positions that count (e.g. the tokens of a padded sequence)
                keep = ops.cast(ops.reshape(ops.not_equal(ops.cast(y_true, "int32"), ignore_class),
                                            ops.shape(values)), values.dtype)
                values = ops.sum(values * keep, axis=axes) / ops.maximum(ops.sum(keep, axis=axes), 1)
        if broadcast_scalar and rank == 0:
            values = ops.broadcast_to(values, ops.shape(y_pred)[:1])
        return values

    return per_example
