"""PrivateRun: one validated plan; its sampler, ledger, config and fingerprint."""

import numpy as np
import pytest

from keras_noisecurve.mixing import MixingMatrix
import dp_accounting

from keras_noisecurve.privacy import accounting
from keras_noisecurve.privacy.spec import RunSpec
from keras_noisecurve.privacy.run import PrivateRun
from keras_noisecurve.privacy.sampler import BatchSampler, key_from_seed, sampling_plan

_DENSE = np.tril(np.ones((8, 8))) - np.tril(np.ones((8, 8)), -2)  # 2 bands of ones
BANDED = MixingMatrix.from_dense(_DENSE / np.linalg.norm(_DENSE, axis=0), bands=2)


def test_random_access_equals_the_whole_plan_in_any_order():
    key = key_from_seed(5)
    plan = sampling_plan(num_examples=300, batch_size=12, bands=3, steps=40, seed=5)
    spec = RunSpec(num_examples=300, batch_size=12, bands=3, steps=40)
    sampler = BatchSampler(spec=spec, padded_size=plan.padded_size, key=key)
    for t in np.random.default_rng(0).permutation(40):  # resumed anywhere, in any order
        indices, mask, _ = sampler.batch(t)
        np.testing.assert_array_equal(indices, plan.indices[t])
        np.testing.assert_array_equal(mask, plan.mask[t])
    other = BatchSampler(spec=spec, padded_size=plan.padded_size, key=key_from_seed(6))
    assert not all(np.array_equal(other.batch(t)[0], plan.indices[t]) for t in range(40))
    with pytest.raises(ValueError, match="outside the plan of 40 steps"):
        sampler.batch(40)


def test_plan_fields_and_steps_or_epochs():
    run = PrivateRun(num_examples=1000, batch_size=50, epochs=3, noise_multiplier=1.2, delta=1e-6, seed=1)
    assert (run.steps, run.bands, run.steps_per_epoch, run.epochs) == (60, 1, 20, 3)
    assert run.mixing == MixingMatrix.identity(60)
    assert run.spec.sampling_probability == pytest.approx(0.05)
    assert run.padded_batch_size == accounting.padded_batch_size(spec=run.spec)
    fixed = PrivateRun(num_examples=1000, batch_size=50, steps=50, noise_multiplier=1.0, delta=1e-6,
                       sampling="fixed_epochs")
    assert (fixed.spec.epochs, fixed.padded_batch_size, fixed.overflow_probability) == (3, 50, 0.0)


def _dp_accounting_epsilon(*, q, sigma, compositions, delta):
    """dp_accounting's own PLD accountant on ``compositions`` Poisson-subsampled Gaussians."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), compositions)
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    return accountant.compose(event).get_epsilon(delta)


def test_epsilon_of_the_ledger_matches_the_accountant():
    run = PrivateRun(num_examples=200, batch_size=10, steps=8, mixing=BANDED, noise_multiplier=1.0, delta=1e-5)
    for step in (0, 1, 3, 4, 8):
        expected = 0.0 if step == 0 else accounting.compute_epsilon(
            noise_multiplier=1.0, delta=1e-5, num_examples=200, batch_size=10, steps=8, mixing=BANDED,
        ) if step == 8 else _dp_accounting_epsilon(q=run.spec.sampling_probability, sigma=1.0,
                                                    compositions=-(-step // 2), delta=1e-5)
        assert run.epsilon(step) == pytest.approx(expected, rel=1e-3, abs=1e-9)
    assert run.total_delta() > 1e-5


def test_calibration_happens_in_the_plan():
    run = PrivateRun(num_examples=500, batch_size=25, steps=40, epsilon=3.0, delta=1e-5, accountant="rdp")
    assert run.target_epsilon == 3.0
    eps = accounting.compute_epsilon(noise_multiplier=run.noise_multiplier, delta=1e-5, num_examples=500,
                                     batch_size=25, steps=40, accountant="rdp")
    assert 3.0 * (1 - 1e-3) <= eps <= 3.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(steps=None), "exactly one of steps"),
        (dict(epochs=2), "exactly one of steps"),
        (dict(noise_multiplier=None), "exactly one of noise_multiplier"),
        (dict(epsilon=1.0), "exactly one of noise_multiplier"),
        (dict(batch_size=0), "batch_size"),
        (dict(delta=1.5), "delta"),
        (dict(sampling="uniform"), "sampling"),
        (dict(steps=9, mixing=BANDED), "exceeds the mixing matrix"),
        (dict(batch_size=60, mixing=BANDED), "must be < 1"),
        (dict(max_batch_size=20, overflow_probability=1e-9), "not both"),
    ],
)
def test_validation_names_the_argument(kwargs, match):
    base = dict(num_examples=100, batch_size=5, steps=8, noise_multiplier=1.0, delta=1e-5)
    with pytest.raises(ValueError, match=match):
        PrivateRun(**{**base, **kwargs})


def test_config_round_trip_and_fingerprint():
    run = PrivateRun(num_examples=200, batch_size=10, steps=8, mixing=BANDED, noise_multiplier=1.0, delta=1e-5,
                     seed=3)
    again = PrivateRun.from_config(run.get_config())
    assert again.same_plan(run) and again.fingerprint() == run.fingerprint()
    assert "seed" not in run.get_config() and "key" not in str(run.get_config())
    assert not np.array_equal(again.initial_key(), run.initial_key())  # a new secret key
    for change in (dict(noise_multiplier=1.01), dict(batch_size=11), dict(delta=1e-6), dict(steps=7)):
        other = PrivateRun(**{**run.get_config(), **change})
        assert other.fingerprint() != run.fingerprint()


def test_batches_without_an_optimizer_start_at_step_zero_with_the_runs_key():
    run = PrivateRun(num_examples=100, batch_size=5, steps=8, noise_multiplier=1.0, delta=1e-5, seed=9)
    np.testing.assert_array_equal(run.initial_key(), key_from_seed(9))
    np.testing.assert_array_equal(run.sampler().batch(0)[0], BatchSampler(
        spec=RunSpec(num_examples=100, batch_size=5, bands=1, steps=8, sampling="cyclic_poisson"),
        padded_size=run.padded_batch_size, key=key_from_seed(9)).batch(0)[0])
    data = run.dataset(np.zeros((100, 2), np.float32), np.zeros(100, np.int64))
    with pytest.raises(ValueError, match="not created for a PrivateRun"):
        data.batches(object())
    with pytest.raises(TypeError, match="batches\\(optimizer\\)"):
        iter(data)
