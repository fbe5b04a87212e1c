"""Lanczos, SLQ and the tail fit on a real model Hessian whose full spectrum is known.

The reference is the dense Hessian of a 2,244-parameter float64 tanh MLP (random-label
pre-trained, paper §4.1) diagonalised with numpy.linalg.eigh.
"""

import keras
import numpy as np
import pytest

from keras_noisecurve.spectrum.dense import dense_hessian
from keras_noisecurve.spectrum.hvp import HessianOperator
from keras_noisecurve.spectrum.lanczos import lanczos_top_k
from keras_noisecurve.spectrum.losses import random_labels
from keras_noisecurve.spectrum.pretrain import pretrain
from keras_noisecurve.spectrum.slq import slq_count
from keras_noisecurve.spectrum.tail import fit_tail, tail_pairs

from .conftest import tanh_mlp

SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def known():
    rng = np.random.default_rng(0)
    model = tanh_mlp(inputs=10, hidden=(40, 40), outputs=4)
    x = rng.normal(size=(128, 10))
    y = random_labels(128, num_outputs=4, label_kind="sparse", seed=1)
    pretrain(model, x, y, loss_fn=SCCE.call, epochs=5, learning_rate=0.1, batch_size=32, seed=0)
    op = HessianOperator(model, x, y, loss=SCCE, batch_size=128)
    H = dense_hessian(op, chunk_size=64)
    eigs = np.linalg.eigvalsh(H)[::-1]
    return op, H, eigs


def test_lanczos_top20_matches_eigh_on_model_hessian(known):
    op, _, eigs = known
    assert op.dimension == 2244
    before = op.num_hvps
    res = lanczos_top_k(op.matvec, dimension=op.dimension, k=20, seed=3)
    assert op.num_hvps - before == res.num_matvecs <= 800  # the default budget, min(20·m, max(p, 2m)) with m = 40
    np.testing.assert_allclose(res.eigenvalues, eigs[:20], rtol=1e-6)
    assert res.num_converged == 20
    assert np.max(res.residuals) < 1e-6 * eigs[0]


def test_slq_count_matches_exact_count(known):
    op, _, eigs = known
    threshold = 0.1 * eigs[0]
    exact = int(np.count_nonzero(eigs >= threshold))
    res = slq_count(op.matvec, dimension=op.dimension, threshold=threshold, probes=20, steps=60, seed=5)
    print(f"SLQ count ≥ {threshold:.3g}: {res.estimate:.1f} ± {res.stderr:.1f} (exact {exact})")
    assert abs(res.estimate - exact) <= 3 * res.stderr


def _tail_fractions(eigs, k, mu_min=1e-6):
    p_plus = int(np.count_nonzero(eigs >= mu_min))
    idx = np.arange(k + 1, p_plus + 1)
    out = {}
    for name, frac in (("lower-half fit", 0.5), ("all-top-k fit", 0.0)):
        fit = fit_tail(eigs[:k], p_plus=p_plus, mu_min=mu_min, fit_from=frac)
        out[name] = (fit, float(np.mean(fit.values(idx) >= eigs[k:p_plus])))
    return p_plus, out


@pytest.mark.parametrize("k", [50, 100])
def test_tail_fit_matches_top_k_and_compressed_tail_bounds_the_fit(known, k):
    _, _, eigs = known
    p_plus, fits = _tail_fractions(eigs, k)
    fit, above = fits["lower-half fit"]
    print(f"k={k}: p+={p_plus}, R²={fit.r2:.3f} (all top-k {fit.r2_top_k:.3f}), "
          f"fraction of tail above truth: " + ", ".join(f"{n} {a:.3f}" for n, (_, a) in fits.items()))
    # Matches the top-k on the fitted (lower) half.
    lower = np.arange(k // 2, k + 1)
    assert np.max(np.abs(np.log(fit.values(lower)) - np.log(eigs[lower - 1]))) < 1.0
    assert fit.r2 > 0.9
    # The compressed tail (first-index values, capped at μ_k) is ≥ the capped fitted curve.
    idx = np.arange(k + 1, p_plus + 1)
    values, mult = tail_pairs(fit, start=k + 1, cap=eigs[k - 1], num_bins=64)
    per_index = np.repeat(values, mult.astype(int))
    assert per_index.size == idx.size
    assert np.all(per_index >= np.minimum(fit.values(idx), eigs[k - 1]) * (1 - 1e-12))


@pytest.mark.parametrize(
    "k",
    [
        pytest.param(
            50,
            marks=pytest.mark.xfail(
                strict=True,
                reason="measured: with k=50 the eq.-3 fit (lower half) lies BELOW the true tail at "
                "every index of this model (fraction 0.000; fitting all top-k: 0.381)",
            ),
        ),
        100,
        200,
    ],
)
def test_paper_claim_fitted_tail_above_true_tail_for_most_indices(known, k):
    """Paper Fig. 4: the fitted curve upper-bounds the true tail for most indices."""
    _, _, eigs = known
    _, fits = _tail_fractions(eigs, k)
    fit, above = fits["lower-half fit"]
    print(f"k={k}: fraction of tail indices where the default fit ≥ truth: {above:.3f}")
    assert above >= 0.9


def test_estimate_spectrum_lanczos_defaults_converge_on_float32_mlp():
    """The user's case: a 1,604-parameter float32 MLP, ``method="lanczos"``, ``top_k=20`` and
    every other setting at its default. Every top-20 value converges with no warning and
    matches the exact eigenvalues (dense Hessian, ``method="exact"``, same seed)."""
    import warnings

    from keras_noisecurve.spectrum.estimate import estimate_spectrum

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(4)])
    assert model.count_params() == 1604
    x = np.random.default_rng(0).normal(size=(256, 20)).astype("float32")
    common = dict(loss=SCCE, pretrain_epochs=3, seed=1)
    exact = estimate_spectrum(model, x, method="exact", **common).eigenvalues[:20]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        spec = estimate_spectrum(model, x, method="lanczos", top_k=20, slq_probes=2, slq_steps=4, **common)
    assert spec.metadata["converged"] == 20 and spec.metadata["lanczos_tol"] == 1e-6  # float32 HVPs
    np.testing.assert_allclose(spec.eigenvalues[:20], exact, rtol=0, atol=1e-6 * exact[0])
