"""Numpy-only pieces (Lanczos, SLQ, tail fit, dominance ratio) on matrices with known spectra.

References are independent: numpy/scipy dense eigensolvers, exact counts, scipy's
generalised eigensolver and random Rayleigh quotients. No TensorFlow here.
"""

import subprocess
import sys

import numpy as np
import pytest
import scipy.linalg

from keras_noisecurve.spectrum.artifact import Spectrum
from keras_noisecurve.spectrum.certificate import dominance_ratio
from keras_noisecurve.spectrum.lanczos import lanczos_top_k
from keras_noisecurve.spectrum.slq import slq_count
from keras_noisecurve.spectrum.tail import fit_tail, tail_pairs


def _matrix_with_spectrum(eigs, rng):
    q, _ = np.linalg.qr(rng.normal(size=(eigs.size, eigs.size)))
    return (q * eigs) @ q.T


def test_numpy_modules_do_not_import_tensorflow():
    code = (
        "import sys; import keras_noisecurve.spectrum.lanczos, keras_noisecurve.spectrum.slq, "
        "keras_noisecurve.spectrum.tail, keras_noisecurve.spectrum.certificate, keras_noisecurve.spectrum.dense; "
        "print('tensorflow' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_lanczos_top_k_power_law_matrix():
    rng = np.random.default_rng(0)
    p = 400
    eigs = 10.0 * np.arange(1, p + 1) ** -1.5 - 0.01 * rng.random(p)
    A = _matrix_with_spectrum(eigs, rng)
    calls = []
    with pytest.warns(RuntimeWarning, match=r"2 of the top 15 eigenvalues did not converge"):  # 35 steps: too few
        res = lanczos_top_k(lambda v: calls.append(1) or A @ v, dimension=p, k=15, seed=1, max_steps=35)
    true = np.sort(eigs)[::-1][:15]
    assert res.num_matvecs == len(calls) == max(30, 35)
    np.testing.assert_allclose(res.eigenvalues, true, rtol=1e-8)
    # Residual bounds are true bounds: |θ − nearest eigenvalue| ≤ residual (+ rounding).
    dist = np.min(np.abs(res.eigenvalues[:, None] - eigs[None, :]), axis=1)
    assert np.all(dist <= res.residuals + 1e-12)
    assert res.num_converged >= 10


def test_lanczos_handles_invariant_subspace_restart():
    # Only 3 distinct eigenvalues: Krylov space exhausts after 3 steps, must restart.
    rng = np.random.default_rng(2)
    eigs = np.repeat([5.0, 2.0, 1.0], [2, 3, 45])
    A = _matrix_with_spectrum(eigs, rng)
    res = lanczos_top_k(lambda v: A @ v, dimension=50, k=5, num_steps=20, seed=0)
    np.testing.assert_allclose(res.eigenvalues, [5, 5, 2, 2, 2], rtol=1e-10)


def test_lanczos_validates_arguments():
    with pytest.raises(ValueError, match="k must be <= 10"):
        lanczos_top_k(lambda v: v, dimension=10, k=11)
    with pytest.raises(ValueError, match="num_steps must be >= 5"):
        lanczos_top_k(lambda v: v, dimension=10, k=5, num_steps=3)


def test_slq_count_within_three_standard_errors():
    rng = np.random.default_rng(3)
    p = 300
    eigs = np.concatenate([np.geomspace(1e-3, 5.0, 120), -np.geomspace(1e-4, 0.5, 30), np.full(150, 1e-7)])
    A = _matrix_with_spectrum(eigs, rng)
    for threshold in (1e-2, 0.3):
        exact = int(np.count_nonzero(eigs >= threshold))
        res = slq_count(lambda v: A @ v, dimension=p, threshold=threshold, probes=30, steps=60, seed=4)
        assert res.num_matvecs == 30 * 60
        assert abs(res.estimate - exact) <= 3 * res.stderr + 1.0, (threshold, res.estimate, exact, res.stderr)
        assert res.stderr < 0.1 * exact


def test_tail_fit_recovers_eq3_parameters_and_bins_upper_bound_the_curve():
    p_plus, mu_min, C, alpha = 5000, 1e-6, 2.0, 1.3
    i = np.arange(1, 101)
    mu = np.exp(C * np.log(p_plus / i) ** alpha + np.log(mu_min))
    fit = fit_tail(mu, p_plus=p_plus, mu_min=mu_min, fit_from=0.0)
    assert fit.C == pytest.approx(C, rel=1e-6) and fit.alpha == pytest.approx(alpha, rel=1e-6)
    assert fit.r2 > 1 - 1e-10 and fit.max_log_residual < 1e-6
    values, mult = tail_pairs(fit, start=101, num_bins=50)
    assert mult.sum() == p_plus - 100 and values.size <= 50
    # Each bin's value is ≥ the fitted curve at every index in the bin (independent formula).
    idx = np.arange(101, p_plus + 1)
    per_index = np.repeat(values, mult.astype(int))
    curve = np.exp(C * np.log(p_plus / idx) ** alpha + np.log(mu_min))
    assert np.all(per_index >= curve * (1 - 1e-9))
    # cap
    capped, _ = tail_pairs(fit, start=101, cap=mu[-1] * 0.5, num_bins=50)
    assert capped.max() <= mu[-1] * 0.5


def test_tail_fit_validation():
    with pytest.raises(ValueError, match="descending"):
        fit_tail([1.0, 2.0, 3.0], p_plus=10, mu_min=1e-6)
    with pytest.raises(ValueError, match="mu_min must be > 0"):
        fit_tail([3.0, 2.0], p_plus=10, mu_min=0.0)


def test_dominance_ratio_against_scipy_generalised_eigh_and_rayleigh_quotients():
    rng = np.random.default_rng(5)
    p, r = 30, 22
    B = rng.normal(size=(p, r))
    upper = B @ B.T  # PSD, rank 22
    # H = B S Bᵀ shares Ĥ's range (no null-space curvature), indefinite S.
    S = rng.normal(size=(r, r))
    H = B @ (0.5 * (S + S.T)) @ B.T
    rho = dominance_ratio(H, upper)
    # Independent: scipy generalised eigenproblem on an orthonormal basis of the range.
    Q, _ = np.linalg.qr(B)
    ref = scipy.linalg.eigh(Q.T @ H @ Q, Q.T @ upper @ Q, eigvals_only=True)[-1]
    assert rho == pytest.approx(ref, rel=1e-8)
    quotients = [(v @ H @ v) / (v @ upper @ v) for v in (B @ rng.normal(size=(r, 2000))).T]
    assert max(quotients) <= rho * (1 + 1e-9)
    # Scaling: ρ(H, cĤ) = ρ/c; H ⪯ Ĥ ⇔ ρ ≤ 1.
    assert dominance_ratio(H, 2 * upper) == pytest.approx(rho / 2, rel=1e-9)
    assert dominance_ratio(0.5 * upper, upper) == pytest.approx(0.5, rel=1e-9)


def test_dominance_ratio_null_space_rules():
    upper = np.diag([2.0, 1.0, 0.0])
    assert dominance_ratio(np.diag([1.0, 1.0, 0.0]), upper) == pytest.approx(1.0)  # 0/0 = 0
    assert dominance_ratio(np.diag([1.0, 0.5, 1e-3]), upper) == np.inf  # curvature outside range
    H = np.array([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, -1.0]])
    # sup over v=(a,0,c): (a² + 2ac − c²)/(2a²) → max over c at c = a: (1 + 2 − 1)/2 = 1
    assert dominance_ratio(H, upper) == pytest.approx(1.0, rel=1e-9)
    with pytest.raises(ValueError, match="positive semi-definite"):
        dominance_ratio(np.eye(2), np.diag([1.0, -1.0]))


def test_spectrum_scaled_and_tail_info():
    s = Spectrum([3.0, 1.0, 0.5], [1, 1, 4], dimension=10, metadata={"tail": None})
    t = s.scaled(0.25)
    np.testing.assert_allclose(t.eigenvalues, [0.75, 0.25, 0.125])
    np.testing.assert_allclose(t.multiplicities, [1, 1, 4])
    assert t.dimension == 10 and t.metadata["scale_factors"] == [0.25]
    assert t.scaled(2.0).metadata["scale_factors"] == [0.25, 2.0]
    assert s.tail_info() is None
    with pytest.raises(ValueError, match="factor must be finite and > 0"):
        s.scaled(0.0)
    tailed = Spectrum([3.0, 2.0, 0.5, 0.1], [1, 1, 10, 20], metadata={"tail": {"C": 1.0, "first_index": 3}})
    info = tailed.tail_info()
    assert info["tail_mass"] == 30 and info["C"] == 1.0
    assert info["tail_trace_fraction"] == pytest.approx((5 + 2) / (3 + 2 + 5 + 2))
