"""The BLT solver (``solve_blt``): its loss against dense numpy, its gradient against finite
differences, local optimality, the comparison with BISR and the banded Toeplitz square
root, several participations, the recorded inputs, files and refusals; and the BISR
closed form (non-negative, non-increasing coefficients; loss falling with p)."""

import math

import numpy as np
import pytest

from keras_noisecurve.mixing import load_mixing, workload_matrix
from keras_noisecurve.mixing import solve_blt as solve_blt_module
from keras_noisecurve.mixing.solve_blt import blt_column, blt_loss, solve_blt
from keras_noisecurve.mixing.strategies import BISRMixing, BLTMixing, ToeplitzMixing
from keras_noisecurve.mixing.toeplitz_loss import ToeplitzWorkload, toeplitz_loss
from keras_noisecurve.spectrum.artifact import Spectrum

SPEC = Spectrum(np.geomspace(1.0, 1e-3, 30))
ETA = 0.8
INPUTS = {
    "bandmf": {},
    "noisecurve": dict(spectrum=SPEC, learning_rate=ETA),
    "noisecurve-blend": dict(spectrum=SPEC, learning_rate=ETA, blend_weight=0.3),
}


def _dense_loss(strategy, objective, participations=1, separation=None):
    """sens²·Tr(W X⁻¹) from the dense C: np.linalg.inv, ``workload_matrix`` and the column
    sums of the k participations' columns of C (start 0, the worst start for c ≥ 0)."""
    c = strategy.to_dense()
    steps = c.shape[0]
    w = workload_matrix(objective=objective, steps=steps, **INPUTS[objective])
    c_inv = np.linalg.inv(c)
    trace = float(np.trace(c_inv.T @ w @ c_inv))
    starts = [i * separation for i in range(participations)] if participations > 1 else [0]
    total = c[:, [s for s in starts if s < steps]].sum(axis=1)
    return float(total @ total) * trace, float(total @ total), trace


def _random_blt(buffers, steps, seed):
    rng = np.random.default_rng(seed)
    theta = np.sort(1.0 - np.geomspace(2.0 / steps, 0.6, buffers) * rng.uniform(0.7, 1.3, buffers))[::-1]
    omega = rng.uniform(0.05, 0.4, buffers)
    return BLTMixing(theta, omega, steps=steps)


# ------------------------------------------------------------------------------ loss
@pytest.mark.parametrize("objective", list(INPUTS))
@pytest.mark.parametrize("steps,buffers,participations,separation",
                         [(60, 1, 1, None), (150, 3, 1, None), (120, 1, 3, 40), (200, 3, 3, 70)])
def test_loss_matches_dense(objective, steps, buffers, participations, separation):
    strategy = _random_blt(buffers, steps, seed=steps + buffers)
    workload = ToeplitzWorkload.from_objective(objective=objective, steps=steps, **INPUTS[objective])
    got = blt_loss(strategy.theta, strategy.omega, steps=steps, workload=workload,
                   participations=participations, separation=separation)
    loss, sens2, trace = _dense_loss(strategy, objective, participations, separation)
    assert got["loss"] == pytest.approx(loss, rel=1e-9)
    assert got["sensitivity_squared"] == pytest.approx(sens2, rel=1e-12)
    assert got["trace"] == pytest.approx(trace, rel=1e-9)
    # the strategy's own sensitivity (what the accountant uses) agrees
    assert strategy.sensitivity(participations=participations, separation=separation) ** 2 == \
        pytest.approx(sens2, rel=1e-12)
    # the unnormalised objective of the solver is the same (scale-free) loss, as a logarithm
    objective_fn = solve_blt_module._Objective(steps, workload, participations, separation)
    value, _ = objective_fn(solve_blt_module._pack(strategy.theta, strategy.omega))
    assert value == pytest.approx(math.log(loss), abs=1e-9)


def test_column_matches_strategy():
    strategy = _random_blt(3, 80, seed=1)
    col = blt_column(strategy.theta, strategy.omega, 80)
    np.testing.assert_allclose(col / np.linalg.norm(col), strategy.first_column(), rtol=1e-13)
    assert col[0] == 1.0


@pytest.mark.parametrize("objective", ["bandmf", "noisecurve-blend"])
@pytest.mark.parametrize("buffers,participations,separation", [(1, 1, None), (3, 1, None), (3, 3, 40)])
def test_gradient_matches_central_differences(objective, buffers, participations, separation):
    steps = 120
    strategy = _random_blt(buffers, steps, seed=7 + buffers)
    workload = ToeplitzWorkload.from_objective(objective=objective, steps=steps, **INPUTS[objective])
    fn = solve_blt_module._Objective(steps, workload, participations, separation)
    x = solve_blt_module._pack(strategy.theta, strategy.omega)
    _, grad = fn(x)
    h = 1e-6
    numeric = np.array([(fn(x + h * e)[0] - fn(x - h * e)[0]) / (2 * h) for e in np.eye(x.shape[0])])
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8 * np.abs(grad).max())


