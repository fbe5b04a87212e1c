"""Random-access example sources: the features of a batch from its example indices.

A private run draws its batches up front as example indices (see
``keras_noisecurve.privacy.sampler``); step t needs the rows ``indices`` (int64,
shape (P,)) of the training data as fixed-shape tensors. :func:`as_source` wraps
the data in an :class:`ExampleSource` whose :meth:`~ExampleSource.tf_gather`
does that inside a ``tf.data`` map function::

    source = as_source(x, y)
    ds = tf.data.Dataset.from_tensor_slices(plan.indices)          # (T, P) int64
    ds = ds.map(source.tf_gather, num_parallel_calls=tf.data.AUTOTUNE).prefetch(2)

Accepted inputs (``kind``) and what each costs:

- ``"memory"`` — numpy arrays (n, ...), or a dict / tuple / list of them (and
  anything ``np.asarray`` turns into one: tensors, DataFrames). ``tf.gather`` on
  constant tensors: the fastest path; the data must fit in memory.
- ``"memory"`` from a ``tf.data.Dataset`` of examples ``x``, ``(x,)``, ``(x, y)``
  or ``(x, y, sample_weight)`` (a batched dataset — every component with an
  unknown leading dimension — is unbatched): read once and stacked into numpy;
  more than :data:`MAX_MATERIALIZED_BYTES` (2 GiB) is refused.
- ``"memmap"`` — a ``np.memmap`` (``np.load(path, mmap_mode="r")``) or any array
  whose buffer is a memory map, alone or in a dict / tuple with in-memory arrays
  (e.g. memmap features, in-memory labels). Nothing is loaded: each batch reads
  its rows by numpy fancy indexing (indices sorted and de-duplicated for
  locality, then put back in order) inside ONE ``tf.numpy_function`` per batch.
  Memory: the batches in flight, plus the file pages the kernel keeps cached
  (reclaimable page cache; the source advises the kernel of random access,
  ``MADV_RANDOM``, so a page fault reads one page, not a read-ahead window).
- ``"sequence"`` — any random-access sequence with ``__len__`` and
  ``__getitem__(i)`` returning ONE example: ``x``, ``(x,)`` or ``(x, y)`` (a dict
  needs ``example_fn``: it maps one raw example to ``(x, y)`` or ``x``).
  ``__getitems__(list_of_ints)`` is used when present (TFDS
  ``tfds.data_source(...)``, whose examples are dicts like
  ``{"image": ..., "label": ...}``). Shapes and dtypes are those of example 0
  (after ``example_fn``); every example must match them. Cost: one Python call
  per example (or per batch with ``__getitems__``) plus a ``np.stack``, in one
  ``tf.numpy_function`` per batch.
- ``"py_dataset"`` — a ``keras.utils.PyDataset`` (whose ``__getitem__`` returns a
  BATCH ``x``, ``(x,)`` or ``(x, y)``): example i is row ``i % k`` of batch
  ``i // k``, k = the size of batch 0; every batch but the last must have k rows
  (the last is read when the source is built, the others are checked when read).
  A gather loads only the batches its indices fall in — up to P whole batches
  for P scattered indices, so keep its batches small (k = 1 is a per-example
  sequence). ``on_epoch_end`` is never called: batch i must always hold the
  same examples (no shuffling inside the PyDataset).

Not accepted: generators, iterators and other objects that cannot be indexed
(the run draws examples by index, in any order, several times).

Thread safety: ``tf.data`` calls ``tf_gather``'s Python function from several
threads at once; the sources keep no mutable state, so a sequence's or
PyDataset's ``__getitem__`` / ``__getitems__`` must be safe to call
concurrently (reading files or a memory map is).

``sample_weight`` is always an (n,) float32 numpy array held in memory (or None);
weights inside a streamed source's examples are refused (they would have to be
read in full up front): pass them as ``sample_weight=``.

Importing this module does not import TensorFlow; :func:`as_source` does.
"""

from __future__ import annotations

import collections.abc
import inspect
import mmap
import sys
import threading
from typing import Callable, Optional

