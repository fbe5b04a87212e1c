"""Online correlated noise z̃ = C⁻¹z for every mixing strategy (docs/design.md#notation),
shared by the Keras optimizer and the TensorFlow Privacy query.

Randomness is counter based: the standard normal draw z_t for variable k is made
from Philox bits keyed by ``seed = fold_in(fold_in(key, t), k)`` (see
:func:`normal_from_seed`: Box–Muller on 32-bit uniforms, computed with vectorised
TensorFlow ops, because ``tf.random.stateless_normal`` runs its Box–Muller in scalar
code; docs/training.md, "Secret seeds", has the timings). It depends
only on (key, step t, variable index k), so it is identical on every replica of a
``tf.distribute`` strategy and is reproduced exactly after restoring the key, the
step counter and the noise state from any checkpoint.

:class:`StreamNoise` runs the recurrence of a ``keras_noisecurve.mixing.stream.NoiseStream``
(``strategy.stream()``): the stream's ``init``/``coefficients``/``next`` are written once
against a tiny array namespace and run here with :class:`TensorFlowOps` (the module
docstring of ``keras_noisecurve.mixing.stream`` states the recurrences; ``stream_apply``
runs the same code in float64 numpy, the reference). Each variable keeps ONE state
array of shape ``(buffers, *variable_shape)`` (none when ``buffers == 0``): a ring of
the last b − 1 values z̃ (banded, Toeplitz; slot ``t mod (b − 1)``), a ring of the last
p − 1 draws (BISR's FIR form), or the d accumulators of BLT. With no state (b = 1,
p = 1, or C = I) z̃_t is z_t times a scalar, folded into the draw.

The optimizer runs a step in place (:meth:`StreamNoise.advance_in_place`, the stream's
``next_in_place``, which picks ``fused_ring_step`` or ``fused_blt_step``): one
XLA-compiled function per variable reads the state once (the Σ over the buffers is one
reduction fused with the rest of the arithmetic) and writes only what changes (a ring
slot, or the BLT accumulators) into the same buffer. The unfused form (:meth:`advance`
and a TensorFlow scatter) is kept as the reference and under ``tf.distribute``; it is
several times slower because a TensorFlow scatter puts the variable in copy-on-read
mode, so that every later read of the state copies all of it (docs/training.md,
"Performance").
"""

from __future__ import annotations

import math
import secrets
from typing import Optional

import numpy as np
import tensorflow as tf

from keras_noisecurve import _compat
from keras_noisecurve._validation import check_int
from keras_noisecurve.mixing.stream import (
    BandedStream,
    IdentityStream,
    NoiseStream,
    StateWrite,
    StepCoefficients,
    apply_write,
)
from keras_noisecurve.mixing.strategies import load_mixing

__all__ = [
    "StateWrite",
    "StepCoefficients",
    "StreamNoise",
    "TensorFlowOps",
    "fused_ring_step",
    "fused_blt_step",
    "key_from_seed",
    "normal_from_seed",
    "standard_normal",
    "step_seed",
    "variable_seed",
]

_SEED_LIMIT = 2**63 - 1


def key_from_seed(seed=None) -> np.ndarray:
    """The int64 noise key, shape (2,).

    Args:
      seed: ``None`` (default) draws 126 bits from the OS entropy pool
        (``secrets.randbits``): the noise is secret, as DP requires. An integer in
        [0, 2⁶³) gives a fixed key, for tests and reproducibility only: anyone who
        knows the seed can subtract the noise, which voids the privacy guarantee.

    Returns:
      ``np.ndarray`` of dtype int64 and shape (2,).
    """
    if seed is None:
        return np.array([secrets.randbits(63), secrets.randbits(63)], dtype=np.int64)
    seed = check_int("seed", seed, minimum=0, maximum=_SEED_LIMIT)
    # A fixed, documented mixing of the seed into two words (no secret here).
    return np.array([seed, 0x5EED_C0DE], dtype=np.int64)


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
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # Philox-4×32 multipliers
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # Philox-4×32 key increments
_SEED_KEY = (0x3EC8F720, 0x02461E29)  # TensorFlow's key for turning a seed into (key, counter)


