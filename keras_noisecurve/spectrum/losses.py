"""Loss resolution and random labels for the spectrum estimators (Keras/TensorFlow).

``resolve_loss`` turns what the user gave (``None``, a name, a ``keras.losses.Loss``,
a function) into a function returning one loss value per example (the same
per-example loss private training uses, :mod:`keras_noisecurve._losses`), so HVPs can
weight batches by their example counts exactly. With ``loss=None`` the model's compiled
loss is used; an uncompiled model gets a classification loss inferred from its last
layer's activation: softmax → sparse categorical cross-entropy; sigmoid → binary
cross-entropy; anything else → the same losses ``from_logits=True`` (K > 1 outputs:
sparse categorical, K = 1: binary).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class ResolvedLoss:
    """A per-example loss and how to draw random labels for it.

    Attributes:
      fn: (y_true, y_pred) → per-example losses, shape (batch,) (extra axes are averaged).
      name: a readable name, recorded in metadata.
      label_kind: "sparse" (integer class ids), "onehot" or "binary" (0/1 per output).
    """

    fn: Callable
    name: str
    label_kind: str


def _loss_name(loss) -> str:
    if isinstance(loss, str):
        return loss
    name = getattr(loss, "name", None) or getattr(loss, "__name__", None) or type(loss).__name__
    return str(name)


def _label_kind(name: str, num_outputs: int) -> str:
    n = name.lower()
    if "sparse" in n:
        return "sparse"
    if "binary" in n or num_outputs == 1:
        return "binary"
    return "onehot"


def output_width(model, x_sample) -> int:
    """Number of outputs K of the model (last axis of its output on one example)."""
    import keras

    shape = None
    try:
        shape = tuple(model.output_shape)
    except (AttributeError, ValueError, RuntimeError):
        shape = None
    if shape is None or shape[-1] is None or isinstance(shape[-1], (tuple, list)):
        out = model(keras.ops.convert_to_tensor(np.asarray(x_sample[:1])), training=False)
        shape = tuple(out.shape)
    return int(shape[-1]) if len(shape) > 1 else 1


def resolve_loss(model, loss, *, num_outputs: int) -> ResolvedLoss:
    """Per-example loss for ``model`` from ``loss`` (see module docstring).

    ``None`` picks the model's compiled loss, else one inferred from its last layer;
    the rest is :func:`keras_noisecurve._losses.per_example_loss_fn`, with a scalar
    loss repeated for every example of the batch.
    """
    import keras

    from keras_noisecurve._losses import per_example_loss_fn, single_loss

    if loss is None:
        loss = getattr(model, "loss", None)
    if loss is None:
        layer = model.layers[-1] if getattr(model, "layers", None) else None
        act = getattr(getattr(layer, "activation", None), "__name__", "linear")
        if act == "softmax":
            loss = keras.losses.SparseCategoricalCrossentropy()
        elif act == "sigmoid":
            loss = keras.losses.BinaryCrossentropy()
        elif num_outputs > 1:
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        else:
            loss = keras.losses.BinaryCrossentropy(from_logits=True)
    loss_obj = single_loss(loss)
    name = _loss_name(loss)
    if isinstance(loss_obj, keras.losses.Loss):
        try:
            if loss_obj.get_config().get("from_logits"):
                name += " (from_logits=True)"
        except (NotImplementedError, AttributeError):
            pass
    fn = per_example_loss_fn(loss_obj, broadcast_scalar=True)
    return ResolvedLoss(fn=fn, name=name, label_kind=_label_kind(name, num_outputs))


def random_labels(num_examples: int, *, num_outputs: int, label_kind: str, seed=None) -> np.ndarray:
    """Labels drawn uniformly over the K output classes (paper §4.1).

    Returns: "sparse": (n,) int32 in [0, K); "onehot": (n, K) float32 one-hot;
    "binary": (n, K) float32 in {0, 1} (each output a fair coin).
    """
    rng = np.random.default_rng(seed)
    if label_kind == "sparse":
        return rng.integers(0, num_outputs, size=num_examples).astype(np.int32)
    if label_kind == "onehot":
        ids = rng.integers(0, num_outputs, size=num_examples)
        return np.eye(num_outputs, dtype=np.float32)[ids]
    if label_kind == "binary":
        return rng.integers(0, 2, size=(num_examples, num_outputs)).astype(np.float32)
    raise ValueError(f"label_kind must be 'sparse', 'onehot' or 'binary', got {label_kind!r}.")
