"""Per-example clipping on JAX against an independent per-example loop.

Tolerance: everything runs in float32 (JAX without x64). The clipped sums add ≤ 32
per-example gradients whose entries are themselves reductions over ≤ 8 terms, so the
rounding error is a few tens of float32 ulps (ε = 1.2e-7) of the largest term:
rtol = 2e-5 with atol = 2e-6 (the entries are O(0.1–1)) is ~100 ulps, far below any
real error (a wrong clip factor or a missing example changes entries by > 1e-2).
"""

import jax.numpy as jnp
import keras
import numpy as np
import pytest

from keras_noisecurve import NoiseCurveOptimizer, make_private
from keras_noisecurve.backend.jax.clipping import clipped_sum
from tests.jax.helpers import mlp, mse_per_example, reference_clipped_sum, weights_of

RTOL, ATOL = 2e-5, 2e-6


def _data(n=24, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32") * 2.0
    y = rng.normal(size=(n, 3)).astype("float32")
    return x, y


@pytest.mark.parametrize("microbatch_size", [None, 5])
def test_clipped_sum_and_norms_equal_a_per_example_loop(microbatch_size):
    model = mlp()
    x, y = _data()
    weights = np.ones(24, np.float32)
    weights[[3, 17]] = 0.0  # padding rows: no contribution
    weights[5] = 0.5
    clip = 10.0  # about the median norm: both clipped and unclipped examples
    sums, norms, losses, _, _ = clipped_sum(
        model, mse_per_example, [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables], jnp.asarray(x), jnp.asarray(y), jnp.asarray(weights),
        l2_norm_clip=clip, microbatch_size=microbatch_size,
    )
    ref_sums, ref_norms = reference_clipped_sum(model, x, y, weights, clip)
    np.testing.assert_allclose(np.asarray(norms), ref_norms, rtol=RTOL, atol=ATOL)
    for s, r in zip(sums, ref_sums):
        np.testing.assert_allclose(np.asarray(s), r, rtol=RTOL, atol=ATOL)
    assert np.sum(ref_norms > clip) >= 5 and np.sum((ref_norms < clip) & (ref_norms > 0)) >= 1  # both regimes
    pred = model(x)
    np.testing.assert_allclose(np.asarray(losses), np.mean((np.asarray(pred) - y) ** 2, axis=-1), rtol=1e-5)


def test_noise_free_step_is_sgd_on_the_clipped_sum_plus_regularisation():
    """σ = 1e-9 (noise ζσ·z ~ 1e-9): w₁ = w₀ − η/B·(Σ clip(w_i g_i) + B·∇reg), the sum from the loop."""
    model = mlp(regularizer=keras.regularizers.L2(0.01))
    x, y = _data(16)
    weights = np.ones(16, np.float32)
    weights[-3:] = 0.0
    clip, lr, batch = 0.5, 0.3, 20
    ref_sums, _ = reference_clipped_sum(model, x, y, weights, clip)
    before = weights_of(model)
    private = make_private(model)
    private.compile(optimizer=NoiseCurveOptimizer(learning_rate=lr, l2_norm_clip=clip, noise_multiplier=1e-9,
                                                  expected_batch_size=batch, seed=0), loss="mse")
    private.train_on_batch(x, y, sample_weight=weights)
    after = weights_of(model)
    kernel = 0  # the first Dense kernel carries the L2 regulariser: ∇ = 2·0.01·w
    for k, (w0, w1, s) in enumerate(zip(before, after, ref_sums)):
        reg = 2 * 0.01 * w0 * batch if k == kernel else 0.0
        expected = w0 - lr / batch * (s + reg)
        np.testing.assert_allclose(w1, expected, rtol=RTOL, atol=ATOL)
    assert not np.allclose(before[0], after[0])
