"""The online recurrence and the counter-based RNG of keras_noisecurve.training.noise."""

import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.mixing import MixingMatrix
from keras_noisecurve.training.noise import (
    StreamNoise,
    key_from_seed,
    normal_from_seed,
    standard_normal,
    step_seed,
    variable_seed,
)
from tests.training.helpers import random_banded_c


@pytest.mark.parametrize("bands", [1, 2, 5])
def test_recurrence_equals_dense_solve(bands):
    """z̃ from the ring buffer equals C⁻¹z by a dense triangular solve."""
    rng = np.random.default_rng(bands)
    c = random_banded_c(11, bands, rng=rng, diag_scale=0.3)
    z = rng.normal(size=(11, 3, 2))
    noise = StreamNoise(c.band_values)
    ring = None if bands == 1 else tf.zeros(noise.state_shape((3, 2)), tf.float64)
    out = []
    for t in range(11):
        zt, ring = noise.correlate(tf.constant(z[t]), tf.constant(t), ring)
        out.append(zt.numpy())
    expected = np.linalg.solve(c.to_dense(), z.reshape(11, -1)).reshape(z.shape)
    np.testing.assert_allclose(np.array(out), expected, rtol=1e-10, atol=1e-10)


def test_rng_is_a_function_of_key_step_index():
    key = key_from_seed(7)
    a = standard_normal(key, 3, 1, (5,)).numpy()
    np.testing.assert_array_equal(a, standard_normal(key, 3, 1, (5,)).numpy())
    assert not np.allclose(a, standard_normal(key, 4, 1, (5,)).numpy())
    assert not np.allclose(a, standard_normal(key, 3, 2, (5,)).numpy())
    assert not np.allclose(a, standard_normal(key_from_seed(8), 3, 1, (5,)).numpy())


def test_default_key_is_secret_and_random():
    keys = {tuple(key_from_seed(None)) for _ in range(5)}
    assert len(keys) == 5
    with pytest.raises(ValueError, match="seed must be >= 0"):
        key_from_seed(-1)


def test_dpsgd_noise_has_no_limit_and_no_buffer():
    noise = StreamNoise(None)
    assert noise.steps is None and noise.bands == 1 and noise.state_shape((3,)) is None
    assert noise.assert_in_plan(10**9) is None
    assert StreamNoise(MixingMatrix.identity(4).band_values).state_bytes([(10,), (3, 3)]) == 0
    assert StreamNoise(np.ones((4, 3)) * [1, 0, 0]).state_bytes([(10,), (3, 3)]) == 2 * 19 * 4


def test_assert_in_plan_refuses_step_t():
    noise = StreamNoise(MixingMatrix.identity(3).band_values)
    noise.assert_in_plan(tf.constant(2))
    with pytest.raises(tf.errors.InvalidArgumentError, match="privacy plan is spent"):
        noise.assert_in_plan(tf.constant(3))


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_standard_normal_has_the_standard_normal_law(dtype):
    """The draw is N(0, 1), entry by entry and jointly: a KS test on the marginal, the
    tail mass beyond 3σ, and no dependence between the Box–Muller partners (entry i
    and entry i + n/2 share a seed pair: their product and their squares must be
    uncorrelated), for an odd number of entries."""
    from scipy import stats

    n = 200_001
    z = standard_normal(key_from_seed(11), 5, 2, (n,), dtype=dtype).numpy()
    assert z.dtype == dtype.as_numpy_dtype and np.all(np.isfinite(z))
    assert stats.kstest(z, "norm").pvalue > 1e-3
    tail = np.mean(np.abs(z) > 3.0)  # 0.0027; binomial std ≈ 1.2e-4
    assert abs(tail - 0.0027) < 6e-4
    assert np.abs(z).max() > 4.0
    half = n // 2
    a, b = z[:half], z[half : 2 * half]
    tol = 5 / np.sqrt(half)
    assert abs(np.corrcoef(a, b)[0, 1]) < tol
    assert abs(np.corrcoef(a**2, b**2)[0, 1]) < tol
    # consecutive steps and neighbouring variables are uncorrelated too
    for other in (standard_normal(key_from_seed(11), 6, 2, (n,), dtype=dtype),
                  standard_normal(key_from_seed(11), 5, 3, (n,), dtype=dtype)):
        assert abs(np.corrcoef(z, other.numpy())[0, 1]) < 5 / np.sqrt(n)


def test_normal_from_seed_scale_shape_and_dtypes():
    seed = variable_seed(step_seed(key_from_seed(3), 4), 1)
    z = normal_from_seed(seed, (7, 3, 5))
    assert z.shape == (7, 3, 5) and z.dtype == tf.float32
    np.testing.assert_allclose(normal_from_seed(seed, (7, 3, 5), scale=2.5).numpy(), 2.5 * z.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(z.numpy(), standard_normal(key_from_seed(3), 4, 1, (7, 3, 5)).numpy())
    half = normal_from_seed(seed, (7, 3, 5), dtype=tf.float16)
    assert half.dtype == tf.float16
    np.testing.assert_allclose(half.numpy(), z.numpy(), rtol=1e-3, atol=1e-3)
    assert normal_from_seed(seed, (0,)).shape == (0,)
    assert normal_from_seed(seed, ()).shape == ()
    with pytest.raises(ValueError, match="fully defined"):
        normal_from_seed(seed, tf.TensorShape([None, 3]))


def test_the_noise_bits_are_tensorflows_stateless_philox_words_for_any_seed():
    """The Philox words behind every draw (two raw kernels: the seed's key and counter,
    then the words) equal ``tf.random.stateless_uniform(..., dtype=uint32, alg="philox")``
    bit for bit, and ``fold_in`` equals ``tf.random.experimental.stateless_fold_in``,
    eagerly and traced, over int64 seeds anywhere in [−2⁶³, 2⁶³) and odd lengths."""
    from keras_noisecurve.backend.tensorflow import noise as tf_noise

    rng = np.random.default_rng(5)
    seeds = [[0, 0], [-1, -1], [2**63 - 1, -(2**63)], *rng.integers(-(2**63), 2**63 - 1, size=(12, 2), dtype=np.int64)]
    traced = tf.function(tf_noise._philox_bits, reduce_retracing=True)
    folded = tf.function(tf_noise.fold_in)
    for seed in seeds:
        seed = tf.constant(np.asarray(seed, np.int64))
        for n in (1, 7, 1000):
            want = tf.random.stateless_uniform([n], seed=seed, minval=None, maxval=None, dtype=tf.uint32, alg="philox")
            np.testing.assert_array_equal(tf_noise._philox_bits(seed, n).numpy(), want.numpy())
            np.testing.assert_array_equal(traced(seed, n).numpy(), want.numpy())
        for data in (0, 1, -7, 2**62):
            want = tf.random.experimental.stateless_fold_in(seed, tf.constant(data, tf.int64)).numpy()
            np.testing.assert_array_equal(tf_noise.fold_in(seed, data).numpy(), want)
            np.testing.assert_array_equal(folded(seed, tf.constant(data, tf.int64)).numpy(), want)
