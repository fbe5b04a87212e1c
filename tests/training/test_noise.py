"""The online recurrence and the counter-based RNG of keras_noisecurve.training.noise."""

import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.mixing import MixingMatrix
from keras_noisecurve.training.noise import BandedNoise, key_from_seed, standard_normal
from tests.training.helpers import random_banded_c


@pytest.mark.parametrize("bands", [1, 2, 5])
def test_recurrence_equals_dense_solve(bands):
    """z̃ from the ring buffer equals C⁻¹z by a dense triangular solve."""
    rng = np.random.default_rng(bands)
    c = random_banded_c(11, bands, rng=rng, diag_scale=0.3)
    z = rng.normal(size=(11, 3, 2))
    noise = BandedNoise(c.band_values)
    ring = None if bands == 1 else tf.zeros(noise.ring_shape((3, 2)), tf.float64)
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
    noise = BandedNoise(None)
    assert noise.steps is None and noise.bands == 1 and noise.ring_shape((3,)) is None
    assert noise.assert_in_plan(10**9) is None
    assert BandedNoise(MixingMatrix.identity(4).band_values).ring_bytes([(10,), (3, 3)]) == 0
    assert BandedNoise(np.ones((4, 3)) * [1, 0, 0]).ring_bytes([(10,), (3, 3)]) == 2 * 19 * 4


def test_assert_in_plan_refuses_step_t():
    noise = BandedNoise(MixingMatrix.identity(3).band_values)
    noise.assert_in_plan(tf.constant(2))
    with pytest.raises(tf.errors.InvalidArgumentError, match="privacy plan is spent"):
        noise.assert_in_plan(tf.constant(3))