def _philox_block(counter, key):
    """One Philox-4×32-10 block: 4 uint32 words (as uint64 scalars) from a 4-word
    counter and a 2-word key."""
    mask = tf.constant(_MASK32, tf.uint64)
    m0, m1 = (tf.constant(m, tf.uint64) for m in _PHILOX_M)
    c, k = list(counter), list(key)
    for r in range(10):
        p0, p1 = m0 * c[0], m1 * c[2]  # exact: both factors < 2^32
        hi0, lo0 = tf.bitwise.right_shift(p0, tf.constant(32, tf.uint64)), tf.bitwise.bitwise_and(p0, mask)
        hi1, lo1 = tf.bitwise.right_shift(p1, tf.constant(32, tf.uint64)), tf.bitwise.bitwise_and(p1, mask)
        x = tf.bitwise.bitwise_xor
        c = [x(x(hi1, c[1]), k[0]), lo1, x(x(hi0, c[3]), k[1]), lo0]
        if r < 9:
            k = [tf.bitwise.bitwise_and(k[i] + tf.constant(_PHILOX_W[i], tf.uint64), mask) for i in range(2)]
    return c


def _philox_key_counter(seed):
    """TensorFlow's ``StatelessRandomGetKeyCounter`` for Philox, in plain integer ops:
    one Philox block of the seed's four 32-bit words under a fixed key. (XLA's own
    kernel truncates each int64 seed word to 32 bits, so an XLA step would draw other
    noise than the same step without XLA; this gives the same stream in both.)

    Returns ``key`` uint64 (1,) and ``counter`` uint64 (2,)."""
    words = tf.bitcast(tf.cast(seed, tf.int64), tf.uint64)
    mask = tf.constant(_MASK32, tf.uint64)
    shift = tf.constant(32, tf.uint64)
    counter = [tf.bitwise.bitwise_and(words[0], mask), tf.bitwise.right_shift(words[0], shift),
               tf.bitwise.bitwise_and(words[1], mask), tf.bitwise.right_shift(words[1], shift)]
    mix = _philox_block(counter, [tf.constant(k, tf.uint64) for k in _SEED_KEY])
    key = mix[0] + tf.bitwise.left_shift(mix[1], shift)
    high = mix[2] + tf.bitwise.left_shift(mix[3], shift)
    return tf.reshape(key, [1]), tf.stack([tf.constant(0, tf.uint64), high])


def _philox_bits(seed, n):
    """n uniform uint32 words of Philox for a (2,) int64 seed: what
    ``tf.random.stateless_uniform([n], seed, dtype=tf.uint32, alg="philox")`` gives
    without XLA, also under XLA."""
    if not _in_xla_context():  # TensorFlow's own kernel: the same words, fewer ops
        return tf.random.stateless_uniform([n], seed=seed, minval=None, maxval=None, dtype=tf.uint32, alg="philox")
    key, counter = _philox_key_counter(seed)
    return tf.raw_ops.StatelessRandomUniformFullIntV2(shape=[n], key=key, counter=counter, alg=1, dtype=tf.uint32)


def fold_in(seed, data) -> tf.Tensor:
    """``tf.random.experimental.stateless_fold_in(seed, data)`` for an int64 (2,) seed,
    also under XLA: ``[w, data]`` with w the first int64 Philox word of ``seed`` (XLA's
    own kernels truncate int64 seeds to 32 bits: other noise than without XLA)."""
    data = tf.cast(data, tf.int64)
    if not _in_xla_context():
        return tf.random.experimental.stateless_fold_in(tf.cast(seed, tf.int64), data)
    key, counter = _philox_key_counter(seed)
    word = tf.raw_ops.StatelessRandomUniformFullIntV2(shape=[], key=key, counter=counter, alg=1, dtype=tf.int64)
    return tf.stack([word, data])


def _in_xla_context() -> bool:
    """Whether the graph being built is compiled by XLA (``jit_compile=True``); True
    when TensorFlow's (private) test is unavailable, which is correct either way."""
    return _compat.in_xla_context()


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

    fused_ring_step = staticmethod(fused_ring_step)
    fused_blt_step = staticmethod(fused_blt_step)

    @staticmethod
    def constant(value, dtype):
        return tf.constant(value, dtype=dtype)

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


