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
  constant tensors captured by the map function: the fastest path; the data must
  fit in memory. (With tf.data's default static optimizations, creating an
  iterator copies the captured tensors once, transiently; none with
  ``experimental_optimization.apply_default_optimizations=False``.)
- ``"memory"`` from a ``tf.data.Dataset`` of examples ``x``, ``(x,)``, ``(x, y)``
  or ``(x, y, sample_weight)`` (a batched dataset — every component with an
  unknown leading dimension — is unbatched): read once and stacked into numpy;
  more than :data:`MAX_MATERIALIZED_BYTES` (2 GiB) is refused.
- ``"memmap"`` — a ``np.memmap`` (``np.load(path, mmap_mode="r")``) or any array
  whose buffer is a memory map, alone or in a dict / tuple with in-memory arrays
  (e.g. memmap features, in-memory labels). Nothing is loaded and nothing is
  captured by the graph: each batch reads its rows with one ``np.take`` per array
  (rows in the order of the indices) inside ONE ``tf.numpy_function`` per batch.
  The source reads through its own read-only map of the file, advised
  ``MADV_RANDOM`` (a page fault reads one page, not a read-ahead window; the
  user's map is left as it is). The trade: on a cold file that fits in memory,
  read-ahead warms the cache faster, but on a file larger than memory it reads and
  maps many times the bytes used. Data that fits in memory is fastest as in-memory arrays anyway.
  Memory: the batches in flight, plus the pages of the file touched so far,
  mapped from the kernel's page cache (reclaimable, but counted in the
  process's RSS while mapped: about one page per distinct row read;
  tests/privacy/test_sources_big.py streams a 4.3 GiB file with a peak RSS growth
  near 100 MiB). Throughput, and the alternatives tried and not kept:
  docs/performance.md ("Example sources").
- ``"sequence"`` — any random-access sequence with ``__len__`` and
  ``__getitem__(i)`` returning ONE example: ``x``, ``(x,)`` or ``(x, y)`` (a dict
  needs ``example_fn``: it maps one raw example to ``(x, y)`` or ``x``).
  ``__getitems__(list_of_ints)`` is used when present (TFDS
  ``tfds.data_source(...)``, whose examples are dicts like
  ``{"image": ..., "label": ...}``). Shapes and dtypes are those of example 0
  (after ``example_fn``); every example must match them. Cost: one Python call
  per example (or per batch with ``__getitems__``) plus a ``np.stack``, in one
  ``tf.numpy_function`` per batch (its cost: docs/performance.md).
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


def _random_access_map(array) -> np.ndarray:
    """A read-only map of a memory-mapped array's file, advised for random access.

    The source reads through its OWN map (``np.memmap(mode="r")`` of the same file
    and bytes), so the user's map keeps its advice, and advises it ``MADV_RANDOM``:
    a page fault then reads one page, not a read-ahead window (on a file larger
    than memory, read-ahead multiplies the bytes read and maps them into the
    process). Falls back to ``np.asarray(array)`` (the user's map, default advice)
    for a copy-on-write map (``mode="c"``: its changes are not in the file), a
    non-contiguous view, a map without a file name, or where madvise is missing.
    """
    view = np.asarray(array)
    root = array
    while root is not None and not (isinstance(root, np.memmap) and isinstance(root.base, mmap.mmap)):
        root = getattr(root, "base", None)
    if (
        root is None
        or not hasattr(mmap, "MADV_RANDOM")
        or getattr(root, "filename", None) is None
        or getattr(root, "mode", "c") not in ("r", "r+", "w+")
        or not view.flags.c_contiguous
        or view.size == 0
    ):
        return view
    offset = int(root.offset) + (view.ctypes.data - root.ctypes.data)
    try:
        own = np.memmap(root.filename, dtype=view.dtype, mode="r", offset=offset, shape=view.shape)
        own.base.madvise(mmap.MADV_RANDOM)
    except (OSError, ValueError):  # the file is gone or cannot be mapped again: read the user's map
        return view
    return np.asarray(own)


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


def _is_tuple(obj) -> bool:
    return isinstance(obj, tuple) and not hasattr(obj, "_fields")  # a namedtuple is one structure


