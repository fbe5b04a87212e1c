"""The input pipeline of a private run on JAX: the plan's batches as a
``keras.utils.PyDataset``.

``run_batches(batches)`` wraps the numpy step batches of a run (an object with
``len()`` and ``batches[i] -> (x, y, mask, step)``, ``keras_noisecurve.privacy.
step_batches.StepBatches``) so Keras's JAX trainer can index them: item i is step
``start + i`` of the plan, and Keras may restart the iteration from item 0 (it does,
after reading one batch to build the model) without skipping a step.

Keras's ``PyDataset`` items are ``(inputs, targets, sample_weights)`` at most, so an item
``batches[i]`` carries the step inside the inputs: ``({"inputs": x, STEP_KEY: step},
y, mask)``; the private model's ``train_step`` takes it apart (``keras_noisecurve.backend.run_batch.split_step``).
Iterating the dataset (a custom loop) yields ``(x, y, mask, step)`` as on TensorFlow.

Under several JAX processes (``jax.distributed.initialize``) every process iterates the
same plan and serves ITS rows of each step (``StepBatches(parts=, part=)`` with
:func:`input_parts`, the split Keras makes of a dataset); Keras assembles the global batch
from the processes' rows. The processes must stand at the same step with the same sampling
key: before the first batch they compare them (one ``process_allgather``) and a process at
another step is refused; a fresh run's key is process 0's (:func:`agreed_position`; the
optimizer's ``build`` broadcasts its keys the same way, :func:`shared_key`).
"""

from __future__ import annotations

import jax
import keras
import numpy as np
from jax.experimental import multihost_utils

from keras_noisecurve.backend.run_batch import STEP_KEY

__all__ = ["STEP_KEY", "RunBatches", "agreed_position", "batch_shards", "input_parts", "run_batches", "shared_key"]

#: the key of a batch's step inside the inputs of a ``RunBatches`` item


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


def batch_shards() -> int:
    """The number of devices the batch axis is split over under the active
    ``keras.distribution`` (``DataParallel``/``ModelParallel``: the mesh's batch axis), 1
    without one."""
    active = keras.distribution.distribution()
    mesh = getattr(active, "device_mesh", None)
    name = getattr(active, "batch_dim_name", None)
    if mesh is None or name not in tuple(mesh.axis_names):
        return 1
    return int(mesh.shape[tuple(mesh.axis_names).index(name)])


def shared_key(key) -> np.ndarray:
    """Process 0's ``key`` (int64 (2,)) in every process (``broadcast_one_to_all`` of its
    four uint32 words: JAX without x64 would truncate int64); ``key`` itself in a single
    process."""
    key = np.ascontiguousarray(np.asarray(key, np.int64))
    if jax.process_count() == 1:
        return key
    words = multihost_utils.broadcast_one_to_all(key.view(np.uint32))
    return np.ascontiguousarray(np.asarray(words, np.uint32)).view(np.int64).copy()


def input_parts():
    """``(parts, part, multiple)`` for ``StepBatches``, as Keras splits a dataset between
    processes (``Distribution.distribute_dataset``): with R = :func:`batch_shards` model
    replicas (the devices along the batch axis) and N processes, each process feeds
    ``1/N`` of the batch when R ≥ N (``DataParallel``), ``1/R`` when the replicas span
    processes (``ModelParallel`` with the model axis across processes: the processes of
    one replica feed the same rows), the whole batch when R = 1; the global batch is
    padded to a multiple of R."""
    processes, replicas = jax.process_count(), batch_shards()
    if processes == 1 or replicas == 1 or keras.distribution.distribution() is None:
        return 1, 0, replicas
    if replicas >= processes:
        return processes, jax.process_index(), replicas
    return replicas, jax.process_index() // (processes // replicas), replicas


def agreed_position(position):
    """``(step, key)`` of ``position`` = ``(step, key, built)`` (the optimizer's step and
    sampling key; ``built`` False while the key is still the run's fresh one), checked
    against every process's: ``ValueError`` when the processes stand at different steps,
    or hold different sampling keys in built optimizers (the key is not printed); before
    ``build`` each process holds its own fresh key and process 0's is taken."""
    step, key, built = position
    if jax.process_count() == 1:
        return int(step), np.asarray(key, np.int64)
    mine = np.concatenate([[np.uint32(step), np.uint32(built)], np.asarray(key, np.int64).view(np.uint32)])
    every = np.asarray(multihost_utils.process_allgather(mine.astype(np.uint32)), np.uint32).reshape(-1, 6)
    steps = every[:, 0].astype(np.int64)
    if np.any(steps != steps[0]):
        raise ValueError(
            f"the JAX processes of this run stand at different steps of its plan ({steps.tolist()}, one per "
            f"process; this is process {jax.process_index()}): each process would feed its rows of another "
            "step's batch. Every process must start fit(run.dataset(...)) from the same optimizer state (the "
            "same checkpoint, or none).")
    if np.any(every[:, 1] == 1) and np.any(np.any(every[:, 2:] != every[0, 2:], axis=1)):
        raise ValueError(
            "the JAX processes of this run hold different sampling keys (not printed: they are secret): "
            "each process would sample other examples. Every process must restore the same checkpoint.")
    return int(steps[0]), shared_key(key)


def run_batches(batches) -> RunBatches:
    """``batches`` (``StepBatches``) as a :class:`RunBatches` ``PyDataset``."""
    return RunBatches(batches)
