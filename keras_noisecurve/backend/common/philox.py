"""The noise's counter-based generator, written once for any array namespace.

Imports no framework. Every function takes ``xp``, a numpy-like namespace (``numpy``,
``jax.numpy``, or for the key/counter derivation TensorFlow's uint32 ops under XLA) that
needs only **uint32** integer arithmetic (wrapping ``multiply``/``add``,
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

import functools
import math

import numpy as np

__all__ = [
    "PHILOX_M",
    "PHILOX_W",
    "SEED_KEY",
    "box_muller",
    "box_muller_words",
    "fold_in",
    "int64_words",
    "key_counter",
    "mul_hi_lo",
    "philox_block",
    "philox_block_looped",
    "uniform_words",
    "variable_normals",
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


def _materialize(xp, values):
    """``values`` computed once: ``xp.materialize`` where the namespace has it (JAX's
    ``optimization_barrier``, so that XLA does not copy a whole Philox chain into every
    fusion that reads a key word), else unchanged."""
    materialize = getattr(xp, "materialize", None)
    return values if materialize is None else materialize(values)


def mul_hi_lo(xp, a, b):
    """The high and low 32-bit words of the 64-bit product a·b of uint32 arrays, in uint32.

    With 16-bit limbs a = a₁·2¹⁶ + a₀ and b = b₁·2¹⁶ + b₀ (every partial sum below fits in
    32 bits): ``t = a₁b₀ + ⌊a₀b₀/2¹⁶⌋``, ``u = a₀b₁ + (t mod 2¹⁶)``,
    ``hi = a₁b₁ + ⌊t/2¹⁶⌋ + ⌊u/2¹⁶⌋`` and ``lo = a·b mod 2³²`` (a wrapping multiply).
    ``b`` may be a Python int (a constant: its limbs are split in Python).
    """
    mask, shift = _u32(xp, 0xFFFF), _u32(xp, 16)
    if isinstance(b, int):
        b0, b1, b = _u32(xp, b & 0xFFFF), _u32(xp, b >> 16), _u32(xp, b)
    else:
        b0, b1 = xp.bitwise_and(b, mask), xp.right_shift(b, shift)
    a0, a1 = xp.bitwise_and(a, mask), xp.right_shift(a, shift)
    t = xp.add(xp.multiply(a1, b0), xp.right_shift(xp.multiply(a0, b0), shift))
    u = xp.add(xp.multiply(a0, b1), xp.bitwise_and(t, mask))
    hi = xp.add(xp.add(xp.multiply(a1, b1), xp.right_shift(t, shift)), xp.right_shift(u, shift))
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
    w0, w1 = (_u32(xp, w) for w in PHILOX_W)
    for r in range(ROUNDS):
        hi0, lo0 = mul_hi_lo(xp, c0, PHILOX_M[0])
        hi1, lo1 = mul_hi_lo(xp, c2, PHILOX_M[1])
        c0, c1, c2, c3 = (xp.bitwise_xor(xp.bitwise_xor(hi1, c1), k0), lo1,
                          xp.bitwise_xor(xp.bitwise_xor(hi0, c3), k1), lo0)
        if r < ROUNDS - 1:
            k0, k1 = xp.add(k0, w0), xp.add(k1, w1)
            # each round's words computed once: without the barrier XLA re-computes a round
            # inside every fusion that reads it (compile time ×4 on CPU, run time no better)
            c0, c1, c2, c3, k0, k1 = _materialize(xp, (c0, c1, c2, c3, k0, k1))
    shape = xp.broadcast_shapes(*(xp.shape(c) for c in (c0, c1, c2, c3)))
    return tuple(xp.broadcast_to(c, shape) for c in (c0, c1, c2, c3))


def philox_block_looped(xp, counter, key):
    """:func:`philox_block` with its 10 rounds as one loop, for the few-lane blocks of the key
    and counter derivations: the same words.

    Where ``xp`` has ``fori_loop`` (JAX's ``jax.lax.fori_loop``) the rounds are one loop body,
    traced and compiled once; unrolled, each of these small blocks is 10 rounds of scalar
    kernels that XLA compiles one by one (a step's draw derives its keys in about seven such
    blocks: on a 2-core CPU the MLP's draw compiles in 0.55 s instead of 1.04 s, and runs no
    slower; docs/performance.md). The bulk of a draw keeps :func:`philox_block`: over many
    lanes the unrolled rounds run 1.4–1.6× faster than the loop there. A namespace without
    ``fori_loop`` (numpy, TensorFlow's ops) runs :func:`philox_block`.

    Args and returns: as :func:`philox_block`.
    """
    loop = getattr(xp, "fori_loop", None)
    if loop is None:
        return philox_block(xp, counter, key)
    words = [_u32(xp, c) for c in counter]
    shape = xp.broadcast_shapes(*(xp.shape(c) for c in words))
    words = [xp.broadcast_to(c, shape) for c in words]  # a loop carries fixed shapes
    return tuple(loop(0, ROUNDS, _round_body(xp), (*words, *(_u32(xp, k) for k in key)))[:4])


@functools.lru_cache(maxsize=None)
def _round_body(xp):
    """One Philox round then the key's Weyl step (unused after the last round), as a loop body
    over ``(c₀, c₁, c₂, c₃, k₀, k₁)``: one function object per namespace, so that JAX reuses its
    compiled loop when a draw runs outside ``jit`` (a new closure per call compiled it anew)."""
    def round_(_, carry):
        c0, c1, c2, c3, k0, k1 = carry
        hi0, lo0 = mul_hi_lo(xp, c0, PHILOX_M[0])
        hi1, lo1 = mul_hi_lo(xp, c2, PHILOX_M[1])
        return (xp.bitwise_xor(xp.bitwise_xor(hi1, c1), k0), lo1,
                xp.bitwise_xor(xp.bitwise_xor(hi0, c3), k1), lo0,
                xp.add(k0, _u32(xp, PHILOX_W[0])), xp.add(k1, _u32(xp, PHILOX_W[1])))

    return round_


def key_counter(xp, seed):
    """TensorFlow's ``StatelessRandomGetKeyCounter`` for Philox.

    Args:
      seed: four uint32 scalars (or a (4,) uint32 array): the int64 seed pair's words.

    Returns:
      ``(key, counter_high)``: the Philox key (two uint32 scalars) and the counter's words
      2 and 3 (its words 0 and 1 are zero).
    """
    mix = _materialize(xp, philox_block_looped(xp, tuple(seed[i] for i in range(4)), SEED_KEY))
    return (mix[0], mix[1]), (mix[2], mix[3])


def uniform_words(xp, seed, n: int):
    """n uniform uint32 words of the seed's Philox stream, shape (n,):
    ``tf.random.stateless_uniform([n], seed, dtype=tf.uint32, alg="philox")``."""
    n = int(n)
    key, (c2, c3) = key_counter(xp, seed)
    blocks = xp.arange((n + 3) // 4, dtype=xp.uint32)
    zero = _u32(xp, 0)
    words = xp.stack(_materialize(xp, philox_block(xp, (blocks, zero, c2, c3), key)), axis=-1)
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
    block = philox_block_looped(xp, (zero, zero, c2, c3), key)
    return _materialize(xp, xp.stack([block[0], block[1], _u32(xp, data_lo), _u32(xp, data_hi)]))


def box_muller(xp, seed, angle_seed, n: int, compute, scale=None):
    """n independent N(0, scale²) draws, flat, from two seeds' uniform words.

    With b₀, b₁ the words of ``seed`` and ``angle_seed`` (= ``fold_in(seed, 1)``), ⌈n/2⌉ of
    each: see :func:`box_muller_words`.

    Returns:
      an (n,) array of dtype ``compute``.
    """
    half = (int(n) + 1) // 2
    return box_muller_words(xp, uniform_words(xp, seed, half), uniform_words(xp, angle_seed, half), n, compute, scale)


def box_muller_words(xp, bits, angle_bits, n: int, compute, scale=None):
    """n draws of N(0, scale²) from ⌈n/2⌉ radius words b₀ and ⌈n/2⌉ angle words b₁.

    u = (b₀ + ½)·2⁻³² ∈ (0, 1], r = √(−2 ln u) (times ``scale``), θ = 2π·b₁·2⁻³²; the
    draws are (r·cos θ, r·sin θ) with the cosines first, cut to n entries. Computed in the
    float dtype ``compute`` (the words are rounded to it first, as TensorFlow's cast does).
    """
    n = int(n)
    half = (n + 1) // 2
    radius, cos, sin = _polar(xp, bits, angle_bits, compute)
    if scale is not None:
        radius = radius * xp.astype(xp.asarray(scale), compute)
    z = xp.concatenate([radius * cos, radius * sin], axis=0)
    return z if 2 * half == n else z[:n]


def variable_normals(xp, seed, indices, sizes, compute, scales=None):
    """The draws of many variables of one step in one pass of Philox over all their words.

    Entry k is ``box_muller(s_k, fold_in(s_k, 1), sizes[k], compute, scales[k])`` with
    ``s_k = fold_in(seed, indices[k])``, the same words as one variable at a time: the
    Philox blocks of every variable (its key/counter, its angle seed, its radius and angle
    words) are computed as lanes of the same few vectorised blocks (7 blocks in all
    instead of ~8 per variable: what a compiler traces does not grow with the number of
    variables), and the logarithms, square roots, cosines and sines once over all words.

    The bulk block is elementwise over a grid of lanes: the radius words of every
    variable, then their angle words, each padded to whole rows of ``width`` blocks (a
    power of two, :func:`_row_width`); lane (r, j) has the counter ``(base_r + j, 0, c₂,
    c₃)`` and the key of its row's variable, so the only tables are per row (small: ~64
    rows per variable) and nothing of the size of the draw is a constant or a gather.

    Args:
      seed: the step seed's four uint32 words (``fold_in(key, t)``).
      indices: the variables' int64 indices k (Python ints).
      sizes: the number of draws of each variable (Python ints).
      compute: the float dtype of the Box–Muller arithmetic, or one per variable.
      scales: ``None`` or one scalar (or ``None``) per variable, folded into the radius.

    Returns:
      a list of flat arrays, entry k of shape (sizes[k],).
    """
    sizes = [int(n) for n in sizes]
    count = len(sizes)
    if len(indices) != count or (scales is not None and len(scales) != count):
        raise ValueError(f"indices, sizes and scales need one entry per variable, got {len(indices)}, {count} and "
                         f"{'-' if scales is None else len(scales)}.")
    if count == 0:
        return []
    # fold_in(seed, k) = (w, k): w, the first int64 of the step seed's stream, is shared
    key, (c2, c3) = key_counter(xp, seed)
    zero = _u32(xp, 0)
    first = _materialize(xp, philox_block_looped(xp, (zero, zero, c2, c3), key))
    words = np.array([int64_words(k) for k in indices], dtype=np.uint32).reshape(count, 2)
    lanes = xp.zeros((count,), dtype=xp.uint32)
    variables = (xp.add(lanes, first[0]), xp.add(lanes, first[1]), _u32(xp, words[:, 0]), _u32(xp, words[:, 1]))
    var_key, (var_c2, var_c3) = key_counter(xp, variables)
    start = _materialize(xp, philox_block_looped(xp, (zero, zero, var_c2, var_c3), var_key))  # fold_in(s_k, 1) = (w_k, 1)
    angle_key, (angle_c2, angle_c3) = key_counter(xp, (start[0], start[1], _u32(xp, 1), zero))
    # 2·count streams (the radius words of every variable, then their angle words) laid
    # out as rows of `width` blocks (each stream padded to whole rows): every lane is
    # (row, column), its counter (row base + column, 0, c₂, c₃) and its key its row's
    halves = [(n + 1) // 2 for n in sizes]
    blocks = np.array([(h + 3) // 4 for h in halves] * 2, dtype=np.int64)
    width = _row_width(int(blocks.sum()), len(blocks))
    rows = -(-blocks // width)
    owner = np.repeat(np.arange(len(blocks)), rows)  # the stream of each row
    first_row = np.concatenate([[0], np.cumsum(rows)[:-1]])
    base = (np.arange(len(owner)) - first_row[owner]) * width
    if int(blocks.max(initial=0)) >= 2**32:
        raise ValueError(f"a variable's noise is limited to 2**32 Philox blocks (2**34 draws), got "
                         f"{int(blocks.max())} blocks.")
    position = xp.add(_u32(xp, base.astype(np.uint32).reshape(-1, 1)), xp.arange(width, dtype=xp.uint32))
    row = lambda a, b: xp.reshape(xp.take(xp.concatenate([a, b]), owner), (-1, 1))  # noqa: E731
    out = philox_block(xp, (position, zero, row(var_c2, angle_c2), row(var_c3, angle_c3)),
                       (row(var_key[0], angle_key[0]), row(var_key[1], angle_key[1])))
    flat = xp.reshape(xp.stack(_materialize(xp, out), axis=-1), (-1,))
    firsts = first_row * width
    offsets = firsts * 4  # word offsets of the streams in flat
    computes = list(compute) if isinstance(compute, (list, tuple)) else [compute] * count
    polar = {}  # compute dtype -> (radius, cos θ, sin θ) of every word
    draws = []
    for k in range(count):
        kind = np.dtype(computes[k]).name
        if kind not in polar:
            polar[kind] = _polar(xp, flat[:int(offsets[count])], flat[int(offsets[count]):], computes[k])
        radius, cos, sin = polar[kind]
        lo, half = int(offsets[k]), halves[k]
        r = radius[lo:lo + half]
        if scales is not None and scales[k] is not None:
            r = r * xp.astype(xp.asarray(scales[k]), computes[k])
        z = xp.concatenate([r * cos[lo:lo + half], r * sin[lo:lo + half]], axis=0)
        draws.append(z if 2 * half == sizes[k] else z[:sizes[k]])
    return draws


def _row_width(blocks: int, streams: int) -> int:
    """The blocks per row of :func:`variable_normals`' lanes: a power of two, at most
    1024, with about 64 rows per stream (the padding, under one row per stream, stays
    under ~1/64 of the blocks; the per-row tables stay small)."""
    width = 1
    while width < 1024 and 2 * width * 64 * streams <= blocks:
        width *= 2
    return width


def _polar(xp, bits, angle_bits, compute):
    """Box–Muller's radius √(−2 ln u) and cos θ, sin θ of radius words b₀ and angle words
    b₁ (:func:`box_muller_words`), in the float dtype ``compute``."""
    u = (xp.astype(bits, compute) + 0.5) * (2.0**-32)
    theta = xp.astype(angle_bits, compute) * (2.0 * math.pi * 2.0**-32)
    return xp.sqrt(-2.0 * xp.log(u)), xp.cos(theta), xp.sin(theta)
