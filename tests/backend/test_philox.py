"""The neutral Philox generator (keras_noisecurve.backend.common.philox) run with numpy, against
independent references: Python big-integer products, the Random123 known-answer vectors
of Philox-4×32-10, and TensorFlow's own stateless kernels (``stateless_uniform`` with
uint32 words, ``stateless_fold_in``, and the noise of the TensorFlow backend, with and
without XLA) for many int64 seeds, steps and sizes."""

import numpy as np
import pytest

from keras_noisecurve.backend.common import philox

tf = pytest.importorskip("tensorflow", reason="the comparisons with TensorFlow's kernels need TensorFlow")

MASK32 = 2**32 - 1
EDGE_SEEDS = [(0, 0), (2**63 - 1, 2**63 - 1), (-1, -1), (-(2**63), 0), (2**32 - 1, 2**32), (7, 0x5EED_C0DE)]
STEPS = [0, 1, 5, 2**31 - 1, 2**31, 2**32 + 3, 2**62 + 11]
SIZES = [0, 1, 2, 3, 4, 5, 7, 8, 9, 1001]


def _seeds(count, seed=0):
    rng = np.random.default_rng(seed)
    random = rng.integers(-(2**63), 2**63 - 1, size=(count, 2), dtype=np.int64, endpoint=True)
    return [np.array(s, np.int64) for s in EDGE_SEEDS] + list(random)


def _words(seed):
    """The int64 pair's uint32 words, low word first (numpy's view on a little-endian host,
    independent of ``philox.int64_words``)."""
    return np.asarray(seed, dtype="<i8").view("<u4").astype(np.uint32)


def _tf_bits(seed, n):
    return tf.random.stateless_uniform([n], seed=tf.constant(seed, tf.int64), minval=None, maxval=None,
                                       dtype=tf.uint32, alg="philox").numpy()


def test_int64_words_are_the_twos_complement_words():
    for value in [0, 1, -1, 2**31, 2**32 + 5, 2**63 - 1, -(2**63), -(2**40) + 3]:
        lo, hi = philox.int64_words(value)
        np.testing.assert_array_equal([lo, hi], _words([value]))
    with pytest.raises(ValueError, match=r"\[-2\*\*63, 2\*\*63\), got 9223372036854775808"):
        philox.int64_words(2**63)


def test_mul_hi_lo_is_the_64_bit_product():
    """The 16-bit-limb product equals Python's exact a·b split in two words."""
    rng = np.random.default_rng(1)
    a = np.concatenate([rng.integers(0, 2**32, 5000, dtype=np.uint64), [0, 1, MASK32, 2**16, 2**16 - 1, 2**31]])
    b = np.concatenate([rng.integers(0, 2**32, 5000, dtype=np.uint64), [MASK32, MASK32, MASK32, 2**16, 2**16 - 1, 2]])
    hi, lo = philox.mul_hi_lo(np, a.astype(np.uint32), b.astype(np.uint32))
    exact = [int(x) * int(y) for x, y in zip(a, b)]
    np.testing.assert_array_equal(hi, np.array([p >> 32 for p in exact], np.uint64))
    np.testing.assert_array_equal(lo, np.array([p & MASK32 for p in exact], np.uint64))
    assert hi.dtype == np.uint32 and lo.dtype == np.uint32
    for constant in philox.PHILOX_M:  # a Python-int factor (split into limbs in Python)
        hi, lo = philox.mul_hi_lo(np, a.astype(np.uint32), constant)
        np.testing.assert_array_equal(hi, np.array([(int(x) * constant) >> 32 for x in a], np.uint64))
        np.testing.assert_array_equal(lo, np.array([(int(x) * constant) & MASK32 for x in a], np.uint64))


