"""Accounting for the Toeplitz-family strategies (banded Toeplitz, BLT, BISR).

The sensitivities are checked against dense column sums of C (an independent
computation), the ε against the exact Gaussian mechanism and against a banded C.
"""

import numpy as np
import pytest
from scipy import special

import keras_noisecurve as knc
from keras_noisecurve.mixing.matrix import MixingMatrix
from keras_noisecurve.mixing.strategies import BISRMixing, BLTMixing, ToeplitzMixing
from keras_noisecurve.privacy import events
from keras_noisecurve.privacy.spec import RunSpec

N, B = 3500, 250  # 14 steps per epoch
PER_EPOCH = 14


def _blt(steps):
    return BLTMixing([0.95, 0.6, 0.2], [0.25, 0.15, 0.1], steps=steps)


def _dense_worst(C, k, sep):
    """max over starts p < sep of ‖Σ_{i<k, p+i·sep<T} C[:, p + i·sep]‖ (brute force)."""
    steps = C.shape[0]
    best = 0.0
    for p in range(sep):
        cols = [p + i * sep for i in range(k) if p + i * sep < steps]
        best = max(best, float(np.linalg.norm(C[:, cols].sum(axis=1))))
    return best


def _gaussian_delta(eps, mu):
    return special.ndtr(mu / 2 - eps / mu) - np.exp(eps) * special.ndtr(-mu / 2 - eps / mu)


@pytest.mark.parametrize("make", [_blt, lambda t: BISRMixing.closed_form(steps=t, bands=4)], ids=["blt", "bisr"])
def test_fixed_epoch_sensitivity_is_the_worst_start_of_dense_columns(make):
    steps = 5 * PER_EPOCH
    mixing = make(steps)
    C = mixing.to_dense()
    setup = RunSpec(num_examples=N, batch_size=B, steps=steps, sampling="fixed_epochs", epochs=5,
                           mixing=mixing)
    assert setup.strategy == mixing.kind and setup.bands == 1
    for k in range(1, 6):
        assert setup.fixed_epoch_sensitivity(k) == pytest.approx(_dense_worst(C, k, PER_EPOCH), rel=1e-12)
    # overlapping columns: more than √k, less than k
    assert np.sqrt(5) < setup.fixed_epoch_sensitivity(5) < 5


def test_blt_epsilon_is_the_exact_gaussian_of_its_sensitivity():
    steps = 5 * PER_EPOCH
    mixing = _blt(steps)
    sigma = 7.0
    run = knc.PrivateRun(num_examples=N, batch_size=B, steps=steps, mixing=mixing, noise_multiplier=sigma,
                         delta=1e-5, sampling="fixed_epochs", seed=0)
    mu = _dense_worst(mixing.to_dense(), 5, PER_EPOCH) / sigma
    eps = run.epsilon()
    assert _gaussian_delta(eps, mu) == pytest.approx(1e-5, rel=1e-3)
    # ε after 2 epochs uses Δ_2 (not √2·s)
    mu2 = _dense_worst(mixing.to_dense(), 2, PER_EPOCH) / sigma
    assert _gaussian_delta(run.epsilon(2 * PER_EPOCH), mu2) == pytest.approx(1e-5, rel=1e-3)


def test_calibration_reaches_the_target_for_blt():
    steps = 10 * PER_EPOCH
    run = knc.PrivateRun(num_examples=N, batch_size=B, steps=steps, mixing=_blt(steps), epsilon=2.0, delta=1e-5,
                         sampling="fixed_epochs", seed=0)
    assert run.epsilon() == pytest.approx(2.0, rel=1e-3)
    assert run.epsilon() <= 2.0
    # a larger sensitivity than a banded C over the same epochs: more noise for the same ε
    banded = knc.PrivateRun(num_examples=N, batch_size=B, steps=steps, mixing=None, epsilon=2.0, delta=1e-5,
                            sampling="fixed_epochs", seed=0)
    assert run.noise_multiplier > banded.noise_multiplier


@pytest.mark.parametrize("make", [_blt, lambda t: BISRMixing.closed_form(steps=t, bands=4)], ids=["blt", "bisr"])
def test_cyclic_poisson_is_refused_for_a_c_that_is_not_banded(make):
    with pytest.raises(ValueError, match="cyclic_poisson.*banded C.*fixed_epochs"):
        knc.PrivateRun(num_examples=N, batch_size=B, steps=56, mixing=make(56), noise_multiplier=3.0, delta=1e-5)


def test_bands_is_refused_for_a_c_that_is_not_banded():
    with pytest.raises(ValueError, match="bands=4 does not apply to a blt"):
        RunSpec(num_examples=N, batch_size=B, steps=56, bands=4, sampling="fixed_epochs",
                       epochs=4, mixing=_blt(56))


def test_banded_toeplitz_is_accounted_as_any_banded_c():
    steps = 56
    toeplitz = ToeplitzMixing.normalised([1.0, 0.6, 0.3, 0.1], steps=steps)
    # the same b = 4 with unit columns everywhere (the Toeplitz C's last 3 columns rescaled)
    dense = toeplitz.to_dense()
    unit = MixingMatrix.from_dense(dense / np.linalg.norm(dense, axis=0), bands=4)
    for sampling, kw in (("cyclic_poisson", {}), ("fixed_epochs", {"epochs": 4})):
        a = events.compute_epsilon(noise_multiplier=2.0, delta=1e-5, num_examples=N, batch_size=B, steps=steps,
                                   sampling=sampling, mixing=toeplitz, **kw)
        b = events.compute_epsilon(noise_multiplier=2.0, delta=1e-5, num_examples=N, batch_size=B, steps=steps,
                                   sampling=sampling, mixing=unit, **kw)
        assert a == b


def test_run_config_round_trips_the_strategy_sensitivities():
    steps = 5 * PER_EPOCH
    run = knc.PrivateRun(num_examples=N, batch_size=B, steps=steps, mixing=_blt(steps), noise_multiplier=6.0,
                         delta=1e-5, sampling="fixed_epochs", seed=0)
    assert run.spec.strategy == "blt" and len(run.spec.participation_sensitivities) == 5
    again = knc.PrivateRun.from_config(run.get_config())
    assert again.spec == run.spec
    assert again.epsilon() == run.epsilon()


def test_private_run_config_round_trips_every_strategy():
    steps = 4 * PER_EPOCH
    for mixing in (_blt(steps), BISRMixing.closed_form(steps=steps, bands=3),
                   ToeplitzMixing.normalised([1.0, 0.5], steps=steps)):
        run = knc.PrivateRun(num_examples=N, batch_size=B, steps=steps, mixing=mixing, noise_multiplier=6.0,
                             delta=1e-5, sampling="fixed_epochs", seed=0)
        again = knc.PrivateRun.from_config(run.get_config())
        assert again.mixing == mixing and again.fingerprint() == run.fingerprint()
