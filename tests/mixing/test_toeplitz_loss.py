"""Toeplitz objective Tr(W X⁻¹), its gradient and the participation sensitivity against
independent dense computations (np.linalg.inv of the dense C, ``workload_matrix``)."""

import numpy as np
import pytest

from keras_noisecurve.mixing.strategies import BISRMixing, BLTMixing, ToeplitzMixing
from keras_noisecurve.mixing.toeplitz_loss import (
    LFILTER_MAX_SUPPORT,
    ToeplitzWorkload,
    inverse_column,
    inverse_loss,
    participation_sensitivity,
    toeplitz_loss,
)
from keras_noisecurve.mixing.workloads import workload_matrix
from keras_noisecurve.spectrum.artifact import Spectrum

SPEC = Spectrum(np.geomspace(1.0, 1e-3, 30))
ETA = 0.8
OBJECTIVES = {
    "bandmf": {},
    "noisecurve": dict(spectrum=SPEC, learning_rate=ETA),
    "noisecurve-blend": dict(spectrum=SPEC, learning_rate=ETA, blend_weight=0.3),
}


def _dense_c(column):
    steps = column.shape[0]
    idx = np.subtract.outer(np.arange(steps), np.arange(steps))
    return np.where(idx >= 0, column[np.clip(idx, 0, None)], 0.0)


def _dense_loss(column, workload):
    c_inv = np.linalg.inv(_dense_c(column))
    return float(np.trace(c_inv.T @ workload @ c_inv))


def _columns(steps, seed):
    """A banded positive column (recursion path), a long mixed-sign one and a long
    positive one (both beyond LFILTER_MAX_SUPPORT when T is large: FFT path)."""
    rng = np.random.default_rng(seed)
    banded = np.zeros(steps)
    banded[:8] = np.r_[1.0, 0.6 * rng.random(7)]
    mixed = np.r_[1.0, 0.4 * rng.standard_normal(steps - 1) / np.arange(1, steps)]
    positive = 1.0 / np.arange(1, steps + 1) ** 0.6
    return {"banded": banded, "mixed": mixed, "positive": positive}


@pytest.mark.parametrize("objective", list(OBJECTIVES))
@pytest.mark.parametrize("steps", [50, 200])
def test_loss_matches_dense_inverse(objective, steps):
    kw = OBJECTIVES[objective]
    workload = ToeplitzWorkload.from_objective(objective=objective, steps=steps, **kw)
    dense_w = workload_matrix(objective=objective, steps=steps, **kw)
    np.testing.assert_allclose(workload.dense(), dense_w, rtol=1e-12, atol=1e-14 * np.abs(dense_w).max())
    for name, column in _columns(steps, seed=steps).items():
        for scale in (1.0, 3.7):
            value, grad = toeplitz_loss(scale * column, workload)
            expected = _dense_loss(scale * column, dense_w)
            assert value == pytest.approx(expected, rel=1e-10), (name, scale)
            assert grad.shape == (steps,)
        assert toeplitz_loss(column, workload, gradient=False)[1] is None


@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_gradient_matches_central_differences(objective):
    steps = 200  # > LFILTER_MAX_SUPPORT: the long columns take the FFT path
    assert steps > LFILTER_MAX_SUPPORT
    workload = ToeplitzWorkload.from_objective(objective=objective, steps=steps, **OBJECTIVES[objective])
    for name, column in _columns(steps, seed=7).items():
        _, grad = toeplitz_loss(column, workload)
        for j in (0, 1, 5, 9, 60, steps - 1):
            h = 1e-6 * max(1.0, abs(column[j]))
            up, down = column.copy(), column.copy()
            up[j] += h
            down[j] -= h
            fd = (toeplitz_loss(up, workload, gradient=False)[0]
                  - toeplitz_loss(down, workload, gradient=False)[0]) / (2 * h)
            assert fd == pytest.approx(grad[j], rel=1e-5, abs=1e-7 * np.abs(grad).max()), (name, j)


