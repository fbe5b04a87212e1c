"""Paper Theorem 3.1 (eq. 1) for banded Toeplitz C: Monte Carlo on a quadratic loss.

Same quadratic and spectrum as ``test_theorem31.py`` (P = 200 eigenvalues 10^U(−2, 0),
η = 0.9, T = 40, b = 6). Noisy gradient descent with ``z̃ = C⁻¹z`` from the strategy's
online recurrence (``ToeplitzMixing.inverse_apply``); the mean final loss gap is compared
with ``(η²σ²/2)·Tr(W X⁻¹)`` from ``toeplitz_loss`` (4 standard errors), and the
curvature-aware Toeplitz C against the Toeplitz DP-BandMF C (paired, common random
numbers). Deterministic part: the ordering of the eq.-1 losses of the four C.
"""

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from keras_noisecurve.mixing import solve_mixing_matrix
from keras_noisecurve.mixing.solve_toeplitz import solve_toeplitz
from keras_noisecurve.mixing.toeplitz_loss import ToeplitzWorkload, toeplitz_loss

# the quadratic, spectrum, step size and trial count of the banded Theorem-3.1 test
from tests.mixing.test_theorem31 import BANDS, ETA, P, SIGMA, STEPS, TRIALS, _spectrum  # noqa: E402,F401


@pytest.fixture(scope="module")
def setup():
    spec = _spectrum()
    kw = dict(spectrum=spec, learning_rate=ETA)
    mats = {"bandmf": solve_toeplitz(steps=STEPS, bands=BANDS),
            "noisecurve": solve_toeplitz(steps=STEPS, bands=BANDS, objective="noisecurve", **kw)}
    return spec, mats


def _final_gaps(mixing, spec, seed):
    """L(w̃_T) − L(w_T) per trial for L(w) = ½(w−d)ᵀdiag(μ)(w−d) (shape (TRIALS,))."""
    rng = np.random.default_rng(seed)
    mu = spec.expanded()
    w0 = rng.standard_normal(P)
    d = rng.standard_normal(P)
    gaps = []
    chunk = 1000
    with threadpool_limits(limits=1, user_api="blas"):
        for _ in range(TRIALS // chunk):
            z = rng.standard_normal((STEPS, chunk * P))
            zt = mixing.inverse_apply(z).reshape(STEPS, chunk, P)
            w = np.broadcast_to(w0, (chunk, P)).copy()
            wc = w0.copy()
            for t in range(STEPS):
                w -= ETA * (mu * (w - d) + SIGMA * zt[t])
                wc -= ETA * mu * (wc - d)
            gaps.append(0.5 * np.sum(mu * (w - d) ** 2, axis=1) - 0.5 * np.sum(mu * (wc - d) ** 2))
    return np.concatenate(gaps)


def test_final_gap_matches_eq1_and_noisecurve_beats_bandmf(setup):
    spec, mats = setup
    workload = ToeplitzWorkload.from_objective(objective="noisecurve", steps=STEPS, spectrum=spec,
                                               learning_rate=ETA)
    sims = {}
    for name, mixing in mats.items():
        sims[name] = _final_gaps(mixing, spec, seed=100)  # common random numbers
        theory = ETA**2 * SIGMA**2 / 2 * toeplitz_loss(mixing.first_column(), workload, gradient=False)[0]
        mean, se = sims[name].mean(), sims[name].std(ddof=1) / np.sqrt(TRIALS)
        assert abs(mean - theory) <= 4 * se, (name, mean, theory, se)
    diff = sims["noisecurve"] - sims["bandmf"]
    assert diff.mean() + 4 * diff.std(ddof=1) / np.sqrt(TRIALS) < 0


def test_eq1_losses_of_toeplitz_and_banded_strategies(setup):
    spec, mats = setup
    kw = dict(spectrum=spec, learning_rate=ETA)
    toeplitz_nc = mats["noisecurve"].metadata
    banded_nc = solve_mixing_matrix(steps=STEPS, bands=BANDS, objective="noisecurve", **kw).metadata
    losses = {"dpsgd": toeplitz_nc["baseline_losses"]["dpsgd"],
              "toeplitz-bandmf": toeplitz_nc["baseline_losses"]["bandmf"], "toeplitz-noisecurve": toeplitz_nc["loss"],
              "banded-bandmf": banded_nc["baseline_losses"]["bandmf"], "banded-noisecurve": banded_nc["loss"]}
    # measured: dpsgd 116.92, toeplitz-bandmf 112.13, toeplitz-noisecurve 75.81, banded-bandmf 60.82,
    # banded-noisecurve 56.83: the curvature objective helps within each family, but a Toeplitz C
    # cannot taper its last columns and loses to both banded C
    assert losses["toeplitz-noisecurve"] < 0.8 * losses["toeplitz-bandmf"]
    assert losses["banded-noisecurve"] < losses["banded-bandmf"] < losses["toeplitz-noisecurve"]
    assert losses["toeplitz-bandmf"] < losses["dpsgd"]
