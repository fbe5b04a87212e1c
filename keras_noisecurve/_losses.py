"""Per-example losses from what a user passes as ``loss`` (Keras 3; keras.ops only: one
definition for the TensorFlow and the JAX backend).

One home for turning a loss name, a ``keras.losses.Loss`` (object or class) or a
function into ``(y_true, y_pred) -> (P,)``, one UNREDUCED value per example. Private
training clips per example, so it needs them
(:func:`keras_noisecurve.backend.tensorflow.clipping.per_example_loss_fn` re-exports
:func:`per_example_loss_fn`); the spectrum estimators weight batches by their example
counts with them (:mod:`keras_noisecurve.spectrum.losses`).
"""

from __future__ import annotations

import functools
from typing import Callable

import keras
from keras import ops

from keras_noisecurve import _compat

__all__ = ["per_example_loss_fn", "reduce_positions", "single_loss", "split_sample_weight", "weigh_positions",
           "float32_outputs"]


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


def _built_in(loss, resolved) -> bool:
    """A loss Keras applies to EACH output of a multi-output model (a name, a
    ``keras.losses.Loss``, a function of ``keras.losses``); a function of the user's own
    receives the whole structures (one combined loss)."""
    if isinstance(loss, str) or isinstance(resolved, keras.losses.Loss):
        return True
    return getattr(resolved, "__module__", "").startswith("keras.")


def _ignore_class(loss):
    """The ``ignore_class`` of a Keras loss object (e.g. SparseCategoricalCrossentropy), else None."""
    if not isinstance(loss, keras.losses.Loss):
        return None
    try:
        value = loss.get_config().get("ignore_class")
    except NotImplementedError:
        return None
    return None if value is None else int(value)


def _reduction(loss) -> str:
    """The ``reduction`` of a Keras loss object (``"sum_over_batch_size"`` for a function)."""
    value = getattr(loss, "reduction", None) if isinstance(loss, keras.losses.Loss) else None
    return "sum_over_batch_size" if value in (None, "none") else value


def _align(t, values):
    """``t`` (a mask or per-position weights) broadcast to the shape of ``values``, as Keras
    aligns them (a trailing axis of size 1 squeezed, missing trailing axes added)."""
    t = ops.convert_to_tensor(t)
    while len(t.shape) > len(values.shape) and t.shape[-1] == 1:
        t = ops.squeeze(t, axis=-1)
    while len(t.shape) < len(values.shape):
        t = ops.expand_dims(t, axis=-1)
    return ops.broadcast_to(t, ops.shape(values))


def reduce_positions(values, *, mask=None, weight=None, reduction="sum_over_batch_size"):
    """One value per example from a loss's values ``(P, ...)``, as Keras reduces a batch.

    Keras reduces the values v_{i,t} of a batch with the weights w_{i,t} (sample weight,
    1 without) and the mask m_{i,t} (1 without) to Σ w·m·v / Σ m ("sum_over_batch_size",
    "mean"), Σ w·m·v ("sum") or Σ w·m·v / Σ w·m ("mean_with_sample_weight"). The
    per-example loss is the same sum over example i's own positions t only:

        loss_i = Σ_t w_it·m_it·v_it / Σ_t m_it        (and "sum", "mean_with_sample_weight" alike)

    so a padded sequence is ONE example whose loss is the mean over its real tokens, and a
    (P,) weight gives w_i·loss_i. An example with no position left weighs 0 (loss 0).

    Args:
      values: (P,) or (P, d1, ...) float, the loss's unreduced values.
      mask: bool/0-1 (P, d1, ...) or None (a trailing axis of size 1 is squeezed, missing
        trailing axes are broadcast).
      weight: per-position weights (P, d1, ...) or None.
      reduction: the loss's reduction ("none"/None: as "sum_over_batch_size").

    Returns:
      (P,) in ``values``' dtype.
    """
    if reduction in (None, "none"):
        reduction = "sum_over_batch_size"
    if len(values.shape) <= 1:
        if weight is not None:
            values = values * ops.cast(_align(weight, values), values.dtype)
        if mask is not None:
            values = ops.where(ops.cast(_align(mask, values), "bool"), values, ops.zeros_like(values))
        return values
    axes = tuple(range(1, len(values.shape)))
    keep = ops.ones_like(values) if mask is None else ops.cast(_align(mask, values), values.dtype)
    weighted = keep if weight is None else keep * ops.cast(_align(weight, values), values.dtype)
    total = ops.sum(ops.where(keep > 0, values, ops.zeros_like(values)) * weighted, axis=axes)
    if reduction == "sum":
        return total
    denominator = ops.sum(weighted if reduction == "mean_with_sample_weight" else keep, axis=axes)
    positive = denominator > 0
    return ops.where(positive, total / ops.where(positive, denominator, ops.ones_like(denominator)),
                     ops.zeros_like(total))


def _fitting(mask, values):
    """``mask`` when it can weigh ``values`` (after :func:`_align`'s squeeze, no more axes than
    ``values``), else None: a loss that already reduced the masked axes (e.g. a function of
    your own returning (P,) for a masked sequence output) is taken as it is."""
    if mask is None:
        return None
    shape = tuple(mask.shape)
    while len(shape) > len(values.shape) and shape[-1] == 1:
        shape = shape[:-1]
    return mask if len(shape) <= len(values.shape) else None


