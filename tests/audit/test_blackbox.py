"""The black-box (final model, loss-scored mislabelled canaries) audit through the real path."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("kwargs, message", [
    ({"confidence": 1.5}, "confidence must lie strictly between 0 and 1, got 1.5"),
    ({"methods": ("one-run", "best")}, "methods must be a non-empty subset of"),
    ({"methods": ("gaussian-dp",), "sampling": "cyclic_poisson"}, "needs sampling='fixed_epochs'"),
    ({"canary_radius": 0.0}, "canary_radius must be > 0, got 0.0"),
    ({"strategy": "bisr"}, "strategy must be one of"),
])
def test_every_argument_is_checked_before_any_training(kwargs, message, monkeypatch):
    import keras

    def no_training(*args, **kw):
        raise AssertionError("trained before refusing the arguments")

    monkeypatch.setattr(keras.Model, "fit", no_training)
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        audit_blackbox(**kwargs)
