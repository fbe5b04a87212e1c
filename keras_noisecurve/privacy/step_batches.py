"""The batches of a :class:`~keras_noisecurve.privacy.run.PrivateRun` step by step, in
numpy: what the JAX backend's input pipeline serves (``keras_noisecurve.backend.jax.
pipeline``) and the per-key sampler cache the ``tf.data`` pipeline (``pipeline.py``)
shares. Imports no framework.

Step t's batch is ``(x, y, mask, step)``: the examples of the run's random-access
:class:`~keras_noisecurve.privacy.sampler.BatchSampler` for the optimizer's sampling
key, gathered from numpy arrays, with leading dimension P (the padded batch size);
``mask`` float32 (P,) (1 = real example, times ``sample_weight``), ``step`` int32 (P,)
(every entry t).
"""

from __future__ import annotations

import threading
import warnings

import numpy as np

from keras_noisecurve.privacy.sampler import truncation_warning

__all__ = ["ArraySource", "Samplers", "StepBatches"]


def _map(fn, structure):
    """``fn`` on every array of a dict / list / tuple structure (the structure kept)."""
    if isinstance(structure, dict):
        return {k: _map(fn, v) for k, v in structure.items()}
    if isinstance(structure, (list, tuple)) and not hasattr(structure, "_fields"):
        return type(structure)(_map(fn, v) for v in structure)
    return fn(structure)


def _leaves(structure) -> list:
    out = []
    _map(out.append, structure)
    return out


class ArraySource:
    """In-memory (or memory-mapped) numpy examples gathered by index, with no framework.

    Args:
      x: an array (n, ...) or a dict / list / tuple of them.
      y: ``None`` or the same for the labels.
      sample_weight: ``None`` or an (n,) array of non-negative weights.

    Raises ``ValueError`` when the arrays' leading dimensions differ, or for anything
    that is not numpy data (a ``tf.data.Dataset``, a sequence, a ``PyDataset``: those
    kinds of ``keras_noisecurve.privacy.sources`` need TensorFlow).
    """

    kind = "memory"

    def __init__(self, x, y=None, sample_weight=None):
        def as_array(a):
            if hasattr(a, "__len__") and hasattr(a, "__getitem__") and not hasattr(a, "shape"):
                if not isinstance(a, (list, tuple)):
                    raise ValueError(
                        f"on the JAX backend run.dataset(x, y) takes numpy arrays (or dicts/tuples of them); "
                        f"got {type(a).__name__}."
                    )
            if not hasattr(a, "shape"):
                raise ValueError(
                    "on the JAX backend run.dataset(x, y) takes numpy arrays (or dicts/tuples of them); got "
                    f"{type(a).__module__}.{type(a).__name__}."
                )
            return np.asarray(a)

        self._x = _map(as_array, x)
        self._y = None if y is None else _map(as_array, y)
        lengths = {int(a.shape[0]) if a.ndim else -1 for a in _leaves(self._x) + ([] if self._y is None else _leaves(self._y))}
        if len(lengths) != 1 or -1 in lengths:
            raise ValueError(f"every array in x and y must have the same leading (example) dimension; got {sorted(lengths)}.")
        self.num_examples = lengths.pop()
        self.has_labels = self._y is not None
        if sample_weight is not None:
            sample_weight = np.asarray(sample_weight, dtype=np.float32).reshape(-1)
            if sample_weight.shape != (self.num_examples,) or np.any(sample_weight < 0) or not np.all(
                np.isfinite(sample_weight)
            ):
                raise ValueError(
                    f"sample_weight must be {self.num_examples} finite non-negative numbers, got shape "
                    f"{sample_weight.shape}."
                )
        self.sample_weight = sample_weight

    def __len__(self) -> int:
        return self.num_examples

    def gather(self, indices) -> tuple:
        """``(x_batch, y_batch or None)``: the rows ``indices`` (int (P,)) of every array."""
        indices = np.asarray(indices, dtype=np.int64)
        take = lambda a: np.take(a, indices, axis=0)  # noqa: E731
        return _map(take, self._x), (None if self._y is None else _map(take, self._y))

    def __repr__(self) -> str:
        return f"ArraySource(num_examples={self.num_examples}, has_labels={self.has_labels})"


class Samplers:
    """One :class:`BatchSampler` per key (normally one), shared by a pipeline's threads;
    warns once when a step's draw was truncated to P examples."""

    def __init__(self, run, sample_weight):
        self._run = run
        self._weight = sample_weight
        self._by_key = {}
        self._lock = threading.Lock()
        self._warned = False

    def batch(self, step, key):
        """``(indices int64 (P,), mask float32 (P,))`` of step ``step`` for ``key``."""
        key = np.asarray(key, dtype=np.int64)
        with self._lock:
            sampler = self._by_key.get(key.tobytes())
            if sampler is None:
                sampler = self._run.sampler(key)
                self._by_key = {key.tobytes(): sampler}  # keep only the newest key
        indices, mask, dropped = sampler.batch(int(step))
        if self._weight is not None:
            mask = mask * self._weight[indices]
        if dropped and not self._warned:
            self._warned = True
            warnings.warn(
                truncation_warning(truncated=sampler.truncated_steps, steps=int(step) + 1,
                                   padded_size=sampler.padded_size, dropped=sampler.dropped_examples,
                                   overflow_probability=self._run.overflow_probability),
                RuntimeWarning,
            )
        return indices, mask.astype(np.float32)


class StepBatches:
    """The batches of a run from a start position: ``batches[i]`` is step ``start + i``.

    Args:
      run: the ``PrivateRun``.
      source: an :class:`ArraySource` of the run's examples.
      position: ``(step, key)``, where the batches start (the optimizer's step and its
        sampling key, int64 (2,)).

    ``len(batches)`` is ``T − start``; each item is ``(x, y, mask, step)`` numpy arrays
    (``y`` left out of the tuple when the source has no labels: ``(x, None, ...)``).
    """

    def __init__(self, run, source, position):
        step, key = position
        self.run = run
        self.source = source
        self.start = int(step)
        self.key = np.asarray(key, dtype=np.int64)
        self._samplers = Samplers(run, source.sample_weight)

    def __len__(self) -> int:
        return max(0, self.run.steps - self.start)

    def __getitem__(self, i):
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"batch {i} is outside the {len(self)} remaining steps of the plan.")
        t = self.start + i
        indices, mask = self._samplers.batch(t, self.key)
        xb, yb = self.source.gather(indices)
        return xb, yb, mask, np.full(mask.shape, t, dtype=np.int32)
