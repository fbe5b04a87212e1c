"""The noise generator on JAX: the same z_t as the TensorFlow backend, in jax.numpy.

Imports JAX, never TensorFlow, and needs no 64-bit integers (x64 stays off). A key or a
seed is the four uint32 words of TensorFlow's int64 pair (``key_words``; an int32 array
with the same bits is accepted everywhere, as the optimizer stores it in an int32
variable). The generator is ``keras_noisecurve.backend.common.philox`` run with ``jax.numpy``:
the uniform words are bit for bit TensorFlow's Philox words for the same seed, and the
normals equal TensorFlow's ``normal_from_seed`` up to float32 rounding of log/cos/sin
(tests/backend/test_jax_noise.py measures it). Everything is jit-able: ``step`` and
``index`` may be traced integer scalars.

:class:`JaxOps` is the array namespace a ``keras_noisecurve.mixing.stream.NoiseStream``
runs its recurrence with (as ``NumpyOps`` and the TensorFlow ``TensorFlowOps``): pure
functions, the state written functionally (``write_slot`` returns a new array).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from keras_noisecurve.backend.common import philox

__all__ = [
    "OPS",
    "JaxOps",
    "key_words",
    "normal_from_seed",
    "standard_normal",
    "step_seed",
    "variable_normals",
    "variable_seed",
]


class _Arrays:
    """jax.numpy for ``keras_noisecurve.backend.common.philox``, with ``materialize``
    (``jax.lax.optimization_barrier``: the key and counter words of a Philox chain are
    computed once instead of being copied by XLA into every fusion that reads them, which
    made a jitted draw take seconds to compile) and ``fori_loop`` (``jax.lax.fori_loop``:
    the few-lane key derivations run their 10 rounds as one loop,
    ``philox.philox_block_looped``)."""

    materialize = staticmethod(jax.lax.optimization_barrier)
    fori_loop = staticmethod(jax.lax.fori_loop)  # the key derivations' rounds as one loop

    def __getattr__(self, name):
        return getattr(jnp, name)


_xp = _Arrays()


def key_words(key) -> np.ndarray:
    """The words of an int64 noise key: uint32 (4,) ``(lo k₀, hi k₀, lo k₁, hi k₁)``.

    Args:
      key: the int64 key of shape (2,) (``keras_noisecurve.training.noise.key_from_seed``),
        any integer array-like holding int64 values.

    Returns:
      ``np.ndarray`` of dtype uint32 and shape (4,). ``key_words(k).view(np.int32)`` is the
      same bits as int32 (what a JAX variable without x64 can hold).
    """
    array = np.asarray(key)
    if array.shape != (2,) or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"key must be an integer array of shape (2,) (an int64 noise key), got "
                         f"dtype {array.dtype} and shape {array.shape}.")
    return np.array([w for value in array.tolist() for w in philox.int64_words(value)], dtype=np.uint32)


def _seed_words(seed, name="seed"):
    """A key or seed as a (4,) uint32 jax array: uint32 or int32 words (bit pattern kept),
    or an int64 (2,) numpy pair."""
    if isinstance(seed, np.ndarray) and seed.shape == (2,) and seed.dtype == np.int64:
        return jnp.asarray(key_words(seed))
    words = jnp.asarray(seed)
    if words.shape != (4,) or words.dtype not in (jnp.uint32, jnp.int32):
        raise ValueError(f"{name} must be the (4,) uint32 or int32 words of an int64 pair (see key_words), or an "
                         f"int64 numpy array of shape (2,); got dtype {words.dtype} and shape {words.shape}.")
    if words.dtype == jnp.int32:
        words = jax.lax.bitcast_convert_type(words, jnp.uint32)
    return words


def _data_words(data, name):
    """The (low, high) uint32 words of an int64 ``data`` given as a Python/numpy integer
    (any value in [−2⁶³, 2⁶³)) or a jax integer scalar (sign-extended to 64 bits; 64-bit
    ones exist only with x64 on)."""
    host = isinstance(data, (int, np.integer)) or (isinstance(data, np.ndarray) and data.shape == ()
                                                    and np.issubdtype(data.dtype, np.integer))
    if host and not isinstance(data, bool):  # numpy int64 values keep their 64 bits
        lo, hi = philox.int64_words(int(data))
        return jnp.uint32(lo), jnp.uint32(hi)
    value = jnp.asarray(data)
    if value.shape != () or not jnp.issubdtype(value.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer scalar, got dtype {value.dtype} and shape {value.shape}.")
    if jnp.dtype(value.dtype).itemsize > 4:  # x64 on: split the 64-bit value
        mask = jnp.asarray(0xFFFFFFFF, value.dtype)
        return (jnp.bitwise_and(value, mask).astype(jnp.uint32),
                jnp.bitwise_and(jnp.right_shift(value, 32), mask).astype(jnp.uint32))
    unsigned = jnp.issubdtype(value.dtype, jnp.unsignedinteger)
    lo = value.astype(jnp.uint32) if unsigned else jax.lax.bitcast_convert_type(value.astype(jnp.int32), jnp.uint32)
    hi = jnp.uint32(0) if unsigned else jnp.where(value < 0, jnp.uint32(0xFFFFFFFF), jnp.uint32(0))
    return lo, hi


def _fold_in(seed, data, name):
    lo, hi = _data_words(data, name)
    return philox.fold_in(_xp, _seed_words(seed), lo, hi)


def step_seed(key, step):
    """The seed of step t for all variables, ``fold_in(key, t)``: uint32 (4,).

    Args:
      key: the key's words, (4,) uint32 or int32 (``key_words``), or the int64 (2,) key.
      step: the step t (0-based), a Python int or an integer scalar (traced is fine).
    """
    return _fold_in(key, step, "step")


def variable_seed(seed, index):
    """The seed of variable ``index`` at a step, ``fold_in(step_seed, k)``: uint32 (4,)."""
    return _fold_in(seed, index, "index")


def _shape(shape):
    try:
        return tuple(int(d) for d in shape)
    except TypeError:
        raise ValueError(f"the noise needs a fully defined shape, got {shape}.") from None


def normal_from_seed(seed, shape, dtype=jnp.float32, scale=None):
    """N(0, scale²·I) of ``shape``, a pure function of the seed (the TensorFlow backend's
    ``normal_from_seed``, on words).

    Box–Muller on the seed's Philox words (``keras_noisecurve.backend.common.philox.box_muller``
    with the angle seed ``fold_in(seed, 1)``), computed in float32 (float64 when it is
    asked for and JAX's x64 is on) and cast to ``dtype``.

    Args:
      seed: (4,) uint32 or int32 words, e.g. ``variable_seed(step_seed(key, t), k)``.
      shape: a fully defined shape.
      dtype: floating dtype of the result (float64 gives float32 while JAX's x64 is off,
        as every JAX array does).
      scale: optional scalar multiplying the draw (folded into the Box–Muller radius).

    Returns:
      a jax array of ``shape`` and ``dtype``.
    """
    shape = _shape(shape)
    dtype, compute = _dtypes(dtype)
    seed = _seed_words(seed)
    angle_seed = philox.fold_in(_xp, seed, jnp.uint32(1), jnp.uint32(0))
    z = philox.box_muller(_xp, seed, angle_seed, int(np.prod(shape, dtype=np.int64)), compute, scale)
    return jnp.reshape(z, shape).astype(dtype)


def _dtypes(dtype):
    """The result and compute dtypes of a draw: float64 is float32 while x64 is off, and
    the arithmetic is float32 except for float64."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype, got {dtype}.")
    dtype = jax.dtypes.canonicalize_dtype(dtype)
    return dtype, jnp.dtype(jnp.float64) if dtype == jnp.float64 else jnp.dtype(jnp.float32)


