"""The noise's counter-based generator, written once for any array namespace.

Imports no framework. Every function takes ``xp``, a numpy-like namespace (``numpy`` or
``jax.numpy``) that needs only **uint32** integer arithmetic (wrapping ``multiply``/``add``,
shifts, ``bitwise_and``/``bitwise_xor``) and float32 ``log``/``sqrt``/``cos``/``sin``: JAX
without x64 has no 64-bit integers, so a 64-bit value is carried as two uint32 words
(low word first) and the 32×32 → 64-bit products of Philox are built from 16-bit limbs.

What it computes is TensorFlow's stateless Philox stream, bit for bit (tested against
TensorFlow in tests/backend/test_philox.py):

- a **seed** is TensorFlow's int64 pair ``(s₀, s₁)``, here the four words
  ``(lo s₀, hi s₀, lo s₁, hi s₁)``;
- :func:`key_counter` is ``StatelessRandomGetKeyCounter``: one Philox-4×32-10 block of the
  seed's words under the fixed key ``(0x3EC8F720, 0x02461E29)`` gives the Philox key
  ``(m₀, m₁)`` and the counter ``(0, 0, m₂, m₃)``;
- :func:`uniform_words` is ``tf.random.stateless_uniform([n], seed, dtype=tf.uint32,
  alg="philox")``: word i is word ``i mod 4`` of the Philox block of counter
  ``(⌊i/4⌋, 0, m₂, m₃)``;
- :func:`fold_in` is ``tf.random.experimental.stateless_fold_in(seed, data)``: the seed
  ``(w, data)`` with w the first int64 of the seed's stream (the words 0 and 1 of
  block 0 are lo w and hi w);
- :func:`box_muller` turns the words of a seed into N(0, 1) draws as
  ``keras_noisecurve.training.noise.normal_from_seed`` does.

The noise z_t of variable k is ``box_muller(fold_in(fold_in(key, t), k), n)``
(docs/training.md, "The same noise on every backend").
"""

from __future__ import annotations

import math

__all__ = [
    "PHILOX_M",
    "PHILOX_W",
    "SEED_KEY",
    "box_muller",
    "fold_in",
    "int64_words",
    "key_counter",
    "mul_hi_lo",
    "philox_block",
    "uniform_words",
]

PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # Philox-4×32 round multipliers
PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # Philox-4×32 key increments (Weyl sequence)
SEED_KEY = (0x3EC8F720, 0x02461E29)  # TensorFlow's key turning a seed into (key, counter)
ROUNDS = 10
_MASK32 = 0xFFFFFFFF


def int64_words(value: int) -> tuple[int, int]:
    """The (low, high) uint32 words of a Python integer in [−2⁶³, 2⁶³) (two's complement),
    as Python ints."""
    value = int(value)
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"an int64 value must lie in [-2**63, 2**63), got {value}.")
    value &= 2**64 - 1
    return value & _MASK32, value >> 32


def _u32(xp, value):
    return xp.asarray(value, dtype=xp.uint32)


def mul_hi_lo(xp, a, b):
    """The high and low 32-bit words of the 64-bit product a·b of uint32 arrays, in uint32.

    With a = a₁·2¹⁶ + a₀ and b = b₁·2¹⁶ + b₀ (16-bit limbs, each partial product < 2³²):
    ``lo = a·b mod 2³²`` (wrapping multiply) and
    ``hi = a₁b₁ + ⌊a₁b₀/2¹⁶⌋ + ⌊a₀b₁/2¹⁶⌋ + ⌊(⌊a₀b₀/2¹⁶⌋ + (a₁b₀ mod 2¹⁶) + (a₀b₁ mod 2¹⁶))/2¹⁶⌋``.
    """
    mask, shift = _u32(xp, 0xFFFF), _u32(xp, 16)
    a0, a1 = xp.bitwise_and(a, mask), xp.right_shift(a, shift)
    b0, b1 = xp.bitwise_and(b, mask), xp.right_shift(b, shift)
    p00, p01 = xp.multiply(a0, b0), xp.multiply(a0, b1)
    p10, p11 = xp.multiply(a1, b0), xp.multiply(a1, b1)
    middle = xp.add(xp.add(xp.right_shift(p00, shift), xp.bitwise_and(p10, mask)), xp.bitwise_and(p01, mask))
    hi = xp.add(xp.add(p11, xp.right_shift(p10, shift)), xp.add(xp.right_shift(p01, shift), xp.right_shift(middle, shift)))
    return hi, xp.multiply(a, b)


