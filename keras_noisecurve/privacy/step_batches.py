"""The batches of a :class:`~keras_noisecurve.privacy.run.PrivateRun` step by step, in
numpy: what the JAX backend's input pipeline serves (``keras_noisecurve.backend.jax.
pipeline``) and the per-key sampler cache the ``tf.data`` pipeline (``pipeline.py``)
shares, handed to the backend's pipeline as a :class:`BatchPlan`. Imports no framework.

Step t's batch is ``(x, y, mask, step)``: the examples of the run's random-access
:class:`~keras_noisecurve.privacy.sampler.BatchSampler` for the optimizer's sampling
key, gathered from the run's example source in numpy, with leading dimension P (the padded batch size);
``mask`` float32 (P,) (1 = real example, times ``sample_weight``), ``step`` int32 (P,)
(every entry t). Split between several input processes (``parts``), each serves its
consecutive block of the step's rows, the batch first padded (mask 0) to a multiple of
the processes and of the devices the batch is split over.

A user-level run (``run.privacy_unit == "user"``) samples users: :class:`Samplers` expands the
sampler's P user slots into P·k rows right after the draw
(:meth:`~keras_noisecurve.privacy.users.UserTable.rows`: slot j is rows ``[j·k, (j+1)·k)``),
and every padding is by whole slots: the rows of a batch, and of each process's block, stay a
multiple of k.
"""

from __future__ import annotations

import copy
import math
import threading
import warnings

import numpy as np

from keras_noisecurve.privacy.sampler import truncation_warning

__all__ = ["BatchPlan", "Samplers", "StepBatches", "blank_rows"]


def _blank(leaf, keep):
    """``leaf`` (P, ...) with the rows where ``keep`` (P,) bool is False set to zero (numbers),
    ``""``/``b""`` (text) or ``None`` (other objects)."""
    leaf = np.asarray(leaf)
    if keep.all():
        return leaf
    if leaf.dtype == object:
        first = next((v for v in leaf.reshape(-1)[:1]), None)
        fill = type(first)() if isinstance(first, (str, bytes)) else None
    else:
        fill = np.zeros((), leaf.dtype)
    out = leaf.copy()
    out[~keep] = fill
    return out