def variable_normals(seed, shapes, dtypes=jnp.float32, scales=None, indices=None):
    """The draws of every variable of a step at once: entry k is
    ``normal_from_seed(variable_seed(seed, indices[k]), shapes[k], dtypes[k], scales[k])``,
    the same values, with the Philox blocks of all variables computed as lanes of a few
    vectorised blocks (``keras_noisecurve.backend.common.philox.variable_normals``): a jitted step
    traces ~7 Philox blocks however many variables it has, instead of ~8 per variable.

    Args:
      seed: the step seed's words (``step_seed(key, t)``), (4,) uint32 or int32.
      shapes: one fully defined shape per variable.
      dtypes: one floating dtype for all, or one per variable.
      scales: ``None`` or one scalar (or ``None``) per variable, multiplying its draw.
      indices: the variables' indices k (Python ints); default 0, 1, …, len(shapes) − 1.

    Returns:
      a list of jax arrays, entry k of ``shapes[k]`` and ``dtypes[k]``.
    """
    shapes = [_shape(shape) for shape in shapes]
    count = len(shapes)
    dtypes = list(dtypes) if isinstance(dtypes, (list, tuple)) else [dtypes] * count
    indices = list(range(count)) if indices is None else [int(k) for k in indices]
    if len(dtypes) != count or len(indices) != count or (scales is not None and len(scales) != count):
        raise ValueError(f"dtypes, indices and scales need one entry per shape ({count}), got {len(dtypes)}, "
                         f"{len(indices)} and {'-' if scales is None else len(scales)}.")
    pairs = [_dtypes(dtype) for dtype in dtypes]
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]
    flat = philox.variable_normals(_xp, _seed_words(seed), indices, sizes, [c for _, c in pairs], scales)
    return [jnp.reshape(z, shape).astype(dtype) for z, shape, (dtype, _) in zip(flat, shapes, pairs)]


