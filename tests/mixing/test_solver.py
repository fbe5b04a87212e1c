"""The banded solver: optimality against an independent dense solve in X, gradients against
finite differences, invariants, scale-free stopping, rank-deficient workloads and bad input."""

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize
from threadpoolctl import threadpool_limits

import keras_noisecurve
from keras_noisecurve.mixing import (
    AUTO_BLEND_FACTOR,
    AUTO_BLEND_GRID,
    RIDGE_RELATIVE,
    MixingMatrix,
    objective_value,
    solve_mixing_matrix,
    workload_matrix,
)
from keras_noisecurve.mixing import banded, optimize
from keras_noisecurve.mixing import surrogate as surrogate_module
from keras_noisecurve.mixing import solver as solver_module
from keras_noisecurve.mixing.workloads import check_curvature_inputs
from keras_noisecurve.spectrum.artifact import Spectrum

SPEC = Spectrum(np.geomspace(1.0, 1e-3, 40))
ETA = 0.8


def _dense_reference_loss(workload, bands):
    """min Tr(W X⁻¹) over X = CᵀC, C dense lower-triangular b-banded with unit columns.

    Independent code path: dense matrices, ``np.linalg.inv(X)``, the gradient through X
    (``∂f/∂X = −X⁻¹WX⁻¹``, ``∂f/∂C = 2C·∂f/∂X``), columns normalised inside the objective,
    scipy BFGS (not L-BFGS-B) from C = I; then polished from the best point twice.
    """
    steps = workload.shape[0]
    mask = _band_mask(steps, bands)

    def fun(x):
        raw = np.zeros((steps, steps))
        raw[mask] = x
        norms = np.linalg.norm(raw, axis=0)
        c = raw / norms
        inv = np.linalg.inv(c.T @ c)
        value = float(np.sum(workload * inv))
        g_c = 2.0 * c @ (-inv @ workload @ inv)
        g_raw = (g_c - c * np.sum(c * g_c, axis=0)) / norms
        return value, g_raw[mask]

    x = np.eye(steps)[mask]
    with threadpool_limits(limits=1, user_api="blas"):
        for _ in range(3):
            res = minimize(fun, x, jac=True, method="BFGS", options={"maxiter": 20_000, "gtol": 1e-12})
            x = res.x / np.linalg.norm(res.x) * np.sqrt(steps)
    return res.fun


def _band_mask(steps, bands):
    diff = np.subtract.outer(np.arange(steps), np.arange(steps))
    return (diff >= 0) & (diff < bands)


@pytest.mark.parametrize(
    "objective,steps,bands",
    [("bandmf", 24, 4), ("noisecurve", 20, 5), ("noisecurve-all-iterates", 18, 3),
     ("noisecurve-convergence", 16, 4), ("noisecurve-blend", 16, 16)],
)
def test_loss_matches_independent_dense_reference(objective, steps, bands):
    kw = {} if objective == "bandmf" else dict(spectrum=SPEC, learning_rate=ETA)
    if objective == "noisecurve-blend":
        kw["blend_weight"] = 0.3
    mixing = solve_mixing_matrix(steps=steps, bands=bands, objective=objective, **kw)
    meta = mixing.metadata
    assert meta["solver"]["converged"]
    workload = workload_matrix(objective=objective, steps=steps, **kw)
    ridge = meta["ridge"]
    reference = _dense_reference_loss(workload + ridge * np.eye(steps), bands)
    assert meta["solver"]["surrogate_loss"] == pytest.approx(reference, rel=1e-6)
    # the reported loss is the exact Tr(W X⁻¹) of the returned C (dense inverse here)
    c_inv = np.linalg.inv(mixing.to_dense())
    assert meta["loss"] == pytest.approx(np.trace(c_inv.T @ workload @ c_inv), rel=1e-10)
    assert meta["loss"] <= meta["baseline_losses"]["bandmf"] * (1 + 1e-9)
    assert meta["baseline_losses"]["dpsgd"] == pytest.approx(np.trace(workload), rel=1e-12)