def _and(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return ops.logical_and(ops.cast(a, "bool"), ops.cast(_align(b, a), "bool"))


def per_example_loss_fn(loss, *, broadcast_scalar: bool = False) -> Callable:
    """A per-example loss ``(y_true, y_pred, sample_weight=None) -> (P,)`` from a compiled loss.

    Args:
      loss: as :func:`single_loss`. ``None`` is refused (a model to train privately
        must be compiled with a loss).
      broadcast_scalar: a loss function that returns one scalar for the batch is
        repeated for each of the P examples (the spectrum's mean-loss Hessian accepts
        that); ``False`` (private training) leaves the scalar as it is, and the
        clipping engines then refuse it, since a batch mean is not a per-example loss.

    Returns:
      ``fn(y_true, y_pred, sample_weight=None) -> (P,)``, the same on every backend. A
      built-in loss (a name, a ``keras.losses.Loss``, a ``keras.losses`` function) on a
      model with several outputs (list or dict) is applied to each output and the
      per-example values summed, as Keras does (``loss_i = Σ_k loss(y_true[k], y_pred[k])_i``);
      a function of your own receives the whole structures (one combined loss). Never
      reduced over the batch: a ``Loss`` object's ``call`` is used, and values with
      extra axes (per token, per pixel, per output position) are reduced over example
      i's own positions by :func:`reduce_positions` with the loss's ``reduction``, the
      mask Keras would use (the Keras mask of ``y_pred``, e.g. from
      ``Embedding(mask_zero=True)``, and of the loss's values, e.g. ``ignore_class``;
      the loss's ``ignore_class`` also directly) and ``sample_weight`` when it is
      per position (P, d1, ...) (a (P,) weight is applied by the caller, before
      clipping). A padded sequence is ONE example: its loss is the mean over its real
      tokens.
    """
    if loss is None:
        raise ValueError("the model must be compiled with a loss for private training.")
    resolved = single_loss(loss)
    fn = resolved.call if isinstance(resolved, keras.losses.Loss) else resolved
    ignore_class = _ignore_class(resolved)
    reduction = _reduction(resolved)

    def per_example(y_true, y_pred, sample_weight=None):
        if _built_in(loss, resolved) and isinstance(y_pred, (list, tuple, dict)) and len(y_pred) > 1:
            # one built-in loss for several outputs: Keras applies it to each output and sums
            keys = sorted(y_pred) if isinstance(y_pred, dict) else range(len(y_pred))
            if isinstance(y_pred, dict) != isinstance(y_true, dict) or len(y_true) != len(y_pred):
                raise ValueError(
                    f"the model has {len(y_pred)} outputs but y has another structure "
                    f"({type(y_true).__name__} of {len(y_true) if hasattr(y_true, '__len__') else 1}): "
                    "give one label per output, in the same list/dict structure."
                )
            nested = isinstance(sample_weight, (list, tuple, dict))
            return functools.reduce(ops.add, [
                one(y_true[k], y_pred[k], sample_weight[k] if nested else sample_weight) for k in keys])
        return one(y_true, y_pred, sample_weight)

    def one(y_true, y_pred, sample_weight):
        in_mask = None if isinstance(y_pred, (list, tuple, dict)) else _compat.keras_mask(y_pred)
        values = ops.convert_to_tensor(fn(y_true, y_pred))
        rank = len(values.shape)
        if rank == 0:
            if sample_weight is not None:
                raise ValueError(_SCALAR_WITH_WEIGHTS)
            return ops.broadcast_to(values, ops.shape(y_pred)[:1]) if broadcast_scalar else values
        if rank == 1 and sample_weight is not None:
            raise ValueError(
                f"sample_weight of shape {tuple(sample_weight.shape)} weighs positions, but the loss gives one "
                f"value per example (shape {tuple(values.shape)}): give one weight per example, shape (P,)."
            )
        mask = _and(_fitting(in_mask, values), _fitting(_compat.keras_mask(values), values))
        if ignore_class is not None and rank > 1:
            mask = _and(mask, ops.reshape(ops.not_equal(ops.cast(y_true, "int32"), ignore_class),
                                          ops.shape(values)))
        return reduce_positions(values, mask=mask, weight=sample_weight, reduction=reduction)

    return per_example


_SCALAR_WITH_WEIGHTS = ("the loss returns one scalar for the batch, which per-position sample weights cannot "
                        "weigh: return one value per example or per position.")


def split_sample_weight(sample_weight):
    """``(row, positions)`` of a batch's ``sample_weight``: a (P,) or (P, 1) weight is one
    weight per example (``row`` (P,), applied before clipping, ``positions`` None); a
    weight with more entries per example, e.g. (P, L) per token, weighs the positions
    inside the per-example loss (``row`` None, ``positions`` as given). ``(None, None)``
    for None. Decided on the static shape."""
    if sample_weight is None or isinstance(sample_weight, (list, tuple, dict)):
        return sample_weight, None
    shape = tuple(sample_weight.shape)
    if len(shape) <= 1 or all(d == 1 for d in shape[1:]):
        return ops.reshape(sample_weight, (-1,)), None
    return None, sample_weight


def weigh_positions(loss_fn):
    """``loss_fn`` (of :func:`per_example_loss_fn`) taking ``y`` = ``(labels, positions)``
    (what :func:`split_sample_weight` found per position): ``loss_fn(labels, y_pred, positions)``."""

    def loss(y, y_pred):
        labels, positions = y
        return loss_fn(labels, y_pred, positions)

    return loss


def float32_outputs(y_pred):
    """``y_pred`` (a tensor or a structure) with float16/bfloat16 outputs cast to float32, as
    Keras's ``Loss.__call__`` casts them, each keeping its Keras mask (a cast is a new tensor)."""

    def cast(t):
        if getattr(t, "dtype", None) is None or keras.backend.standardize_dtype(t.dtype) not in ("float16", "bfloat16"):
            return t
        return _compat.copy_keras_mask(t, ops.cast(t, "float32"))

    return keras.tree.map_structure(cast, y_pred)
