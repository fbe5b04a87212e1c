"""What a model must satisfy to be trained privately, checked on every backend (no
framework import): the clipping engines' names and the refusal of layers that mix
examples or add data-dependent losses."""

from __future__ import annotations

import keras
import numpy as np

from keras_noisecurve import _compat

__all__ = ["ENGINES", "check_model_is_clippable", "input_batch"]

#: the clipping engines of ``make_private(model, clipping=...)``; on JAX every name runs
#: the ``vmap`` per-example engine of ``keras_noisecurve.backend.jax.dp_model``
ENGINES = ("auto", "vectorized", "ghost")


# ----------------------------------------------------------------------- checks
def check_model_is_clippable(model) -> None:
    """Refuse layers that mix examples or add data-dependent losses inside ``call``.

    Raises:
      ValueError: for a trainable BatchNormalization (training mode mixes the examples of a
        batch, so per-example clipping would not bound one example's influence) and
        for activity regularizers (data-dependent losses outside the clipped loss).
    """
    for layer in _compat.flatten_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            raise ValueError(
                f"layer {layer.name!r} is a BatchNormalization layer: in training mode it mixes "
                "the examples of a batch, so per-example clipping cannot bound one example's "
                "influence (no DP guarantee). Use GroupNormalization or LayerNormalization "
                "(keras_noisecurve.replace_batch_normalization(model) rebuilds a functional or Sequential "
                "model so, keeping the other weights), or freeze it (layer.trainable = False runs it in "
                "inference mode)."
            )
        if getattr(layer, "activity_regularizer", None) is not None and layer is not model:
            raise ValueError(
                f"layer {layer.name!r} has an activity_regularizer: a data-dependent loss that would "
                "escape per-example clipping. Remove it or add the penalty inside the loss."
            )


def input_batch(model):
    """Two examples of zeros shaped like a functional model's inputs, or ``None`` (a model
    without inputs of known shape)."""
    inputs = getattr(model, "inputs", None)
    try:
        specs = list(inputs) if inputs else None
    except TypeError:
        return None
    if not specs or any(None in tuple(s.shape)[1:] for s in specs):
        return None
    batch = [np.zeros((2, *tuple(s.shape)[1:]), dtype=str(getattr(s.dtype, "name", s.dtype))) for s in specs]
    return batch[0] if len(batch) == 1 else batch
