"""White-box scores against dense likelihood ratios computed independently (numpy/scipy)."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

import keras_noisecurve as knc
from keras_noisecurve.audit import report, scoring


def _banded_c(steps, bands):
    return knc.solve_mixing_matrix(steps=steps, bands=bands, objective="bandmf").to_dense()


def _gaussian_llr(y, mean, cov):
    """log N(y; mean, cov) − log N(y; 0, cov) by scipy (dense, no whitening shortcut)."""
    return stats.multivariate_normal(mean, cov).logpdf(y) - stats.multivariate_normal(np.zeros_like(mean), cov).logpdf(y)


def test_plan_scores_are_the_dense_likelihood_ratio():
    steps, sigma = 8, 0.7
    c = _banded_c(steps, 3)
    cov = sigma**2 * np.linalg.inv(c) @ np.linalg.inv(c).T  # noise of y = p − σ C⁻¹ z
    rng = np.random.default_rng(0)
    patterns = (rng.random((steps, 5)) < 0.3).astype(float)
    y = patterns + sigma * np.linalg.solve(c, rng.normal(size=(steps, 5)))
    got = scoring.plan_scores(observations=y, patterns=patterns,
                              precision=scoring.claimed_precision(mixing_dense=c, noise_multiplier=sigma))
    want = [_gaussian_llr(y[:, i], patterns[:, i], cov) for i in range(5)]
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


def test_poisson_score_is_the_mixture_likelihood_ratio_by_enumeration():
    steps, bands, q, sigma = 6, 2, 0.3, 0.8
    c = _banded_c(steps, bands)
    cov = sigma**2 * np.linalg.inv(c) @ np.linalg.inv(c).T
    rng = np.random.default_rng(1)
    y = rng.normal(size=(steps, 3))
    got = scoring.poisson_log_likelihood_ratio(
        observations=y, precision=scoring.claimed_precision(mixing_dense=c, noise_multiplier=sigma), bands=bands,
        rate=q)
    for i in range(3):
        total = 0.0
        for r in range(bands):  # partition r, uniform; each of its steps with probability q
            own = list(range(r, steps, bands))
            for bits in itertools.product([0, 1], repeat=len(own)):
                p = np.zeros(steps)
                p[own] = bits
                weight = q ** sum(bits) * (1 - q) ** (len(own) - sum(bits)) / bands
                total += weight * np.exp(_gaussian_llr(y[:, i], p, cov))
        assert got[i] == pytest.approx(np.log(total), rel=1e-9, abs=1e-9)


def test_empirical_precision_recovers_the_claimed_one():
    steps, sigma = 6, 1.3
    c = _banded_c(steps, 3)
    rng = np.random.default_rng(2)
    probes = -sigma * np.linalg.solve(c, rng.normal(size=(steps, 200000)))
    est = scoring.empirical_precision(probe_observations=probes)
    want = scoring.claimed_precision(mixing_dense=c, noise_multiplier=sigma)
    np.testing.assert_allclose(est, want, atol=0.03 * np.abs(want).max())
    with pytest.raises(ValueError, match="more probe coordinates than steps"):
        scoring.empirical_precision(probe_observations=probes[:, :5])


def test_observations_from_iterates_undo_the_sgd_step():
    eta, batch, clip, sigma = 0.3, 50, 2.0, 0.9
    rng = np.random.default_rng(3)
    p = (rng.random((5, 4)) < 0.5).astype(float)
    noise = rng.normal(size=(5, 4))
    w = np.zeros((6, 4))
    for t in range(5):  # w ← w − η/B·(−ζ·p_t + ζσ·z̃_t)
        w[t + 1] = w[t] - eta / batch * (-clip * p[t] + clip * sigma * noise[t])
    y = scoring.observations_from_iterates(iterates=w, learning_rate=eta, batch_size=batch, l2_norm_clip=clip)
    np.testing.assert_allclose(y, p - sigma * noise, atol=1e-12)


def test_summarize_splits_alpha_and_flags_a_violation():
    rng = np.random.default_rng(4)
    inc = rng.random(4000) < 0.5
    strong = rng.normal(size=4000) + 3.0 * inc   # μ = 3: ε(δ = 1e-5) ≈ 16.8
    weak = rng.normal(size=4000) + 0.1 * inc
    res = report.summarize(scores={"strong": strong, "weak": weak}, included=inc, claimed_epsilon=2.0,
                           delta=1e-5, gaussian_claim=True)
    assert res.verdict == "violation" and res.best.startswith("strong/")
    assert len(res.bounds) == 6
    assert all(b.confidence == pytest.approx(1 - 0.05 / 6) for b in res.bounds.values())
    ok = report.summarize(scores={"weak": weak}, included=inc, claimed_epsilon=2.0, delta=1e-5)
    assert ok.verdict == "consistent" and "weak/gaussian-dp" not in ok.bounds


def test_statistics_modules_do_not_import_tensorflow():
    code = ("import sys; import keras_noisecurve.audit.bounds, keras_noisecurve.audit.scoring, "
            "keras_noisecurve.audit.report; print('tensorflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