def _random_ab(rng, bands, steps):
    ab = 0.3 * rng.standard_normal((bands, steps))
    ab[0] = 1.0 + rng.random(steps)
    return ab * banded.valid_mask(bands, steps)


def _dense_from_ab(ab):
    bands, steps = ab.shape
    dense = np.zeros((steps, steps))
    for d in range(bands):
        dense[np.arange(d, steps), np.arange(steps - d)] = ab[d, : steps - d]
    return dense


@pytest.mark.parametrize("steps,bands", [(5, 2), (16, 16), (33, 4), (48, 16), (49, 16), (130, 17), (130, 64)])
def test_inverse_frobenius_term_matches_dense_inverse(steps, bands):
    # 1 to 9 blocks of the block recursion (odd and even counts: it runs two blocks at a time)
    rng = np.random.default_rng(steps + bands)
    ab = _random_ab(rng, bands, steps)
    value, grad, row_norms = banded.inverse_frobenius_term(ab, return_diagonal=True)
    c_inv = np.linalg.inv(_dense_from_ab(ab))
    assert value == pytest.approx(float(np.sum(c_inv**2)), rel=1e-12)
    np.testing.assert_allclose(row_norms, np.sum(c_inv**2, axis=1), rtol=1e-11)
    dense_grad = -2.0 * c_inv.T @ c_inv @ c_inv.T  # ∂‖C⁻¹‖²_F/∂C
    mask = banded.valid_mask(bands, steps)
    expected = np.zeros_like(ab)
    for d in range(bands):
        expected[d, : steps - d] = dense_grad[np.arange(d, steps), np.arange(steps - d)]
    np.testing.assert_allclose(grad[mask], expected[mask], rtol=1e-10, atol=1e-12 * np.abs(expected).max())


@pytest.mark.parametrize("steps,bands", [(13, 1), (17, 3), (40, 7), (30, 30)])
def test_gradient_matches_central_differences(steps, bands):
    rng = np.random.default_rng(steps)
    factor = rng.standard_normal((steps, 3))
    surrogate = surrogate_module.Surrogate(factor=factor, prefix_weight=0.7, identity_weight=0.2)
    ab = _random_ab(rng, bands, steps)
    value, grad = surrogate(ab)
    # value against a dense computation with np.linalg.inv
    workload = factor @ factor.T + 0.7 * np.tril(np.ones((steps, steps))).T @ np.tril(np.ones((steps, steps)))
    workload += 0.2 * np.eye(steps)
    c_inv = np.linalg.inv(_dense_from_ab(ab))
    assert value == pytest.approx(np.trace(c_inv.T @ workload @ c_inv), rel=1e-11)
    mask = banded.valid_mask(bands, steps)
    entries = np.argwhere(mask)
    for d, c in entries[rng.choice(len(entries), size=min(12, len(entries)), replace=False)]:
        h = 1e-6 * max(1.0, abs(ab[d, c]))
        up, down = ab.copy(), ab.copy()
        up[d, c] += h
        down[d, c] -= h
        fd = (surrogate(up, gradient=False)[0] - surrogate(down, gradient=False)[0]) / (2 * h)
        assert grad[d, c] == pytest.approx(fd, rel=1e-6, abs=1e-8 * abs(value))


