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
    assert info["probe_covariance_error"] < 6 / math.sqrt(info["probes"])


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
    assert result.info["probe_covariance_error"] > 20 / math.sqrt(result.info["probes"])