def standard_normal(key, step, index, shape, dtype=jnp.float32):
    """z_t for variable ``index``: N(0, I) of ``shape``, a pure function of (key, step, index):
    ``normal_from_seed(variable_seed(step_seed(key, step), index), shape, dtype)``."""
    return normal_from_seed(variable_seed(step_seed(key, step), index), shape, dtype)


class JaxOps:
    """The array namespace that runs a ``NoiseStream``'s recurrence in jax.numpy
    (``keras_noisecurve.mixing.stream.NumpyOps`` is the numpy one). Pure and jit-able:
    ``step`` may be traced; ``write_slot`` returns a new state (``.at[slot].set``).
    There are no in-place fused steps: under ``jit`` XLA fuses the functional step."""

    name = "jax"
    standard_normal = staticmethod(standard_normal)

    @staticmethod
    def constant(value, dtype):
        return jnp.asarray(value, dtype=dtype)

    @staticmethod
    def cast(value, dtype):
        return jnp.asarray(value).astype(dtype)

    @staticmethod
    def gather(table, index):
        """Row ``index`` of ``table``; NaN past the table's end (a step past the plan gives
        NaN noise, never a silent repeat of the last row: a traced step cannot raise)."""
        return jnp.take(table, jnp.asarray(index, jnp.int32), axis=0, mode="fill", fill_value=jnp.nan)

    @staticmethod
    def slot(step, buffers):
        return jnp.mod(jnp.asarray(step, jnp.int32), buffers)

    @staticmethod
    def slot_coefficients(tail, step, buffers):
        """(m,) vector whose entry s = (t − j) mod m is ``tail[j − 1]``, j = 1 … m."""
        slots = jnp.mod(jnp.asarray(step, jnp.int32) - jnp.arange(1, buffers + 1, dtype=jnp.int32), buffers)
        return jnp.zeros((buffers,), tail.dtype).at[slots].set(tail)

    @staticmethod
    def tensordot(vector, state):
        return jnp.tensordot(vector, state, axes=1)

    @staticmethod
    def broadcast(vector, rank):
        return jnp.reshape(vector, (-1,) + (1,) * rank)

    @staticmethod
    def rank(x):
        return jnp.ndim(x)

    @staticmethod
    def expand(x):
        return jnp.asarray(x)[None]

    @staticmethod
    def zeros(shape, dtype):
        return jnp.zeros(shape, dtype=dtype)

    @staticmethod
    def write_slot(state, slot, value):
        """A new state with ``state[slot] = value`` (functional)."""
        return state.at[slot].set(value)

    @staticmethod
    def assert_less(step, limit, message):
        """No run-time check under JAX (``None``): a traced step cannot raise; the caller
        checks the plan limit on the host."""
        return None

    @staticmethod
    def can_fuse(state):
        """JAX has no in-place fused step (``jit`` fuses the functional one)."""
        return False


#: the array namespace of this backend (``StreamNoise``'s default under this Keras backend)
OPS = JaxOps
