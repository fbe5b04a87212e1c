"""Private training under the ``mixed_bfloat16`` and ``mixed_float16`` policies (models
built under the policy, no ``dtype=`` on layers): one private step equals the float32
model's step within the policy's precision, the per-example norms, the clipped sum and
the noise are float32 (the noise is the float32 model's noise exactly), and float16's
static loss scale is undone before clipping.

Tolerances (relative to the float32 step's size): bfloat16 1.5e-2 (8 significand bits;
measured ≤ 7.3e-3 on these models), float16 1.5e-3 (11 bits; measured ≤ 7e-4)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.training.helpers import noiseless
from keras_noisecurve.mixing import MixingMatrix
from keras_noisecurve.privacy.run import PrivateRun
from keras_noisecurve.training import NoiseCurveOptimizer, make_private
from keras_noisecurve.backend.tensorflow.dp_model import _train_loss
from tests.training.helpers import random_banded_c

B = 16
TOLERANCE = {"mixed_bfloat16": 1.5e-2, "mixed_float16": 1.5e-3}
POLICIES = sorted(TOLERANCE)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _mlp():
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(5)])


def _block():
    """A small transformer block: attention + LayerNorm, gelu MLP + LayerNorm, pooling."""
    layers = keras.layers
    inputs = keras.Input((6, 16))
    h = layers.LayerNormalization()(inputs + layers.MultiHeadAttention(2, 8)(inputs, inputs))
    h = layers.LayerNormalization()(h + layers.Dense(16)(layers.Dense(32, activation="gelu")(h)))
    return keras.Model(inputs, layers.Dense(5)(layers.GlobalAveragePooling1D()(h)))


MODELS = {"mlp": (_mlp, (12,)), "block": (_block, (6, 16))}
CASES = [("mlp", "vectorized"), ("mlp", "auto"), ("block", "auto")]


@pytest.fixture(autouse=True)
def _float32_after():
    yield
    keras.config.set_dtype_policy("float32")


def _data(name, n=B):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, *MODELS[name][1])).astype("float32"), rng.integers(0, 5, n)


def _built(name, policy):
    """The model under ``policy`` with the float32 model's initial weights."""
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(1)
    weights = MODELS[name][0]().get_weights()
    keras.config.set_dtype_policy(policy)
    model = MODELS[name][0]()
    model.set_weights(weights)
    keras.config.set_dtype_policy("float32")
    return model, weights


def _with_sigma(optimizer, sigma):
    return noiseless(optimizer) if sigma == 0 else optimizer


def _update(name, policy, clipping, sigma, clip=0.5):
    """Δw of one private train_step (flattened), and the private model."""
    base, start = _built(name, policy)
    model = make_private(base, clipping=clipping)
    model.compile(
        optimizer=_with_sigma(NoiseCurveOptimizer(learning_rate=1.0, l2_norm_clip=clip, noise_multiplier=sigma or 1.0,
                                                  expected_batch_size=B, seed=3), sigma),
        loss=LOSS,
    )
    x, y = _data(name)
    tf.function(model.train_step)((tf.constant(x), tf.constant(y)))
    return np.concatenate([(a - b).ravel() for a, b in zip(model.get_weights(), start)]), model


@pytest.mark.parametrize("name,clipping", CASES)
@pytest.mark.parametrize("policy", POLICIES)
def test_one_private_step_equals_the_float32_step(policy, name, clipping):
    exact, _ = _update(name, "float32", clipping, sigma=0.0)
    mixed, model = _update(name, policy, clipping, sigma=0.0)
    assert model.inner.layers[-1].compute_dtype == policy.split("_")[1]
    assert all(v.dtype == "float32" for v in model.trainable_variables)
    assert model._dp_loss_scale == (128.0 if policy == "mixed_float16" else 1.0)
    scale = np.linalg.norm(exact)
    assert scale > 1e-2  # it trained
    assert np.linalg.norm(mixed - exact) <= TOLERANCE[policy] * scale

    # σ > 0: the noise is the float32 model's noise (float32, same draws), the data part as above
    noisy_exact, _ = _update(name, "float32", clipping, sigma=2.0)
    noisy_mixed, _ = _update(name, policy, clipping, sigma=2.0)
    noise = noisy_exact - exact
    assert np.linalg.norm(noise) > scale  # the noise is not negligible
    np.testing.assert_allclose(noisy_mixed - mixed, noise, rtol=1e-5, atol=1e-6)  # float32 noise
    assert np.linalg.norm(noisy_mixed - noisy_exact) <= TOLERANCE[policy] * scale