def test_inverse_column_recursion_and_newton_agree_with_dense():
    steps = 300
    for column in _columns(steps, seed=3).values():
        expected = np.linalg.inv(_dense_c(column))[:, 0]
        np.testing.assert_allclose(inverse_column(column), expected, rtol=1e-9, atol=1e-12 * np.abs(expected).max())
    # long banded column (Newton/FFT) against the exact recursion at a larger T
    from keras_noisecurve.mixing import toeplitz_loss as module

    steps = 20_000
    column = np.zeros(steps)
    coef = np.cumprod(np.r_[1.0, [(k - 0.5) / k for k in range(1, 200)]])
    column[:200] = coef
    newton = module._newton_inverse(column)
    impulse = np.zeros(steps)
    impulse[0] = 1.0
    import scipy.signal

    exact = scipy.signal.lfilter([1.0], coef, impulse)
    np.testing.assert_allclose(newton, exact, rtol=0, atol=1e-13)


def test_inverse_loss_and_bandmf_closed_forms():
    steps = 64
    workload = ToeplitzWorkload.from_objective(objective="bandmf", steps=steps)
    # C = I: Tr(AᵀA) = T(T+1)/2
    column = np.zeros(steps)
    column[0] = 1.0
    assert toeplitz_loss(column, workload)[0] == pytest.approx(steps * (steps + 1) / 2, rel=1e-14)
    # C = A (c = ones): C⁻¹ = A⁻¹, A·A⁻¹ = I, loss = T
    assert toeplitz_loss(np.ones(steps), workload)[0] == pytest.approx(steps, rel=1e-12)
    value, grad = inverse_loss(inverse_column(np.ones(steps)), workload)
    assert value == pytest.approx(steps, rel=1e-12) and grad.shape == (steps,)
    with pytest.raises(ValueError, match="shape"):
        inverse_loss(np.ones(3), workload)


def test_workload_validation_and_refusals():
    for objective in ("dpsgd", "noisecurve-all-iterates", "noisecurve-convergence"):
        with pytest.raises(ValueError, match="supported for Toeplitz strategies.*'bandmf'"):
            ToeplitzWorkload.from_objective(objective=objective, steps=10, spectrum=SPEC, learning_rate=ETA)
    with pytest.raises(ValueError, match="objective must be one of.*got 'nope'"):
        ToeplitzWorkload.from_objective(objective="nope", steps=10)
    with pytest.raises(ValueError, match="spectrum"):
        ToeplitzWorkload.from_objective(objective="noisecurve", steps=10, learning_rate=ETA)
    with pytest.raises(ValueError, match="does not use a spectrum"):
        ToeplitzWorkload.from_objective(objective="bandmf", steps=10, spectrum=SPEC)
    with pytest.raises(ValueError, match="blend_weight"):
        ToeplitzWorkload.from_objective(objective="noisecurve-blend", steps=10, spectrum=SPEC, learning_rate=ETA,
                                        blend_weight="auto")
    with pytest.raises(ValueError, match=">= 2"):
        ToeplitzWorkload.from_objective(objective="noisecurve", steps=10, spectrum=SPEC, learning_rate=3.0)
    workload = ToeplitzWorkload.from_objective(objective="noisecurve", steps=10, spectrum=SPEC, learning_rate=ETA)
    assert workload.spectrum_digest == SPEC.digest() and workload.learning_rate == ETA
    with pytest.raises(ValueError, match="shape"):
        toeplitz_loss(np.ones(9), workload)
    with pytest.raises(ValueError, match="c_0 must be > 0"):
        toeplitz_loss(np.r_[0.0, np.ones(9)], workload)
    with pytest.raises(TypeError, match="ToeplitzWorkload"):
        toeplitz_loss(np.ones(10), np.eye(10))
    with pytest.raises(ValueError, match="same shape"):
        ToeplitzWorkload(10, 0.0, 1.0, np.ones(3), np.ones(2))
    # blend endpoints: λ = 1 is AᵀA / Tr(AᵀA), λ = 0 the normalised eq.-1 workload
    ends = {lam: ToeplitzWorkload.from_objective(objective="noisecurve-blend", steps=10, spectrum=SPEC,
                                                 learning_rate=ETA, blend_weight=lam) for lam in (0.0, 1.0)}
    assert np.trace(ends[0.0].dense()) == pytest.approx(1.0) and np.trace(ends[1.0].dense()) == pytest.approx(1.0)
    assert ends[1.0].beta == 0.0 and ends[0.0].alpha == 0.0