import numpy as np

#: A tf.data input is materialised into numpy once; larger inputs are refused.
MAX_MATERIALIZED_BYTES = 2 * 1024**3

KINDS = ("memory", "memmap", "sequence", "py_dataset")


# ------------------------------------------------------------------ helpers
def _nbytes(structure) -> int:
    import tensorflow as tf

    return sum(int(np.asarray(a).nbytes) for a in tf.nest.flatten(structure))


def _materialize(dataset):
    """(x, y, sample_weight) numpy structures from a dataset of examples."""
    import tensorflow as tf

    spec = dataset.element_spec
    leaves = tf.nest.flatten(spec)
    if leaves and all(getattr(s, "shape", None) is not None and s.shape.rank and s.shape[0] is None for s in leaves):
        dataset = dataset.unbatch()  # a batched dataset: every component has an unknown leading dim
        spec = dataset.element_spec
    rows, total = [], 0
    for element in dataset.as_numpy_iterator():
        total += _nbytes(element)
        if total > MAX_MATERIALIZED_BYTES:
            raise ValueError(
                f"the tf.data input exceeds {MAX_MATERIALIZED_BYTES / 1024**3:g} GiB when materialised; "
                "a tf.data input is read into memory once to gather its batches. For larger data pass a "
                "np.memmap (np.load(path, mmap_mode='r')), a random-access sequence (e.g. "
                "tfds.data_source(...)) or a keras.utils.PyDataset: those are streamed."
            )
        rows.append(element)
    if not rows:
        raise ValueError("the tf.data input is empty.")
    stacked = tf.nest.map_structure(lambda *xs: np.stack(xs), *rows)
    if isinstance(spec, tuple):
        if len(spec) == 1:
            return stacked[0], None, None
        if len(spec) == 2:
            return stacked[0], stacked[1], None
        if len(spec) == 3:
            return stacked[0], stacked[1], stacked[2]
        raise ValueError(f"a tuple element must be (x,), (x, y) or (x, y, sample_weight); got {len(spec)} parts.")
    return stacked, None, None


def _leading_length(name, structure) -> int:
    import tensorflow as tf

    lengths = {int(np.shape(a)[0]) if np.ndim(a) else -1 for a in tf.nest.flatten(structure)}
    if len(lengths) != 1 or -1 in lengths:
        raise ValueError(
            f"every array in {name} must have the same leading (example) dimension; got lengths "
            f"{sorted(lengths)} (-1: a scalar)."
        )
    return lengths.pop()


def _mapping_of(array) -> Optional[mmap.mmap]:
    """The ``mmap.mmap`` an array's buffer lives in (walking ``.base``), or None."""
    base = array
    while base is not None:
        if isinstance(base, mmap.mmap):
            return base
        base = getattr(base, "base", None)
    return None


