"""Empirical ε lower bounds from canary scores (numpy/scipy only; no TensorFlow).

An audit plants m canaries, each included in training with probability ½, and gives
every canary a score (higher = "looks included"). If the training run is (ε, δ)-DP,
no test of "included?" can do better than the (ε, δ) trade-off curve: for the test
"included iff score ≥ τ", with FPR = P[score ≥ τ | out] and FNR = P[score < τ | in],

    FPR + e^ε · FNR ≥ 1 − δ    and    FNR + e^ε · FPR ≥ 1 − δ                (1)

(Kairouz, Oh & Viswanath 2015), so

    ε ≥ max( ln((1 − δ − FPR) / FNR), ln((1 − δ − FNR) / FPR) ).            (2)

Three estimators, all one-sided at a stated confidence 1 − α:

- :func:`epsilon_lower_bound` — Clopper–Pearson (exact binomial) upper confidence bounds
  on FPR and FNR plugged into (2). The canaries' scores must be independent trials
  given their inclusion bits (true for the white-box gradient canaries of
  :mod:`keras_noisecurve.audit.whitebox`, which live on disjoint coordinates with
  independent noise; for canaries that share a model it is an assumption). The
  threshold τ must not be chosen from the same data that estimates the rates:
  ``thresholds="split"`` chooses τ (and the direction) on a random part of the canaries
  and evaluates it on the rest; ``thresholds="bonferroni"`` evaluates every τ of a grid
  FIXED IN ADVANCE with confidence α/(2K) per rate (K thresholds, two rates each), so
  all 2K bounds hold at once and the best may be reported.
- :func:`one_run_lower_bound` — Steinke, Nasr & Jagielski (2023), "Privacy auditing with
  one (1) training run", Theorem 3.3 (with δ): needs no independence between canaries,
  only that inclusion bits are i.i.d. fair coins. Guess "in" for the k highest scores and
  "out" for the k lowest (r = 2k guesses, v correct). If the run is (ε, δ)-DP,

      P[V ≥ v] ≤ P[Bin(r, p_ε) ≥ v] + 2mδ · max_{1≤i≤v} P[v − i ≤ Bin(r, p_ε) < v] / i,
      p_ε = e^ε / (1 + e^ε),                                                   (3)

  and the bound is the largest ε whose right-hand side is ≤ α (Bonferroni over a fixed
  list of k).
- :func:`gaussian_dp_bound` — the Gaussian-DP reading (Dong, Roth & Su 2022): a μ-GDP
  mechanism has, at every threshold, Φ⁻¹(1 − FPR) − Φ⁻¹(FNR) ≤ μ; with Clopper–Pearson
  bounds this gives a lower confidence bound on μ, converted to ε at δ by the
  Gaussian mechanism's curve (``dp_accounting``'s PLD of a Gaussian of standard
  deviation 1/μ, optimistic rounding so the conversion never overstates ε). It is a
  valid bound on the claim whenever the claim is itself a Gaussian mechanism (DP-SGD and
  every strategy with ``sampling="fixed_epochs"``); otherwise it is an estimate.

All inputs are one-dimensional score arrays; ``confidence`` is 1 − α (default 0.95).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np
from scipy import optimize, special, stats

from keras_noisecurve._validation import check_choice, check_float, check_int

__all__ = [
    "EpsilonBound",
    "THRESHOLD_STRATEGIES",
    "clopper_pearson_upper",
    "epsilon_from_rates",
    "epsilon_lower_bound",
    "gaussian_dp_bound",
    "gaussian_epsilon",
    "gaussian_mu_for_epsilon",
    "one_run_lower_bound",
    "one_run_p_value",
]

THRESHOLD_STRATEGIES = ("split", "bonferroni")


@dataclasses.dataclass(frozen=True)
class EpsilonBound:
    """An empirical ε lower bound.

    Attributes:
      epsilon: the lower bound (≥ 0): with probability ≥ ``confidence`` over the
        training run's randomness, the run is NOT (ε', δ)-DP for any ε' < epsilon.
      confidence: 1 − α.
      delta: the δ the bound is stated at.
      method: ``"clopper-pearson/split"``, ``"clopper-pearson/bonferroni"``,
        ``"one-run"`` or ``"gaussian-dp"``.
      details: what produced it (threshold, counts, rates, μ, …), JSON-able.
    """

    epsilon: float
    confidence: float
    delta: float
    method: str
    details: dict = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------- validation
def _scores(name, value) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array of scores, got shape {arr.shape}.")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite, got {int(np.sum(~np.isfinite(arr)))} non-finite values.")
    return arr


def _confidence(confidence) -> float:
    return check_float("confidence", confidence, open_unit=True)


def _delta(delta) -> float:
    delta = check_float("delta", delta, nonnegative=True)
    if delta >= 1:
        raise ValueError(f"delta must be in [0, 1), got {delta}.")
    return delta


# ------------------------------------------------------------ building blocks
def clopper_pearson_upper(*, successes: int, trials: int, alpha: float) -> float:
    """One-sided Clopper–Pearson upper confidence bound on a binomial rate.

    P[p ≤ bound] ≥ 1 − α for X ~ Bin(trials, p): the bound is the p solving
    P[Bin(trials, p) ≤ successes] = α, i.e. the (1 − α) quantile of
    Beta(successes + 1, trials − successes); 1 when successes == trials.
    """
    k = check_int("successes", successes, minimum=0)
    n = check_int("trials", trials, minimum=1)
    if k > n:
        raise ValueError(f"successes must be <= trials, got successes={k}, trials={n}.")
    alpha = check_float("alpha", alpha, open_unit=True)
    if k == n:
        return 1.0
    return float(stats.beta.ppf(1.0 - alpha, k + 1, n - k))


def epsilon_from_rates(*, fpr: float, fnr: float, delta: float) -> float:
    """ε ≥ max(ln((1−δ−FPR)/FNR), ln((1−δ−FNR)/FPR)), clipped at 0 (eq. 2)."""
    best = 0.0
    for a, b in ((fpr, fnr), (fnr, fpr)):
        if b > 0 and 1.0 - delta - a > b:
            best = max(best, math.log((1.0 - delta - a) / b))
    return best


def _counts(scores_in, scores_out, thresholds):
    """(false positives, false negatives) of "in iff score ≥ τ" for every τ (int arrays)."""
    taus = np.asarray(thresholds, dtype=np.float64)
    fp = scores_out.size - np.searchsorted(np.sort(scores_out), taus, side="left")
    fn = np.searchsorted(np.sort(scores_in), taus, side="left")
    return fp.astype(np.int64), fn.astype(np.int64)


def _cp_upper(k, n, alpha):
    """Vectorised :func:`clopper_pearson_upper` (k an int array, n an int)."""
    k = np.asarray(k)
    out = np.ones(k.shape, dtype=np.float64)
    below = k < n
    out[below] = stats.beta.ppf(1.0 - alpha, k[below] + 1, n - k[below])
    return out


def _eps_vec(fpr_u, fnr_u, delta):
    """Vectorised :func:`epsilon_from_rates`."""
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.log(np.maximum(1.0 - delta - fpr_u, 0.0) / fnr_u)
        b = np.log(np.maximum(1.0 - delta - fnr_u, 0.0) / fpr_u)
    return np.maximum(0.0, np.nan_to_num(np.maximum(a, b), nan=0.0, neginf=0.0))


def _bounds(scores_in, scores_out, thresholds, alpha_each, delta):
    """ε bound (eq. 2) at every threshold, with the counts and Clopper–Pearson rates."""
    fp, fn = _counts(scores_in, scores_out, thresholds)
    fpr_u = _cp_upper(fp, scores_out.size, alpha_each)
    fnr_u = _cp_upper(fn, scores_in.size, alpha_each)
    return _eps_vec(fpr_u, fnr_u, delta), fp, fn, fpr_u, fnr_u


def _best(scores_in, scores_out, thresholds, alpha_each, delta):
    """(ε, details) of the threshold with the largest bound."""
    taus = np.asarray(thresholds, dtype=np.float64)
    eps, fp, fn, fpr_u, fnr_u = _bounds(scores_in, scores_out, taus, alpha_each, delta)
    i = int(np.argmax(eps))
    return float(eps[i]), {"threshold": float(taus[i]), "false_positives": int(fp[i]),
                           "false_negatives": int(fn[i]), "trials_out": int(scores_out.size),
                           "trials_in": int(scores_in.size), "fpr_upper": float(fpr_u[i]),
                           "fnr_upper": float(fnr_u[i])}


def _candidate_thresholds(scores_in, scores_out):
    """Every cut that changes the counts: the distinct scores (and +inf)."""
    return np.unique(np.concatenate([scores_in, scores_out, [np.inf]]))


# --------------------------------------------------------- Clopper–Pearson
def epsilon_lower_bound(
    *,
    scores_in,
    scores_out,
    delta: float,
    confidence: float = 0.95,
    thresholds: str = "split",
    grid: Optional[Sequence[float]] = None,
    split_fraction: float = 0.5,
    seed: int = 0,
) -> EpsilonBound:
    """ε lower bound from Clopper–Pearson bounds on FPR and FNR at a threshold (eq. 2).

    Args:
      scores_in: (m_in,) scores of the canaries that were included.
      scores_out: (m_out,) scores of the canaries that were left out.
      delta: δ of the claim, in [0, 1).
      confidence: 1 − α in (0, 1).
      thresholds: ``"split"``: a random ``split_fraction`` of each group picks the
        threshold with the best bound there (evaluated at the nominal α); the rest
        evaluates that one threshold at α/2 per rate. ``"bonferroni"``: every
        threshold of ``grid`` (required, fixed before seeing the scores) at α/(2K).
      grid: the K thresholds for ``"bonferroni"``.
      split_fraction: fraction in (0, 1) used to pick the threshold (``"split"``).
      seed: seed of the random split (public: it is not part of the trained run).

    Returns:
      an :class:`EpsilonBound`; its ``details`` hold the chosen threshold, counts and rates.
    """
    s_in = _scores("scores_in", scores_in)
    s_out = _scores("scores_out", scores_out)
    delta = _delta(delta)
    conf = _confidence(confidence)
    alpha = 1.0 - conf
    check_choice("thresholds", thresholds, THRESHOLD_STRATEGIES)
    if thresholds == "bonferroni":
        if grid is None:
            raise ValueError("thresholds='bonferroni' needs grid=, thresholds fixed before seeing the scores.")
        grid = _scores("grid", grid)
        best_eps, best = _best(s_in, s_out, grid, alpha / (2 * grid.size), delta)
        best.update(grid_size=int(grid.size))
        return EpsilonBound(best_eps, conf, delta, "clopper-pearson/bonferroni", best)
    fraction = check_float("split_fraction", split_fraction, open_unit=True)
    if s_in.size < 2 or s_out.size < 2:
        raise ValueError(
            f"thresholds='split' needs at least 2 scores in each group, got {s_in.size} in and {s_out.size} out."
        )
    rng = np.random.default_rng(check_int("seed", seed, minimum=0))
    pick_in, eval_in = _split(rng, s_in, fraction)
    pick_out, eval_out = _split(rng, s_out, fraction)
    tau = _best(pick_in, pick_out, _candidate_thresholds(pick_in, pick_out), alpha / 2, delta)[1]["threshold"]
    eps, info = _best(eval_in, eval_out, [tau], alpha / 2, delta)
    info.update(split_fraction=fraction, seed=int(seed))
    return EpsilonBound(eps, conf, delta, "clopper-pearson/split", info)


def _split(rng, scores, fraction):
    perm = rng.permutation(scores.size)
    cut = min(max(1, int(round(fraction * scores.size))), scores.size - 1)
    return scores[perm[:cut]], scores[perm[cut:]]


# ----------------------------------------------------------------- one run
def one_run_p_value(*, canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """Right-hand side of eq. (3): an upper bound on P[V ≥ correct] under (ε, δ)-DP.

    Args:
      canaries: m, the number of canaries (each included with probability ½).
      guesses: r ≤ m, the number of non-abstaining guesses.
      correct: v ≤ r, how many of them were right.
      epsilon, delta: the null hypothesis (ε ≥ 0, δ ∈ [0, 1)).
    """
    m = check_int("canaries", canaries, minimum=1)
    r = check_int("guesses", guesses, minimum=0, maximum=m)
    v = check_int("correct", correct, minimum=0, maximum=r)
    eps = check_float("epsilon", epsilon, nonnegative=True)
    delta = _delta(delta)
    p = float(special.expit(eps))
    tail = float(stats.binom.sf(v - 1, r, p))  # P[Bin ≥ v]
    if delta == 0 or v == 0:
        return min(1.0, tail)
    i = np.arange(1, v + 1)
    window = np.cumsum(stats.binom.pmf(v - i, r, p))  # P[v − i ≤ Bin < v]
    return min(1.0, tail + 2 * m * delta * float(np.max(window / i)))


def one_run_lower_bound(
    *,
    scores,
    included,
    delta: float,
    confidence: float = 0.95,
    guess_fractions: Sequence[float] = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
) -> EpsilonBound:
    """The one-run ε lower bound (Steinke, Nasr & Jagielski 2023; eq. 3).

    Args:
      scores: (m,) one score per canary.
      included: (m,) booleans, whether each canary was included (fair coins).
      delta: δ of the claim.
      confidence: 1 − α; each of the L guess counts is tested at α/L.
      guess_fractions: the fractions r/m of canaries to guess on, fixed in advance;
        for r the auditor guesses "in" for the ⌊r/2⌋ highest and "out" for the
        ⌈r/2⌉ lowest scores.
    """
    s = _scores("scores", scores)
    inc = np.asarray(included)
    if inc.shape != s.shape:
        raise ValueError(f"included must have the shape of scores {s.shape}, got {inc.shape}.")
    inc = inc.astype(bool)
    delta = _delta(delta)
    conf = _confidence(confidence)
    fractions = [check_float("guess_fractions", f, positive=True) for f in guess_fractions]
    if any(f > 1 for f in fractions) or not fractions:
        raise ValueError(f"guess_fractions must be a non-empty list in (0, 1], got {list(guess_fractions)}.")
    alpha = (1.0 - conf) / len(fractions)
    m = s.size
    order = np.argsort(s, kind="stable")
    best_eps, best = 0.0, None
    for f in fractions:
        r = max(2, int(round(f * m)))
        r = min(r, m)
        k_out = (r + 1) // 2
        k_in = r - k_out
        correct = int(np.sum(inc[order[m - k_in:]])) + int(np.sum(~inc[order[:k_out]]))
        eps = _largest_epsilon(m, r, correct, delta, alpha)
        info = {"guesses": r, "correct": correct, "canaries": m, "alpha_each": alpha}
        if best is None or eps > best_eps:
            best_eps, best = eps, info
    return EpsilonBound(best_eps, conf, delta, "one-run", best)


def _largest_epsilon(m, r, v, delta, alpha) -> float:
    """The largest ε whose p-value (eq. 3) is ≤ α (0 if even ε = 0 explains v)."""
    def p(e):
        return one_run_p_value(canaries=m, guesses=r, correct=v, epsilon=e, delta=delta)

    if p(0.0) > alpha:
        return 0.0
    hi = 1.0
    while p(hi) <= alpha and hi < 64:
        hi *= 2
    if p(hi) <= alpha:
        return hi
    return float(optimize.brentq(lambda e: p(e) - alpha, 0.0, hi, xtol=1e-6))


# --------------------------------------------------------------- Gaussian DP
def _gaussian_delta(eps: float, mu: float) -> float:
    """δ(ε) of a μ-GDP mechanism: Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2) (Balle & Wang 2018), the
    second term in log space so that large ε neither overflows nor loses the difference."""
    first = special.ndtr(-eps / mu + mu / 2)
    second = math.exp(eps + special.log_ndtr(-eps / mu - mu / 2))
    return float(first - second)


def gaussian_epsilon(*, mu: float, delta: float) -> float:
    """ε at δ of a μ-GDP mechanism (a Gaussian of sensitivity 1 and standard deviation 1/μ):
    the exact root of δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Balle & Wang 2018, the
    curve ``dp_accounting``'s Gaussian PLD discretises; tests/audit compare the two); 0 for
    μ = 0 or when δ(0) ≤ δ."""
    mu = check_float("mu", mu, nonnegative=True)
    delta = check_float("delta", delta, open_unit=True)
    if mu == 0 or _gaussian_delta(0.0, mu) <= delta:
        return 0.0
    hi = 1.0
    while _gaussian_delta(hi, mu) > delta:
        hi *= 2
    return float(optimize.brentq(lambda e: _gaussian_delta(e, mu) - delta, 0.0, hi, xtol=1e-10))


def gaussian_mu_for_epsilon(*, epsilon: float, delta: float) -> float:
    """The μ whose Gaussian mechanism is exactly (ε, δ)-DP (the inverse of :func:`gaussian_epsilon`)."""
    eps = check_float("epsilon", epsilon, positive=True)
    delta = check_float("delta", delta, open_unit=True)
    hi = 1.0
    while _gaussian_delta(eps, hi) < delta:
        hi *= 2
    return float(optimize.brentq(lambda mu: _gaussian_delta(eps, mu) - delta, 1e-9, hi, xtol=1e-12))


def gaussian_dp_bound(
    *,
    scores_in,
    scores_out,
    delta: float,
    confidence: float = 0.95,
    grid: Optional[Sequence[float]] = None,
    split_fraction: float = 0.5,
    seed: int = 0,
) -> EpsilonBound:
    """Lower confidence bound on μ (Gaussian DP) and its ε at δ.

    At a threshold τ, any μ-GDP mechanism satisfies μ ≥ Φ⁻¹(1 − FPR) − Φ⁻¹(FNR); with
    Clopper–Pearson upper bounds on FPR and FNR (α/2 each) the right-hand side is a
    lower confidence bound on μ. The threshold is picked on a random ``split_fraction``
    of the canaries (by the point estimate of μ there) and evaluated on the rest; with
    ``grid`` (fixed in advance) every threshold is evaluated at α/(2K) instead.

    Returns:
      an :class:`EpsilonBound` with ``epsilon = gaussian_epsilon(mu=μ_lower, delta)``;
      ``details`` hold ``mu_lower``, ``mu_point`` (the same formula at the empirical
      rates of the evaluation part) and the counts.
    """
    s_in = _scores("scores_in", scores_in)
    s_out = _scores("scores_out", scores_out)
    delta = check_float("delta", delta, open_unit=True)
    conf = _confidence(confidence)
    alpha = 1.0 - conf
    if grid is not None:
        grid = _scores("grid", grid)
        candidates, eval_in, eval_out, alpha_each = grid, s_in, s_out, alpha / (2 * grid.size)
    else:
        fraction = check_float("split_fraction", split_fraction, open_unit=True)
        if s_in.size < 2 or s_out.size < 2:
            raise ValueError(f"need at least 2 scores in each group, got {s_in.size} in and {s_out.size} out.")
        rng = np.random.default_rng(check_int("seed", seed, minimum=0))
        pick_in, eval_in = _split(rng, s_in, fraction)
        pick_out, eval_out = _split(rng, s_out, fraction)
        taus = _candidate_thresholds(pick_in, pick_out)
        mus = _mu_vec(pick_in, pick_out, taus, alpha / 2)[0]
        candidates, alpha_each = taus[[int(np.argmax(mus))]], alpha / 2
    mus, fp, fn, fpr_u, fnr_u = _mu_vec(eval_in, eval_out, candidates, alpha_each)
    i = int(np.argmax(mus))
    fpr = (fp[i] + 0.5) / (eval_out.size + 1)  # point estimate, continuity-corrected (finite at 0)
    fnr = (fn[i] + 0.5) / (eval_in.size + 1)
    info = {"threshold": float(candidates[i]), "false_positives": int(fp[i]), "false_negatives": int(fn[i]),
            "trials_out": int(eval_out.size), "trials_in": int(eval_in.size), "fpr_upper": float(fpr_u[i]),
            "fnr_upper": float(fnr_u[i]), "mu_point": float(stats.norm.isf(fpr) - stats.norm.ppf(fnr))}
    mu_lower = float(mus[i])
    mu_lower = max(0.0, mu_lower)
    info["mu_lower"] = mu_lower
    info["epsilon_point"] = gaussian_epsilon(mu=max(0.0, info["mu_point"]), delta=delta)
    return EpsilonBound(gaussian_epsilon(mu=mu_lower, delta=delta), conf, delta, "gaussian-dp", info)


def _mu_vec(s_in, s_out, taus, alpha_each):
    """μ lower bound Φ⁻¹(1 − FPR_u) − Φ⁻¹(FNR_u) at every threshold (−inf where a rate bound is 1)."""
    fp, fn = _counts(s_in, s_out, taus)
    fpr_u = _cp_upper(fp, s_out.size, alpha_each)
    fnr_u = _cp_upper(fn, s_in.size, alpha_each)
    with np.errstate(divide="ignore", invalid="ignore"):
        mus = stats.norm.isf(fpr_u) - stats.norm.ppf(fnr_u)
    mus = np.where((fpr_u < 1) & (fnr_u < 1), mus, -np.inf)
    return mus, fp, fn, fpr_u, fnr_u
