"""The :class:`ExampleSource` interface and the helpers every kind of source shares.

An example source gathers training examples by index (``keras_noisecurve.privacy.sources``
documents the kinds and their costs). Importing this module does not import TensorFlow, and
neither does anything but :meth:`ExampleSource.tf_gather` and
:attr:`ExampleSource.element_spec` (the ``tf.data`` pipeline's side): the JAX backend
gathers its batches with :meth:`ExampleSource.gather` (numpy). Structures (dicts, lists,
tuples of arrays) are walked by ``keras.tree``, in ``tf.nest``'s order.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

__all__ = ["KINDS", "ArraySpec", "ExampleSource"]

KINDS = ("memory", "memmap", "sequence", "py_dataset")


def flatten(structure) -> list:
    """The leaves of a structure (``tf.nest.flatten``'s order: dict keys sorted)."""
    import keras

    return keras.tree.flatten(structure)


def map_structure(fn, *structures):
    """``fn`` on the leaves of one or more structures of the same shape."""
    import keras

    return keras.tree.map_structure(fn, *structures)


def pack(structure, leaves):
    """``leaves`` in the shape of ``structure`` (the inverse of :func:`flatten`)."""
    import keras

    return keras.tree.pack_sequence_as(structure, leaves)


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """The shape and dtype of one leaf of ONE example (no batch dimension), framework-free.

    ``dtype`` is the numpy dtype in native byte order; text (``U``, ``S``, ``O``) is
    ``is_text`` (a ``tf.string`` on TensorFlow).
    """

    shape: tuple
    dtype: np.dtype

    @property
    def is_text(self) -> bool:
        return self.dtype.kind in "USO"

    def tf_spec(self):
        """The ``tf.TensorSpec`` of this leaf (imports TensorFlow)."""
        from keras_noisecurve import backend

        return backend.module("pipeline").tensor_spec(self)


def _leading_length(name, structure) -> int:
    lengths = {int(np.shape(a)[0]) if np.ndim(a) else -1 for a in flatten(structure)}
    if len(lengths) != 1 or -1 in lengths:
        raise ValueError(
            f"every array in {name} must have the same leading (example) dimension; got lengths "
            f"{sorted(lengths)} (-1: a scalar)."
        )
    return lengths.pop()


def _native(dtype: np.dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    return dtype if dtype.kind in "USO" else dtype.newbyteorder("=")


def _spec(shape, dtype) -> ArraySpec:
    return ArraySpec(tuple(int(d) for d in shape), _native(dtype))


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
      has_labels: whether ``gather`` / ``tf_gather`` return labels (``y``).
      example_spec: ``(x_spec, y_spec or None)``, nested :class:`ArraySpec` of ONE
        example (no batch dimension); ``element_spec`` the same as ``tf.TensorSpec``.
      sample_weight: None or a float32 numpy array (n,).
    """

    kind: str = ""

    def __init__(self, x_spec, y_spec, num_examples: int, sample_weight):
        self.example_spec = (x_spec, y_spec)
        self.num_examples = int(num_examples)
        self.has_labels = y_spec is not None
        self.sample_weight = _check_weights(sample_weight, self.num_examples)

    def __len__(self) -> int:
        return self.num_examples

    @property
    def element_spec(self):
        """``(x_spec, y_spec or None)`` as nested ``tf.TensorSpec`` (imports TensorFlow)."""
        x_spec, y_spec = self.example_spec
        to_tf = lambda spec: spec.tf_spec()  # noqa: E731
        return map_structure(to_tf, x_spec), (None if y_spec is None else map_structure(to_tf, y_spec))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(kind={self.kind!r}, num_examples={self.num_examples}, "
                f"has_labels={self.has_labels})")

    # --- the fingerprint of the examples in their order
    #: a source of at most this many examples is read whole by :meth:`fingerprint`
    FINGERPRINT_FULL = 4096
    #: a larger one: this many examples at fixed, spread positions (and n, specs, weights)
    FINGERPRINT_PROBES = 1024

    def fingerprint(self) -> int:
        """A nonzero 31-bit hash of the examples in their order, computed once.

        What the optimizer's state binds at the first private ``fit``
        (:mod:`keras_noisecurve.privacy.plan_state`): resuming on other examples or the same
        ones in another order is refused. In-memory and memory-mapped arrays of up to
        :data:`FINGERPRINT_FULL_BYTES` are hashed whole; so is any source of at most
        ``FINGERPRINT_FULL`` examples; a larger streamed source hashes n, the example specs,
        the sample weights and ``FINGERPRINT_PROBES`` examples at fixed positions spread
        over [0, n) (any reordering moves some of them with overwhelming probability; one
        replaced example among many is caught only when it is probed: docs/privacy.md). The
        source of a user-level run hashes its users too (:meth:`salt_fingerprint`)."""
        cached = getattr(self, "_fingerprint", None)
        if cached is None:
            digest = hashlib.blake2b(digest_size=8)
            digest.update(repr((self.num_examples, self.example_spec)).encode())
            if self.sample_weight is not None:
                digest.update(np.ascontiguousarray(self.sample_weight).tobytes())
            salt = getattr(self, "_fingerprint_salt", b"")
            if salt:  # a user-level run's users (UserTable.digest): other users are other data
                digest.update(salt)
            self._hash_examples(digest)
            cached = int.from_bytes(digest.digest()[:4], "little") % (2**31 - 1) + 1
            self._fingerprint = cached
        return cached

    def salt_fingerprint(self, salt: bytes) -> None:
        """Make :meth:`fingerprint` also hash ``salt`` (bytes; empty: nothing): what the examples
        are besides their values, e.g. the users of a user-level run
        (:meth:`~keras_noisecurve.privacy.users.UserTable.digest`)."""
        self._fingerprint_salt = bytes(salt)
        self._fingerprint = None

    def _hash_examples(self, digest) -> None:
        n = self.num_examples
        if n <= self.FINGERPRINT_FULL:
            positions = np.arange(n, dtype=np.int64)
        else:
            positions = np.unique(np.linspace(0, n - 1, self.FINGERPRINT_PROBES).astype(np.int64))
        for start in range(0, positions.size, 512):
            for leaf in self._flat_gather(positions[start:start + 512]):
                digest.update(_leaf_bytes(leaf))

    # --- subclasses implement _flat_gather (numpy, any thread); gather and tf_gather wrap it
    def _flat_gather(self, indices: np.ndarray) -> list:
        """The leaves of x then of y (:func:`flatten` order) for int64 indices (P,)."""
        raise NotImplementedError

    def gather(self, indices) -> tuple:
        """``(x_batch, y_batch or None)`` numpy structures for int indices (P,).

        Any thread may call it. Leaves have shape (P, *spec.shape) and the spec's
        dtype (strings as bytes objects).
        """
        flat = self._flat_gather(np.asarray(indices, dtype=np.int64))
        x_spec, y_spec = self.example_spec
        num_x = len(flatten(x_spec))
        xb = pack(x_spec, flat[:num_x])
        return xb, (None if y_spec is None else pack(y_spec, flat[num_x:]))

    def tf_gather(self, indices) -> tuple:
        """``(x_batch, y_batch or None)`` tensors for an int64 tensor ``indices`` (P,).

        For a ``tf.data`` map function (graph mode) or eager use (imports TensorFlow). Every
        leaf has the static shape ``(P, *spec.shape)`` (P static when ``indices``' shape is)
        and the spec's dtype. In-memory arrays are ``tf.gather``-ed from constant tensors;
        streamed kinds run ONE ``tf.numpy_function`` per call.
        """
        from keras_noisecurve import backend

        return backend.module("pipeline").gather(self, indices)


#: arrays (in memory or memory-mapped) of at most this many bytes in all are hashed whole
FINGERPRINT_FULL_BYTES = 2**31


def _leaf_bytes(array) -> bytes:
    """The bytes of a gathered leaf (text and objects by their repr)."""
    array = np.asarray(array)
    if array.dtype.kind == "O":
        return repr(array.tolist()).encode()
    return np.ascontiguousarray(array).tobytes()


def hash_arrays(digest, leaves) -> bool:
    """Hash whole ``leaves`` (numpy arrays, n rows each) into ``digest`` in chunks of rows;
    ``False`` (nothing hashed) when they hold more than ``FINGERPRINT_FULL_BYTES``."""
    if sum(int(np.asarray(a).nbytes) for a in leaves) > FINGERPRINT_FULL_BYTES:
        return False
    for leaf in leaves:
        leaf = np.asarray(leaf)
        rows = max(1, (1 << 24) // max(1, leaf[:1].nbytes))
        for start in range(0, max(1, leaf.shape[0]), rows):
            digest.update(_leaf_bytes(leaf[start:start + rows]))
    return True


def _check_weights(sample_weight, n: int):
    if sample_weight is None:
        return None
    weights = np.array(sample_weight, dtype=np.float32)  # a copy, held in memory
    if weights.shape != (n,):
        raise ValueError(f"sample_weight must have shape ({n},) (one weight per example), got {weights.shape}.")
    if not np.all(np.isfinite(weights)) or np.any(weights < 0):
        raise ValueError("sample_weight must be finite and >= 0.")
    return weights

def _for_tf(array: np.ndarray) -> np.ndarray:
    """An array ``tf.numpy_function`` accepts for its spec: native byte order, text as bytes."""
    if array.dtype.kind == "U":
        return np.char.encode(array, "utf-8")
    if array.dtype.kind in "SO" or array.dtype.isnative:
        return array
    return array.astype(array.dtype.newbyteorder("="))
