"""Monte Carlo checks of paper Theorem 3.1 (and of the all-iterates and blend objectives) on a quadratic loss.

Noisy gradient descent ``w̃_{t+1} = w̃_t − η(H(w̃_t − d) + σ z̃_t)`` with ``z̃ = C⁻¹z`` is
simulated for many independent trials (vectorised numpy), once with the artifact's online
recurrence ``MixingMatrix.inverse_apply`` and once with a dense ``np.linalg.solve``, and the
sample means are compared with the closed forms ``(η²σ²/2)·Tr(W X⁻¹)`` evaluated by
``objective_value`` (banded solves) — an independent computation.
"""

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from keras_noisecurve.mixing import MixingMatrix, objective_value, solve_mixing_matrix
from keras_noisecurve.spectrum.artifact import Spectrum

STEPS = 40
BANDS = 6
ETA = 0.9
SIGMA = 1.0
TRIALS = 4000
P = 200


def _spectrum():
    rng = np.random.default_rng(1234)
    # eigenvalues spread over two decades, η·μ_max = 0.9 < 1
    return Spectrum(np.sort(10 ** rng.uniform(-2, 0, size=P))[::-1])


@pytest.fixture(scope="module")
def setup():
    spec = _spectrum()
    kw = dict(spectrum=spec, learning_rate=ETA)
    mats = {
        "dpsgd": MixingMatrix.identity(STEPS),
        "bandmf": solve_mixing_matrix(steps=STEPS, bands=BANDS, objective="bandmf"),
        "noisecurve": solve_mixing_matrix(steps=STEPS, bands=BANDS, objective="noisecurve", **kw),
        "noisecurve-convergence": solve_mixing_matrix(
            steps=STEPS, bands=BANDS, objective="noisecurve-convergence", **kw),
        "noisecurve-all-iterates": solve_mixing_matrix(
            steps=STEPS, bands=BANDS, objective="noisecurve-all-iterates", **kw),
    }
    cache = {}

    def sim(name, dense):
        key = (name, dense)
        if key not in cache:  # common random numbers: one seed per noise generator
            cache[key] = _simulate(mats[name], spec, seed=100 + int(dense), dense=dense)
        return cache[key]

    return spec, mats, sim


def _simulate(mixing, spec, *, seed, dense):
    with threadpool_limits(limits=1, user_api="blas"):  # small BLAS calls: threads only contend
        return _simulate_impl(mixing, spec, seed=seed, dense=dense)