def _dense_shifted_sum(column, k, sep):
    c = _dense_c(column)
    cols = [i * sep for i in range(k) if i * sep < column.shape[0]]
    return float(np.sum(c[:, cols].sum(axis=1) ** 2))


@pytest.mark.parametrize("k,sep", [(1, None), (2, 7), (3, 50), (7, 77), (20, 30), (4, 500)])
def test_sensitivity_matches_dense_columns_and_strategies(k, sep):
    steps = 400
    strategies = [BISRMixing.closed_form(steps=steps, bands=10),
                  BLTMixing([0.9, 0.5], [0.3, 0.2], steps=steps),
                  ToeplitzMixing.normalised(np.r_[1.0, 0.5, 0.25, 0.1], steps=steps)]
    for strategy in strategies:
        column = strategy.first_column()
        value, grad = participation_sensitivity(column, participations=k, separation=sep)
        assert value == pytest.approx(_dense_shifted_sum(column, k, sep if sep else 1), rel=1e-12)
        if not (strategy.banded and sep is not None and sep >= strategy.bands and (k - 1) * sep >= steps - 3):
            assert value == pytest.approx(strategy.sensitivity(participations=k, separation=sep) ** 2, rel=1e-12)
        rng = np.random.default_rng(k)
        direction = rng.standard_normal(steps)
        h = 1e-6
        fd = (participation_sensitivity(column + h * direction, participations=k, separation=sep)[0]
              - participation_sensitivity(column - h * direction, participations=k, separation=sep)[0]) / (2 * h)
        assert fd == pytest.approx(float(grad @ direction), rel=1e-6)
    with pytest.raises(TypeError, match="separation"):
        participation_sensitivity(np.ones(5), participations=2)


# ------------------------------------------------------------------ the solver
from keras_noisecurve.mixing import load_mixing, solve_mixing_matrix  # noqa: E402
from keras_noisecurve.mixing.solve_toeplitz import solve_toeplitz, sqrt_prefix_coefficients  # noqa: E402


def _normalised_loss(coefficients, workload):
    column = np.zeros(workload.steps)
    column[: coefficients.shape[0]] = coefficients / np.linalg.norm(coefficients)
    return toeplitz_loss(column, workload, gradient=False)[0]


@pytest.fixture(scope="module")
def bandmf_300_8():
    return solve_toeplitz(steps=300, bands=8)


def test_solve_beats_start_and_perturbations(bandmf_300_8):
    mixing = bandmf_300_8
    meta = mixing.metadata
    workload = ToeplitzWorkload.from_objective(objective="bandmf", steps=300)
    c = np.asarray(mixing.coefficients)
    loss = _normalised_loss(c, workload)
    assert meta["solver"]["converged"] and meta["solver"]["relative_optimality"] <= 1e-6
    assert meta["loss"] == pytest.approx(loss, rel=1e-12)
    assert meta["loss"] == pytest.approx(_dense_loss(mixing.first_column(), workload.dense()), rel=1e-10)
    assert loss < _normalised_loss(sqrt_prefix_coefficients(8), workload) * (1 - 1e-4)
    for j in range(8):
        for sign in (1.0, -1.0):
            bumped = c.copy()
            bumped[j] += sign * 1e-3
            assert _normalised_loss(bumped, workload) > loss, (j, sign)
    assert meta["baseline_losses"] == {"dpsgd": pytest.approx(300 * 301 / 2), "bandmf": pytest.approx(loss)}


