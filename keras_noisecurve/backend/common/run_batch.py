"""A run's batch as a private model's ``train_step`` receives it, on either backend: which
step of the plan it belongs to travels with it, and the step takes it apart here."""

from __future__ import annotations

__all__ = ["STEP_KEY", "split_step"]

#: the key of the step in the inputs of a JAX run batch, ``({"inputs": x, STEP_KEY: step}, y, mask)``
#: (Keras's JAX trainer hands ``train_step`` at most (x, y, sample_weight))
STEP_KEY = "noisecurve_step"


def split_step(data):
    """``(x, y, sample_weight), step`` of a run batch: ``(x, y, mask, step)`` (TensorFlow's
    ``tf.data`` batches, the iteration of a JAX ``RunBatches``) or the JAX form with the step
    in the inputs (:data:`STEP_KEY`); ``data, None`` for any other batch."""
    if isinstance(data, (tuple, list)):
        if len(data) == 4:
            return tuple(data[:3]), data[3]
        if data and isinstance(data[0], dict) and STEP_KEY in data[0] and set(data[0]) == {"inputs", STEP_KEY}:
            return (data[0]["inputs"],) + tuple(data[1:]), data[0][STEP_KEY]
    return data, None
