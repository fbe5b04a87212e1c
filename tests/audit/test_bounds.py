"""The audit statistics against closed forms and simulated mechanisms of known ε (numpy only)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats

from keras_noisecurve.audit import bounds as B

DELTA = 1e-5


def _exact_gaussian_epsilon(mu, delta):
    """Balle & Wang (2018): δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2), solved for ε."""
    def gap(eps):
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2) - delta

    if gap(0.0) <= 0:
        return 0.0
    return optimize.brentq(gap, 0.0, 100.0, xtol=1e-12)


def _gaussian_trials(rng, mu, m):
    inc = rng.random(m) < 0.5
    scores = rng.normal(size=m) + mu * inc
    return scores, inc


# ------------------------------------------------------------- closed forms
def test_clopper_pearson_closed_forms():
    # zero successes: the bound solves (1 − p)^n = α
    assert B.clopper_pearson_upper(successes=0, trials=50, alpha=0.05) == pytest.approx(1 - 0.05 ** (1 / 50))
    # one trial, no success: 1 − α
    assert B.clopper_pearson_upper(successes=0, trials=1, alpha=0.1) == pytest.approx(0.9)
    assert B.clopper_pearson_upper(successes=7, trials=7, alpha=0.05) == 1.0
    # definition: P[Bin(n, bound) <= k] = α
    bound = B.clopper_pearson_upper(successes=12, trials=80, alpha=0.05)
    assert stats.binom.cdf(12, 80, bound) == pytest.approx(0.05, abs=1e-9)


def test_clopper_pearson_covers_at_the_stated_rate():
    rng = np.random.default_rng(1)
    p, n, alpha = 0.1, 40, 0.05
    ks = rng.binomial(n, p, size=4000)
    covered = np.mean([p <= B.clopper_pearson_upper(successes=int(k), trials=n, alpha=alpha) for k in ks])
    assert covered >= 1 - alpha


def test_epsilon_from_rates_closed_form():
    assert B.epsilon_from_rates(fpr=0.1, fnr=0.2, delta=0.0) == pytest.approx(math.log(8.0))
    assert B.epsilon_from_rates(fpr=0.1, fnr=0.2, delta=0.05) == pytest.approx(math.log(0.75 / 0.1))
    assert B.epsilon_from_rates(fpr=0.5, fnr=0.5, delta=0.0) == 0.0  # a coin flip proves nothing


def test_gaussian_epsilon_matches_the_closed_form_and_dp_accounting():
    from dp_accounting.pld import privacy_loss_distribution as pld

    for mu in (0.1, 0.5, 1.0, 2.9):
        got = B.gaussian_epsilon(mu=mu, delta=DELTA)
        assert got == pytest.approx(_exact_gaussian_epsilon(mu, DELTA), abs=1e-8)
        # dp_accounting's PLD of the Gaussian mechanism: its pessimistic value lies above
        upper = pld.from_gaussian_mechanism(standard_deviation=1 / mu).get_epsilon_for_delta(DELTA)
        assert got <= upper + 1e-9 and got == pytest.approx(upper, abs=2e-3)
    for eps in (1.0, 4.0, 16.0):
        mu = B.gaussian_mu_for_epsilon(epsilon=eps, delta=DELTA)
        assert _exact_gaussian_epsilon(mu, DELTA) == pytest.approx(eps, abs=1e-6)


def test_one_run_p_value_closed_forms():
    eps = 1.3
    p = math.exp(eps) / (1 + math.exp(eps))
    # δ = 0: the binomial tail
    assert B.one_run_p_value(canaries=10, guesses=6, correct=5, epsilon=eps, delta=0.0) == pytest.approx(
        stats.binom.sf(4, 6, p))
    # one guess, right: P[Bin(1, p) ≥ 1] + 2mδ·P[Bin(1, p) = 0]
    assert B.one_run_p_value(canaries=4, guesses=1, correct=1, epsilon=eps, delta=1e-3) == pytest.approx(
        p + 2 * 4 * 1e-3 * (1 - p))


def test_one_run_bound_of_randomized_response_is_valid_and_tight():
    """ε-DP randomized response: the guess is right with probability e^ε/(1+e^ε) exactly."""
    eps = 2.0
    rng = np.random.default_rng(3)
    m = 20000
    inc = rng.random(m) < 0.5
    truthful = rng.random(m) < math.exp(eps) / (1 + math.exp(eps))
    scores = np.where(truthful, inc, ~inc).astype(float) + 1e-6 * rng.random(m)  # ties broken at random
    bound = B.one_run_lower_bound(scores=scores, included=inc, delta=0.0, guess_fractions=(1.0,))
    assert 0.85 * eps < bound.epsilon <= eps


# -------------------------------------------------- simulated Gaussian mechanism
@pytest.mark.parametrize("eps", [1.0, 4.0])
def test_bounds_stay_below_the_true_epsilon_over_repeated_seeds(eps):
    mu = B.gaussian_mu_for_epsilon(epsilon=eps, delta=DELTA)
    exceed = {"cp": 0, "bonf": 0, "gdp": 0, "one": 0}
    seeds = 40
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        s, inc = _gaussian_trials(rng, mu, 1000)
        kw = {"scores_in": s[inc], "scores_out": s[~inc], "delta": DELTA}
        exceed["cp"] += B.epsilon_lower_bound(**kw, seed=seed).epsilon > eps
        exceed["bonf"] += B.epsilon_lower_bound(**kw, thresholds="bonferroni", grid=np.linspace(-2, 6, 33)).epsilon > eps
        exceed["gdp"] += B.gaussian_dp_bound(**kw, seed=seed).epsilon > eps
        exceed["one"] += B.one_run_lower_bound(scores=s, included=inc, delta=DELTA).epsilon > eps
    # at 95 % confidence, exceeding the truth in 40 runs happens ≤ 2 times in expectation;
    # 5 would have probability < 0.05 even at the nominal rate (binomial tail)
    assert all(v <= 5 for v in exceed.values()), exceed


def test_bounds_approach_the_true_epsilon_with_many_canaries():
    eps = 4.0
    mu = B.gaussian_mu_for_epsilon(epsilon=eps, delta=DELTA)
    rng = np.random.default_rng(7)
    small_s, small_inc = _gaussian_trials(rng, mu, 2000)
    big_s, big_inc = _gaussian_trials(rng, mu, 200000)
    small = B.gaussian_dp_bound(scores_in=small_s[small_inc], scores_out=small_s[~small_inc], delta=DELTA)
    big = B.gaussian_dp_bound(scores_in=big_s[big_inc], scores_out=big_s[~big_inc], delta=DELTA)
    assert small.epsilon < big.epsilon <= eps
    assert big.epsilon > 0.85 * eps and big.details["mu_lower"] > 0.85 * mu
    cp = B.epsilon_lower_bound(scores_in=big_s[big_inc], scores_out=big_s[~big_inc], delta=DELTA)
    assert 0.6 * eps < cp.epsilon <= eps


def test_no_signal_gives_no_bound():
    rng = np.random.default_rng(11)
    s, inc = _gaussian_trials(rng, 0.0, 4000)
    assert B.epsilon_lower_bound(scores_in=s[inc], scores_out=s[~inc], delta=DELTA).epsilon < 0.3
    assert B.gaussian_dp_bound(scores_in=s[inc], scores_out=s[~inc], delta=DELTA).epsilon < 0.3


# -------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: B.epsilon_lower_bound(scores_in=[], scores_out=[1.0], delta=DELTA), "scores_in must be a non-empty"),
        (lambda: B.epsilon_lower_bound(scores_in=[1.0, 2.0], scores_out=[1.0, np.nan], delta=DELTA),
         "scores_out must be finite"),
        (lambda: B.epsilon_lower_bound(scores_in=[1.0], scores_out=[1.0], delta=DELTA, thresholds="best"),
         "thresholds must be one of"),
        (lambda: B.epsilon_lower_bound(scores_in=[1.0], scores_out=[1.0], delta=DELTA, thresholds="bonferroni"),
         "needs grid="),
        (lambda: B.epsilon_lower_bound(scores_in=[1.0, 2.0], scores_out=[1.0, 3.0], delta=DELTA, confidence=1.0),
         "confidence must lie strictly between 0 and 1"),
        (lambda: B.one_run_lower_bound(scores=[1.0, 2.0], included=[True], delta=DELTA), "included must have"),
        (lambda: B.one_run_p_value(canaries=3, guesses=4, correct=1, epsilon=1.0, delta=0.0), "guesses must be <= 3"),
    ],
)
def test_bad_arguments_give_one_line_errors(call, message):
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert "\n" not in str(info.value)