def _split(element, *, what: str):
    """``x`` / ``(x,)`` / ``(x, y)`` -> (x, y or None); ``(x, y, w)`` refused."""
    if _is_tuple(element):
        if len(element) == 1:
            return element[0], None
        if len(element) == 2:
            return element[0], element[1]
        if len(element) == 3:
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
        return (f"{type(self).__name__}(kind={self.kind!r}, num_examples={self.num_examples}, "
                f"has_labels={self.has_labels})")

    # --- subclasses implement _flat_gather (numpy, any thread); gather and tf_gather wrap it
    def _flat_gather(self, indices: np.ndarray) -> list:
        """The leaves of x then of y (``tf.nest.flatten`` order) for int64 indices (P,)."""
        raise NotImplementedError

    def gather(self, indices) -> tuple:
        """``(x_batch, y_batch or None)`` numpy structures for int indices (P,).

        Any thread may call it. Leaves have shape (P, *spec.shape) and the spec's
        dtype (strings as bytes objects).
        """
        import tensorflow as tf

        flat = self._flat_gather(np.asarray(indices, dtype=np.int64))
        x_spec, y_spec = self.element_spec
        num_x = len(tf.nest.flatten(x_spec))
        xb = tf.nest.pack_sequence_as(x_spec, flat[:num_x])
        return xb, (None if y_spec is None else tf.nest.pack_sequence_as(y_spec, flat[num_x:]))

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
        num_x = len(tf.nest.flatten(x_spec))
        flat = tf.numpy_function(
            self._flat_gather, [indices], [s.dtype for s in specs], stateful=False, name=f"gather_{self.kind}"
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
        self._leaves = tf.nest.flatten(x) + ([] if y is None else tf.nest.flatten(y))
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

    def _flat_gather(self, indices):
        return [np.take(a, indices, axis=0) for a in self._leaves]

    def tf_gather(self, indices):
        import tensorflow as tf

        x_t, y_t = self._constants()
        take = lambda a: tf.gather(a, indices)  # noqa: E731
        return tf.nest.map_structure(take, x_t), (None if y_t is None else tf.nest.map_structure(take, y_t))


def _for_tf(array: np.ndarray) -> np.ndarray:
    """An array ``tf.numpy_function`` accepts for its spec: native byte order, text as bytes."""
    if array.dtype.kind == "U":
        return np.char.encode(array, "utf-8")
    if array.dtype.kind in "SO" or array.dtype.isnative:
        return array
    return array.astype(array.dtype.newbyteorder("="))


class _MemmapSource(ExampleSource):
    """Arrays of which at least one is memory-mapped; rows read per batch by numpy."""

    kind = "memmap"

    def __init__(self, x, y, n, sample_weight):
        import tensorflow as tf

        spec = lambda a: _spec(a.shape[1:], a.dtype)  # noqa: E731
        super().__init__(
            tf.nest.map_structure(spec, x), None if y is None else tf.nest.map_structure(spec, y), n, sample_weight
        )
        # plain ndarrays (no np.memmap subclass hooks on every take); maps re-opened for random access
        self._leaves = [
            _random_access_map(a) if _mapping_of(a) is not None else np.asarray(a)
            for a in tf.nest.flatten(x) + ([] if y is None else tf.nest.flatten(y))
        ]

    def _flat_gather(self, indices):
        # One np.take per leaf, rows in the order of `indices` (the take releases the GIL while it copies).
        # (Writing into a 64-byte aligned buffer, which numpy_function would pass on without
        # a copy, was measured slower: TensorFlow frees it late, so every batch faults in
        # fresh pages; the copy lands in TensorFlow's reused buffers.)
        return [_for_tf(np.take(a, indices, axis=0)) for a in self._leaves]


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
        spec = lambda a: _spec(np.shape(a), np.asarray(a).dtype)  # noqa: E731
        x_spec = tf.nest.map_structure(spec, x0)
        if y is not None:
            y_spec = tf.nest.map_structure(lambda a: _spec(a.shape[1:], a.dtype), y)
        else:
            y_spec = None if y0 is None else tf.nest.map_structure(spec, y0)
        super().__init__(x_spec, y_spec, n, sample_weight)
        self._in_example = tf.nest.flatten(x_spec) + ([] if y0 is None else tf.nest.flatten(y_spec))
        self._y_arrays = [] if y is None else [np.asarray(a) for a in tf.nest.flatten(y)]

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
    """``tf.nest.flatten``, with a fast path for one array or scalar (no structure)."""
    if isinstance(structure, (np.ndarray, np.generic, int, float, bytes, str)):
        return [structure]
    if isinstance(structure, (collections.abc.Mapping, list, tuple)) or hasattr(structure, "__attrs_attrs__"):
        import tensorflow as tf

        return tf.nest.flatten(structure)
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
    import tensorflow as tf

    shape = tuple(spec.shape)
    if stacked.shape[1:] != shape:
        raise ValueError(
            f"an example of {what} has shape {stacked.shape[1:]}; every example must have the shape of "
            f"example 0, {shape}."
        )
    if spec.dtype == tf.string:
        return _for_tf(stacked)
    want = np.dtype(spec.dtype.as_numpy_dtype)
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
            tf.nest.map_structure(row_spec, x0),
            None if y0 is None else tf.nest.map_structure(row_spec, y0),
            (num_batches - 1) * self._k + last_rows,
            sample_weight,
        )
        self._specs = tf.nest.flatten(self.element_spec[0]) + (
            [] if y0 is None else tf.nest.flatten(self.element_spec[1])
        )

    def _batch(self, b: int):
        import tensorflow as tf

        x, y = _split(self._dataset[b], what=f"batch {b} of the PyDataset")
        x = tf.nest.map_structure(np.asarray, x)
        y = None if y is None else tf.nest.map_structure(np.asarray, y)
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
        import tensorflow as tf

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
            leaves = tf.nest.flatten(xb) + ([] if yb is None else tf.nest.flatten(yb))
            parts.append([np.take(a, rows[batch_ids == b], axis=0) for a in leaves])
        return [
            _conform(np.concatenate(column)[inverse], spec, "the PyDataset")
            for column, spec in zip(zip(*parts), self._specs)
        ]


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
        indexable = hasattr(a, "__getitem__") and hasattr(a, "__len__")
        if indexable and not hasattr(a, "__array__") and not isinstance(a, (str, bytes)):
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
