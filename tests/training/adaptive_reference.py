"""The adaptive clip written in float64 numpy, shared by the TensorFlow and JAX tests
(tests/training/test_adaptive_clip_train.py, tests/jax/test_jax_adaptive_clip.py)."""

from __future__ import annotations

import keras
import numpy as np

import keras_noisecurve as knc
from keras_noisecurve.privacy.adaptive_clip import COUNT_STREAM
from keras_noisecurve.training.noise import key_from_seed, standard_normal


def count_normal(seed, step):
    """n_t of the count query: the N(0, 1) of stream COUNT_STREAM at step t (the noise key of ``seed``)."""
    return float(np.asarray(standard_normal(key_from_seed(seed), step, COUNT_STREAM, (1,)))[0])


def reference_next(clip, below, real, normal, B, rule):
    """ζ_{t+1} = ζ_t·exp(−η·(b̃ − γ)), b̃ = (below − real/2 + s_b·n_t)/B + ½."""
    stddev = B / 20 if rule.count_stddev is None else rule.count_stddev
    estimate = (below - 0.5 * real + stddev * normal) / B + 0.5
    return clip * np.exp(-rule.learning_rate * (estimate - rule.target_quantile))


def linear_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.set_weights([np.array([[0.5], [-1.0], [0.25]], np.float32), np.array([0.1], np.float32)])
    return model


def dp_sgd_case():
    """The case both backends' "fit equals adaptive DP-SGD in numpy" tests train: a linear model,
    MSE, 48 rows in batches of 8, every fifth row a padding row (weight 0), noise on."""
    n, batch, eta, sigma, seed = 48, 8, 0.2, 0.7, 21
    rng = np.random.default_rng(8)
    x = rng.normal(size=(n, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-1.0], [2.0]]) + 0.5 * rng.normal(size=(n, 1))).astype("float32")
    rule = knc.AdaptiveClip(initial=0.5, learning_rate=0.4)
    weights = rng.uniform(0.5, 2.0, n)
    weights[::5] = 0.0  # padding rows: not examples (no gradient, left out of the count)
    return dict(x=x, y=y, weights=weights, batch=batch, eta=eta, sigma=sigma, seed=seed, rule=rule)


def adaptive_dp_sgd(*, x, y, weights, batch, eta, sigma, seed, rule):
    """The whole algorithm on :func:`linear_model` in float64: per-example gradients
    w_i·2r·[x, 1] clipped at ζ_t, plus ζ_t·σ·z_t (z_t the Philox draw of each variable), over B;
    ζ_{t+1} from the count of norms ≤ ζ_t among the rows of weight > 0, and n_t.

    Returns ``(zetas, kernel, bias)``: ζ_0 … ζ_T (ζ_t the clip step t used) and the final weights."""
    kernel, bias = (np.asarray(w, np.float64) for w in linear_model().get_weights())
    zeta, key, zetas = rule.initial, key_from_seed(seed), [rule.initial]
    for t in range(len(x) // batch):
        xb, yb = x[t * batch:(t + 1) * batch].astype(np.float64), y[t * batch:(t + 1) * batch].astype(np.float64)
        r = xb @ kernel[:, 0] + bias[0] - yb[:, 0]
        wb = weights[t * batch:(t + 1) * batch]
        grads = wb[:, None] * 2 * r[:, None] * np.concatenate([xb, np.ones((batch, 1))], axis=1)  # (B, 4)
        norms = np.linalg.norm(grads, axis=1)
        total = np.sum(grads * np.minimum(1.0, zeta / np.maximum(norms, 1e-300))[:, None], axis=0)
        z_kernel = np.asarray(standard_normal(key, t, 0, (3, 1)), np.float64)
        z_bias = np.asarray(standard_normal(key, t, 1, (1,)), np.float64)
        kernel = kernel - eta * (total[:3, None] + zeta * sigma * z_kernel) / batch
        bias = bias - eta * (total[3:] + zeta * sigma * z_bias) / batch
        real = wb > 0
        below = int(np.sum((norms <= zeta) & real))
        zeta = reference_next(zeta, below, int(np.sum(real)), count_normal(seed, t), batch, rule)
        zetas.append(zeta)
    return zetas, kernel, bias