def test_normalised_parametrisation_gradient_matches_central_differences():
    rng = np.random.default_rng(3)
    steps, bands = 15, 4
    surrogate = surrogate_module.Surrogate(factor=rng.standard_normal((steps, 2)), prefix_weight=0.1)
    raw = _random_ab(rng, bands, steps) * 3.0  # unnormalised raw band values
    mask = banded.valid_mask(bands, steps)

    def f(r):
        return surrogate(optimize.normalise_columns(r)[0], gradient=False)[0]

    c, norms = optimize.normalise_columns(raw)
    _, g = surrogate(c)
    chain = (g - c * np.einsum("ij,ij->j", c, g)) / norms * mask
    for d, col in np.argwhere(mask)[::5]:
        up, down = raw.copy(), raw.copy()
        up[d, col] += 1e-6
        down[d, col] -= 1e-6
        assert chain[d, col] == pytest.approx((f(up) - f(down)) / 2e-6, rel=1e-5, abs=1e-9)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.integers(2, 14),
    band_frac=st.floats(0.0, 1.0),
    objective=st.sampled_from(["bandmf", "noisecurve", "noisecurve-all-iterates", "noisecurve-convergence"]),
    eigs=st.lists(st.floats(1e-4, 1.0), min_size=1, max_size=6),
    seed=st.integers(0, 1000),
)
def test_invariants(steps, band_frac, objective, eigs, seed):
    bands = 1 + int(band_frac * (steps - 1))
    kw = {} if objective == "bandmf" else dict(spectrum=np.array(eigs), learning_rate=0.9 / max(eigs))
    mixing = solve_mixing_matrix(steps=steps, bands=bands, objective=objective, max_iterations=300, **kw)
    dense = mixing.to_dense()
    np.testing.assert_allclose(np.linalg.norm(dense, axis=0), 1.0, rtol=0, atol=1e-12)
    assert np.all(dense[~_band_mask(steps, bands)] == 0)
    assert np.all(np.diag(dense) > 0)
    x = dense.T @ dense
    outside = np.abs(np.subtract.outer(np.arange(steps), np.arange(steps))) >= bands
    assert np.all(np.abs(x[outside]) <= 1e-15)
    z = np.random.default_rng(seed).standard_normal((steps, 3))
    np.testing.assert_allclose(mixing.inverse_apply(z), np.linalg.solve(dense, z), rtol=1e-9, atol=1e-9)
    json.dumps(mixing.metadata)


def test_scale_free_stopping_same_c_for_w_times_1000():
    mu = SPEC.eigenvalues
    base = solve_mixing_matrix(steps=60, bands=6, objective="noisecurve-all-iterates",
                               spectrum=Spectrum(mu, np.ones(mu.size)), learning_rate=ETA)
    scaled = solve_mixing_matrix(steps=60, bands=6, objective="noisecurve-all-iterates",
                                 spectrum=Spectrum(mu, 1000 * np.ones(mu.size)), learning_rate=ETA)
    np.testing.assert_allclose(scaled.band_values, base.band_values, rtol=0, atol=1e-6)
    assert abs(scaled.metadata["solver"]["iterations"] - base.metadata["solver"]["iterations"]) <= 3
    assert scaled.metadata["loss"] == pytest.approx(1000 * base.metadata["loss"], rel=1e-6)


def test_rank_deficient_workload_gets_a_ridge():
    steps, bands = 30, 5
    mixing = solve_mixing_matrix(steps=steps, bands=bands, objective="noisecurve", spectrum=[0.3],
                                 learning_rate=1.0)
    meta = mixing.metadata
    workload = workload_matrix(objective="noisecurve", steps=steps, spectrum=[0.3], learning_rate=1.0)
    assert np.linalg.matrix_rank(workload) == 1
    assert meta["workload_rank"] == 1
    assert meta["ridge"] == pytest.approx(RIDGE_RELATIVE * np.trace(workload) / steps, rel=1e-12)
    assert meta["solver"]["converged"]
    assert np.isfinite(meta["loss"]) and meta["loss"] <= meta["baseline_losses"]["bandmf"]
    assert min(np.diag(mixing.to_dense())) > 0
    # the ridged problem has a unique optimum: an independent dense solve agrees
    reference = _dense_reference_loss(workload + meta["ridge"] * np.eye(steps), bands)
    assert meta["solver"]["surrogate_loss"] == pytest.approx(reference, rel=1e-6)


def test_full_rank_workload_has_no_ridge():
    mixing = solve_mixing_matrix(steps=20, bands=3, objective="bandmf")
    assert mixing.metadata["ridge"] == 0.0