def blank_rows(tree, mask):
    """``tree`` (nested numpy arrays with leading dimension P, or ``None``) with the rows of
    mask 0 blanked (:func:`_blank`): the padding rows of a batch carry no example's data,
    whatever a model does with them (they are gathered as example 0 under mask 0)."""
    if tree is None:
        return None
    keep = np.asarray(mask).reshape(-1) != 0
    if isinstance(tree, dict):
        return {k: blank_rows(v, mask) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        parts = [blank_rows(v, mask) for v in tree]
        return type(tree)(*parts) if hasattr(tree, "_fields") else type(tree)(parts)
    return _blank(tree, keep)


def _check_users(run, users):
    """``users`` (a ``UserTable`` or ``None``) as ``run``'s privacy unit needs it, or ``ValueError``."""
    if (run.privacy_unit == "user") != (users is not None):
        raise ValueError(
            f"a run whose privacy unit is the {run.privacy_unit} takes "
            f"{'users=UserTable(ids, examples_per_user=k)' if users is None else 'no users='}; got "
            f"users={users!r}. Take the batches from run.dataset(x, y{', users=ids' if users is None else ''}).")
    if users is not None and (users.num_users != run.num_users or users.examples_per_user != run.examples_per_user):
        raise ValueError(f"users={users!r} does not fit the run's num_users={run.num_users}, examples_per_user="
                         f"{run.examples_per_user}.")
    return users


class Samplers:
    """One :class:`BatchSampler` per key (normally one), shared by a pipeline's threads;
    warns once when a step's draw was truncated to P examples. ``users``: a user-level run's
    :class:`~keras_noisecurve.privacy.users.UserTable` (required there), which expands each
    step's users into their rows."""

    def __init__(self, run, sample_weight, *, users=None):
        self._run = run
        self._users = _check_users(run, users)
        self._weight = sample_weight
        self._by_key = {}
        self._lock = threading.Lock()
        self._warned = False

    def batch(self, step, key):
        """``(indices int64 (P,), mask float32 (P,))`` of step ``step`` for ``key``; a user-level
        run's: its P·k rows, user-major (``sample_weight`` per example row, before the 1/m_u)."""
        key = np.asarray(key, dtype=np.int64)
        with self._lock:
            sampler = self._by_key.get(key.tobytes())
            if sampler is None:
                sampler = self._run.sampler(key)
                self._by_key = {key.tobytes(): sampler}  # keep only the newest key
        indices, mask, dropped = sampler.batch(int(step))
        if self._users is not None:
            indices, mask = self._users.rows(indices, mask, int(step), key, sample_weight=self._weight)
        elif self._weight is not None:
            mask = mask * self._weight[indices]
        if dropped and not self._warned:
            self._warned = True
            warnings.warn(
                truncation_warning(truncated=sampler.truncated_steps, steps=int(step) + 1,
                                   padded_size=sampler.padded_size, dropped=sampler.dropped_examples,
                                   overflow_probability=self._run.overflow_probability,
                                   unit=getattr(self._run, "privacy_unit", "example")),
                RuntimeWarning,
            )
        return indices, mask.astype(np.float32)


class StepBatches:
    """The batches of a run from a start position: ``batches[i]`` is step ``start + i``.

    Args:
      run: the ``PrivateRun``.
      source: an ``ExampleSource`` of the run's examples
        (:func:`keras_noisecurve.privacy.sources.as_source`), gathered with its numpy ``gather``.
      position: ``(step, key)``, where the batches start (the optimizer's step and its
        sampling key, int64 (2,)).
      parts: the number of input processes that feed each step together (1: this one
        feeds the whole batch); ``part``: which of them this is, in ``[0, parts)``.
      multiple: the global batch is padded to a multiple of ``multiple`` rows too (the
        devices the batch axis is split over; 1: none).
      users: a user-level run's :class:`~keras_noisecurve.privacy.users.UserTable` (required
        there): the batch is then ``run.padded_rows`` = P·k rows, padded to a multiple of
        lcm(``parts``·k, ``multiple``), so that each part's block is whole user slots.

    ``len(batches)`` is ``T − start``; each item is ``(x, y, mask, step)`` numpy arrays
    (``y`` left out of the tuple when the source has no labels: ``(x, None, ...)``) of
    ``rows`` examples: the padded global batch P' = P rounded up to a multiple of
    lcm(``parts``, ``multiple``), divided by ``parts``; part k serves rows
    ``[k·rows, (k+1)·rows)`` of it (the padding rows, mask 0, are the last).
    """

    def __init__(self, run, source, position, *, parts=1, part=0, multiple=1, users=None):
        step, key = position
        for name, value in (("parts", parts), ("multiple", multiple)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if isinstance(part, bool) or not isinstance(part, (int, np.integer)) or not 0 <= part < parts:
            raise ValueError(f"part must be an int in [0, {parts}) (parts={parts}), got {part!r}.")
        self.run = run
        self.source = source
        self.start = int(step)
        self.key = np.asarray(key, dtype=np.int64)
        self._samplers = Samplers(run, source.sample_weight, users=users)
        k = run.examples_per_user  # a user slot's rows (1: example-level)
        # every process's block AND every device's share are whole user slots (a device's rows are
        # contiguous in the global batch only within a process, whatever the mesh)
        unit = math.lcm(int(parts) * k, int(multiple) * k)
        self.padded_size = -(-run.padded_rows // unit) * unit
        self.rows = self.padded_size // int(parts)
        if self.rows % k:  # cannot happen (parts·k divides unit): every block is whole user slots
            raise ValueError(f"{self.rows} rows per part are not whole users of examples_per_user={k}.")
        self._first = int(part) * self.rows

    def at(self, position) -> "StepBatches":
        """These batches from another ``position`` ``(step, key)``: the same run, source and
        split between processes, sharing the samplers (a new key gets its own)."""
        step, key = position
        moved = copy.copy(self)
        moved.start = int(step)
        moved.key = np.asarray(key, dtype=np.int64)
        return moved

    def __len__(self) -> int:
        return max(0, self.run.steps - self.start)

    def __getitem__(self, i):
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"batch {i} is outside the {len(self)} remaining steps of the plan.")
        t = self.start + i
        indices, mask = self._samplers.batch(t, self.key)
        extra = self.padded_size - indices.size
        if extra:  # padding rows: example 0 under mask 0, blanked after the gather
            indices = np.concatenate([indices, np.zeros(extra, np.int64)])
            mask = np.concatenate([mask, np.zeros(extra, np.float32)])
        rows = slice(self._first, self._first + self.rows)
        indices, mask = indices[rows], mask[rows]
        xb, yb = self.source.gather(indices)
        return blank_rows(xb, mask), blank_rows(yb, mask), mask, np.full(mask.shape, t, dtype=np.int32)


class BatchPlan:
    """What the backend's input pipeline (``backend.module("pipeline").plan_batches``) serves a
    run's batches from (``RunData.batches``): the numpy parts, made here.

    Args:
      run: the ``PrivateRun``; source: the ``ExampleSource`` of its examples.
      position: ``position(check=True) -> (step, key)``, where the batches start (the
        optimizer's step and sampling key, read when they start: after any restore;
        ``check``: the optimizer's ``check_plan`` first).
      built: ``built() -> bool``, whether the optimizer holds its own sampling key (a built
        optimizer's), not yet the run's fresh one.
      users: a user-level run's :class:`~keras_noisecurve.privacy.users.UserTable`.
    """

    def __init__(self, run, source, position, *, built, users=None):
        self.run, self.source, self.position, self.built, self.users = run, source, position, built, users

    def sampler(self):
        """``batch_of(step, key) -> (indices, mask)``: the run's :class:`Samplers` (for a pipeline
        that gathers the examples itself)."""
        return Samplers(self.run, self.source.sample_weight, users=self.users).batch

    def step_batches(self, position, *, parts=1, part=0, multiple=1) -> StepBatches:
        """The numpy :class:`StepBatches` from ``position`` ``(step, key)``."""
        return StepBatches(self.run, self.source, position, parts=parts, part=part, multiple=multiple,
                           users=self.users)
