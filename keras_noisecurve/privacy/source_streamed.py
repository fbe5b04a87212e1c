"""Streamed sources: a random-access sequence of examples (``"sequence"``) and a
``keras.utils.PyDataset`` of batches (``"py_dataset"``), read batch by batch.

See ``keras_noisecurve.privacy.sources`` for what each kind costs. Importing this module
does not import TensorFlow.
"""

from __future__ import annotations

import collections.abc

import numpy as np

from keras_noisecurve.privacy.source_base import (
    ExampleSource,
    _describe,
    _for_tf,
    _leading_length,
    _spec,
    _split,
    flatten,
    map_structure,
)


class _SequenceSource(ExampleSource):
    """A random-access sequence of examples (``__len__``, ``__getitem__``, maybe ``__getitems__``)."""

    kind = "sequence"

    def __init__(self, sequence, y, sample_weight, example_fn):
        n = len(sequence)
        if n < 1:
            raise ValueError(f"the sequence x ({_describe(sequence)}) is empty.")
        self._sequence = sequence
        self._example_fn = example_fn
        self._getitems = getattr(sequence, "__getitems__", None)
        x0, y0 = self._example(sequence[0], 0)
        if y0 is not None and y is not None:
            raise ValueError(
                "the sequence's examples already hold labels (x, y); y must then be None, got "
                f"{_describe(y)}."
            )
        spec = lambda a: _spec(np.shape(a), np.asarray(a).dtype)  # noqa: E731
        x_spec = map_structure(spec, x0)
        if y is not None:
            y_spec = map_structure(lambda a: _spec(a.shape[1:], a.dtype), y)
        else:
            y_spec = None if y0 is None else map_structure(spec, y0)
        super().__init__(x_spec, y_spec, n, sample_weight)
        self._in_example = flatten(x_spec) + ([] if y0 is None else flatten(y_spec))
        self._y_arrays = [] if y is None else [np.asarray(a) for a in flatten(y)]

    def _example(self, raw, i):
        example = self._example_fn(raw) if self._example_fn is not None else raw
        if self._example_fn is None and not isinstance(example, tuple) and isinstance(example, collections.abc.Mapping):
            raise ValueError(
                f"example {i} of the sequence is a dict with keys {sorted(example)}; pass example_fn to say "
                "which parts are features and labels, e.g. example_fn=lambda ex: (ex['image'], ex['label']), "
                "or example_fn=lambda ex: ex to use the whole dict as x."
            )
        return _split(example, what=f"example {i} of the sequence" + (" after example_fn" if self._example_fn else ""))

    def _read(self, keys: list) -> list:
        """The flat leaves (x then y) of the examples ``keys``, one list per example."""
        raws = list(self._getitems(keys)) if self._getitems is not None else [self._sequence[k] for k in keys]
        if len(raws) != len(keys):
            raise ValueError(f"the sequence returned {len(raws)} examples for {len(keys)} keys.")
        out = []
        for key, raw in zip(keys, raws):
            xe, ye = self._example(raw, key)
            out.append(_flatten(xe) + ([] if ye is None else _flatten(ye)))
        return out

    def _flat_gather(self, indices):
        unique, inverse = np.unique(indices, return_inverse=True)
        examples = self._read(unique.tolist())
        columns = []
        for j, spec in enumerate(self._in_example):
            columns.append(_stack([leaves[j] for leaves in examples], spec, "the sequence")[inverse])
        for a in self._y_arrays:
            columns.append(_for_tf(np.take(a, indices, axis=0)))
        return columns


def _flatten(structure) -> list:
    """:func:`flatten`, with a fast path for one array or scalar (no structure)."""
    if isinstance(structure, (np.ndarray, np.generic, int, float, bytes, str)):
        return [structure]
    if isinstance(structure, (collections.abc.Mapping, list, tuple)):
        return flatten(structure)
    return [structure]


def _stack(column: list, spec, what: str) -> np.ndarray:
    """Stack one leaf of several examples; every example must have the spec's shape and dtype kind."""
    try:
        stacked = np.stack([np.asarray(a) for a in column])
    except ValueError:
        shapes = sorted({np.shape(a) for a in column})
        raise ValueError(
            f"the examples of {what} differ in shape ({shapes}); every example must have the shape of "
            f"example 0, {tuple(spec.shape)}."
        ) from None
    return _conform(stacked, spec, what)


