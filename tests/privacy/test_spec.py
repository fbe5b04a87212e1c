"""RunSpec: the run described once. Each bad value is refused once, at the boundary, with a
one-line message naming it; the one planning path to ε (``compute_epsilon``) and the one run
path (``run.epsilon``) equal dp-accounting's own accountant on the event written out here."""

import dataclasses
import math

import dp_accounting
import numpy as np
import pytest

import keras_noisecurve as knc
from keras_noisecurve.privacy import events, overflow, run as run_module, sampler
from keras_noisecurve.privacy.events import compute_epsilon, dp_event
from keras_noisecurve.privacy import spec as spec_module
from keras_noisecurve.privacy.spec import RunSpec
from keras_noisecurve.privacy.ledger import PLD_RTOL

GOOD = dict(num_examples=1000, batch_size=20, steps=50)
DELTA = 1e-5


@pytest.mark.parametrize(
    "change,error,message",
    [
        (dict(num_examples=0), ValueError, "num_examples must be >= 1, got 0"),
        (dict(num_examples=2.5), TypeError, "num_examples must be an integer, got 2.5"),
        (dict(batch_size=0), ValueError, "batch_size must be >= 1, got 0"),
        (dict(batch_size=1001), ValueError, "batch_size=1001 cannot exceed num_examples=1000"),
        (dict(steps=0), ValueError, "steps must be >= 1, got 0"),
        (dict(steps="50"), TypeError, "steps must be an integer, got '50'"),
        (dict(steps=None), ValueError, "give steps .* or epochs .*; got neither"),
        (dict(bands=0), ValueError, "bands must be >= 1, got 0"),
        (dict(steps=3, bands=4), ValueError, "bands=4 cannot exceed steps=3"),
        (dict(bands=50), ValueError, r"q = batch_size\*bands/num_examples = 20\*50/1000 = 1 must be < 1"),
        (dict(sampling="shuffle"), ValueError, "sampling must be one of .*; got 'shuffle'"),
        (dict(epochs=2), ValueError, "epochs=2 is only meaningful for sampling='fixed_epochs'"),
        (dict(steps=None, epochs=0), ValueError, "epochs must be >= 1, got 0"),
        (dict(sampling="fixed_epochs", steps=150, epochs=1), ValueError, "steps=150 and epochs=1 are inconsistent"),
        (dict(sampling="fixed_epochs", batch_size=500, bands=3, steps=4), ValueError,
         r"steps_per_epoch = ceil\(num_examples/batch_size\) = 2 >= bands = 3"),
        (dict(mixing="not a matrix"), TypeError, "mixing must be a keras_noisecurve.MixingMatrix .*, got str"),
        (dict(mixing=knc.MixingMatrix.identity(40)), ValueError, "steps=50 exceeds the mixing matrix's 40 steps"),
        (dict(mixing=knc.MixingMatrix.identity(60), bands=2), ValueError,
         "bands=2 does not match the mixing matrix, which has 1 bands"),
    ],
)
def test_each_bad_value_gets_one_line_naming_it(change, error, message):
    with pytest.raises(error, match=message) as info:
        RunSpec(**{**GOOD, **change})
    assert "\n" not in str(info.value)


def test_each_value_is_validated_once_per_private_run(monkeypatch):
    """Building a PrivateRun checks num_examples, batch_size and steps exactly once each,
    however many parts (accounting, padding, sampler, ledger, budget) then use the spec."""
    calls = []
    for module in (spec_module, events, overflow, run_module, sampler):
        if hasattr(module, "check_int"):
            original = module.check_int

            def counting(name, value, *args, _original=original, **kwargs):
                calls.append(name)
                return _original(name, value, *args, **kwargs)

            monkeypatch.setattr(module, "check_int", counting)
    run = knc.PrivateRun(**GOOD, noise_multiplier=1.0, delta=DELTA, accountant="rdp", seed=0)
    run.sampler().batch(3)
    run.epsilon()
    assert calls.count("num_examples") == calls.count("batch_size") == calls.count("steps") == 1
    assert run.sampler().spec is run.spec


