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
    pooled = {f"{s}/{m}" for s in ("claimed/poisson", "empirical/poisson") for m in ("clopper-pearson", "one-run")}
    assert pooled <= set(result.bounds)  # and the same per participation count, "k=2:claimed/poisson/one-run", ...
    assert {key.split(":", 1)[1] for key in result.bounds if key.startswith("k=")} == pooled
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


@pytest.mark.parametrize("kwargs, message", [
    ({"resume_at": 16}, "resume_at must be <= 15, got 16"),
    ({"resume_at": 0}, "resume_at must be >= 1, got 0"),
    ({"confidence": 1.5}, "confidence must lie strictly between 0 and 1, got 1.5"),
    ({"delta": 0.0}, "delta must lie strictly between 0 and 1, got 0.0"),
    ({"epsilon": -1.0}, "epsilon must be > 0, got -1.0"),
    ({"l2_norm_clip": 5e4}, "l2_norm_clip=50000 is too large for the canary target 10000"),
    ({"thresholds": "best"}, "thresholds must be one of 'grid', 'split'; got 'best'"),
    ({"model_hook": 3}, "model_hook must be a callable or None, got 3"),
    ({"probes": 10}, "probes must be >= 17, got 10"),
])
def test_every_argument_is_checked_before_any_training(kwargs, message, monkeypatch):
    """Each refusal comes before the first training step (fit is never reached)."""
    import keras

    def no_training(*args, **kw):
        raise AssertionError("trained before refusing the arguments")

    monkeypatch.setattr(keras.Model, "fit", no_training)
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        audit_whitebox(**{**SMALL, **kwargs})
    assert "\n" not in str(info.value)


def test_the_largest_allowed_clip_follows_the_canaries_reach():
    """Just below the largest ζ the audit starts; the bound is the formula's (independent numbers)."""
    import numpy as np
    from scipy import stats

    import keras_noisecurve as knc
    from keras_noisecurve.audit.whitebox import CANARY_TARGET, check_canary_headroom

    run = knc.PrivateRun(num_examples=64, batch_size=8, steps=16, epsilon=4.0, delta=1e-5, sampling="fixed_epochs",
                         seed=0)  # C = I: cumulative sums of z have std sqrt(s), largest sqrt(16) = 4
    level = stats.norm.isf(1e-6 / (10 * 16))
    largest = CANARY_TARGET / (1 + 0.5 / 8 * (2 + run.noise_multiplier * level * 4.0))
    check_canary_headroom(run=run, learning_rate=0.5, l2_norm_clip=0.999 * largest, canaries=10)
    with pytest.raises(ValueError, match=f"use l2_norm_clip <= {largest:.4g}"):
        check_canary_headroom(run=run, learning_rate=0.5, l2_norm_clip=1.001 * largest, canaries=10)
    assert np.isfinite(largest)


def test_a_sampler_that_repeats_examples_is_refused_before_scoring(monkeypatch):
    """The issue's case: batches overlapping by half put canaries in more steps than the accountant
    assumed; pooled scores would blur it, so the audit refuses to score the run."""
    broken.overlapping_fixed_epochs(monkeypatch)
    with pytest.raises(ValueError, match="the audit refuses to score them. sampling: FAIL"):
        audit_whitebox(strategy="banded", epsilon=4.0, seed=3, **SMALL)


@pytest.mark.slow  # two audits: about 20 s on 2 cores
def test_bounds_are_reported_per_participation_count():
    fixed = audit_whitebox(strategy="dpsgd", epsilon=4.0, seed=1, **SMALL).result
    assert list(fixed.info["bounds_by_participations"]) == ["2"]  # every canary takes part twice
    assert fixed.info["bounds_by_participations"]["2"]["epsilon_lower"] == fixed.epsilon_lower
    poisson = audit_whitebox(strategy="banded", epsilon=4.0, sampling="cyclic_poisson", seed=2, **SMALL).result
    groups = poisson.info["bounds_by_participations"]
    assert len(groups) >= 2 and sum(g["canaries"] for g in groups.values()) <= 2000
    assert poisson.epsilon_lower == max([poisson.info["pooled_bound"]["epsilon_lower"]]
                                        + [g["epsilon_lower"] for g in groups.values()])
    assert poisson.confidence == 0.95 and poisson.verdict == "consistent"
