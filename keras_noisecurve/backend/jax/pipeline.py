"""The input pipeline of a private run on JAX: the one-process pipeline of
``keras_noisecurve.backend.common.defaults.pipeline`` (the plan's batches as a
``keras.utils.PyDataset``, ``tf.data`` inputs handed to TensorFlow), with the agreement of
several JAX processes.

Under several JAX processes (``jax.distributed.initialize``) every process iterates the
same plan and serves ITS rows of each step (``StepBatches(parts=, part=)`` with
:func:`input_parts`, the split Keras makes of a dataset); Keras assembles the global batch
from the processes' rows. The processes must stand at the same step with the same sampling
key, on the same examples in the same order: before the first batch they compare them (one
``process_allgather`` of the step, the key and the data's fingerprint) and every process
refuses when one differs; a fresh run's key is process 0's (:func:`agreed_position`; the
optimizer's ``build`` broadcasts its keys the same way, :func:`shared_key`).
"""

from __future__ import annotations

import jax
import keras
import numpy as np
from jax.experimental import multihost_utils

from keras_noisecurve.backend.common.defaults import pipeline as one_process
from keras_noisecurve.backend.common.defaults.pipeline import (
    RunBatches, gather, materialize, plan_steps_dataset, serve, tensor_spec)

__all__ = ["RunBatches", "gather", "materialize", "plan_batches", "plan_steps_dataset", "shared_key", "tensor_spec"]


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


def agreed_position(position, data=None):
    """``(step, key)`` of ``position`` = ``(step, key, built)`` (the optimizer's step and
    sampling key; ``built`` False while the key is still the run's fresh one), checked
    against every process's, with ``data``, the fingerprint of the examples in their order
    (``RunData.source.fingerprint()``, a nonzero 31-bit int; ``None``: not compared): one
    ``process_allgather``, then :func:`_check_agreement` on the gathered table, the same in
    every process, so every process refuses together (``ValueError``) when they stand at
    different steps, hold other examples or another order of them, or hold different
    sampling keys in built optimizers (the key is not printed); before ``build`` each
    process holds its own fresh key and process 0's is taken."""
    step, key, built = position
    if jax.process_count() == 1:
        return one_process.one_process_position(position)
    mine = np.concatenate([[np.uint32(step), np.uint32(built), np.uint32(0 if data is None else data)],
                           np.asarray(key, np.int64).view(np.uint32)])
    every = np.asarray(multihost_utils.process_allgather(mine.astype(np.uint32)), np.uint32).reshape(-1, 7)
    _check_agreement(every, jax.process_index())
    return int(every[0, 0]), shared_key(key)


def _check_agreement(every, process) -> None:
    """Refuse (``ValueError``) the gathered positions ``every`` (N, 7) uint32, one row per
    process: step, built, data fingerprint (0: not given), the sampling key's four words;
    ``process``: this process's index, for the message. The steps must be equal, the data
    fingerprints too, and a built optimizer's key must be every process's."""
    every = np.asarray(every, np.uint32)
    steps = every[:, 0].astype(np.int64)
    if np.any(steps != steps[0]):
        raise ValueError(
            f"the JAX processes of this run stand at different steps of its plan ({steps.tolist()}, one per "
            f"process; this is process {process}): each process would feed its rows of another "
            "step's batch. Every process must start fit(run.dataset(...)) from the same optimizer state (the "
            "same checkpoint, or none).")
    data = every[:, 2].astype(np.int64)
    if np.any(data != data[0]):
        raise ValueError(
            f"the JAX processes of this run hold other examples, or the same ones in another order (the "
            f"fingerprint of x, y and the sample weights in order, one per process: {data.tolist()}; this is "
            f"process {process}; all must be equal): each process serves its rows of every step from its own "
            "copy, so another order puts some examples in several batches of an epoch and breaks the sampling "
            "the privacy accounting assumes. Every process refuses before the first step. Give every process "
            "the same arrays in the same order: load them deterministically, and shuffle with a fixed seed or "
            "not at all (the run's sampling does the shuffling).")
    if np.any(every[:, 1] == 1) and np.any(np.any(every[:, 3:] != every[0, 3:], axis=1)):
        raise ValueError(
            "the JAX processes of this run hold different sampling keys (not printed: they are secret): "
            "each process would sample other examples. Every process must restore the same checkpoint.")


def plan_batches(plan, input_context=None) -> RunBatches:
    """``RunData.batches(...)`` on JAX: a :class:`RunBatches` of the run's ``BatchPlan``
    (``keras_noisecurve.privacy.step_batches``), this process's rows of each step, starting at
    the position every process agrees on (:func:`agreed_position`, read now and again when the
    batches restart). ``input_context`` (a ``tf.distribute`` argument) is refused."""
    if input_context is not None:
        raise ValueError("input_context is a tf.distribute argument; the JAX backend has none.")
    # the same in every JAX process, on the same examples in the same order, else refused in all
    return serve(plan, agree=agreed_position, parts=input_parts())
