"""EpsilonLedger (the ε table behind ``run.epsilon``): every ε_k against dp_accounting's own
accountant on the same event (the reference, built here independently), the table's shape and
monotonicity, how often the expensive parts run, and the run's argument checks."""

import math
import subprocess
import sys

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_dist

from keras_noisecurve.privacy import accounting as acc
from keras_noisecurve.privacy import ledger as ledger_module
from keras_noisecurve.privacy.ledger import PLD_RTOL, EpsilonLedger

DELTA = 1e-5

# (n, B, T, b, sigma, participation counts to check against the reference)
CYCLIC = [
    (2_000, 40, 60, 1, 1.5, (1, 60)),  # DP-SGD, q = 0.02
    (3_500, 250, 140, 4, 3.6, (1, 12, 35)),  # the demo's DP-BandMF plan, q = 2/7
    (1_000, 20, 50, 3, 1.5, (9, 17)),  # b does not divide T
    (1_000, 50, 100, 4, 20.0, (1, 25)),  # large sigma: a short PLD
]


def _setup(n, B, T, b, sampling="cyclic_poisson", epochs=None, mixing=None):
    return acc.RunSpec(num_examples=n, batch_size=B, steps=T, bands=b, sampling=sampling, epochs=epochs,
                       mixing=mixing)


def _reference(setup, sigma, k, accountant, delta=DELTA, sensitivity=1.0):
    """dp_accounting's accountant on the dominating event of k participations, written out here:
    k self-compositions of PoissonSampled(q = B·b/n, Gaussian(σ/s)) (cyclic Poisson) or one
    Gaussian of noise multiplier σ/(s·√k) (fixed epochs, banded C)."""
    n, B, b = setup.num_examples, setup.batch_size, setup.bands
    if setup.sampling == "cyclic_poisson":
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(B * b / n, dp_accounting.GaussianDpEvent(sigma / sensitivity)), k)
    else:
        event = dp_accounting.GaussianDpEvent(sigma / (sensitivity * math.sqrt(k)))
    if accountant == "pld":
        accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    else:
        accountant = dp_accounting.rdp.RdpAccountant(list(dp_accounting.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS))
    return accountant.compose(event).get_epsilon(delta)


def _ledger(setup, sigma, accountant="pld", delta=DELTA):
    return EpsilonLedger(spec=setup, noise_multiplier=sigma, delta=delta, accountant=accountant)


@pytest.mark.parametrize("n,B,T,b,sigma,ks", CYCLIC)
def test_cyclic_poisson_pld_agrees_with_the_reference(n, B, T, b, sigma, ks):
    setup = _setup(n, B, T, b)
    led = _ledger(setup, sigma, delta=DELTA)
    table = led.epsilons(progress=False)
    assert table.shape == (setup.participations() + 1,)
    for k in ks:
        ref = _reference(setup, sigma, k, "pld")
        # an upper bound as tight as the reference, equal to it up to FFT round-off
        assert abs(table[k] - ref) <= PLD_RTOL * max(1.0, ref), (k, table[k], ref)


@pytest.mark.parametrize("n,B,T,b,sigma,ks", CYCLIC[:3])
def test_cyclic_poisson_rdp_equals_the_reference(n, B, T, b, sigma, ks):
    setup = _setup(n, B, T, b)
    led = _ledger(setup, sigma, "rdp", delta=DELTA)
    table = led.epsilons()
    for k in ks:
        assert table[k] == pytest.approx(_reference(setup, sigma, k, "rdp"), rel=1e-12)


def test_sensitivity_of_a_mixing_matrix_is_used():
    plain = _setup(3_500, 250, 140, 4)
    # A valid artifact has unit columns, so s = 1.3 is set by hand (a RunSpec is frozen):
    # the ledger must divide σ by whatever s the spec carries.
    setup = _setup(3_500, 250, 140, 4)
    object.__setattr__(setup, "sensitivity", 1.3)
    for accountant in ("pld", "rdp"):
        led = _ledger(setup, 3.6, accountant, delta=DELTA)
        ref = _reference(setup, 3.6, 35, accountant, sensitivity=1.3)
        assert abs(led.epsilon() - ref) <= PLD_RTOL * ref
        assert led.epsilon() > _ledger(plain, 3.6, accountant).epsilon()


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_fixed_epochs_agrees_with_the_reference(accountant):
    setup = _setup(1_000, 10, 300, 1, sampling="fixed_epochs", epochs=3)
    led = _ledger(setup, 1.3, accountant, delta=DELTA)
    refs = {k: _reference(setup, 1.3, k, accountant) for k in (1, 2, 3)}
    for steps, k in ((1, 1), (100, 1), (101, 2), (250, 3), (300, 3)):
        ref = refs[k]
        if accountant == "rdp":
            assert led.epsilon(steps) == pytest.approx(ref, rel=1e-12)
        else:
            # the exact Gaussian epsilon; the PLD accountant's discretised value lies just above it
            assert ref - 1e-6 <= led.epsilon(steps) <= ref + 1e-12
    assert led.evaluations == 3