def test_toeplitz_is_within_a_few_percent_of_banded(bandmf_300_8):
    banded = solve_mixing_matrix(steps=300, bands=8).metadata["loss"]
    toeplitz = bandmf_300_8.metadata["loss"]
    # the banded C is a superset of the Toeplitz ones; measured ratio 1.0149
    assert banded * (1 - 1e-9) <= toeplitz <= 1.03 * banded


def test_metadata_round_trip(bandmf_300_8, tmp_path):
    path = tmp_path / "toeplitz.npz"
    bandmf_300_8.save(path)
    loaded = load_mixing(path)
    assert loaded == bandmf_300_8 and loaded.metadata == bandmf_300_8.metadata
    meta = loaded.metadata
    assert meta["strategy"] == "toeplitz" and meta["objective"] == "bandmf" and meta["bands"] == 8
    assert meta["spectrum_digest"] is None and meta["learning_rate"] is None and meta["blend_weight"] is None
    assert set(meta["solver"]) >= {"iterations", "function_evaluations", "seconds", "converged",
                                   "relative_optimality", "message"}
    assert isinstance(meta["version"], str)


@pytest.mark.parametrize("objective", ["noisecurve", "noisecurve-blend"])
def test_curvature_solve_improves_on_bandmf_start(objective):
    kw = OBJECTIVES[objective]
    mixing = solve_toeplitz(steps=120, bands=6, objective=objective, **kw)
    meta = mixing.metadata
    dense_w = workload_matrix(objective=objective, steps=120, **kw)
    assert meta["loss"] == pytest.approx(_dense_loss(mixing.first_column(), dense_w), rel=1e-10)
    assert meta["loss"] < meta["baseline_losses"]["bandmf"]
    assert meta["baseline_losses"]["dpsgd"] == pytest.approx(np.trace(dense_w), rel=1e-12)
    assert meta["spectrum_digest"] == SPEC.digest() and meta["learning_rate"] == ETA
    assert meta["solver"]["converged"] and "bandmf_solver" in meta["solver"]


def test_blend_endpoint_and_trivial_band():
    kw = dict(spectrum=SPEC, learning_rate=ETA, blend_weight=1.0)
    blend = solve_toeplitz(steps=60, bands=4, objective="noisecurve-blend", **kw)
    np.testing.assert_allclose(blend.coefficients, solve_toeplitz(steps=60, bands=4).coefficients)
    identity = solve_toeplitz(steps=60, bands=1)
    np.testing.assert_array_equal(identity.coefficients, [1.0])
    assert identity.metadata["loss"] == pytest.approx(60 * 61 / 2)


def test_solver_validation(capsys, monkeypatch):
    with pytest.raises(ValueError, match="bands must be <= steps"):
        solve_toeplitz(steps=5, bands=6)
    with pytest.raises(ValueError, match="not supported for Toeplitz strategies"):
        solve_toeplitz(steps=5, bands=2, objective="noisecurve-convergence", spectrum=SPEC, learning_rate=ETA)
    with pytest.raises(ValueError, match="objective must be one of"):
        solve_toeplitz(steps=5, bands=2, objective="banded")
    with pytest.raises(ValueError, match="tol must be > 0"):
        solve_toeplitz(steps=5, bands=2, tol=0.0)
    with pytest.raises(ValueError, match="max_iterations must be >= 0"):
        solve_toeplitz(steps=5, bands=2, max_iterations=-1)
    with pytest.raises(TypeError, match="bands must be an integer"):
        solve_toeplitz(steps=5, bands=2.0)
    with pytest.raises(TypeError, match="verbose"):
        solve_toeplitz(steps=5, bands=2, verbose="yes")
    stuck = solve_toeplitz(steps=50, bands=4, max_iterations=0, tol=1e-12)
    assert not stuck.metadata["solver"]["converged"]
    from keras_noisecurve.mixing import solve_toeplitz as module

    monkeypatch.setattr(module, "_PROGRESS_EVERY", 2)
    solve_toeplitz(steps=77, bands=5, verbose=True)
    assert "[solve_toeplitz bandmf] iteration 2: f = " in capsys.readouterr().out