def test_the_spec_is_immutable_and_a_value():
    spec = RunSpec(**GOOD, bands=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.steps = 10
    assert spec == RunSpec(**GOOD, bands=2) != RunSpec(**GOOD)
    assert (spec.sampling_probability, spec.compositions, spec.separation, spec.participations()) == (0.04, 25, 2, 25)
    fixed = RunSpec(**{**GOOD, "steps": 120}, sampling="fixed_epochs")  # epochs derived from T
    assert (fixed.epochs, fixed.steps_per_epoch, fixed.separation, fixed.compositions) == (3, 50, 50, 1)
    assert fixed == RunSpec(**{**GOOD, "steps": 120}, sampling="fixed_epochs", epochs=3)


def test_spec_or_keyword_arguments_never_both():
    spec = RunSpec(**GOOD)
    with pytest.raises(ValueError, match="compute_epsilon: give spec= or the run's keyword arguments, not both"):
        compute_epsilon(noise_multiplier=1.0, delta=DELTA, spec=spec, steps=10)
    with pytest.raises(TypeError, match=r"compute_epsilon\(\) got unexpected keyword argument\(s\) num_steps"):
        compute_epsilon(noise_multiplier=1.0, delta=DELTA, num_examples=1000, batch_size=20, num_steps=5)
    with pytest.raises(TypeError, match="calibrate_noise_multiplier: spec must be a keras_noisecurve.RunSpec, got dict"):
        knc.calibrate_noise_multiplier(epsilon=1.0, delta=DELTA, spec=dict(GOOD))
    with pytest.raises(TypeError, match=r"dp_event\(\) needs the run"):
        dp_event(noise_multiplier=1.0)


@pytest.mark.parametrize("sigma", [0.0, -1.0, float("nan")])
def test_sigma_zero_is_no_privacy_and_refused_everywhere(sigma):
    for make in (lambda: compute_epsilon(noise_multiplier=sigma, delta=DELTA, **GOOD),
                 lambda: dp_event(noise_multiplier=sigma, **GOOD),
                 lambda: knc.PrivateRun(**GOOD, noise_multiplier=sigma, delta=DELTA)):
        with pytest.raises(ValueError, match="noise_multiplier must be"):
            make()


def _dp_accounting(event, accountant):
    if accountant == "pld":
        acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    else:
        acc = dp_accounting.rdp.RdpAccountant(list(dp_accounting.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS))
    return acc.compose(event).get_epsilon(DELTA)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_the_one_planning_path_equals_dp_accounting(accountant):
    n, B, T, b, sigma = 2_000, 40, 30, 3, 1.1
    # cyclic Poisson: ⌈T/b⌉ = 10 compositions of the Poisson-subsampled Gaussian, q = B·b/n
    cyclic = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(B * b / n, dp_accounting.GaussianDpEvent(sigma)), 10)
    spec = RunSpec(num_examples=n, batch_size=B, steps=T, bands=b)
    by_spec = compute_epsilon(noise_multiplier=sigma, delta=DELTA, accountant=accountant, spec=spec)
    by_keywords = compute_epsilon(noise_multiplier=sigma, delta=DELTA, accountant=accountant,
                                  num_examples=n, batch_size=B, steps=T, bands=b)
    assert by_spec == by_keywords == _dp_accounting(cyclic, accountant)
    # fixed epochs, k = 3 epochs of ⌈n/B⌉ = 50 steps: one Gaussian of noise multiplier σ/√3
    fixed = dp_accounting.GaussianDpEvent(sigma / math.sqrt(3))
    assert compute_epsilon(noise_multiplier=sigma, delta=DELTA, accountant=accountant, num_examples=n,
                           batch_size=B, epochs=3, sampling="fixed_epochs") == _dp_accounting(fixed, accountant)


def test_the_one_run_path_equals_dp_accounting():
    n, B, T, sigma = 2_000, 40, 30, 1.1
    run = knc.PrivateRun(num_examples=n, batch_size=B, steps=T, noise_multiplier=sigma, delta=DELTA, seed=0)
    for step in (1, 17, 30):
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(B / n, dp_accounting.GaussianDpEvent(sigma)), step)
        reference = _dp_accounting(event, "pld")
        assert abs(run.epsilon(step) - reference) <= PLD_RTOL * reference
    assert run.epsilon(0) == 0.0
    assert run.epsilon() == run.epsilon(T)


def test_padding_and_sampler_take_the_spec():
    spec = RunSpec(num_examples=1000, batch_size=50, steps=60, bands=2)
    P, p = overflow.padding(spec=spec)
    assert (P, p) == (overflow.padded_batch_size(spec=spec), overflow.overflow_probability(spec=spec, padded_size=P))
    run = knc.PrivateRun(num_examples=1000, batch_size=50, steps=60, mixing=_two_bands(60), noise_multiplier=1.0,
                         delta=DELTA, seed=4)
    assert run.spec == spec and run.padded_batch_size == P
    plan = sampler.sampling_plan(spec=spec, seed=4)
    np.testing.assert_array_equal(plan.indices[7], run.sampler().batch(7)[0])
    fixed = RunSpec(num_examples=1000, batch_size=50, steps=60, sampling="fixed_epochs")
    assert overflow.padding(spec=fixed) == (50, 0.0)
    with pytest.raises(ValueError, match="padded_batch_size applies to sampling='cyclic_poisson' only"):
        overflow.padded_batch_size(spec=fixed)
    with pytest.raises(ValueError, match="give max_batch_size or overflow_probability, not both"):
        overflow.padding(spec=spec, max_batch_size=80, overflow_probability=1e-6)


def _two_bands(steps):
    dense = np.tril(np.ones((steps, steps))) - np.tril(np.ones((steps, steps)), -2)
    return knc.MixingMatrix.from_dense(dense / np.linalg.norm(dense, axis=0), bands=2)
