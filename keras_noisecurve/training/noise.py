"""Online banded correlated noise z̃ = C⁻¹z (docs/design.md#notation), shared by the
Keras optimizer and the TensorFlow Privacy query.

Randomness is counter based: the standard normal draw z_t for variable k is made
from Philox bits keyed by ``seed = fold_in(fold_in(key, t), k)`` (see
:func:`normal_from_seed`: Box–Muller on 32-bit uniforms, computed with vectorised
TensorFlow ops, because ``tf.random.stateless_normal`` runs its Box–Muller in scalar
code; docs/training.md, "Secret seeds", has the timings). It depends
only on (key, step t, variable index k), so it is identical on every replica of a
``tf.distribute`` strategy and is reproduced exactly after restoring the key, the
step counter and the ring buffers from any checkpoint.

The recurrence (paper App. C)::

    z̃_t = (z_t − Σ_{j=1}^{b−1} C[t, t−j] · z̃_{t−j}) / C[t, t]

keeps the last b − 1 values z̃ of each variable in a ring buffer of shape
``(b − 1, *variable_shape)``: slot ``s = t mod (b − 1)`` holds z̃_t until it is
overwritten by z̃_{t+b−1}. With b = 1 (DP-SGD) there is no buffer and z̃_t = z_t / C[t, t].
"""

from __future__ import annotations

import math
import secrets

import numpy as np
import tensorflow as tf

from keras_noisecurve._validation import check_int

__all__ = ["BandedNoise", "key_from_seed", "normal_from_seed", "standard_normal", "step_seed", "variable_seed"]

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
    return tf.random.experimental.stateless_fold_in(key, tf.cast(step, tf.int64))


def variable_seed(seed, index) -> tf.Tensor:
    """The seed of variable ``index`` at a step: ``fold_in(step_seed, k)``, int64 (2,)."""
    return tf.random.experimental.stateless_fold_in(seed, tf.cast(index, tf.int64))


def _box_muller(seed, n, compute, scale=None):
    """n independent N(0, scale²) draws (flat, dtype ``compute``) from a (2,) seed.

    Box–Muller on pairs: with b₀, b₁ independent uniform 32-bit words (Philox, keyed
    by ``seed`` and ``fold_in(seed, 1)``), u₁ = (b₀ + ½)·2⁻³² ∈ (0, 1] and
    θ = 2π·b₁·2⁻³², the pair (r·cos θ, r·sin θ) with r = √(−2 ln u₁) is two
    independent standard normals (tails up to √(2·33·ln 2) ≈ 6.8). The first ⌈n/2⌉
    draws are the cosines, the rest the sines.
    """
    half = (n + 1) // 2
    bits = tf.random.stateless_uniform([half], seed=seed, minval=None, maxval=None, dtype=tf.uint32)
    angle_seed = tf.random.experimental.stateless_fold_in(seed, tf.constant(1, tf.int64))
    angle_bits = tf.random.stateless_uniform([half], seed=angle_seed, minval=None, maxval=None, dtype=tf.uint32)
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


class BandedNoise:
    """The online recurrence z̃ = C⁻¹z for a b-banded lower-triangular C.

    Args:
      band_values: array (T, b) with ``band_values[t, j] == C[t, t − j]`` (a
        ``MixingMatrix.band_values``), or ``None`` for independent noise with no
        step limit (DP-SGD, C = I of unbounded size).

    Attributes:
      steps: T, or ``None`` when unlimited.
      bands: b (1 for DP-SGD).
    """

    def __init__(self, band_values=None):
        if band_values is None:
            self.steps = None
            self.bands = 1
            self._band_values = None
            return
        values = np.asarray(band_values, dtype=np.float64)
        if values.ndim != 2 or values.shape[0] < 1 or values.shape[1] < 1:
            raise ValueError(f"band_values must have shape (T, b), got {values.shape}.")
        self.steps, self.bands = (int(s) for s in values.shape)
        self._band_values = values

    # ------------------------------------------------------------------ helpers
    def ring_shape(self, shape) -> tuple | None:
        """Shape of the ring buffer for a variable of ``shape``; ``None`` when b = 1."""
        if self.bands == 1:
            return None
        return (self.bands - 1,) + tuple(int(d) for d in shape)

    def ring_bytes(self, shapes, dtype_size: int = 4) -> int:
        """Bytes of all ring buffers for variables of ``shapes`` (noise-state memory)."""
        total = 0
        for shape in shapes:
            rs = self.ring_shape(shape)
            if rs is not None:
                total += int(np.prod(rs)) * dtype_size
        return total

    def row(self, step, dtype):
        """Row t of the band values, ``(C[t, t], C[t, t − 1], …)``, a tensor of shape (b,);
        ``None`` for DP-SGD without a matrix (C = I)."""
        if self._band_values is None:
            return None
        table = tf.constant(self._band_values, dtype=dtype)
        return tf.gather(table, tf.cast(step, tf.int32))

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

    # --------------------------------------------------------------- recurrence
    def combine(self, z, step, ring=None, row=None):
        """z̃_t from z_t and the ring buffer, WITHOUT updating the buffer.

        Args:
          z: fresh N(0, I) draw z_t, any shape.
          step: scalar integer tensor t.
          ring: ring buffer (b − 1, *z.shape) holding z̃_{t−1}, …, z̃_{t−b+1} in
            slots ``(t − j) mod (b − 1)``; ``None`` when b = 1.
          row: ``row(step, z.dtype)`` if already computed (shared by all variables
            of a step), else ``None``.

        Returns:
          z̃_t; store it in slot :meth:`slot` ``(t)`` of the buffer before step t + 1.
        """
        if self._band_values is None:
            return z
        if row is None:
            row = self.row(step, z.dtype)
        if self.bands == 1:
            return z / row[0]
        m = self.bands - 1
        t = tf.cast(step, tf.int32)
        # coefficient of slot s: C[t, t − j] with s = (t − j) mod m, j = 1 … m
        j = tf.range(1, self.bands, dtype=tf.int32)
        slots = tf.math.floormod(t - j, m)
        coeff = tf.scatter_nd(slots[:, None], row[1:], [m])
        past = tf.tensordot(coeff, ring, axes=1)
        return (z - past) / row[0]

    def slot(self, step):
        """Ring-buffer slot ``t mod (b − 1)`` that receives z̃_t (int32 scalar); b ≥ 2."""
        return tf.math.floormod(tf.cast(step, tf.int32), self.bands - 1)

    def correlate(self, z, step, ring=None):
        """One step of the recurrence, functional form.

        Returns:
          ``(z_tilde, new_ring)``: z̃_t (shape of z) and the updated buffer (slot
          ``t mod (b − 1)`` replaced by z̃_t), ``None`` when b = 1.
        """
        z_tilde = self.combine(z, step, ring)
        if self.bands == 1:
            return z_tilde, None
        new_ring = tf.tensor_scatter_nd_update(ring, [[self.slot(step)]], z_tilde[None])
        return z_tilde, new_ring

    def sample(self, key, step, index, shape, dtype=tf.float32, ring=None):
        """z̃_t for variable ``index``: draw z_t (``standard_normal``) and ``correlate`` it.

        Returns ``(z_tilde, new_ring)`` as ``correlate``.
        """
        z = standard_normal(key, step, index, shape, dtype)
        return self.correlate(z, step, ring)
