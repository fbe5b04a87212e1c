"""The input pipeline of a private run on JAX: the plan's batches as a
``keras.utils.PyDataset`` (:func:`plan_batches`).

``run_batches(batches, position)`` wraps the numpy step batches of a run (an object with
``len()`` and ``batches[i] -> (x, y, mask, step)``, ``keras_noisecurve.privacy.
step_batches.StepBatches``) so Keras's JAX trainer can index them: item i is step
``start + i`` of the plan, and Keras may restart the iteration from item 0 (it does,
after reading one batch to build the model) without skipping a step. ``start`` is read
from the optimizer when the batches are made and again before ``fit``'s first step, after
the callbacks' ``on_train_begin`` (where ``BackupAndRestore`` restores the optimizer), and
before each iteration of a custom loop (:meth:`RunBatches.restart`).

Keras's ``PyDataset`` items are ``(inputs, targets, sample_weights)`` at most, so an item
``batches[i]`` carries the step inside the inputs: ``({"inputs": x, STEP_KEY: step},
y, mask)``; the private model's ``train_step`` takes it apart (``keras_noisecurve.backend.common.run_batch.split_step``).
Iterating the dataset (a custom loop) yields ``(x, y, mask, step)`` as on TensorFlow.

Under several JAX processes (``jax.distributed.initialize``) every process iterates the
same plan and serves ITS rows of each step (``StepBatches(parts=, part=)`` with
:func:`input_parts`, the split Keras makes of a dataset); Keras assembles the global batch
from the processes' rows. The processes must stand at the same step with the same sampling
key, on the same examples in the same order: before the first batch they compare them (one
``process_allgather`` of the step, the key and the data's fingerprint) and every process
refuses when one differs; a fresh run's key is process 0's (:func:`agreed_position`; the
optimizer's ``build`` broadcasts its keys the same way, :func:`shared_key`).

``tf.data`` inputs (a ``tf.data.Dataset`` of examples, ``banded_poisson_dataset``, an example
source's tensors in a ``tf.data`` map function) are TensorFlow's on any Keras backend: a
program that made a ``tf.data.Dataset`` has TensorFlow. :func:`gather`, :func:`tensor_spec`,
:func:`materialize` and :func:`plan_steps_dataset` hand them to the TensorFlow backend's
pipeline, imported when one is used (numpy sources never import TensorFlow here).
"""

from __future__ import annotations

import importlib

import jax
import keras
import numpy as np
from jax.experimental import multihost_utils

from keras_noisecurve.backend.common.run_batch import STEP_KEY

__all__ = ["RunBatches", "gather", "materialize", "plan_batches", "plan_steps_dataset", "shared_key", "tensor_spec"]


class RunBatches(keras.utils.PyDataset):
    """The step batches of a run as a ``PyDataset`` (one batch per item, read in order):
    item i is step ``start + i``.

    ``start`` is the optimizer's step when the batches were made, read again (with the
    sampling key) by :meth:`restart` when ``position`` is given: iterating (a custom loop)
    restarts first, and a private model's ``fit`` restarts after every callback's
    ``on_train_begin`` (:meth:`restart_callback`), where ``BackupAndRestore`` restores the
    optimizer, after ``fit`` made the batches and built the model from the first. So the
    batches start where the optimizer stands before the first step, as the ``tf.data``
    pipeline, which reads the position when it is iterated.

    Args:
      batches: a ``StepBatches`` from the optimizer's position now.
      position: ``None`` or a function returning the optimizer's position ``(step, key)``
        then, the same in every JAX process (:func:`agreed_position`, a collective: every
        process restarts together).
    """

    def __init__(self, batches, position=None):
        super().__init__(workers=1, use_multiprocessing=False)
        self._batches = batches
        self._position = position
        self._held = False

    @property
    def start(self) -> int:
        """The step of item 0."""
        return self._batches.start

    def restart(self) -> None:
        """Read the optimizer's position again: item 0 is its step from now on."""
        self._held = False
        if self._position is not None:
            self._batches = self._batches.at(self._position())

    def restart_callback(self) -> keras.callbacks.Callback:
        """The callback that restarts these batches in ``fit``'s ``on_train_begin``: pass it
        after every other callback (``on_train_begin`` runs them in order, the user's restores
        first). Until then :attr:`num_batches` is the plan's step count."""
        self._held = True
        return _RestartAtTrainBegin(self)

    def __len__(self) -> int:
        return len(self._batches)

    @property
    def num_batches(self) -> int:
        """What Keras counts: ``len()``, but the plan's whole step count T while a ``fit`` has
        yet to restart the batches. Keras's epoch iterator counts the batches before the
        callbacks' ``on_train_begin`` and ends an epoch early (restarting at item 0) after that
        many: a count that never falls short of what remains after any restore (a restore to
        an earlier step lengthens the batches). Until the restart, Keras reads items only to
        build the model, and an item past ``len()`` is the last batch. After it the count is
        ``len()`` again: Keras's pass over the items, made after ``on_train_begin``, ends
        after the plan's last step (an accelerator's look-ahead reads no item past it)."""
        return self._batches.run.steps if self._held else len(self)

    def __getitem__(self, index):
        batches = self._batches
        if self._held:  # before the restart Keras reads batches only to build the model: the first, and on an
            # accelerator one ahead, within the count T of num_batches; any index gets a batch there is
            index = min(int(index), len(batches) - 1)
        x, y, mask, step = batches[index]
        return {"inputs": x, STEP_KEY: step}, y, mask

    def __iter__(self):
        """``(x, y, mask, step)`` of each remaining step, in order, from the optimizer's step
        when the iteration begins."""
        self.restart()
        batches = self._batches
        return (batches[i] for i in range(len(batches)))