# ----------------------------------------------------------------------------- solve
@pytest.fixture(scope="module")
def solved_300():
    return solve_blt(steps=300, buffers=3)


def test_solve_is_a_local_minimum(solved_300):
    steps = 300
    workload = ToeplitzWorkload.from_objective(objective="bandmf", steps=steps)
    meta = solved_300.metadata
    assert meta["solver"]["converged"] and meta["solver"]["relative_optimality"] <= 1e-6
    x = solve_blt_module._pack(solved_300.theta, solved_300.omega)
    fn = solve_blt_module._Objective(steps, workload, 1, None)
    base = fn(x)[0]
    for i in range(x.shape[0]):
        for delta in (-1e-2, 1e-2):
            y = x.copy()
            y[i] += delta
            assert fn(y)[0] > base, (i, delta)
    # the recorded loss is the loss of the returned (normalised) C, checked densely
    loss, sens2, trace = _dense_loss(solved_300, "bandmf")
    assert meta["loss"] == pytest.approx(loss, rel=1e-9)
    assert meta["loss_components"]["sensitivity_squared"] == pytest.approx(1.0, abs=1e-12)
    assert meta["loss_components"]["trace"] == pytest.approx(trace, rel=1e-9)
    assert meta["baseline_losses"]["dpsgd"] == pytest.approx(steps * (steps + 1) / 2)


def test_solve_beats_bisr_and_toeplitz_square_root(solved_300):
    steps = 300
    workload = ToeplitzWorkload.from_objective(objective="bandmf", steps=steps)
    loss = solved_300.metadata["loss"]
    k = np.arange(1, steps)
    root = np.r_[1.0, np.cumprod((k - 0.5) / k)]  # (1 − x)^{−1/2}: the Toeplitz square root of AᵀA
    others = {f"bisr p={p}": BISRMixing.closed_form(steps=steps, bands=p) for p in (4, 16, 64, steps)}
    others.update({f"sqrt b={b}": ToeplitzMixing.normalised(root[:b], steps=steps) for b in (4, 16, steps)})
    for name, other in others.items():
        other_loss = toeplitz_loss(other.first_column(), workload, gradient=False)[0]
        assert loss < other_loss, name
    # d = 3 buffers beat the best BISR with p − 1 = 63 buffers (measured: 2134.75 vs 2147.91)
    assert loss < 0.995 * toeplitz_loss(others["bisr p=64"].first_column(), workload, gradient=False)[0]


def test_one_buffer_matches_a_grid_search():
    steps = 200
    workload = ToeplitzWorkload.from_objective(objective="bandmf", steps=steps)
    solved = solve_blt(steps=steps, buffers=1)

    def grid(gaps, omegas):
        return min((blt_loss([1 - g], [w], steps=steps, workload=workload)["loss"], g, w)
                   for g in gaps for w in omegas)

    _, gap, omega = grid(np.geomspace(1e-3, 0.9, 20), np.geomspace(1e-3, 1.0, 20))  # coarse, then fine
    best, _, _ = grid(gap * np.geomspace(0.7, 1.4, 12), omega * np.geomspace(0.7, 1.4, 12))
    assert solved.metadata["loss"] <= best * (1 + 1e-9)
    assert solved.metadata["loss"] >= best * (1 - 1e-3)  # and the grid gets close to it


def test_several_participations(solved_300):
    steps, k, sep = 300, 3, 100
    workload = ToeplitzWorkload.from_objective(objective="bandmf", steps=steps)
    multi = solve_blt(steps=steps, buffers=3, participations=k, separation=sep)
    single = solved_300
    meta = multi.metadata
    assert (meta["participations"], meta["separation"]) == (k, sep)
    assert meta["solver"]["converged"]
    loss, sens2, _ = _dense_loss(multi, "bandmf", k, sep)
    assert meta["loss"] == pytest.approx(loss, rel=1e-9)
    assert meta["loss_components"]["sensitivity_squared"] == pytest.approx(sens2, rel=1e-12)
    assert meta["baseline_losses"]["dpsgd"] == pytest.approx(k * steps * (steps + 1) / 2)
    single_under_k = blt_loss(single.theta, single.omega, steps=steps, workload=workload,
                              participations=k, separation=sep)["loss"]
    assert meta["loss"] < single_under_k


@pytest.mark.parametrize("objective", ["noisecurve", "noisecurve-blend"])
def test_curvature_objectives_record_their_inputs(objective):
    steps = 150
    solved = solve_blt(steps=steps, buffers=2, objective=objective, **INPUTS[objective])
    meta = solved.metadata
    assert meta["strategy"] == "blt" and meta["objective"] == objective
    assert (meta["steps"], meta["buffers"], meta["participations"], meta["separation"]) == (steps, 2, 1, None)
    assert meta["learning_rate"] == ETA
    assert meta["spectrum_digest"] == SPEC.digest()
    assert meta["blend_weight"] == (0.3 if objective == "noisecurve-blend" else None)
    loss, _, _ = _dense_loss(solved, objective)
    assert meta["loss"] == pytest.approx(loss, rel=1e-9)
    w = workload_matrix(objective=objective, steps=steps, **INPUTS[objective])
    assert meta["baseline_losses"]["dpsgd"] == pytest.approx(np.trace(w), rel=1e-12)
    assert meta["loss"] < meta["baseline_losses"]["dpsgd"]
    assert meta["solver"]["converged"]