@pytest.mark.parametrize("name,clipping", CASES)
@pytest.mark.parametrize("policy", POLICIES)
def test_norms_and_clipped_sums_are_float32(policy, name, clipping):
    x, y = _data(name)
    out = {}
    for p in ("float32", policy):
        model = make_private(_built(name, p)[0], clipping=clipping)
        model.compile(optimizer=NoiseCurveOptimizer(learning_rate=0.1, noise_multiplier=1.0, expected_batch_size=B), loss=LOSS)
        out[p] = model._engine()(model, _train_loss(model._dp_loss_fn, 1.0), tf.constant(x), tf.constant(y), None,
                                  l2_norm_clip=0.5)
    mixed, exact = out[policy], out["float32"]
    assert mixed.norms.dtype == tf.float32
    assert all(g.dtype == tf.float32 for g in mixed.grads)
    np.testing.assert_allclose(mixed.norms.numpy(), exact.norms.numpy(), rtol=2 * TOLERANCE[policy])
    assert np.max(exact.norms.numpy()) > 0.5  # some examples are clipped


def test_float16_fit_on_a_run_with_banded_noise_matches_float32():
    name, steps = "mlp", 4
    x, y = _data(name, n=48)
    plan = dict(num_examples=48, batch_size=B, steps=steps, noise_multiplier=1.0, delta=1e-5,
                mixing=random_banded_c(steps, 2, rng=np.random.default_rng(4), diag_scale=0.5))
    results = {}
    for policy in ("float32", "mixed_float16"):
        run = PrivateRun(**plan, seed=5)
        model = make_private(_built(name, policy)[0])
        model.compile(optimizer=NoiseCurveOptimizer(run=run, learning_rate=0.5, l2_norm_clip=0.5, seed=9), loss=LOSS)
        model.fit(run.dataset(x, y), verbose=0)
        rings = [r for r in model.optimizer._rings if r is not None]
        assert rings and all(r.dtype == "float32" for r in rings)
        results[policy] = (model.get_weights(), [r.numpy() for r in rings])
    for a, b in zip(results["mixed_float16"][1], results["float32"][1]):
        np.testing.assert_array_equal(a, b)  # the noise state: data-independent, float32
    start = _built(name, "float32")[1]
    for a, b, w0 in zip(results["mixed_float16"][0], results["float32"][0], start):
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b - w0)  # 4 steps apart from float32


def test_float16_loss_scale_options_and_overflow_is_refused():
    x, y = _data("mlp", n=32)
    model = make_private(_built("mlp", "mixed_float16")[0])
    with pytest.raises(ValueError, match="LossScaleOptimizer is not supported"):
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(NoiseCurveOptimizer(learning_rate=0.1, noise_multiplier=1.0, expected_batch_size=B)), loss=LOSS)
    with pytest.raises(ValueError, match="power of two"):
        model.compile(optimizer=NoiseCurveOptimizer(learning_rate=0.1, noise_multiplier=1.0, expected_batch_size=B), loss=LOSS, loss_scale=100.0)
    model.compile(optimizer=NoiseCurveOptimizer(learning_rate=0.1, noise_multiplier=1.0, expected_batch_size=B), loss=LOSS, auto_scale_loss=False)
    assert model._dp_loss_scale == 1.0
    model.compile(optimizer=NoiseCurveOptimizer(learning_rate=0.1, noise_multiplier=1.0, expected_batch_size=B), loss=LOSS, loss_scale=2.0**4)
    assert model._dp_loss_scale == 16.0

    # a scale that overflows float16 (65504): the step uses no data and fit raises after it
    run = PrivateRun(num_examples=32, batch_size=B, steps=2, mixing=MixingMatrix.identity(2), noise_multiplier=1.0, delta=1e-5)
    model.compile(optimizer=NoiseCurveOptimizer(run=run, learning_rate=0.5, seed=1), loss=LOSS, loss_scale=2.0**40)
    with pytest.raises(RuntimeError, match="not finite under mixed_float16 with the static loss scale 1.09951e"):
        model.fit(run.dataset(x, y), verbose=0)
    assert model._dp_refused.numpy()[1] == 4