class _RestartAtTrainBegin(keras.callbacks.Callback):
    """``batches.restart()`` in ``on_train_begin`` (:meth:`RunBatches.restart_callback`)."""

    def __init__(self, batches):
        super().__init__()
        self._batches = batches

    def on_train_begin(self, logs=None):
        self._batches.restart()


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
        return int(step), np.asarray(key, np.int64)
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


def run_batches(batches, position=None) -> RunBatches:
    """``batches`` (``StepBatches``) as a :class:`RunBatches` ``PyDataset``, which reads
    ``position()`` (the optimizer's agreed position) again when it restarts."""
    return RunBatches(batches, position)


def plan_batches(plan, input_context=None) -> RunBatches:
    """``RunData.batches(...)`` on JAX: a :class:`RunBatches` of the run's ``BatchPlan``
    (``keras_noisecurve.privacy.step_batches``), this process's rows of each step, starting at
    the position every process agrees on (:func:`agreed_position`, read now and again when the
    batches restart). ``input_context`` (a ``tf.distribute`` argument) is refused."""
    if input_context is not None:
        raise ValueError("input_context is a tf.distribute argument; the JAX backend has none.")

    def agreed():  # read now and again before fit's first step (a restore), or a loop's iteration
        # the same in every JAX process, on the same examples in the same order, else refused in all;
        # compared before this process's own check_plan, whose refusal alone would leave the others waiting
        step_key = agreed_position((*plan.position(check=False), plan.built()), plan.source.fingerprint())
        plan.position()
        return step_key

    parts, part, multiple = input_parts()
    return run_batches(plan.step_batches(agreed(), parts=parts, part=part, multiple=multiple), agreed)


# ------------------------------------------------------------ tf.data inputs: TensorFlow's
def _tf_data():
    """The TensorFlow backend's pipeline (imports TensorFlow): ``tf.data`` is TensorFlow's."""
    return importlib.import_module("keras_noisecurve.backend.tensorflow.pipeline")


def gather(source, indices) -> tuple:
    """An example source's rows as tensors in a ``tf.data`` map function: TensorFlow's ``gather``."""
    return _tf_data().gather(source, indices)


def tensor_spec(spec):
    """The ``tf.TensorSpec`` of one leaf of an example: TensorFlow's ``tensor_spec``."""
    return _tf_data().tensor_spec(spec)


def materialize(dataset, *, max_bytes: int):
    """A ``tf.data.Dataset`` of examples read into numpy: TensorFlow's ``materialize``."""
    return _tf_data().materialize(dataset, max_bytes=max_bytes)


def plan_steps_dataset(plan, optimizer=None, *, with_step=False):
    """The ``tf.data.Dataset`` of ``banded_poisson_dataset``'s low-level plan: TensorFlow's."""
    return _tf_data().plan_steps_dataset(plan, optimizer, with_step=with_step)
