"""Workload matrices against direct dense sums and extended-precision arithmetic."""

import warnings

import mpmath
import numpy as np
import pytest

from keras_noisecurve.mixing import OBJECTIVES, workload_matrix
from keras_noisecurve.mixing.workloads import check_curvature_inputs, curvature_workload
from keras_noisecurve.spectrum.artifact import Spectrum


def _direct_final(mu, m, eta, steps):
    """VᵀMV with V[i, j] = (1 − ημ_i)^{T−j−1} built densely (paper Theorem 3.1)."""
    j = np.arange(steps)
    v = (1.0 - eta * mu[:, None]) ** (steps - 1 - j[None, :])
    return (v.T * (m * mu)) @ v


def _direct_mean_over_iterates(weights, mu, eta, steps):
    """(1/T) Σ_{t=1}^{T} Σ_i w_i v_{i,t} v_{i,t}ᵀ with v_{i,t}[j] = (1 − ημ_i)^{t−1−j} for j < t."""
    out = np.zeros((steps, steps))
    for t in range(1, steps + 1):
        j = np.arange(t)
        v = (1.0 - eta * mu[:, None]) ** (t - 1 - j[None, :])
        out[:t, :t] += (v.T * weights) @ v
    return out / steps


def _random_spectrum(rng, k=25):
    mu = np.concatenate([10 ** rng.uniform(-10, 0, size=k), [0.0]])
    m = rng.integers(1, 5, size=mu.size).astype(float)
    return mu, m


def test_objectives_tuple():
    assert OBJECTIVES == ("dpsgd", "bandmf", "noisecurve", "noisecurve-convergence",
                          "noisecurve-all-iterates", "noisecurve-blend")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisecurve_matches_dense_vtmv(seed):
    rng = np.random.default_rng(seed)
    mu, m = _random_spectrum(rng)
    eta, steps = 0.8, 37
    got = workload_matrix(objective="noisecurve", steps=steps, spectrum=Spectrum(mu, m), learning_rate=eta)
    np.testing.assert_allclose(got, _direct_final(mu, m, eta, steps), rtol=1e-11, atol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("objective,power", [("noisecurve-all-iterates", 1), ("noisecurve-convergence", 2)])
def test_mean_over_iterates_matches_direct_sum(seed, objective, power):
    rng = np.random.default_rng(seed)
    mu, m = _random_spectrum(rng)
    eta, steps = 0.9, 33
    got = workload_matrix(objective=objective, steps=steps, spectrum=Spectrum(mu, m), learning_rate=eta)
    want = _direct_mean_over_iterates(m * mu**power, mu, eta, steps)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=0)


def test_eta_mu_equal_one_uses_zero_to_the_zero_equals_one():
    # r = 0: only the last step's noise reaches w_T; W = μ·e_{T−1}e_{T−1}ᵀ.
    steps = 6
    got = workload_matrix(objective="noisecurve", steps=steps, spectrum=[2.0], learning_rate=0.5)
    want = np.zeros((steps, steps))
    want[-1, -1] = 2.0
    np.testing.assert_array_equal(got, want)
    # all-iterates: each step's own noise, averaged over t: W = (μ/T)·I
    got = workload_matrix(objective="noisecurve-all-iterates", steps=steps, spectrum=[2.0], learning_rate=0.5)
    np.testing.assert_allclose(got, 2.0 / steps * np.eye(steps), rtol=1e-15, atol=1e-300)


def test_long_horizon_tiny_curvature_against_extended_precision():
    """T = 10⁴ and ημ from 1e-12 to 0.9: spot entries against 40-digit arithmetic."""
    mpmath.mp.dps = 40
    mu = np.array([1e-12, 3e-9, 1e-6, 2e-4, 0.05, 0.9])
    m = np.array([3.0, 1.0, 2.0, 1.0, 1.0, 1.0])
    eta, steps = 1.0, 10_000
    rows = [0, 4321, 9990, steps - 1]
    inputs = check_curvature_inputs(objective="noisecurve", spectrum=Spectrum(mu, m), learning_rate=eta)
    # the same code path as workload_matrix, restricted to a few rows (a dense 10⁴×10⁴ W is 800 MB)
    final = dict(zip(rows, curvature_workload(objective="noisecurve", steps=steps, inputs=inputs, rows=rows)))
    every = dict(zip(rows, curvature_workload(objective="noisecurve-all-iterates", steps=steps, inputs=inputs,
                                              rows=rows)))
    assert all(np.all(np.isfinite(v)) for v in list(final.values()) + list(every.values()))
    for j, l in [(0, 0), (0, steps - 1), (steps - 1, steps - 1), (4321, 4400), (9990, 17)]:
        exact_final = mpmath.mpf(0)
        exact_every = mpmath.mpf(0)
        for mu_i, m_i in zip(mu, m):
            r = 1 - mpmath.mpf(eta) * mpmath.mpf(mu_i)
            a = mpmath.mpf(m_i) * mpmath.mpf(mu_i)
            exact_final += a * r ** (2 * steps - 2 - j - l)
            n = steps - max(j, l)
            q = r * r
            exact_every += a * r ** abs(j - l) * (1 - q**n) / (1 - q) / steps
        assert abs(final[j][l] - float(exact_final)) <= 1e-12 * float(exact_final)
        assert abs(every[j][l] - float(exact_every)) <= 1e-11 * float(exact_every)