def _conform(stacked: np.ndarray, spec, what: str) -> np.ndarray:
    """Check a batch (P, ...) against the per-example spec; cast to its dtype (same kind only)."""
    shape = tuple(spec.shape)
    if stacked.shape[1:] != shape:
        raise ValueError(
            f"an example of {what} has shape {stacked.shape[1:]}; every example must have the shape of "
            f"example 0, {shape}."
        )
    if spec.is_text:
        return _for_tf(stacked)
    want = spec.dtype
    if stacked.dtype != want:
        if not np.can_cast(stacked.dtype, want, casting="same_kind"):
            raise ValueError(
                f"an example of {what} has dtype {stacked.dtype}; every example must have the dtype of "
                f"example 0, {want}."
            )
        stacked = stacked.astype(want)
    return stacked


class _PyDatasetSource(ExampleSource):
    """A ``keras.utils.PyDataset``: example i is row i % k of batch i // k."""

    kind = "py_dataset"

    def __init__(self, dataset, sample_weight):
        try:
            num_batches = dataset.num_batches
        except NotImplementedError:
            num_batches = None
        if num_batches is None:
            raise ValueError(
                f"the PyDataset {_describe(dataset)} is infinite (num_batches is None); examples are drawn by "
                "index, so it needs a finite number of batches (define __len__ or num_batches)."
            )
        num_batches = int(num_batches)
        if num_batches < 1:
            raise ValueError(f"the PyDataset {_describe(dataset)} has no batches.")
        self._dataset = dataset
        self._num_batches = num_batches
        first = self._batch(0)
        self._k = self._rows(first, 0)
        last = first if num_batches == 1 else self._batch(num_batches - 1)
        last_rows = self._rows(last, num_batches - 1)
        if last_rows > self._k:
            raise ValueError(
                f"the last batch of the PyDataset has {last_rows} rows, more than batch 0 ({self._k}); every "
                "batch but the last must have the rows of batch 0 and the last at most that many."
            )
        x0, y0 = first
        row_spec = lambda a: _spec(np.shape(a)[1:], np.asarray(a).dtype)  # noqa: E731
        super().__init__(
            map_structure(row_spec, x0),
            None if y0 is None else map_structure(row_spec, y0),
            (num_batches - 1) * self._k + last_rows,
            sample_weight,
        )
        self._specs = flatten(self.example_spec[0]) + ([] if y0 is None else flatten(self.example_spec[1]))

    def _batch(self, b: int):
        x, y = _split(self._dataset[b], what=f"batch {b} of the PyDataset")
        x = map_structure(np.asarray, x)
        y = None if y is None else map_structure(np.asarray, y)
        return x, y

    def _rows(self, batch, b: int) -> int:
        x, y = batch
        n = _leading_length(f"batch {b} of the PyDataset (x)", x)
        if y is not None and _leading_length(f"batch {b} of the PyDataset (y)", y) != n:
            raise ValueError(f"batch {b} of the PyDataset has {n} rows of x but {_leading_length('y', y)} of y.")
        if n < 1:
            raise ValueError(f"batch {b} of the PyDataset is empty.")
        return n

    def _flat_gather(self, indices):
        unique, inverse = np.unique(indices, return_inverse=True)
        batch_ids, rows = np.divmod(unique, self._k)
        parts = []
        for b in np.unique(batch_ids).tolist():
            xb, yb = batch = self._batch(b)
            size = self._rows(batch, b)
            expected = self._k if b < self._num_batches - 1 else self.num_examples - b * self._k
            if size != expected:
                raise ValueError(
                    f"batch {b} of the PyDataset has {size} rows; every batch but the last must have the "
                    f"{self._k} rows of batch 0 (and the last {expected}): example i is row i % {self._k} "
                    f"of batch i // {self._k}."
                )
            leaves = flatten(xb) + ([] if yb is None else flatten(yb))
            parts.append([np.take(a, rows[batch_ids == b], axis=0) for a in leaves])
        return [
            _conform(np.concatenate(column)[inverse], spec, "the PyDataset")
            for column, spec in zip(zip(*parts), self._specs)
        ]


# ------------------------------------------------------------------ entry point