def test_philox_block_matches_the_random123_known_answers():
    """Philox-4×32-10 known-answer vectors of Random123 (kat_vectors), counter and key low word first."""
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((MASK32,) * 4, (MASK32,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for counter, key, expected in cases:
        np.testing.assert_array_equal([int(w) for w in philox.philox_block(np, counter, key)], expected)


@pytest.mark.parametrize("n", SIZES)
def test_uniform_words_are_tensorflows_philox_words(n):
    for seed in _seeds(12, seed=n):
        np.testing.assert_array_equal(philox.uniform_words(np, _words(seed), n), _tf_bits(seed, n))


def test_fold_in_is_tensorflows_stateless_fold_in():
    """Over edge and random seeds (both int64 words anywhere in [−2⁶³, 2⁶³)) and steps up
    to 2⁶² (int64 data): the words of ``stateless_fold_in``, and the chains step → variable."""
    for seed in _seeds(30):
        for step in STEPS:
            reference = tf.random.experimental.stateless_fold_in(tf.constant(seed), tf.constant(step, tf.int64))
            lo, hi = philox.int64_words(step)
            got = philox.fold_in(np, _words(seed), lo, hi)
            np.testing.assert_array_equal(got, _words(reference.numpy()))
            for index in (0, 3):
                chained = tf.random.experimental.stateless_fold_in(reference, tf.constant(index, tf.int64))
                np.testing.assert_array_equal(philox.fold_in(np, got, index, 0), _words(chained.numpy()))


def _numpy_normal(seed_words, n, scale=None):
    angle = philox.fold_in(np, seed_words, 1, 0)
    return philox.box_muller(np, seed_words, angle, n, np.float32, scale)


def test_numpy_box_muller_equals_the_tensorflow_noise_with_and_without_xla():
    """The numpy draws equal the TensorFlow backend's ``normal_from_seed`` (eager and
    XLA-compiled) to float32 rounding of log/cos/sin; the seeds from the chains
    fold_in(fold_in(key, t), k) are the same words."""
    from keras_noisecurve.backend.tensorflow import noise as tf_noise

    draw = lambda s, t, k, n: tf_noise.normal_from_seed(tf_noise.variable_seed(tf_noise.step_seed(s, t), k), (n,))  # noqa: E731
    draw_xla = tf.function(draw, jit_compile=True, autograph=False, reduce_retracing=True)
    seed_xla = tf.function(lambda s, t, k: tf_noise.variable_seed(tf_noise.step_seed(s, t), k), jit_compile=True)
    rng = np.random.default_rng(3)
    for key in _seeds(6, seed=3):
        step, index = int(rng.choice(STEPS)), int(rng.integers(0, 50))
        n = int(rng.choice([1, 2, 9, 1000, 1001]))
        words = philox.fold_in(np, philox.fold_in(np, _words(key), *philox.int64_words(step)), index, 0)
        # tensors, not Python numbers: the XLA draw is compiled once per size n, not per key and step
        key_t, step_t, index_t = tf.constant(key), tf.constant(step, tf.int64), tf.constant(index, tf.int64)
        np.testing.assert_array_equal(words, _words(seed_xla(key_t, step_t, index_t).numpy()))
        expected = _numpy_normal(words, n)
        for got in (draw(key_t, step_t, index, n).numpy(), draw_xla(key_t, step_t, index_t, n).numpy()):
            assert got.dtype == np.float32 and got.shape == (n,)
            np.testing.assert_allclose(got, expected, rtol=2e-6, atol=2e-6)


def test_numpy_box_muller_scale_and_sizes():
    words = _words([5, 9])
    full = _numpy_normal(words, 11)
    np.testing.assert_allclose(_numpy_normal(words, 11, scale=3.0), 3.0 * full, rtol=1e-6)
    assert _numpy_normal(words, 0).shape == (0,)
    # n = 10 and n = 11 share the first five pairs (cosines first, then sines)
    ten = _numpy_normal(words, 10)
    np.testing.assert_array_equal(ten[:5], full[:5])
    np.testing.assert_array_equal(ten[5:], full[6:11])


@pytest.mark.parametrize("sizes", [[3, 40001, 0, 18000, 1], [1, 2, 0, 5, 1001]])
def test_numpy_variable_normals_are_tensorflows_words_per_variable(sizes):
    """All variables of a step at once (``variable_normals``, lanes in rows of 1 or 16
    blocks with padded streams, an empty variable) use variable k's own TensorFlow words:
    its seed ``stateless_fold_in(seed, k)``, its radius words that seed's
    ``stateless_uniform`` uint32 stream, its angle words the stream of ``fold_in(·, 1)``."""
    assert philox._row_width(sum(2 * (((n + 1) // 2 + 3) // 4) for n in sizes), 2 * len(sizes)) == (
        16 if max(sizes) > 2000 else 1)
    seed = np.array([-77, 2**40 + 3], np.int64)
    indices = [0, 5, 2, 2**33 + 1, 7]
    scales = [None, 2.5, None, None, 0.5]
    draws = philox.variable_normals(np, _words(seed), indices, sizes, np.float32, scales)
    for n, index, scale, got in zip(sizes, indices, scales, draws):
        own = tf.random.experimental.stateless_fold_in(tf.constant(seed, tf.int64), tf.constant(index, tf.int64))
        angle = tf.random.experimental.stateless_fold_in(own, tf.constant(1, tf.int64))
        half = (n + 1) // 2
        u = (_tf_bits(own.numpy(), half).astype(np.float64) + 0.5) * 2.0**-32
        theta = _tf_bits(angle.numpy(), half).astype(np.float64) * 2.0 * np.pi * 2.0**-32
        r = np.sqrt(-2.0 * np.log(u)) * (1.0 if scale is None else scale)
        expected = np.concatenate([r * np.cos(theta), r * np.sin(theta)])[:n]
        assert got.shape == (n,) and got.dtype == np.float32
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