def test_steps_read_the_participation_table():
    setup = _setup(1_000, 20, 50, 3)
    led = _ledger(setup, 1.5, delta=DELTA)
    table = led.epsilons()
    assert table[0] == 0.0 and led.epsilon(0) == 0.0
    assert np.all(np.diff(table) > 0)  # strictly more participations, strictly more epsilon
    per_step = [led.epsilon(t) for t in range(setup.steps + 1)]
    assert per_step == [table[math.ceil(t / 3)] for t in range(setup.steps + 1)]
    assert np.all(np.diff(per_step) >= 0)
    assert led.epsilon() == led.epsilon(50) == table[-1]


def test_each_participation_count_is_computed_once_from_one_pld(monkeypatch):
    builds = []
    original = pld_dist.from_gaussian_mechanism

    def counting(*args, **kwargs):
        builds.append(kwargs)
        return original(*args, **kwargs)

    def no_accountant(*args, **kwargs):
        raise AssertionError("the ledger must not compose a PLD accountant from scratch")

    monkeypatch.setattr(pld_dist, "from_gaussian_mechanism", counting)
    monkeypatch.setattr(ledger_module.events, "epsilon_of_event", no_accountant)
    setup = _setup(3_500, 250, 140, 4)
    led = _ledger(setup, 3.6, delta=DELTA)
    assert led.evaluations == 0 and led.mechanism_builds == 0 and not builds  # the constructor is cheap
    last = led.epsilon(140)
    assert led.evaluations == 1 and len(builds) == 1
    for t in range(141):
        led.epsilon(t)
    table = led.epsilons(progress=False)
    led.epsilons(progress=False)
    assert table[-1] == last
    assert led.evaluations == setup.participations() == 35
    assert led.mechanism_builds == 1 and len(builds) == 1
    assert builds[0]["sampling_prob"] == setup.sampling_probability


def test_vectorised_readout_equals_dp_accounting():
    """The ε(δ) read-out against dp_accounting's own, on the pmfs of a mechanism and of a
    composition, for several δ and starting hints (the hint never changes the answer)."""
    base = pld_dist.from_gaussian_mechanism(standard_deviation=1.0, value_discretization_interval=1e-4,
                                            sampling_prob=0.05)
    for pld in (base, base.self_compose(20)):
        for pmf in ledger_module._dense_pmfs(pld):
            for delta in (1e-3, 1e-5, 1e-9):
                expected = pmf.get_epsilon_for_delta(delta)
                for at_least in (0.0, expected / 2, expected, expected + 1.0):
                    got = ledger_module._epsilon_for_delta(
                        pmf._probs, lower=pmf._lower_loss, infinity_mass=pmf._infinity_mass, delta=delta,
                        discretization=pmf._discretization, at_least=at_least)
                    assert got == pytest.approx(expected, rel=1e-10, abs=1e-12), (delta, at_least)


def test_exact_gaussian_epsilon_is_an_upper_bound():
    for mu in (0.05, 0.7, 3.0, 20.0):
        eps = ledger_module._gaussian_epsilon(mu, DELTA)
        assert ledger_module._gaussian_delta(eps, mu) <= DELTA
        assert ledger_module._gaussian_delta(eps - 1e-9 * max(1.0, eps), mu) > DELTA


def test_run_validates_the_ledger_queries_once():
    from keras_noisecurve.privacy.run import PrivateRun

    run = PrivateRun(num_examples=1_000, batch_size=20, steps=50, noise_multiplier=1.0, delta=DELTA,
                     accountant="rdp", seed=0)
    with pytest.raises(ValueError, match="step must be <= 50, got 51"):
        run.epsilon(51)
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        run.epsilon(-1)
    with pytest.raises(TypeError, match="step must be an integer, got 2.5"):
        run.epsilon(2.5)
    with pytest.raises(ValueError, match="noise_multiplier must be > 0, got 0.0"):
        PrivateRun(num_examples=1_000, batch_size=20, steps=50, noise_multiplier=0.0, delta=DELTA)
    with pytest.raises(ValueError, match="accountant must be one of 'pld', 'rdp'; got 'moments'"):
        PrivateRun(num_examples=1_000, batch_size=20, steps=50, noise_multiplier=1.0, delta=DELTA,
                   accountant="moments")
    assert run.epsilon(50) == run.ledger.epsilon_of_participations(50)


def test_module_does_not_import_tensorflow_or_keras():
    code = ("import sys, keras_noisecurve.privacy.ledger as l, keras_noisecurve.privacy as p; "
            "l.EpsilonLedger(spec=p.RunSpec(num_examples=100, batch_size=10, steps=5), "
            "noise_multiplier=1.0, delta=1e-5, accountant='pld').epsilons(); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
