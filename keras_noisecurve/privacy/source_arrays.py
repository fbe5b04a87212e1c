"""Array sources: numpy arrays in memory (``"memory"``) and memory-mapped arrays (``"memmap"``).

See ``keras_noisecurve.privacy.sources`` for what each kind costs. Importing this module
does not import TensorFlow.
"""

from __future__ import annotations

import mmap
import threading
from typing import Optional

import numpy as np

from keras_noisecurve.privacy.source_base import ExampleSource, _for_tf, _spec, flatten, hash_arrays, map_structure


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

class _ArraySource(ExampleSource):
    """numpy arrays in memory (in ``tf.data``, gathered by ``tf.gather`` on constant tensors)."""

    kind = "memory"

    def __init__(self, x, y, n, sample_weight):
        self._x, self._y = x, y
        self._leaves = flatten(x) + ([] if y is None else flatten(y))
        spec = lambda a: _spec(a.shape[1:], a.dtype)  # noqa: E731
        super().__init__(map_structure(spec, x), None if y is None else map_structure(spec, y), n, sample_weight)
        self._tensors = None
        self._lock = threading.Lock()

    def cached_arrays(self, convert):
        """``convert(x, y)`` (the backend's tensors of the whole arrays), made once per source."""
        with self._lock:
            if self._tensors is None:
                self._tensors = convert(self._x, self._y)
            return self._tensors

    def _hash_examples(self, digest):
        if not hash_arrays(digest, self._leaves):
            super()._hash_examples(digest)

    def _flat_gather(self, indices):
        return [np.take(a, indices, axis=0) for a in self._leaves]


class _MemmapSource(ExampleSource):
    """Arrays of which at least one is memory-mapped; rows read per batch by numpy."""

    kind = "memmap"

    def __init__(self, x, y, n, sample_weight):
        spec = lambda a: _spec(a.shape[1:], a.dtype)  # noqa: E731
        super().__init__(map_structure(spec, x), None if y is None else map_structure(spec, y), n, sample_weight)
        # plain ndarrays (no np.memmap subclass hooks on every take); maps re-opened for random access
        self._leaves = [
            _random_access_map(a) if _mapping_of(a) is not None else np.asarray(a)
            for a in flatten(x) + ([] if y is None else flatten(y))
        ]

    def _hash_examples(self, digest):
        if not hash_arrays(digest, self._leaves):
            super()._hash_examples(digest)

    def _flat_gather(self, indices):
        # One np.take per leaf, rows in the order of `indices` (the take releases the GIL while it copies).
        # (Writing into a 64-byte aligned buffer, which numpy_function would pass on without
        # a copy, was measured slower: TensorFlow frees it late, so every batch faults in
        # fresh pages; the copy lands in TensorFlow's reused buffers.)
        return [_for_tf(np.take(a, indices, axis=0)) for a in self._leaves]