def test_metadata_and_file_round_trip(tmp_path, solved_300):
    meta = solved_300.metadata
    for key in ("strategy", "objective", "steps", "buffers", "participations", "separation", "learning_rate",
                "blend_weight", "spectrum_digest", "loss", "loss_components", "baseline_losses", "solver",
                "version"):
        assert key in meta, key
    for key in ("iterations", "function_evaluations", "seconds", "converged", "relative_optimality", "message"):
        assert key in meta["solver"], key
    assert meta["buffers"] == solved_300.buffers == 3
    assert np.all(solved_300.theta >= 0) and np.all(solved_300.theta < 1) and np.all(solved_300.omega >= 0)
    path = tmp_path / "blt.npz"
    solved_300.save(path)
    loaded = load_mixing(path)
    assert isinstance(loaded, BLTMixing) and loaded == solved_300 and loaded.metadata == meta
    assert load_mixing(solved_300.to_config()) == solved_300


def test_verbose_progress(capsys):
    solve_blt(steps=100, buffers=3, verbose=True, tol=1e-14, max_iterations=26)
    out = capsys.readouterr().out
    assert "iter    25" in out and "done: loss" in out


def test_max_iterations_zero_returns_the_start_not_converged():
    solved = solve_blt(steps=100, buffers=2, max_iterations=0)
    assert solved.metadata["solver"]["iterations"] == 0
    assert not solved.metadata["solver"]["converged"]


# -------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("kwargs,error,match", [
    (dict(objective="dpsgd"), ValueError, r"objective must be one of 'bandmf', .*; got 'dpsgd'"),
    (dict(objective="noisecurve-convergence"), ValueError, r"got 'noisecurve-convergence'"),
    (dict(steps=1), ValueError, r"steps must be >= 2, got 1"),
    (dict(steps=10.0), TypeError, r"steps must be an integer, got 10.0"),
    (dict(buffers=0), ValueError, r"buffers must be >= 1, got 0"),
    (dict(buffers=17), ValueError, r"buffers must be <= 16, got 17"),
    (dict(steps=3, buffers=3), ValueError, r"buffers must be < steps \(3\); got buffers=3"),
    (dict(participations=0), ValueError, r"participations must be >= 1, got 0"),
    (dict(participations=2), ValueError, r"participations=2 needs separation .*got separation=None"),
    (dict(participations=3, separation=50), ValueError,
     r"needs \(participations − 1\) × separation < steps \(100\); got 100"),
    (dict(participations=2, separation=0), ValueError, r"separation must be >= 1, got 0"),
    (dict(tol=0.0), ValueError, r"tol must be > 0, got 0.0"),
    (dict(max_iterations=-1), ValueError, r"max_iterations must be >= 0, got -1"),
    (dict(spectrum=SPEC), ValueError, r"does not use a spectrum"),
    (dict(blend_weight=0.5), ValueError, r"blend_weight is only used by objective='noisecurve-blend'"),
    (dict(objective="noisecurve", learning_rate=ETA), ValueError, r"needs a spectrum"),
    (dict(objective="noisecurve-blend", spectrum=SPEC, learning_rate=ETA, blend_weight="auto"), ValueError,
     r"blend_weight must be a number in \[0, 1\]; got 'auto'"),
    (dict(objective="noisecurve-blend", spectrum=SPEC, learning_rate=ETA, blend_weight=1.5), ValueError,
     r"blend_weight must lie in \[0, 1\]; got 1.5"),
])
def test_refusals(kwargs, error, match):
    args = dict(steps=100, buffers=2)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        solve_blt(**args)


# ------------------------------------------------------------------------------ BISR
@pytest.mark.parametrize("bands", [1, 4, 16, 64])
@pytest.mark.parametrize("steps", [64, 1000, 10_000])
def test_bisr_coefficients_non_negative_and_non_increasing(bands, steps):
    col = BISRMixing.closed_form(steps=steps, bands=bands).first_column()
    assert np.all(col >= 0)
    assert np.all(np.diff(col) <= 1e-15 * col[0])


def test_bisr_loss_falls_with_bands():
    steps = 2000
    workload = ToeplitzWorkload.from_objective(objective="bandmf", steps=steps)
    losses = [toeplitz_loss(BISRMixing.closed_form(steps=steps, bands=p).first_column(), workload,
                            gradient=False)[0] for p in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert losses[0] == pytest.approx(steps * (steps + 1) / 2)  # p = 1: C = I
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
