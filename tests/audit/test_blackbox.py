"""The black-box (final model, loss-scored mislabelled canaries) audit through the real path."""

from __future__ import annotations

from keras_noisecurve.audit.blackbox import audit_blackbox


def test_blackbox_audit_stays_below_the_claim_and_sees_memorisation_without_privacy():
    private = audit_blackbox(strategy="banded", epsilon=4.0, seed=0)
    assert private.verdict == "consistent" and set(private.bounds) == {"loss/one-run"}
    assert private.info["threat_model"].startswith("black-box")
    # with almost no noise (ε = 100) the included canaries' losses are lower: more than half
    # of the one-run guesses are right and the bound is positive, still far below 100
    leaky = audit_blackbox(strategy="dpsgd", epsilon=100.0, seed=0)
    details = leaky.bounds["loss/one-run"].details
    assert details["correct"] > details["guesses"] / 2
    assert 0 < leaky.epsilon_lower < leaky.claimed_epsilon