def test_metadata_contents_and_objective_value():
    mixing = solve_mixing_matrix(steps=32, bands=4, objective="noisecurve", spectrum=SPEC, learning_rate=ETA)
    meta = mixing.metadata
    for key in ("objective", "steps", "bands", "learning_rate", "blend_weight", "spectrum_digest", "loss",
                "baseline_losses", "solver", "ridge", "version"):
        assert key in meta
    assert meta["spectrum_digest"] == SPEC.digest()
    assert meta["version"] == keras_noisecurve.__version__
    assert meta["learning_rate"] == ETA and meta["steps"] == 32 and meta["bands"] == 4
    for key in ("iterations", "function_evaluations", "seconds", "converged", "relative_optimality"):
        assert key in meta["solver"]
    json.dumps(meta)
    assert objective_value(mixing, objective="noisecurve", spectrum=SPEC, learning_rate=ETA) == \
        pytest.approx(meta["loss"], rel=1e-12)
    bandmf = solve_mixing_matrix(steps=32, bands=4, objective="bandmf")
    assert objective_value(bandmf, objective="noisecurve", spectrum=SPEC, learning_rate=ETA) == \
        pytest.approx(meta["baseline_losses"]["bandmf"], rel=1e-9)
    # NoiseCurve beats both baselines on its own objective
    assert meta["loss"] < meta["baseline_losses"]["bandmf"] < meta["baseline_losses"]["dpsgd"]


@pytest.mark.parametrize("objective", ["dpsgd", "bandmf", "noisecurve", "noisecurve-convergence",
                                       "noisecurve-all-iterates", "noisecurve-blend"])
def test_objective_value_matches_dense_formula(objective):
    rng = np.random.default_rng(9)
    steps, bands = 25, 4
    ab = _random_ab(rng, bands, steps)
    ab = optimize.normalise_columns(ab)[0]
    mixing = MixingMatrix(banded.ab_to_band_values(ab))
    kw = {}
    if objective.startswith("noisecurve"):
        kw = dict(spectrum=SPEC, learning_rate=ETA)
    if objective == "noisecurve-blend":
        kw["blend_weight"] = 0.4
    workload = workload_matrix(objective=objective, steps=steps, **kw)
    c_inv = np.linalg.inv(mixing.to_dense())
    assert objective_value(mixing, objective=objective, **kw) == \
        pytest.approx(np.trace(c_inv.T @ workload @ c_inv), rel=1e-10)


def test_diagnostics_are_attached():
    steps, bands = 40, 5
    mixing = solve_mixing_matrix(steps=steps, bands=bands, objective="noisecurve", spectrum=SPEC, learning_rate=ETA)
    diagnostics = mixing.metadata["diagnostics"]
    a = np.tril(np.ones((steps, steps)))
    c_inv = np.linalg.inv(mixing.to_dense())
    peak = np.linalg.norm(a @ c_inv, axis=1).max()
    assert diagnostics["prefix_std_max"] == pytest.approx(peak, rel=1e-9)
    bandmf = solve_mixing_matrix(steps=steps, bands=bands, objective="bandmf")
    bandmf_peak = np.linalg.norm(a @ np.linalg.inv(bandmf.to_dense()), axis=1).max()
    assert diagnostics["excursion_vs_bandmf"] == pytest.approx(peak / bandmf_peak, rel=1e-6)
    assert "excursion_vs_bandmf" not in bandmf.metadata["diagnostics"]


def test_dpsgd_is_identity():
    mixing = solve_mixing_matrix(steps=12, bands=1, objective="dpsgd")
    np.testing.assert_array_equal(mixing.to_dense(), np.eye(12))
    assert mixing.metadata["loss"] == pytest.approx(12.0)


