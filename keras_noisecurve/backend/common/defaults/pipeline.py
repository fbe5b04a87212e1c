"""The input pipeline of a private run on a backend whose Keras trainer takes a
``keras.utils.PyDataset`` and which runs one process: the plan's batches as a ``PyDataset``
(:func:`plan_batches`). JAX's pipeline is this one, with its processes' agreement added.

:class:`RunBatches` wraps the numpy step batches of a run (an object with
``len()`` and ``batches[i] -> (x, y, mask, step)``, ``keras_noisecurve.privacy.
step_batches.StepBatches``) so Keras's trainer can index them: item i is step
``start + i`` of the plan, and Keras may restart the iteration from item 0 (it does,
after reading one batch to build the model) without skipping a step. ``start`` is read
from the optimizer when the batches are made and again before ``fit``'s first step, after
the callbacks' ``on_train_begin`` (where ``BackupAndRestore`` restores the optimizer), and
before each iteration of a custom loop (:meth:`RunBatches.restart`).

Keras's ``PyDataset`` items are ``(inputs, targets, sample_weights)`` at most, so an item
``batches[i]`` carries the step inside the inputs: ``({"inputs": x, STEP_KEY: step},
y, mask)``; the private model's ``train_step`` takes it apart
(``keras_noisecurve.backend.common.run_batch.split_step``). Iterating the dataset (a custom
loop) yields ``(x, y, mask, step)`` as on TensorFlow.

``tf.data`` inputs (a ``tf.data.Dataset`` of examples, ``banded_poisson_dataset``, an example
source's tensors in a ``tf.data`` map function) are TensorFlow's on any Keras backend: a
program that made a ``tf.data.Dataset`` has TensorFlow. :func:`gather`, :func:`tensor_spec`,
:func:`materialize` and :func:`plan_steps_dataset` hand them to the TensorFlow backend's
pipeline, imported when one is used (numpy sources never import TensorFlow here).
"""

from __future__ import annotations

import importlib

import keras
import numpy as np

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
        then (on a backend with several processes the same in every process, a collective:
        every process restarts together).
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


def shared_key(key) -> np.ndarray:
    """The run's key for the optimizer's build, int64 (2,): ``key`` itself (one process)."""
    return np.ascontiguousarray(np.asarray(key, np.int64))


def one_process_position(position, data=None):
    """``(step, key)`` of ``position`` = ``(step, key, built)``, the optimizer's step and sampling
    key: one process has nothing to agree with (``data``, the examples' fingerprint, unused)."""
    step, key, _ = position
    return int(step), np.asarray(key, np.int64)


def serve(plan, *, agree=one_process_position, parts=(1, 0, 1)) -> RunBatches:
    """A :class:`RunBatches` of the run's ``BatchPlan`` (``keras_noisecurve.privacy.step_batches``),
    starting at the position ``agree((step, key, built), fingerprint) -> (step, key)`` gives (read
    now and again when the batches restart), ``parts = (parts, part, multiple)`` as
    ``plan.step_batches`` takes them (this process's rows of each step)."""

    def agreed():  # read now and again before fit's first step (a restore), or a loop's iteration
        # agreed between processes before this process's own check_plan, whose refusal alone would leave the
        # others waiting
        step_key = agree((*plan.position(check=False), plan.built()), plan.source.fingerprint())
        plan.position()
        return step_key

    count, part, multiple = parts
    return RunBatches(plan.step_batches(agreed(), parts=count, part=part, multiple=multiple), agreed)


def plan_batches(plan, input_context=None) -> RunBatches:
    """``RunData.batches(...)``: a :class:`RunBatches` of the run's ``BatchPlan`` from the
    optimizer's position (:func:`serve`). ``input_context`` (a ``tf.distribute`` argument) is
    refused."""
    if input_context is not None:
        raise ValueError(f"input_context is a tf.distribute argument; the {keras.backend.backend()} backend has "
                         "none.")
    return serve(plan)


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