class StreamNoise:
    """The online recurrence z̃ = C⁻¹z of any ``NoiseStream``, run in TensorFlow.

    The recurrence itself is the stream's (``init``/``coefficients``/``next``, written
    once in ``keras_noisecurve.mixing.stream`` and run here with :class:`TensorFlowOps`);
    this class adds the plan limit, the state variables and the fused in-place step.

    Args:
      stream: a ``keras_noisecurve.mixing.stream.NoiseStream`` (``strategy.stream()``);
        an array (T, b) of band values ``band_values[t, j] == C[t, t − j]`` (a
        ``MixingMatrix.band_values``; a ``BandedStream``); or ``None`` for
        independent noise with no step limit (DP-SGD, C = I of unbounded size).
      fused: ``True`` (default): :meth:`advance_in_place` runs the XLA-compiled
        in-place step (the stream's ``next_in_place``: ``fused_ring_step`` /
        ``fused_blt_step``) outside ``tf.distribute``; ``False``: always the unfused
        reference (:meth:`advance` and a TensorFlow scatter). Both give the same noise up
        to float round-off (the order of the sum over the buffers).

    Attributes:
      stream: the ``NoiseStream``.
      kind: the stream's label (``stream.kind``).
      steps: T, or ``None`` when unlimited.
      buffers: state arrays per variable (0: no state).
      bands: width of the coefficient row for the rings (b, or p for FIR; 1 without
        state); T for BLT.
      state_name: suffix of the optimizer's state variables (``"noise_ring"`` for a
        banded C, whose checkpoints carry that name; ``"noise_state"`` otherwise).
    """

    ops = TensorFlowOps

    def __init__(self, stream=None, fused=True):
        if not isinstance(fused, bool):
            raise ValueError(f"fused must be True or False, got {fused!r}.")
        self.fused = fused
        if stream is None:
            stream = IdentityStream(None)
        elif not isinstance(stream, NoiseStream):
            stream = BandedStream(stream)
        self.stream = stream
        self.kind = stream.kind
        self.steps = stream.steps
        self.buffers = int(stream.buffers)
        self.bands = int(stream.bands)
        self.state_name = stream.state_name

    @classmethod
    def from_mixing(cls, mixing) -> "StreamNoise":
        """The generator of a strategy (anything ``load_mixing`` reads; ``"dpsgd"``: no plan)."""
        return cls(load_mixing(mixing).stream())

    # ------------------------------------------------------------------ helpers
    def state_shape(self, shape) -> tuple | None:
        """Shape of the noise state of a variable of ``shape``; ``None`` without state."""
        return self.stream.init(shape)

    def state_bytes(self, shapes, dtype_size: int = 4) -> int:
        """Bytes of the noise state of variables of ``shapes`` (buffers × parameters × size)."""
        total = 0
        for shape in shapes:
            ss = self.state_shape(shape)
            if ss is not None:
                total += int(np.prod(ss)) * dtype_size
        return total

    def row(self, step, dtype):
        """The coefficient vector used at step t: banded, row t of the table
        ``(C[t, t], C[t, t − 1], …)``; toeplitz, c; fir, f; blt, ω. ``None`` for C = I."""
        return self.stream.row(step, self.ops, dtype)

    def assert_in_plan(self, step):
        """An op that fails when ``step >= T`` (privacy plan used up); ``None`` if unlimited."""
        if self.steps is None:
            return None
        return tf.debugging.assert_less(
            tf.cast(step, tf.int64),
            tf.constant(self.steps, tf.int64),
            message=(
                f"the mixing matrix plans {self.steps} steps and they have all been used: "
                "the privacy plan is spent. Refusing to train past step T (the noise would "
                "not be covered by the privacy accounting); solve a mixing matrix with more steps."
            ),
        )

    def slot(self, step):
        """Ring slot ``t mod (b − 1)`` that receives step t's value (int32 scalar); ring kinds
        with state only."""
        return self.ops.slot(step, self.buffers)

    # --------------------------------------------------------------- recurrence
    def step_coefficients(self, step, dtype) -> Optional[StepCoefficients]:
        """The :class:`StepCoefficients` of step t (shared by all variables of the step);
        ``None`` for C = I."""
        return self.stream.coefficients(step, self.ops, dtype)

    def folded_scale(self, std, coefficients):
        """The factor a stateless step applies to z_t, times ``std`` (folded into the
        draw): std (C = I), std / V[t, 0] (banded, toeplitz), std · f_0 (fir)."""
        return self.stream.fold(std, coefficients)

    def advance(self, z, step, state=None, coefficients=None):
        """One step of the recurrence: z̃_t from z_t and the state, and how the state changes.

        Args:
          z: fresh N(0, I) draw z_t, any shape.
          step: scalar integer tensor t.
          state: the variable's state, shape ``state_shape(z.shape)``; ``None`` without state.
          coefficients: ``step_coefficients(step, z.dtype)`` if already computed (shared
            by all variables of a step), else ``None``.

        Returns:
          ``(z_tilde, write)``: z̃_t and a :class:`StateWrite` (``None`` without state);
          apply it (:meth:`apply_write`, or an in-place slot update) before step t + 1.
        """
        if coefficients is None:
            coefficients = self.step_coefficients(step, z.dtype)
        return self.stream.next(z, state, coefficients, self.ops)

    def fuses(self, state) -> bool:
        """Whether :meth:`advance_in_place` takes the XLA-compiled path for ``state``:
        ``fused`` is set, the stream has state, no ``tf.distribute`` strategy is active (a
        distributed variable is updated by the unfused reference), and :meth:`advance` is
        this class's (a subclass that redefines the recurrence gets the unfused path, which
        calls its ``advance``)."""
        return (self.fused and self.buffers > 0 and type(self).advance is StreamNoise.advance
                and not tf.distribute.has_strategy()
                and not isinstance(state, tf.distribute.DistributedValues))

    def advance_in_place(self, z, step, state, coefficients=None, scale=None):
        """One step of the recurrence that updates the state VARIABLE in place.

        Args:
          z: fresh N(0, I) draw z_t (the variable's shape).
          step: scalar integer tensor t.
          state: ``tf.Variable`` of shape ``state_shape(z.shape)`` (the stream must have state).
          coefficients: ``step_coefficients(step, z.dtype)`` if already computed.
          scale: optional scalar (e.g. the noise standard deviation ζσ) multiplying the
            result, folded into the fused step; the state holds the unscaled values.

        Returns:
          z̃_t, or scale·z̃_t. Afterwards the state is the one of step t + 1: the ring slot t mod (b − 1)
          holds z̃_t (banded, toeplitz) or z_t (fir); the BLT accumulators are
          θ_i S_i + y_t. Fused (:meth:`fuses`): the stream's ``next_in_place`` (one XLA
          function reads the state once and writes in place); otherwise :meth:`advance`
          and a scatter (or assign).
        """
        if self.buffers == 0:
            raise ValueError(f"advance_in_place needs a stream with state; this {self.kind} stream has none.")
        if coefficients is None:
            coefficients = self.step_coefficients(step, z.dtype)
        if self.fuses(state):
            factor = tf.ones([], z.dtype) if scale is None else tf.cast(scale, z.dtype)
            return self.stream.next_in_place(z, state.handle, coefficients, factor, self.ops)
        z_tilde, write = self.advance(z, step, state.read_value(), coefficients)
        if write.slot is None:
            state.assign(write.value)
        else:
            state.scatter_nd_update(tf.reshape(write.slot, [1, 1]), write.value[None])
        return z_tilde if scale is None else tf.cast(scale, z.dtype) * z_tilde

    @staticmethod
    def apply_write(state, write):
        """The new state after ``write`` (functional; ``state`` unchanged)."""
        return apply_write(state, write, TensorFlowOps)

    def combine(self, z, step, state=None, coefficients=None):
        """z̃_t from z_t and the state, WITHOUT the state update (see :meth:`advance`)."""
        return self.advance(z, step, state, coefficients)[0]

    def correlate(self, z, step, state=None):
        """One step of the recurrence, functional form.

        Returns:
          ``(z_tilde, new_state)``: z̃_t (shape of z) and the updated state, ``None``
          without state.
        """
        z_tilde, write = self.advance(z, step, state)
        if write is None:
            return z_tilde, None
        return z_tilde, self.apply_write(state, write)

    def sample(self, key, step, index, shape, dtype=tf.float32, state=None):
        """z̃_t for variable ``index``: draw z_t (``standard_normal``) and ``correlate`` it.

        Returns ``(z_tilde, new_state)`` as ``correlate``.
        """
        z = standard_normal(key, step, index, shape, dtype)
        return self.correlate(z, step, state)