def test_blend_auto_rule():
    steps, bands = 48, 6
    mixing = solve_mixing_matrix(steps=steps, bands=bands, objective="noisecurve-blend", spectrum=SPEC,
                                 learning_rate=ETA, blend_weight="auto")
    meta = mixing.metadata
    lam = meta["blend_weight"]
    assert lam in AUTO_BLEND_GRID
    rule = meta["blend_rule"]
    assert "smallest" in rule["rule"]

    def peak(m):  # independent: dense A C⁻¹
        a = np.tril(np.ones((steps, steps)))
        return np.linalg.norm(a @ np.linalg.inv(m.to_dense()), axis=1).max()

    bandmf_peak = peak(solve_mixing_matrix(steps=steps, bands=bands, objective="bandmf"))
    assert rule["bandmf_peak_prefix_std"] == pytest.approx(bandmf_peak, rel=1e-9)
    assert peak(mixing) <= AUTO_BLEND_FACTOR * bandmf_peak * (1 + 1e-9)
    tried = rule["tried"]
    assert tried[-1]["blend_weight"] == lam
    for earlier in tried[:-1]:
        assert earlier["ratio"] > AUTO_BLEND_FACTOR
        assert earlier["blend_weight"] < lam
    assert meta["loss"] == pytest.approx(
        objective_value(mixing, objective="noisecurve-blend", spectrum=SPEC, learning_rate=ETA,
                        blend_weight=lam), rel=1e-10)


