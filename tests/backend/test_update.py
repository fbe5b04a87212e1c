"""The private update every backend's optimizer applies (``backend/common/update.py``), against
numpy: w ← w − (η/B)·(S + ζσ·z̃) without an inner optimizer, inner.update_step((S + ζσ·z̃)/B, w, η)
with one, in the variable's dtype."""

import keras
import numpy as np
import pytest

from keras_noisecurve.backend.common.update import apply_update


class _Optimizer:
    def __init__(self, batch, inner=None):
        self.expected_batch_size, self.inner = batch, inner

    def assign_sub(self, variable, value):
        variable.assign(variable - value)


class _Inner:
    def update_step(self, gradient, variable, learning_rate):
        self.seen = (keras.ops.convert_to_numpy(gradient), variable, learning_rate)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_without_an_inner_optimizer_the_variable_takes_the_noisy_mean_step(dtype):
    if dtype == "float64" and keras.backend.backend() == "jax":
        pytest.skip("JAX holds float64 only with jax_enable_x64")
    rng = np.random.default_rng(0)
    w0, s, noise = (rng.normal(size=(3, 2)) for _ in range(3))
    variable = keras.Variable(w0.astype(dtype), dtype=dtype)
    apply_update(_Optimizer(batch=16.0), s.astype("float32"), variable, 0.5, keras.ops.convert_to_tensor(noise, dtype))
    want = w0 - (0.5 / 16.0) * (s.astype("float32").astype("float64") + noise)
    got = keras.ops.convert_to_numpy(variable.value)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == "float32" else 1e-14, atol=1e-7 if dtype == "float32" else 0)


def test_an_inner_optimizer_gets_the_noisy_mean_gradient_and_its_learning_rate():
    rng = np.random.default_rng(1)
    s, noise = rng.normal(size=(4,)), rng.normal(size=(4,))
    inner = _Inner()
    variable = keras.Variable(np.zeros(4, "float32"))
    apply_update(_Optimizer(batch=8, inner=inner), s, variable, 0.25, keras.ops.convert_to_tensor(noise, "float32"))
    gradient, seen, rate = inner.seen
    np.testing.assert_allclose(gradient, (s + noise) / 8, rtol=1e-6)
    assert seen is variable and rate == 0.25
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable.value), np.zeros(4))  # the inner one steps


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_on_tensorflow_the_update_is_bit_for_bit_the_tensorflow_expression_it_replaced(dtype):
    if keras.backend.backend() != "tensorflow":
        pytest.skip("compares with TensorFlow ops")
    import tensorflow as tf

    rng = np.random.default_rng(2)
    w0, s, noise = (rng.normal(size=(5, 3)).astype("float32") for _ in range(3))
    variable = keras.Variable(w0, dtype=dtype)
    noise_term = tf.cast(noise, dtype)
    before = tf.identity(variable.value)
    apply_update(_Optimizer(batch=48), s, variable, 0.3, noise_term)
    rate = tf.cast(0.3, dtype) / tf.cast(48, dtype)  # the per-backend code this replaced
    want = before - rate * (tf.cast(s, dtype) + noise_term)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable.value).astype("float32"),
                                  want.numpy().astype("float32"))
    inner = _Inner()
    apply_update(_Optimizer(batch=48, inner=inner), s, variable, 0.3, noise_term)
    np.testing.assert_array_equal(inner.seen[0].astype("float32"),
                                  ((tf.cast(s, dtype) + noise_term) / tf.cast(48, dtype)).numpy().astype("float32"))