def _native(dtype: np.dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    return dtype if dtype.kind in "USO" else dtype.newbyteorder("=")


def _tf_dtype(dtype: np.dtype):
    import tensorflow as tf

    dtype = np.dtype(dtype)
    if dtype.kind in "USO":
        return tf.string
    return tf.as_dtype(_native(dtype))


def _spec(shape, dtype):
    import tensorflow as tf

    return tf.TensorSpec(tuple(shape), _tf_dtype(dtype))


def _describe(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _take(array, indices: np.ndarray) -> np.ndarray:
    """Rows ``array[indices]`` of a (memory-mapped) array, read in sorted order.

    The unique indices are read in increasing order (locality on disk), then the
    rows are put back in the order of ``indices`` (repeats included).
    """
    unique, inverse = np.unique(indices, return_inverse=True)
    rows = np.asarray(array[unique])
    return rows if unique.size == indices.size and np.array_equal(unique, indices) else rows[inverse]


def _is_tuple(obj) -> bool:
    return isinstance(obj, tuple) and not hasattr(obj, "_fields")  # a namedtuple is one structure


def _split(element, *, what: str, allow_weights: bool = False):
    """``x`` / ``(x,)`` / ``(x, y)`` -> (x, y or None); ``(x, y, w)`` refused."""
    if _is_tuple(element):
        if len(element) == 1:
            return element[0], None
        if len(element) == 2:
            return element[0], element[1]
        if len(element) == 3 and not allow_weights:
            raise ValueError(
                f"{what} is a 3-tuple (x, y, sample_weight); weights inside a streamed source are not read "
                "(they are needed for every example up front): pass them as as_source(..., sample_weight=) "
                "— an (n,) array — and return (x, y)."
            )
        raise ValueError(f"{what} must be x, (x,) or (x, y); got a tuple of {len(element)} parts.")
    return element, None


class ExampleSource:
    """Training examples that can be gathered by index.

    Attributes:
      kind: one of :data:`KINDS` (see the module docstring for their costs).
      num_examples: n.
      has_labels: whether ``tf_gather`` returns labels (``y``).
      element_spec: ``(x_spec, y_spec or None)``, nested ``tf.TensorSpec`` of ONE
        example (no batch dimension).
      sample_weight: None or a float32 numpy array (n,).
    """

    kind: str = ""

    def __init__(self, x_spec, y_spec, num_examples: int, sample_weight):
        self.element_spec = (x_spec, y_spec)
        self.num_examples = int(num_examples)
        self.has_labels = y_spec is not None
        self.sample_weight = _check_weights(sample_weight, self.num_examples)

    def __len__(self) -> int:
        return self.num_examples

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kind={self.kind!r}, num_examples={self.num_examples}, has_labels={self.has_labels})"

    # --- subclasses implement gather (numpy); tf_gather wraps it by default
    def gather(self, indices) -> tuple:
        """``(x_batch, y_batch or None)`` numpy structures for int indices (P,).

        Any thread may call it. Leaves have shape (P, *spec.shape) and the spec's dtype.
        """
        raise NotImplementedError

    def tf_gather(self, indices) -> tuple:
        """``(x_batch, y_batch or None)`` tensors for an int64 tensor ``indices`` (P,).

        For a ``tf.data`` map function (graph mode) or eager use. Every leaf has the
        static shape ``(P, *spec.shape)`` (P static when ``indices``' shape is) and
        the spec's dtype. Streamed kinds run ONE ``tf.numpy_function`` per call.
        """
        import tensorflow as tf

        indices = tf.convert_to_tensor(indices)
        if indices.dtype != tf.int64:
            indices = tf.cast(indices, tf.int64)
        x_spec, y_spec = self.element_spec
        specs = tf.nest.flatten(x_spec) + ([] if y_spec is None else tf.nest.flatten(y_spec))
        dtypes = [s.dtype.as_numpy_dtype if s.dtype != tf.string else object for s in specs]
        num_x = len(tf.nest.flatten(x_spec))

        def flat_gather(idx):
            xb, yb = self.gather(idx)
            leaves = tf.nest.flatten(xb) + ([] if yb is None else tf.nest.flatten(yb))
            return [np.asarray(a, dtype=d) for a, d in zip(leaves, dtypes)]

        flat = tf.numpy_function(
            flat_gather, [indices], [s.dtype for s in specs], stateful=False, name=f"gather_{self.kind}"
        )
        lead = indices.shape[:1]
        for tensor, spec in zip(flat, specs):
            tensor.set_shape(lead.concatenate(spec.shape))
        xb = tf.nest.pack_sequence_as(x_spec, flat[:num_x])
        yb = None if y_spec is None else tf.nest.pack_sequence_as(y_spec, flat[num_x:])
        return xb, yb


def _check_weights(sample_weight, n: int):
    if sample_weight is None:
        return None
    weights = np.array(sample_weight, dtype=np.float32)  # a copy, held in memory
    if weights.shape != (n,):
        raise ValueError(f"sample_weight must have shape ({n},) (one weight per example), got {weights.shape}.")
    if not np.all(np.isfinite(weights)) or np.any(weights < 0):
        raise ValueError("sample_weight must be finite and >= 0.")
    return weights


class _ArraySource(ExampleSource):
    """numpy arrays in memory, gathered by ``tf.gather`` on constant tensors."""

    kind = "memory"

    def __init__(self, x, y, n, sample_weight):
        import tensorflow as tf

        self._x, self._y = x, y
        spec = lambda a: _spec(a.shape[1:], a.dtype)  # noqa: E731
        super().__init__(
            tf.nest.map_structure(spec, x), None if y is None else tf.nest.map_structure(spec, y), n, sample_weight
        )
        self._tensors = None
        self._lock = threading.Lock()

    def _constants(self):
        import tensorflow as tf

        with self._lock:
            if self._tensors is None:
                with tf.init_scope():  # eager constants, captured by the map function (not graph constants)
                    convert = lambda a: tf.convert_to_tensor(a)  # noqa: E731
                    self._tensors = (
                        tf.nest.map_structure(convert, self._x),
                        None if self._y is None else tf.nest.map_structure(convert, self._y),
                    )
            return self._tensors

    def gather(self, indices):
        import tensorflow as tf

        idx = np.asarray(indices, dtype=np.int64)
        take = lambda a: np.take(a, idx, axis=0)  # noqa: E731
        return tf.nest.map_structure(take, self._x), (None if self._y is None else tf.nest.map_structure(take, self._y))

    def tf_gather(self, indices):
        import tensorflow as tf

        x_t, y_t = self._constants()
        take = lambda a: tf.gather(a, indices)  # noqa: E731
        return tf.nest.map_structure(take, x_t), (None if y_t is None else tf.nest.map_structure(take, y_t))


class _MemmapSource(ExampleSource):
    """Arrays of which at least one is memory-mapped; rows read per batch by numpy."""

    kind = "memmap"

    def __init__(self, x, y, n, sample_weight):
        import tensorflow as tf

        self._x, self._y = x, y
        spec = lambda a: _spec(a.shape[1:], a.dtype)  # noqa: E731
        super().__init__(
            tf.nest.map_structure(spec, x), None if y is None else tf.nest.map_structure(spec, y), n, sample_weight
        )
        for leaf in tf.nest.flatten((x, y)):
            mapping = _mapping_of(leaf) if leaf is not None else None
            if mapping is not None and hasattr(mapping, "madvise") and hasattr(mmap, "MADV_RANDOM"):
                try:
                    mapping.madvise(mmap.MADV_RANDOM)
                except (OSError, ValueError):  # closed or not supported here: only a hint
                    pass

    def gather(self, indices):
        import tensorflow as tf

        idx = np.asarray(indices, dtype=np.int64)

        def take(a):
            rows = _take(a, idx) if _mapping_of(a) is not None else np.take(a, idx, axis=0)
            return rows.astype(_native(rows.dtype), copy=False)

        return tf.nest.map_structure(take, self._x), (None if self._y is None else tf.nest.map_structure(take, self._y))


class _SequenceSource(ExampleSource):
    """A random-access sequence of examples (``__len__``, ``__getitem__``, maybe ``__getitems__``)."""

    kind = "sequence"

    def __init__(self, sequence, y, sample_weight, example_fn):
        import tensorflow as tf

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
        self._y = y
        self._x_structure = x0
        self._y_structure = y0
        self._x_flat = [np.asarray(a) for a in tf.nest.flatten(x0)]
        self._y_flat = None if y0 is None else [np.asarray(a) for a in tf.nest.flatten(y0)]
        spec = lambda a: _spec(np.shape(a), np.asarray(a).dtype)  # noqa: E731
        x_spec = tf.nest.map_structure(spec, x0)
        if y is not None:
            y_spec = tf.nest.map_structure(lambda a: _spec(a.shape[1:], a.dtype), y)
        else:
            y_spec = None if y0 is None else tf.nest.map_structure(spec, y0)
        super().__init__(x_spec, y_spec, n, sample_weight)

    def _example(self, raw, i):
        example = self._example_fn(raw) if self._example_fn is not None else raw
        if self._example_fn is None and isinstance(example, collections.abc.Mapping):
            raise ValueError(
                f"example {i} of the sequence is a dict with keys {sorted(example)}; pass example_fn to say "
                "which parts are features and labels, e.g. example_fn=lambda ex: (ex['image'], ex['label']), "
                "or example_fn=lambda ex: ex to use the whole dict as x."
            )
        return _split(example, what=f"example {i} of the sequence" + (" after example_fn" if self._example_fn else ""))

    def _raw(self, keys: list) -> list:
        if self._getitems is not None:
            return list(self._getitems(keys))
        return [self._sequence[k] for k in keys]

    def _stack(self, examples, keys):
        """Stack per leaf the (x, y) examples read for ``keys``; check shapes/dtypes."""
        import tensorflow as tf

        x_spec, y_spec = self.element_spec
        x_leaves = [[] for _ in self._x_flat]
        y_leaves = None if self._y_flat is None else [[] for _ in self._y_flat]
        for key, (xe, ye) in zip(keys, examples):
            for column, leaf in zip(x_leaves, tf.nest.flatten(xe)):
                column.append(leaf)
            if y_leaves is not None:
                for column, leaf in zip(y_leaves, tf.nest.flatten(ye)):
                    column.append(leaf)
        out = []
        flat_specs = tf.nest.flatten(x_spec) + ([] if y_leaves is None else tf.nest.flatten(y_spec))
        for column, spec in zip(x_leaves + (y_leaves or []), flat_specs):
            try:
                stacked = np.stack(column)
            except ValueError:
                shapes = {np.shape(a) for a in column}
                raise ValueError(
                    f"the examples of the sequence differ in shape ({sorted(shapes)}); every example must have "
                    f"the shape of example 0, {tuple(spec.shape)}."
                ) from None
            if stacked.shape[1:] != tuple(spec.shape):
                raise ValueError(
                    f"an example has shape {stacked.shape[1:]}, example 0 has {tuple(spec.shape)}; every example "
                    "must have the shape (and dtype) of example 0."
                )
            out.append(stacked)
        return out

    def _examples(self, keys: list) -> list:
        return [self._example(raw, k) for k, raw in zip(keys, self._raw(keys))]

    def gather(self, indices):
        import tensorflow as tf

        idx = np.asarray(indices, dtype=np.int64)
        unique, inverse = np.unique(idx, return_inverse=True)
        keys = unique.tolist()
        columns = [c[inverse] for c in self._stack(self._examples(keys), keys)]
        x_spec, y_spec = self.element_spec
        num_x = len(self._x_flat)
        xb = tf.nest.pack_sequence_as(self._x_structure, columns[:num_x])
        if self._y is not None:
            yb = tf.nest.map_structure(lambda a: np.take(a, idx, axis=0), self._y)
        elif y_spec is None:
            yb = None
        else:
            yb = tf.nest.pack_sequence_as(self._y_structure, columns[num_x:])
        return xb, yb


class _PyDatasetSource(_SequenceSource):
    """A ``keras.utils.PyDataset``: example i is row i % k of batch i // k."""

    kind = "py_dataset"

    def __init__(self, dataset, sample_weight):
        import tensorflow as tf

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
        first = self._batch(0, check=False)
        self._k = self._rows(first, 0)
        last = first if num_batches == 1 else self._batch(num_batches - 1, check=False)
        last_rows = self._rows(last, num_batches - 1)
        if last_rows > self._k:
            raise ValueError(
                f"the last batch of the PyDataset has {last_rows} rows, more than batch 0 ({self._k}); every "
                "batch but the last must have the rows of batch 0 and the last at most that many."
            )
        n = (num_batches - 1) * self._k + last_rows
        x0, y0 = first
        self._x_structure, self._y_structure, self._y = x0, y0, None
        row_spec = lambda a: _spec(np.shape(a)[1:], np.asarray(a).dtype)  # noqa: E731
        self._x_flat = tf.nest.flatten(x0)
        self._y_flat = None if y0 is None else tf.nest.flatten(y0)
        ExampleSource.__init__(
            self,
            tf.nest.map_structure(row_spec, x0),
            None if y0 is None else tf.nest.map_structure(row_spec, y0),
            n,
            sample_weight,
        )

    def _batch(self, b: int, *, check: bool = True):
        import tensorflow as tf

        x, y = _split(self._dataset[b], what=f"batch {b} of the PyDataset")
        x = tf.nest.map_structure(np.asarray, x)
        y = None if y is None else tf.nest.map_structure(np.asarray, y)
        if check:
            rows = self._rows((x, y), b)
            expected = self._k if b < self._num_batches - 1 else self.num_examples - b * self._k
            if rows != expected:
                raise ValueError(
                    f"batch {b} of the PyDataset has {rows} rows; every batch but the last must have the "
                    f"{self._k} rows of batch 0 (and the last {expected}): example i is row i % {self._k} "
                    f"of batch i // {self._k}."
                )
        return x, y

    def _rows(self, batch, b: int) -> int:
        x, y = batch
        n = _leading_length(f"batch {b} of the PyDataset (x)", x)
        if y is not None and _leading_length(f"batch {b} of the PyDataset (y)", y) != n:
            raise ValueError(f"batch {b} of the PyDataset has {n} rows of x but {_leading_length('y', y)} of y.")
        if n < 1:
            raise ValueError(f"batch {b} of the PyDataset is empty.")
        return n

    def gather(self, indices):
        import tensorflow as tf

        idx = np.asarray(indices, dtype=np.int64)
        unique, inverse = np.unique(idx, return_inverse=True)
        batch_ids, rows = np.divmod(unique, self._k)
        columns = None
        parts = []
        for b in np.unique(batch_ids).tolist():
            xb, yb = self._batch(b)
            select = rows[batch_ids == b]
            leaves = tf.nest.flatten(xb) + ([] if yb is None else tf.nest.flatten(yb))
            parts.append([np.take(a, select, axis=0) for a in leaves])
        columns = [np.concatenate(column)[inverse] for column in zip(*parts)]
        num_x = len(self._x_flat)
        xo = tf.nest.pack_sequence_as(self._x_structure, columns[:num_x])
        yo = None if self._y_structure is None else tf.nest.pack_sequence_as(self._y_structure, columns[num_x:])
        return xo, yo


# ------------------------------------------------------------------ entry point
def _is_array_like(obj) -> bool:
    return isinstance(obj, (np.ndarray, collections.abc.Mapping, list, tuple)) or hasattr(obj, "__array__")


def _refuse(name: str, obj):
    raise ValueError(
        f"{name} cannot be indexed: got {_describe(obj)}. Allowed: numpy arrays (or a dict/tuple of them, "
        "np.memmap included), a tf.data.Dataset of examples, a keras.utils.PyDataset, or a random-access "
        "sequence with __len__ and __getitem__(i) (e.g. tfds.data_source(...)). Generators and iterators are "
        "read once, in order: examples are drawn by index, several times, so they cannot be used."
    )


def _arrays(name: str, structure):
    """numpy arrays of a structure; memory-mapped leaves are kept as they are (not loaded)."""
    import tensorflow as tf

    def leaf(a):
        if isinstance(a, np.ndarray):
            return a
        if not hasattr(a, "__array__") and hasattr(a, "__getitem__") and hasattr(a, "__len__") and not isinstance(a, str):
            raise ValueError(
                f"{name} holds a {_describe(a)}, a sequence inside a dict/tuple; pass the sequence itself as x "
                "(with example_fn to build the dict of each example)."
            )
        if inspect.isgenerator(a) or isinstance(a, collections.abc.Iterator):
            _refuse(name, a)
        return np.asarray(a)

    return tf.nest.map_structure(leaf, structure)


def as_source(x, y=None, *, sample_weight=None, example_fn: Optional[Callable] = None) -> ExampleSource:
    """Wrap training data in an :class:`ExampleSource` that gathers batches by index.

    Args:
      x: the examples; see the module docstring for the accepted kinds — numpy
        arrays (n, ...) or a dict/tuple of them (``np.memmap`` leaves are streamed),
        a ``tf.data.Dataset`` of examples, a random-access sequence of examples, or
        a ``keras.utils.PyDataset`` of batches.
      y: labels (n, ...) or a structure of them, or None. Arrays only (in memory or
        memory-mapped); must be None when x is a ``tf.data.Dataset``, a PyDataset or
        a sequence whose examples hold labels.
      sample_weight: optional per-example weights, shape (n,); held in memory as
        float32 (``ExampleSource.sample_weight``). Must be None for a
        ``tf.data.Dataset`` (put them in its elements).
      example_fn: for a sequence only: maps one raw example (e.g. a TFDS dict) to
        ``(x, y)`` or ``x``. Called from several threads at once.

    Returns:
      ExampleSource.

    Raises:
      ValueError: x cannot be indexed (a generator, an iterator, ...), lengths of x,
        y and sample_weight disagree, or an argument does not apply to x's kind.
    """
    if example_fn is not None and not callable(example_fn):
        raise TypeError(f"example_fn must be callable or None, got {example_fn!r} ({type(example_fn).__name__}).")
    if x is None:
        raise ValueError("x is None; pass the training examples.")
    tf = sys.modules.get("tensorflow")
    keras = sys.modules.get("keras")
    is_dataset = tf is not None and isinstance(x, tf.data.Dataset)
    is_py_dataset = keras is not None and isinstance(x, keras.utils.PyDataset)
    streamed = not is_dataset and not _is_array_like(x) and not is_py_dataset
    if example_fn is not None and not streamed:
        raise ValueError(
            f"example_fn applies to a random-access sequence x only; x is a {_describe(x)}. Transform arrays "
            "before passing them (or map the tf.data.Dataset)."
        )
    if is_dataset:
        if y is not None or sample_weight is not None:
            raise ValueError("with a tf.data.Dataset input, put y and sample_weight inside the dataset's elements.")
        x, y, sample_weight = _materialize(x)
        return _ArraySource(x, y, _length(x, y), sample_weight)
    if is_py_dataset:
        if y is not None:
            raise ValueError(f"with a keras.utils.PyDataset input, y comes from its batches; got y={_describe(y)}.")
        return _PyDatasetSource(x, sample_weight)
    if inspect.isgenerator(x) or isinstance(x, collections.abc.Iterator):
        _refuse("x", x)
    if y is not None and not _is_array_like(y):
        raise ValueError(f"y must be numpy arrays (or a dict/tuple of them, np.memmap included); got {_describe(y)}.")
    if streamed:
        if not (hasattr(x, "__len__") and hasattr(x, "__getitem__")) or isinstance(x, (str, bytes)):
            _refuse("x", x)
        if y is not None:
            y = _arrays("y", y)
            if _leading_length("y", y) != len(x):
                raise ValueError(f"y has {_leading_length('y', y)} examples but x has {len(x)}.")
        return _SequenceSource(x, y, sample_weight, example_fn)
    import tensorflow as tf

    was_list = isinstance(x, list)
    x = _arrays("x", x)
    y = None if y is None else _arrays("y", y)
    try:
        n = _length(x, y)
    except ValueError as error:
        if not was_list:
            raise
        raise ValueError(
            f"{error} A list x is read as a list of input arrays (Keras multi-input); for a list of examples, "
            "wrap it in a class with __len__ and __getitem__ (a random-access sequence) or stack it with numpy."
        ) from None
    leaves = tf.nest.flatten(x) + ([] if y is None else tf.nest.flatten(y))
    if any(_mapping_of(a) is not None for a in leaves):
        return _MemmapSource(x, y, n, sample_weight)
    return _ArraySource(x, y, n, sample_weight)


def _length(x, y) -> int:
    n = _leading_length("x", x)
    if y is not None and _leading_length("y", y) != n:
        raise ValueError(f"y has {_leading_length('y', y)} examples but x has {n}.")
    if n < 1:
        raise ValueError("x has no examples (leading dimension 0).")
    return n