def philox_block(xp, counter, key):
    """Philox-4×32-10: the four uint32 output words of one block.

    Args:
      xp: the array namespace.
      counter: four uint32 arrays (broadcastable to one shape): the 128-bit counter, low
        word first.
      key: two uint32 arrays (scalars): the 64-bit key, low word first.

    Returns:
      a tuple of four uint32 arrays of the broadcast shape. Each round:
      ``(hi₀, lo₀) = M₀·c₀``, ``(hi₁, lo₁) = M₁·c₂``,
      ``c ← (hi₁ ⊕ c₁ ⊕ k₀, lo₁, hi₀ ⊕ c₃ ⊕ k₁, lo₀)``, then ``k ← k + W`` (mod 2³²).
    """
    c0, c1, c2, c3 = (_u32(xp, c) for c in counter)
    k0, k1 = (_u32(xp, k) for k in key)
    m0, m1 = (_u32(xp, m) for m in PHILOX_M)
    w0, w1 = (_u32(xp, w) for w in PHILOX_W)
    for r in range(ROUNDS):
        hi0, lo0 = mul_hi_lo(xp, m0, c0)
        hi1, lo1 = mul_hi_lo(xp, m1, c2)
        c0, c1, c2, c3 = (xp.bitwise_xor(xp.bitwise_xor(hi1, c1), k0), lo1,
                          xp.bitwise_xor(xp.bitwise_xor(hi0, c3), k1), lo0)
        if r < ROUNDS - 1:
            k0, k1 = xp.add(k0, w0), xp.add(k1, w1)
    shape = xp.broadcast_shapes(*(xp.shape(c) for c in (c0, c1, c2, c3)))
    return tuple(xp.broadcast_to(c, shape) for c in (c0, c1, c2, c3))


def key_counter(xp, seed):
    """TensorFlow's ``StatelessRandomGetKeyCounter`` for Philox.

    Args:
      seed: four uint32 scalars (or a (4,) uint32 array): the int64 seed pair's words.

    Returns:
      ``(key, counter_high)``: the Philox key (two uint32 scalars) and the counter's words
      2 and 3 (its words 0 and 1 are zero).
    """
    mix = philox_block(xp, tuple(seed[i] for i in range(4)), SEED_KEY)
    return (mix[0], mix[1]), (mix[2], mix[3])


def uniform_words(xp, seed, n: int):
    """n uniform uint32 words of the seed's Philox stream, shape (n,):
    ``tf.random.stateless_uniform([n], seed, dtype=tf.uint32, alg="philox")``."""
    n = int(n)
    key, (c2, c3) = key_counter(xp, seed)
    blocks = xp.arange((n + 3) // 4, dtype=xp.uint32)
    zero = _u32(xp, 0)
    words = xp.stack(philox_block(xp, (blocks, zero, c2, c3), key), axis=-1)
    return xp.reshape(words, (-1,))[:n]


def fold_in(xp, seed, data_lo, data_hi):
    """``tf.random.experimental.stateless_fold_in(seed, data)`` on words.

    Args:
      seed: the seed's four uint32 words.
      data_lo, data_hi: the int64 ``data``'s low and high words (uint32 scalars).

    Returns:
      a (4,) uint32 array: the words of ``(w, data)``, w the first int64 of the seed's
      Philox stream (block 0 of the counter; its words 0 and 1 are w's low and high words).
    """
    key, (c2, c3) = key_counter(xp, seed)
    zero = _u32(xp, 0)
    block = philox_block(xp, (zero, zero, c2, c3), key)
    return xp.stack([block[0], block[1], _u32(xp, data_lo), _u32(xp, data_hi)])


def box_muller(xp, seed, angle_seed, n: int, compute, scale=None):
    """n independent N(0, scale²) draws, flat, from two seeds' uniform words.

    With b₀, b₁ the words of ``seed`` and ``angle_seed`` (= ``fold_in(seed, 1)``), ⌈n/2⌉ of
    each: u = (b₀ + ½)·2⁻³² ∈ (0, 1], r = √(−2 ln u) (times ``scale``), θ = 2π·b₁·2⁻³²; the
    draws are (r·cos θ, r·sin θ) with the cosines first, cut to n entries. Computed in the
    float dtype ``compute`` (the words are rounded to it first, as TensorFlow's cast does).

    Returns:
      an (n,) array of dtype ``compute``.
    """
    n = int(n)
    half = (n + 1) // 2
    bits = uniform_words(xp, seed, half)
    angle_bits = uniform_words(xp, angle_seed, half)
    u = (xp.astype(bits, compute) + 0.5) * (2.0**-32)
    radius = xp.sqrt(-2.0 * xp.log(u))
    if scale is not None:
        radius = radius * xp.astype(xp.asarray(scale), compute)
    theta = xp.astype(angle_bits, compute) * (2.0 * math.pi * 2.0**-32)
    z = xp.concatenate([radius * xp.cos(theta), radius * xp.sin(theta)], axis=0)
    return z if 2 * half == n else z[:n]