def _simulate_impl(mixing, spec, *, seed, dense):
    """Per-trial statistics of noisy GD on L(w) = ½(w−d)ᵀdiag(μ)(w−d).

    Returns a dict of arrays of shape (TRIALS,):
      final_gap: L(w̃_T) − L(w_T);
      mean_gap: (1/T) Σ_{t=1}^{T} [L(w̃_t) − L(w_t)];
      mean_grad: (1/T) Σ_{t=1}^{T} ‖∇L(w̃_t)‖² − k*, k* the noise-free value;
      prefix: Σ_t ‖Σ_{s≤t} z̃_s‖² / p (running-noise-sum variance per coordinate).
    """
    rng = np.random.default_rng(seed)
    mu = spec.expanded()
    w0 = rng.standard_normal(P)
    d = rng.standard_normal(P)
    c_dense = mixing.to_dense()
    out = {k: [] for k in ("final_gap", "mean_gap", "mean_grad", "prefix")}
    chunk = 1000
    for _ in range(TRIALS // chunk):
        z = rng.standard_normal((STEPS, chunk * P))
        if dense:
            zt = np.linalg.solve(c_dense, z)
        else:
            zt = mixing.inverse_apply(z)
        zt = zt.reshape(STEPS, chunk, P)
        w = np.broadcast_to(w0, (chunk, P)).copy()
        wc = w0.copy()
        gaps = np.zeros(chunk)
        grads = np.zeros(chunk)
        k_star = 0.0
        prefix_sum = np.zeros((chunk, P))
        prefix = np.zeros(chunk)
        for t in range(STEPS):
            w = w - ETA * (mu * (w - d) + SIGMA * zt[t])
            wc = wc - ETA * mu * (wc - d)
            loss = 0.5 * np.sum(mu * (w - d) ** 2, axis=1)
            loss_c = 0.5 * np.sum(mu * (wc - d) ** 2)
            gaps += loss - loss_c
            grads += np.sum((mu * (w - d)) ** 2, axis=1)
            k_star += np.sum((mu * (wc - d)) ** 2)
            prefix_sum += zt[t]
            prefix += np.sum(prefix_sum**2, axis=1) / P
        out["final_gap"].append(loss - loss_c)
        out["mean_gap"].append(gaps / STEPS)
        out["mean_grad"].append((grads - k_star) / STEPS)
        out["prefix"].append(prefix)
    return {k: np.concatenate(v) for k, v in out.items()}


def _within(samples, expected, n_se=4.0):
    mean = samples.mean()
    se = samples.std(ddof=1) / np.sqrt(samples.size)
    assert abs(mean - expected) <= n_se * se, (mean, expected, se)
    return mean, se


@pytest.mark.parametrize("dense", [False, True], ids=["inverse_apply", "dense_solve"])
def test_final_gap_matches_eq1_and_noisecurve_is_smallest(setup, dense):
    spec, mats, sim = setup
    sims = {}
    for name in ("dpsgd", "bandmf", "noisecurve"):
        sims[name] = sim(name, dense)
        theory = ETA**2 * SIGMA**2 / 2 * objective_value(
            mats[name], objective="noisecurve", spectrum=spec, learning_rate=ETA)
        _within(sims[name]["final_gap"], theory)
    # NoiseCurve has the smallest simulated gap: paired differences, 4 standard errors.
    for other in ("dpsgd", "bandmf"):
        diff = sims["noisecurve"]["final_gap"] - sims[other]["final_gap"]
        assert diff.mean() + 4 * diff.std(ddof=1) / np.sqrt(diff.size) < 0, other


def test_inverse_apply_equals_dense_solve(setup):
    _, mats, _ = setup
    z = np.random.default_rng(5).standard_normal((STEPS, 7))
    for mixing in mats.values():
        np.testing.assert_allclose(mixing.inverse_apply(z), np.linalg.solve(mixing.to_dense(), z),
                                   rtol=1e-10, atol=1e-10)


def test_convergence_objective_matches_mean_squared_gradient(setup):
    spec, mats, sim = setup
    sims = {name: sim(name, False) for name in ("bandmf", "noisecurve-convergence")}
    for name, result in sims.items():
        theory = ETA**2 * SIGMA**2 * objective_value(
            mats[name], objective="noisecurve-convergence", spectrum=spec, learning_rate=ETA)
        _within(result["mean_grad"], theory)
    diff = sims["noisecurve-convergence"]["mean_grad"] - sims["bandmf"]["mean_grad"]
    assert diff.mean() < 0


def test_printed_eq2_form_disagrees_with_simulation(setup):
    """The paper prints W = 𝔐 ⊙ VᵀM²V; its proof gives exponent 2t−2−j−l per step t.

    The simulation sides with the proof (previous test) and rejects the printed form.
    """
    spec, mats, sim = setup
    mu = spec.eigenvalues
    m = spec.multiplicities
    j = np.arange(STEPS)
    v = (1 - ETA * mu[:, None]) ** (STEPS - j[None, :] - 1)
    printed = (STEPS - np.maximum.outer(j, j)) / STEPS * ((v.T * (m * mu**2)) @ v)
    c_inv = np.linalg.inv(mats["bandmf"].to_dense())
    value = ETA**2 * np.trace(c_inv.T @ printed @ c_inv)
    samples = sim("bandmf", True)["mean_grad"]
    se = samples.std(ddof=1) / np.sqrt(samples.size)
    assert abs(samples.mean() - value) > 10 * se


def test_all_iterates_objective_matches_mean_gap(setup):
    spec, mats, sim = setup
    sims = {name: sim(name, False) for name in ("bandmf", "noisecurve-all-iterates", "dpsgd")}
    for name, result in sims.items():
        theory = ETA**2 * SIGMA**2 / 2 * objective_value(
            mats[name], objective="noisecurve-all-iterates", spectrum=spec, learning_rate=ETA)
        _within(result["mean_gap"], theory)
    diff = sims["noisecurve-all-iterates"]["mean_gap"] - sims["bandmf"]["mean_gap"]
    assert diff.mean() < 0


@pytest.mark.parametrize("lam", [0.3, 0.8])
def test_blend_is_normalised_combination_of_simulated_pieces(setup, lam):
    spec, mats, simulate = setup
    mixing = mats["noisecurve"]
    sim = simulate("noisecurve", False)
    w_curv_trace = objective_value(MixingMatrix.identity(STEPS), objective="noisecurve",
                                   spectrum=spec, learning_rate=ETA)  # C = I gives Tr(W)
    prefix_trace = STEPS * (STEPS + 1) / 2
    # per-trial estimate of (1−λ)·Tr(W_c X⁻¹)/Tr(W_c) + λ·Tr(AᵀA X⁻¹)/Tr(AᵀA)
    samples = ((1 - lam) * sim["final_gap"] * 2 / (ETA**2 * SIGMA**2) / w_curv_trace
               + lam * sim["prefix"] / prefix_trace)
    theory = objective_value(mixing, objective="noisecurve-blend", spectrum=spec, learning_rate=ETA,
                             blend_weight=lam)
    _within(samples, theory)