def test_dpsgd_bandmf_and_blend():
    steps = 9
    np.testing.assert_array_equal(workload_matrix(objective="dpsgd", steps=steps), np.eye(steps))
    a = np.tril(np.ones((steps, steps)))
    np.testing.assert_array_equal(workload_matrix(objective="bandmf", steps=steps), a.T @ a)
    mu = np.array([0.5, 0.1, 0.01])
    w_curv = _direct_final(mu, np.ones(3), 1.2, steps)
    for lam in (0.0, 0.25, 1.0):
        got = workload_matrix(objective="noisecurve-blend", steps=steps, spectrum=mu, learning_rate=1.2,
                              blend_weight=lam)
        want = (1 - lam) * w_curv / np.trace(w_curv) + lam * a.T @ a / np.trace(a.T @ a)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("objective", ["noisecurve", "noisecurve-convergence", "noisecurve-all-iterates"])
def test_curvature_workloads_are_symmetric_psd(objective):
    rng = np.random.default_rng(4)
    mu, m = _random_spectrum(rng)
    with pytest.warns(UserWarning, match="Theorem 3.2"):  # ημ_max ≈ 1.04: still exact, still PSD
        w = workload_matrix(objective=objective, steps=40, spectrum=Spectrum(mu, m), learning_rate=1.5)
    np.testing.assert_array_equal(w, w.T)
    assert np.linalg.eigvalsh(w).min() >= -1e-12 * np.abs(w).max()


def test_multiplicities_and_spectrum_clamping():
    steps = 7
    spec = Spectrum([0.3, 0.3, 0.2, -0.05])  # negative eigenvalue clamped to 0 by Spectrum
    got = workload_matrix(objective="noisecurve", steps=steps, spectrum=spec, learning_rate=1.0)
    want = _direct_final(np.array([0.3, 0.2]), np.array([2.0, 1.0]), 1.0, steps)
    np.testing.assert_allclose(got, want, rtol=1e-13)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(objective="nope", steps=3), "objective must be one of"),
        (dict(objective="bandmf", steps=0), "steps must be >= 1, got 0"),
        (dict(objective="noisecurve", steps=3, learning_rate=0.1), "needs a spectrum"),
        (dict(objective="noisecurve", steps=3, spectrum=[0.1]), "needs learning_rate"),
        (dict(objective="noisecurve", steps=3, spectrum=[0.1], learning_rate=0.0), "learning_rate must be > 0"),
        (dict(objective="noisecurve", steps=3, spectrum=[0.1], learning_rate=-1.0), "learning_rate must be > 0"),
        (dict(objective="noisecurve", steps=3, spectrum=[0.1, -0.2], learning_rate=1.0), r"\[-0.2\]"),
        (dict(objective="noisecurve", steps=3, spectrum=[0.1, np.nan], learning_rate=1.0), "finite"),
        (dict(objective="noisecurve", steps=3, spectrum=[], learning_rate=1.0), "at least one"),
        (dict(objective="noisecurve", steps=3, spectrum=[1.0], learning_rate=2.0), "diverges"),
        (dict(objective="noisecurve-all-iterates", steps=3, spectrum=[4.0], learning_rate=0.75), "= 3 >= 2"),
        (dict(objective="noisecurve-blend", steps=3, spectrum=[0.1], learning_rate=1.0), "needs blend_weight"),
        (dict(objective="noisecurve-blend", steps=3, spectrum=[0.1], learning_rate=1.0, blend_weight=1.5),
         r"\[0, 1\]; got 1.5"),
        (dict(objective="noisecurve-blend", steps=3, spectrum=[0.1], learning_rate=1.0, blend_weight="auto"),
         "got 'auto'"),
        (dict(objective="noisecurve", steps=3, spectrum=[0.1], learning_rate=1.0, blend_weight=0.5),
         "only used by objective='noisecurve-blend'"),
        (dict(objective="bandmf", steps=3, spectrum=[0.1]), "does not use a spectrum"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        workload_matrix(**kwargs)


def test_warns_when_eta_mu_above_one():
    with pytest.warns(UserWarning, match="Theorem 3.2"):
        workload_matrix(objective="noisecurve", steps=4, spectrum=[1.5], learning_rate=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        workload_matrix(objective="noisecurve", steps=4, spectrum=[1.0], learning_rate=1.0)
