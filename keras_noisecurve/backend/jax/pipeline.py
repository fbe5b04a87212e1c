"""The input pipeline of a private run on JAX: the plan's batches as a
``keras.utils.PyDataset``.

``run_batches(batches)`` wraps the numpy step batches of a run (an object with
``len()`` and ``batches[i] -> (x, y, mask, step)``, ``keras_noisecurve.privacy.
step_batches.StepBatches``) so Keras's JAX trainer can index them: item i is step
``start + i`` of the plan, and Keras may restart the iteration from item 0 (it does,
after reading one batch to build the model) without skipping a step.

Keras's ``PyDataset`` items are ``(inputs, targets, sample_weights)`` at most, so an item
``batches[i]`` carries the step inside the inputs: ``({"inputs": x, STEP_KEY: step},
y, mask)``; the private model's ``train_step`` takes it apart (:func:`split_step`).
Iterating the dataset (a custom loop) yields ``(x, y, mask, step)`` as on TensorFlow.
"""

from __future__ import annotations

import keras

__all__ = ["STEP_KEY", "RunBatches", "run_batches", "split_step"]

#: the key of a batch's step inside the inputs of a ``RunBatches`` item
STEP_KEY = "noisecurve_step"


def split_step(data):
    """``(x, y, sample_weight), step`` of a run batch (an item of :class:`RunBatches`, or
    the ``(x, y, mask, step)`` of its iteration); ``data, None`` for any other batch."""
    if isinstance(data, (tuple, list)):
        if len(data) == 4:
            return tuple(data[:3]), data[3]
        if data and isinstance(data[0], dict) and STEP_KEY in data[0] and set(data[0]) == {"inputs", STEP_KEY}:
            return (data[0]["inputs"],) + tuple(data[1:]), data[0][STEP_KEY]
    return data, None


class RunBatches(keras.utils.PyDataset):
    """The step batches of a run as a ``PyDataset`` (one batch per item, read in order).

    ``start`` is the first step (the optimizer's step when it was made)."""

    def __init__(self, batches):
        super().__init__(workers=1, use_multiprocessing=False)
        self._batches = batches
        self.start = batches.start

    def __len__(self) -> int:
        return len(self._batches)

    def __getitem__(self, index):
        x, y, mask, step = self._batches[index]
        return {"inputs": x, STEP_KEY: step}, y, mask

    def __iter__(self):
        """``(x, y, mask, step)`` of each remaining step, in order."""
        for i in range(len(self)):
            yield self._batches[i]


def run_batches(batches) -> RunBatches:
    """``batches`` (``StepBatches``) as a :class:`RunBatches` ``PyDataset``."""
    return RunBatches(batches)
