"""The white-box audit through the real training path: correct mechanisms stay below their
claim, deliberately broken ones (tests/audit/broken.py) are caught."""

from __future__ import annotations

import math

import pytest

from keras_noisecurve.audit.whitebox import audit_whitebox

from . import broken

SMALL = {"canaries": 2000, "epochs": 2, "steps_per_epoch": 8}


def _check_probes(result):
    """Under the claim the C-whitened probe noise is i.i.d. N(0, 1)."""
    info = result.info
    count = info["steps"] * info["probes"]
    assert abs(info["probe_whitened_variance"] - 1.0) < 6 * math.sqrt(2.0 / count)
    assert info["noise_matches_claim"] and info["probe_covariance_error"] <= info["probe_threshold"]


@pytest.mark.parametrize("strategy", ["dpsgd", "banded", "toeplitz", "blt"])
def test_a_correct_run_stays_below_its_claim_and_the_audit_is_not_weak(strategy):
    result = audit_whitebox(strategy=strategy, epsilon=4.0, seed=1, **SMALL).result
    assert result.verdict == "consistent", result.to_dict()
    assert result.epsilon_lower > 0.4 * result.claimed_epsilon  # 2000 canaries: ≈ 50-65 % measured
    _check_probes(result)
    assert result.info["claimed_mu"] == pytest.approx(0.925, abs=0.01)  # ε = 4, δ = 1e-5


def test_cyclic_poisson_run_stays_below_its_claim():
    result = audit_whitebox(strategy="banded", epsilon=4.0, sampling="cyclic_poisson", seed=2, **SMALL).result
    assert result.verdict == "consistent", result.to_dict()
    assert set(result.bounds) == {f"{s}/{m}" for s in ("claimed/poisson", "empirical/poisson")
                                  for m in ("clopper-pearson", "one-run")}
    _check_probes(result)


@pytest.mark.parametrize(
    "name, strategy, epsilon, kwargs",
    [
        ("noise scaled by 1/2", "banded", 4.0, {"optimizer_factory": broken.ScaledNoiseOptimizer}),
        ("C instead of C^-1", "banded", 8.0, {"optimizer_factory": broken.ForwardCOptimizer}),
        ("clip skipped", "dpsgd", 4.0, {"model_hook": broken.skip_clipping}),
        ("batches re-used on two workers", "dpsgd", 4.0, {"dataset_factory": broken.duplicated_batches}),
    ],
)
def test_a_broken_mechanism_is_caught(name, strategy, epsilon, kwargs):
    result = audit_whitebox(strategy=strategy, epsilon=epsilon, seed=3, **SMALL, **kwargs).result
    assert result.verdict == "violation", (name, result.epsilon_lower, result.claimed_epsilon, result.best)
    assert result.epsilon_lower > result.claimed_epsilon


def test_different_noise_on_two_replicas_is_caught(monkeypatch):
    broken.two_replica_noise(monkeypatch)
    result = audit_whitebox(strategy="banded", epsilon=8.0, seed=4, **SMALL).result
    assert result.verdict == "violation", (result.epsilon_lower, result.claimed_epsilon, result.best)


def test_independent_noise_with_the_banded_sigma_is_not_a_leak_but_the_probes_see_it():
    """C⁻¹ replaced by I with the σ of the banded C: with fixed epochs both are one Gaussian
    mechanism of sensitivity sqrt(k)/σ, so NO valid audit can exceed the claim; the noise is
    nevertheless not the claimed one, which the probe covariance shows."""
    result = audit_whitebox(strategy="banded", epsilon=4.0, seed=5, optimizer_factory=broken.IndependentNoiseOptimizer,
                            **SMALL).result
    assert result.verdict == "consistent"
    assert not result.info["noise_matches_claim"]
    assert result.info["probe_covariance_error"] > 2 * result.info["probe_threshold"]


@pytest.mark.parametrize("strategy", ["banded", "blt"])
def test_a_resumed_run_is_audited_through_save_and_load(strategy):
    result = audit_whitebox(strategy=strategy, epsilon=4.0, seed=6, resume_at=5, **SMALL).result
    assert result.verdict == "consistent" and result.info["resume_at"] == 5
    assert result.epsilon_lower > 0.4 * result.claimed_epsilon
    _check_probes(result)


def test_a_noise_state_lost_on_resume_is_seen_by_the_probes():
    """The ring of past noise values restarts from zeros after the reload: the run stays about
    as private (no ε violation is expected), but the noise is no longer C⁻¹z."""
    result = audit_whitebox(strategy="banded", epsilon=4.0, seed=6, resume_at=5,
                            model_hook=broken.reset_noise_state_on_resume, **SMALL).result
    assert not result.info["noise_matches_claim"]
    assert result.info["probe_covariance_error"] > 2 * result.info["probe_threshold"]


@pytest.mark.parametrize("strategy", ["dpsgd", "banded"])
def test_correct_runs_stay_below_the_claim_over_repeated_seeds(strategy):
    for seed in range(10, 15):
        result = audit_whitebox(strategy=strategy, epsilon=4.0, seed=seed, **SMALL).result
        assert result.epsilon_lower <= result.claimed_epsilon, (seed, result.epsilon_lower, result.best)
        assert result.info["noise_matches_claim"], seed


def test_bad_arguments_give_one_line_errors():
    with pytest.raises(ValueError, match="needs sampling='fixed_epochs'") as info:
        audit_whitebox(sampling="cyclic_poisson", scorings=["claimed/plan"], **SMALL)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="strategy must be one of"):
        audit_whitebox(strategy="bisr", **SMALL)