def test_initial_and_verbose(capsys):
    first = solve_mixing_matrix(steps=40, bands=4, objective="noisecurve", spectrum=SPEC, learning_rate=ETA,
                                verbose=True)
    out = capsys.readouterr().out
    assert "rel. optimality" in out and "iter" in out
    again = solve_mixing_matrix(steps=40, bands=4, objective="noisecurve", spectrum=SPEC, learning_rate=ETA,
                                initial=first)
    # from a converged C the solver stops at once, on relative optimality
    assert first.metadata["solver"]["relative_optimality"] <= 1e-6
    assert again.metadata["solver"]["iterations"] <= 2
    assert again.metadata["solver"]["stopping_reason"] == "relative optimality"
    assert again.metadata["solver"]["converged"]
    assert again.metadata["loss"] == pytest.approx(first.metadata["loss"], rel=1e-5)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(steps=0, bands=1, objective="bandmf"), "steps must be >= 1, got 0"),
        (dict(steps=5, bands=0, objective="bandmf"), "bands must be >= 1, got 0"),
        (dict(steps=5, bands=6, objective="bandmf"), r"bands must be <= steps \(5\); got bands=6"),
        (dict(steps=5, bands=2, objective="dpsgd"), "bands=1; got bands=2"),
        (dict(steps=5, bands=2, objective="bandmf", tol=0.0), "tol must be > 0"),
        (dict(steps=5, bands=2, objective="bandmf", max_iterations=-1), "max_iterations must be >= 0"),
        (dict(steps=5, bands=2, objective="what"), "objective must be one of"),
        (dict(steps=5, bands=2, objective="noisecurve"), "needs a spectrum"),
        (dict(steps=5, bands=2, objective="noisecurve", spectrum=[0.1]), "needs learning_rate"),
        (dict(steps=5, bands=2, objective="noisecurve", spectrum=[0.1], learning_rate=0.0), "learning_rate must be > 0"),
        (dict(steps=5, bands=2, objective="noisecurve", spectrum=[0.1, -1.0], learning_rate=1.0), "must be >= 0"),
        (dict(steps=5, bands=2, objective="noisecurve", spectrum=[np.inf], learning_rate=1.0), "finite"),
        (dict(steps=5, bands=2, objective="noisecurve", spectrum=[1.0], learning_rate=2.5), "diverges"),
        (dict(steps=5, bands=2, objective="noisecurve-blend", spectrum=[0.1], learning_rate=1.0), "blend_weight"),
        (dict(steps=5, bands=2, objective="noisecurve-blend", spectrum=[0.1], learning_rate=1.0,
              blend_weight=-0.1), r"\[0, 1\]; got -0.1"),
        (dict(steps=5, bands=2, objective="noisecurve-blend", spectrum=[0.1], learning_rate=1.0,
              blend_weight="sometimes"), "'auto'; got 'sometimes'"),
        (dict(steps=5, bands=2, objective="bandmf", learning_rate=1.0), "does not use"),
        (dict(steps=5, bands=2, objective="bandmf", initial=MixingMatrix.identity(5)),
         r"initial has \(steps, bands\) = \(5, 1\); expected \(5, 2\)"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        solve_mixing_matrix(**kwargs)


def test_warns_above_one_and_not_below():
    with pytest.warns(UserWarning, match="Theorem 3.2"):
        solve_mixing_matrix(steps=6, bands=2, objective="noisecurve", spectrum=[1.5, 0.1], learning_rate=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        solve_mixing_matrix(steps=6, bands=2, objective="noisecurve", spectrum=[1.0, 0.1], learning_rate=1.0)


def test_objective_value_bad_input():
    with pytest.raises(ValueError, match="mixing must be a MixingMatrix"):
        objective_value(np.eye(3), objective="bandmf")
    with pytest.raises(ValueError, match="needs a spectrum"):
        objective_value(MixingMatrix.identity(3), objective="noisecurve", learning_rate=0.1)


def test_mixing_package_does_not_import_tensorflow():
    code = ("import sys, keras_noisecurve.mixing as m; import keras_noisecurve.mixing.banded, "
            "keras_noisecurve.mixing.surrogate, keras_noisecurve.mixing.optimize, "
            "keras_noisecurve.mixing.diagnostics; m.solve_mixing_matrix(steps=4, bands=2, "
            "objective='bandmf'); assert 'tensorflow' not in sys.modules, 'tensorflow imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_diagonal_preconditioner_matches_dense_hessian_diagonal():
    """With one probe per entry (colours ≥ T) the estimate is the Hessian diagonal;
    reference: central differences of the dense-inverse objective, entry by entry."""
    rng = np.random.default_rng(11)
    steps, bands = 12, 3
    factor = rng.standard_normal((steps, 2))
    workload = factor @ factor.T + 0.05 * np.eye(steps)
    surrogate = surrogate_module.Surrogate(factor=factor, identity_weight=0.05)
    mask = banded.valid_mask(bands, steps)
    x = optimize.normalise_columns(_random_ab(rng, bands, steps))[0][mask]

    def dense_loss(z):
        raw = np.zeros((bands, steps))
        raw[mask] = z
        c_inv = np.linalg.inv(_dense_from_ab(optimize.normalise_columns(raw)[0]))
        return float(np.trace(c_inv.T @ workload @ c_inv))

    def gradient(z):
        raw = np.zeros((bands, steps))
        raw[mask] = z
        c, norms = optimize.normalise_columns(raw)
        _, g = surrogate(c)
        return ((g - c * np.einsum("ij,ij->j", c, g)) * mask / norms)[mask]

    h = 1e-4
    diag = np.array([(dense_loss(x + h * e) - 2 * dense_loss(x) + dense_loss(x - h * e)) / h**2
                     for e in np.eye(x.size)])
    scale = optimize._diagonal_scaling(gradient, x, gradient(x), bands, steps, mask, colours=steps)
    live = np.abs(diag) > 1e-6 * np.abs(diag).max()  # the last column's single entry is constant
    expected = np.sqrt(np.median(np.abs(diag[live])) / np.abs(diag[live]))
    np.testing.assert_allclose(scale[live], expected, rtol=1e-3)


def test_preconditioned_and_plain_lbfgs_reach_the_same_loss():
    inputs = dict(spectrum=SPEC, learning_rate=ETA)
    problem = surrogate_module.Problem(objective="noisecurve", steps=30,
                                       inputs=check_curvature_inputs(objective="noisecurve", **inputs))
    start = solver_module._bandmf_initial(30, 4)
    losses = []
    for precondition in (False, True):
        _, stats = optimize.minimize_band_values(problem.surrogate, start, tol=1e-7, max_iterations=20_000,
                                                 verbose=False, label="t", precondition=precondition)
        assert stats["converged"]
        losses.append(stats["surrogate_loss"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


def test_default_objective_is_the_benchmark_winner():
    """docs/results.md: no curvature objective beat DP-BandMF on validation data."""
    from keras_noisecurve.mixing import DEFAULT_OBJECTIVE

    assert DEFAULT_OBJECTIVE == "bandmf"
    default = solve_mixing_matrix(steps=8, bands=2)
    explicit = solve_mixing_matrix(steps=8, bands=2, objective="bandmf")
    assert default.metadata["objective"] == "bandmf"
    np.testing.assert_allclose(default.band_values, explicit.band_values)
