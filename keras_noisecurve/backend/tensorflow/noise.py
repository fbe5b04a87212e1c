"""The noise generator on TensorFlow: Philox bits, Box–Muller, and the array namespace
of the noise recurrences with its XLA-compiled in-place steps.

The standard normal draw z_t for variable k is made from Philox bits keyed by
``seed = fold_in(fold_in(key, t), k)`` (see :func:`normal_from_seed`: Box–Muller on 32-bit
uniforms, computed with vectorised TensorFlow ops, because ``tf.random.stateless_normal``
runs its Box–Muller in scalar code; docs/training.md, "Secret seeds", has the timings).
The words are TensorFlow's own Philox stream (``stateless_uniform``/``stateless_fold_in``),
also under XLA, whose own kernels truncate int64 seeds. ``keras_noisecurve.backend.common.philox``
computes the same words with uint32 arithmetic in numpy or jax.numpy (the JAX backend's
generator, ``keras_noisecurve.backend.jax.noise``); tests/backend/test_philox.py checks
that they are TensorFlow's bit for bit.

:class:`TensorFlowOps` is the array namespace that runs a
``keras_noisecurve.mixing.stream.NoiseStream``'s recurrence in TensorFlow (driven by
``keras_noisecurve.training.noise.StreamNoise``), with the in-place steps
:func:`fused_ring_step` and :func:`fused_blt_step`: one XLA-compiled function per variable
reads the state once and writes only what changes into the same buffer.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from keras_noisecurve.backend.tensorflow import compat
from keras_noisecurve.backend.common import philox

__all__ = [
    "OPS",
    "TensorFlowOps",
    "fold_in",
    "fused_blt_step",
    "fused_ring_step",
    "normal_from_seed",
    "standard_normal",
    "step_seed",
    "variable_seed",
]


def step_seed(key, step) -> tf.Tensor:
    """The seed of step t for all variables: ``fold_in(key, t)``, int64 shape (2,).

    Args:
      key: int64 tensor of shape (2,) (the optimizer's noise key).
      step: scalar integer tensor, the step t (0-based).
    """
    key = tf.cast(tf.convert_to_tensor(key), tf.int64)
    return fold_in(key, step)


def variable_seed(seed, index) -> tf.Tensor:
    """The seed of variable ``index`` at a step: ``fold_in(step_seed, k)``, int64 (2,)."""
    return fold_in(seed, index)


_MASK32 = 0xFFFFFFFF


class _Arrays:
    """The uint32 operations ``keras_noisecurve.backend.common.philox`` needs, in TensorFlow: the
    generator's integer code is the one the numpy and JAX runs use."""

    uint32 = tf.uint32
    multiply = staticmethod(tf.math.multiply)
    add = staticmethod(tf.math.add)
    bitwise_and = staticmethod(tf.bitwise.bitwise_and)
    bitwise_xor = staticmethod(tf.bitwise.bitwise_xor)
    right_shift = staticmethod(tf.bitwise.right_shift)
    broadcast_to = staticmethod(tf.broadcast_to)
    broadcast_shapes = staticmethod(np.broadcast_shapes)

    @staticmethod
    def asarray(value, dtype):
        if isinstance(value, tf.Tensor):
            return value if value.dtype == dtype else tf.cast(value, dtype)
        return tf.constant(value, dtype)

    @staticmethod
    def shape(x):
        return tuple(x.shape)


def _philox_key_counter(seed):
    """TensorFlow's ``StatelessRandomGetKeyCounter`` for Philox, in plain integer ops
    (``keras_noisecurve.backend.common.philox.key_counter``: one Philox block of the seed's four
    32-bit words under a fixed key). XLA's own kernel truncates each int64 seed word to
    32 bits, so an XLA step would draw other noise than the same step without XLA; this
    gives the same stream in both.

    Returns ``key`` uint64 (1,) and ``counter`` uint64 (2,)."""
    words = tf.bitcast(tf.cast(seed, tf.int64), tf.uint64)
    mask = tf.constant(_MASK32, tf.uint64)
    shift = tf.constant(32, tf.uint64)
    split = [tf.bitwise.bitwise_and(words[0], mask), tf.bitwise.right_shift(words[0], shift),
             tf.bitwise.bitwise_and(words[1], mask), tf.bitwise.right_shift(words[1], shift)]
    (k0, k1), (c2, c3) = philox.key_counter(_Arrays, [tf.cast(w, tf.uint32) for w in split])
    wide = lambda lo, hi: tf.cast(lo, tf.uint64) + tf.bitwise.left_shift(tf.cast(hi, tf.uint64), shift)  # noqa: E731
    return tf.reshape(wide(k0, k1), [1]), tf.stack([tf.constant(0, tf.uint64), wide(c2, c3)])


def _key_counter(seed):
    """The Philox key and counter of a (2,) int64 seed: TensorFlow's own kernel in one op
    (``tf.random.stateless_uniform(..., alg="philox")`` builds them from ~20 Python-level
    ops per call, ~14 ms of tracing each: a third of a second per step trace for every 10
    variables), :func:`_philox_key_counter` under XLA."""
    if _in_xla_context():
        return _philox_key_counter(seed)
    return tf.raw_ops.StatelessRandomGetKeyCounter(seed=tf.cast(seed, tf.int64))


def _philox_bits(seed, n):
    """n uniform uint32 words of Philox for a (2,) int64 seed: what
    ``tf.random.stateless_uniform([n], seed, dtype=tf.uint32, alg="philox")`` gives
    without XLA, also under XLA."""
    key, counter = _key_counter(seed)
    return tf.raw_ops.StatelessRandomUniformFullIntV2(shape=[n], key=key, counter=counter, alg=1, dtype=tf.uint32)


def fold_in(seed, data) -> tf.Tensor:
    """``tf.random.experimental.stateless_fold_in(seed, data)`` (whose automatic algorithm
    is Philox on CPU and GPU) for an int64 (2,) seed, Philox on every device and also
    under XLA: ``[w, data]`` with w the first int64 Philox word of ``seed`` (XLA's own
    kernels truncate int64 seeds to 32 bits: other noise than without XLA)."""
    data = tf.cast(data, tf.int64)
    key, counter = _key_counter(seed)
    word = tf.raw_ops.StatelessRandomUniformFullIntV2(shape=[], key=key, counter=counter, alg=1, dtype=tf.int64)
    return tf.stack([word, data])


def _in_xla_context() -> bool:
    """Whether the graph being built is compiled by XLA (``jit_compile=True``); True
    when TensorFlow's (private) test is unavailable, which is correct either way."""
    return compat.in_xla_context()


def _box_muller(seed, n, compute, scale=None):
    """n independent N(0, scale²) draws (flat, dtype ``compute``) from a (2,) seed.

    Box–Muller on pairs: with b₀, b₁ independent uniform 32-bit words (Philox, keyed
    by ``seed`` and ``fold_in(seed, 1)``), u₁ = (b₀ + ½)·2⁻³² ∈ (0, 1] and
    θ = 2π·b₁·2⁻³², the pair (r·cos θ, r·sin θ) with r = √(−2 ln u₁) is two
    independent standard normals (tails up to √(2·33·ln 2) ≈ 6.8). The first ⌈n/2⌉
    draws are the cosines, the rest the sines.
    """
    half = (n + 1) // 2
    bits = _philox_bits(seed, half)
    angle_seed = fold_in(seed, 1)
    angle_bits = _philox_bits(angle_seed, half)
    u = (tf.cast(bits, compute) + 0.5) * (2.0**-32)  # (0, 1]: the log is finite and <= 0
    radius = tf.sqrt(-2.0 * tf.math.log(u))
    if scale is not None:
        radius = radius * tf.cast(scale, compute)
    theta = tf.cast(angle_bits, compute) * (2.0 * math.pi * 2.0**-32)
    z = tf.concat([radius * tf.cos(theta), radius * tf.sin(theta)], axis=0)
    return z if 2 * half == n else z[:n]


def normal_from_seed(seed, shape, dtype=tf.float32, scale=None) -> tf.Tensor:
    """N(0, scale²·I) of ``shape``, a pure function of the (2,) int64 ``seed``.

    Args:
      seed: int64 tensor (2,), e.g. ``variable_seed(step_seed(key, t), k)``.
      shape: a fully defined shape (a variable's shape).
      dtype: floating dtype of the result; float64 is computed in float64, any
        other float in float32 and cast.
      scale: optional scalar tensor multiplying the draw (folded into the radius of
        the Box–Muller pairs: one multiply on half the entries).

    Returns:
      tensor of ``shape`` and ``dtype``.
    """
    dtype = tf.as_dtype(dtype)
    shape = tf.TensorShape(shape)
    n = shape.num_elements()
    if n is None:
        raise ValueError(f"the noise needs a fully defined shape, got {shape}.")
    compute = tf.float64 if dtype == tf.float64 else tf.float32
    z = tf.reshape(_box_muller(seed, n, compute, scale), shape)
    return z if compute == dtype else tf.cast(z, dtype)


def standard_normal(key, step, index, shape, dtype=tf.float32):
    """z_t for variable ``index``: N(0, I) of ``shape``, a pure function of (key, step, index).

    ``normal_from_seed(variable_seed(step_seed(key, step), index), shape, dtype)``.

    Args:
      key: int64 tensor of shape (2,).
      step: scalar integer tensor, the step t (0-based).
      index: Python int or scalar tensor, the variable's position k.
      shape: the variable's shape.
      dtype: floating dtype of the draw.
    """
    return normal_from_seed(variable_seed(step_seed(key, step), index), shape, dtype)


def _broadcast(vector, rank):
    """A (m,) vector reshaped to (m, 1, …, 1) against a (m, *shape) state of ``rank`` + 1 axes."""
    return tf.reshape(vector, [-1] + [1] * rank)


@tf.function(jit_compile=True, autograph=False)
def fused_ring_step(z, state, mix, lead, slot, keeps_draw, scale):
    """One ring step in place, compiled by XLA (one read of the ring, one slot written).

    Args:
      z: the draw z_t, the variable's shape.
      state: the resource handle (``variable.handle``) of the ring, a variable of
        shape (m, *z.shape), m = b − 1, and z's dtype. A handle, not the variable: a
        ``tf.function`` traced with one variable argument would reuse that variable for
        every later variable of the same shape.
      mix: (m,) coefficient of each slot at step t (``StepCoefficients.mix``).
      lead: scalar, V[t, 0] (banded, toeplitz) or f_0 (fir).
      slot: int32 scalar, the slot ``t mod m`` that receives this step's value.
      keeps_draw: Python bool; ``False`` (banded, toeplitz):
        ``z̃ = (z − Σ_s mix_s·state_s) / lead`` and z̃ is written; ``True`` (fir):
        ``z̃ = lead·z + Σ_s mix_s·state_s`` and z is written.
      scale: scalar multiplying the result only (the noise standard deviation ζσ; 1 for z̃).

    Returns:
      scale·z̃_t (the shape of z); ``state[slot]`` holds the written value afterwards.
    """
    ring = tf.raw_ops.ReadVariableOp(resource=state, dtype=z.dtype)
    past = tf.reduce_sum(_broadcast(mix, z.shape.rank) * ring, axis=0)
    if keeps_draw:
        z_tilde, written = lead * z + past, z
    else:
        z_tilde = (z - past) / lead
        written = z_tilde
    updated = tf.tensor_scatter_nd_update(ring, tf.reshape(slot, [1, 1]), written[None])
    tf.raw_ops.AssignVariableOp(resource=state, value=updated)
    return scale * z_tilde


@tf.function(jit_compile=True, autograph=False)
def fused_blt_step(z, state, omega, theta, scale):
    """One BLT step in place, compiled by XLA.

    ``y = z − Σ_i ω_i S_i``, ``z̃ = scale·y``, ``S_i ← θ_i S_i + y``, with ``state`` the
    resource handle of the variable S of shape (d, *z.shape) (see ``fused_ring_step``)
    and ω, θ of shape (d,). Returns ``scale·y``: z̃_t with the stream's scale, or ζσ·z̃_t
    when the noise standard deviation is folded into ``scale``.
    """
    accumulators = tf.raw_ops.ReadVariableOp(resource=state, dtype=z.dtype)
    y = z - tf.reduce_sum(_broadcast(omega, z.shape.rank) * accumulators, axis=0)
    tf.raw_ops.AssignVariableOp(resource=state, value=_broadcast(theta, z.shape.rank) * accumulators + y[None])
    return y * scale


class TensorFlowOps:
    """The array namespace that runs a ``NoiseStream``'s recurrence in TensorFlow
    (``keras_noisecurve.mixing.stream.NumpyOps`` is the numpy one), with the XLA-compiled
    in-place steps ``fused_ring_step`` and ``fused_blt_step``."""

    name = "tensorflow"
    fused_ring_step = staticmethod(fused_ring_step)
    fused_blt_step = staticmethod(fused_blt_step)
    standard_normal = staticmethod(standard_normal)

    @staticmethod
    def constant(value, dtype):
        return tf.constant(value, dtype=dtype)

    @staticmethod
    def cast(value, dtype):
        return tf.cast(value, dtype)

    @staticmethod
    def zeros(shape, dtype):
        return tf.zeros(shape, dtype)

    @staticmethod
    def gather(table, index):
        return tf.gather(table, tf.cast(index, tf.int32))

    @staticmethod
    def slot(step, buffers):
        return tf.math.floormod(tf.cast(step, tf.int32), buffers)

    @staticmethod
    def slot_coefficients(tail, step, buffers):
        """(m,) vector whose entry s = (t − j) mod m is ``tail[j − 1]``, j = 1 … m."""
        t = tf.cast(step, tf.int32)
        slots = tf.math.floormod(t - tf.range(1, buffers + 1, dtype=tf.int32), buffers)
        return tf.scatter_nd(slots[:, None], tail, [buffers])

    @staticmethod
    def tensordot(vector, state):
        return tf.tensordot(vector, state, axes=1)

    @staticmethod
    def broadcast(vector, rank):
        return _broadcast(vector, rank)

    @staticmethod
    def rank(x):
        return x.shape.rank

    @staticmethod
    def expand(x):
        return x[None]

    @staticmethod
    def write_slot(state, slot, value):
        """A copy of ``state`` with ``state[slot] = value``."""
        return tf.tensor_scatter_nd_update(state, tf.reshape(slot, [1, 1]), value[None])

    @staticmethod
    def assert_less(step, limit, message):
        """An op that fails with ``message`` when ``step >= limit``."""
        return tf.debugging.assert_less(tf.cast(step, tf.int64), tf.constant(limit, tf.int64), message=message)

    @staticmethod
    def can_fuse(state) -> bool:
        """Whether the fused in-place step may update ``state``: no ``tf.distribute``
        strategy is active (a distributed variable is updated by the unfused reference)."""
        return not tf.distribute.has_strategy() and not isinstance(state, tf.distribute.DistributedValues)

    @staticmethod
    def write_in_place(state, write):
        """Apply a ``StateWrite`` to the ``tf.Variable`` ``state``: the whole state
        (``write.slot`` ``None``) or one ring slot (a scatter)."""
        if write.slot is None:
            state.assign(write.value)
        else:
            state.scatter_nd_update(tf.reshape(write.slot, [1, 1]), write.value[None])


#: the array namespace of this backend (``StreamNoise``'s default under this Keras backend)
OPS = TensorFlowOps
