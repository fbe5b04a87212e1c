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

Importing this module does not import TensorFlow, and neither does :func:`as_source`, but
for a ``tf.data.Dataset`` (whose program already imported TensorFlow); the ``tf.data``
pipeline's :meth:`ExampleSource.tf_gather` does. So on the JAX backend every kind is
gathered in numpy without TensorFlow.
"""

from __future__ import annotations

import collections.abc
import inspect
import sys
from typing import Callable, Optional

import numpy as np

from keras_noisecurve.privacy.source_arrays import _ArraySource, _mapping_of, _MemmapSource
from keras_noisecurve.privacy.source_base import KINDS, ExampleSource, _describe, _leading_length, flatten, map_structure
from keras_noisecurve.privacy.source_streamed import _PyDatasetSource, _SequenceSource

__all__ = ["KINDS", "MAX_MATERIALIZED_BYTES", "ExampleSource", "as_source"]

#: A tf.data input is materialised into numpy once; larger inputs are refused.
MAX_MATERIALIZED_BYTES = 2 * 1024**3


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

    return map_structure(leaf, structure)


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
        from keras_noisecurve import backend

        x, y, sample_weight = backend.module("pipeline").materialize(x, max_bytes=MAX_MATERIALIZED_BYTES)
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
    leaves = flatten(x) + ([] if y is None else flatten(y))
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
