"""``PrivateModel.set_state_tree`` (what Keras's Orbax ``load_weights``/``load_model`` call)
refuses an optimizer state that does not name every variable of the ``NoiseCurveOptimizer``:
Keras assigns by path and skips what it does not find, which would resume a run with a fresh
step counter, keys or noise state. Backend-neutral: tests/jax/test_jax_state_tree.py runs
these on JAX."""

import keras
import numpy as np
import pytest

import keras_noisecurve as knc
from tests.training.helpers import random_banded_c


def _private(name):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="hidden"), keras.layers.Dense(1, name="out")],
                             name=name)
    private = knc.make_private(model)
    mixing = random_banded_c(4, 2, rng=np.random.default_rng(0), diag_scale=2.0)
    private.compile(optimizer=knc.NoiseCurveOptimizer(learning_rate=0.1, mixing=mixing, noise_multiplier=1.0,
                                                      l2_norm_clip=1.0, expected_batch_size=4, seed=1), loss="mse")
    private.optimizer.build(private.trainable_variables)
    return private


def _trained(name):
    private = _private(name)
    x = np.random.default_rng(2).normal(size=(4, 3)).astype("float32")
    private.train_on_batch(x, x[:, :1])
    private.train_on_batch(x, x[:, :1])
    return private


def test_a_state_tree_of_the_same_model_restores_step_and_noise_state():
    saved = _trained("net").get_state_tree(value_format="numpy_array")
    restored = _private("net")
    restored.set_state_tree(saved)
    assert int(np.asarray(restored.optimizer.iterations.value)) == 2
    rings = [v for v in restored.optimizer.variables if "noise_ring" in v.path]
    assert len(rings) == 4 and all(np.any(np.asarray(v.value) != 0) for v in rings)
    for a, b in zip(restored.optimizer.variables, _trained("net").optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))


def test_a_state_tree_whose_paths_do_not_name_the_noise_state_is_refused_and_nothing_is_assigned():
    saved = _trained("net").get_state_tree(value_format="numpy_array")
    other = _private("other_net")  # its noise states are other_net_hidden_kernel_noise_ring, ...
    before = [np.asarray(v.value).copy() for v in other.variables + other.optimizer.variables]
    with pytest.raises(ValueError, match=r"does not name 4 of this optimizer's 8 variables \(noisecurve_optimizer/"
                                         r"other_net_hidden_bias_noise_ring.*Keras would skip them"):
        other.set_state_tree(saved)
    for b, v in zip(before, other.variables + other.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(v.value), b)


def test_a_weights_only_state_tree_is_not_checked():
    saved = _trained("net").get_state_tree(value_format="numpy_array")
    restored = _private("net")
    restored.set_state_tree({"trainable_variables": saved["trainable_variables"]})
    assert int(np.asarray(restored.optimizer.iterations.value)) == 0
