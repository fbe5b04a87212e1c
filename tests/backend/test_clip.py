"""The clipping factor every engine uses (keras_noisecurve.backend.common.clip), against values by hand."""

import keras
import numpy as np

from keras_noisecurve.backend.common.clip import clip_factors


def test_factors_are_min_one_zeta_over_norm_and_zero_when_dropped():
    norms = np.array([0.0, 0.5, 2.0, 8.0, np.inf, np.nan, 3.0], np.float32)
    losses = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, np.nan], np.float32)
    factors, keep = clip_factors(keras.ops.convert_to_tensor(norms), keras.ops.convert_to_tensor(losses), 2.0)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(keep), [True, True, True, True, False, False, False])
    # at or below ζ exactly 1 (no rounding: ζ/ζ), above ζ/‖g‖; dropped exactly 0
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(factors), np.float32([1, 1, 1, 0.25, 0, 0, 0]))


def test_the_factor_keeps_the_norms_dtype():
    # float64 where the backend has it (JAX without x64 makes float32 arrays)
    norms = keras.ops.convert_to_tensor(np.array([3.0], np.float64))
    dtype = keras.backend.standardize_dtype(norms.dtype)
    factors, _ = clip_factors(norms, keras.ops.convert_to_tensor(np.array([0.0])), 1.0)
    assert keras.backend.standardize_dtype(factors.dtype) == dtype
    assert keras.ops.convert_to_numpy(factors)[0] == np.asarray(1.0, dtype) / np.asarray(3.0, dtype)
