"""One audit's verdict from several scores and estimators, at one overall confidence (numpy only).

An audit may score its canaries in several ways (:mod:`keras_noisecurve.audit.scoring`)
and apply several estimators (:mod:`keras_noisecurve.audit.bounds`) to each. Reporting
the largest of K bounds is valid at confidence 1 − α when each is computed at
1 − α/K (union bound): that is what :func:`summarize` does.

Verdict: ``"violation"`` when the combined lower bound exceeds the claimed ε (with
probability ≤ α this happens to a run that keeps its claim), otherwise
``"consistent"`` — which proves nothing by itself: an audit bounds ε from below only.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from keras_noisecurve._validation import check_float
from keras_noisecurve.audit import bounds

__all__ = ["AuditResult", "METHODS", "summarize"]

#: estimators: "gaussian-dp" is applied only when the claim is a Gaussian mechanism
METHODS = ("clopper-pearson", "one-run", "gaussian-dp")


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """The outcome of one audit.

    Attributes:
      claimed_epsilon: ε of the accountant for the audited run, at ``delta``.
      delta: δ.
      confidence: the overall confidence 1 − α of ``epsilon_lower``.
      epsilon_lower: the largest bound of ``bounds`` (each at 1 − α/K).
      best: ``"score/method"`` that gave it.
      bounds: ``{"score/method": EpsilonBound}``, every bound computed.
      verdict: ``"violation"`` (epsilon_lower > claimed_epsilon) or ``"consistent"``.
      canaries_in, canaries_out: the numbers of included and excluded canaries.
      info: the audited run's description (strategy, σ, T, …), JSON-able.
    """

    claimed_epsilon: float
    delta: float
    confidence: float
    epsilon_lower: float
    best: str
    bounds: dict
    verdict: str
    canaries_in: int
    canaries_out: int
    info: dict = dataclasses.field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """epsilon_lower / claimed_epsilon: how much of the claim the audit reaches."""
        return self.epsilon_lower / self.claimed_epsilon if self.claimed_epsilon > 0 else float("inf")

    def to_dict(self) -> dict:
        """JSON-able form (bounds as plain dicts)."""
        out = dataclasses.asdict(self)
        out["bounds"] = {k: dataclasses.asdict(v) for k, v in self.bounds.items()}
        out["ratio"] = self.ratio
        return out


def summarize(
    *,
    scores: Mapping[str, np.ndarray],
    included,
    claimed_epsilon: float,
    delta: float,
    confidence: float = 0.95,
    gaussian_claim: bool = False,
    methods: Sequence[str] = METHODS,
    grid=None,
    seed: int = 0,
    info: Mapping | None = None,
) -> AuditResult:
    """Every (score, method) bound at 1 − α/K and the verdict of their maximum.

    Args:
      scores: ``{name: (m,) scores}``, larger = more likely included.
      included: (m,) booleans, the canaries' (fair-coin) inclusion bits.
      claimed_epsilon: the accountant's ε at ``delta``.
      delta: δ in (0, 1).
      confidence: overall 1 − α.
      gaussian_claim: whether the claim is a Gaussian mechanism (fixed-epochs runs),
        so that "gaussian-dp" is a valid bound; otherwise that method is skipped.
      methods: estimators from ``METHODS``.
      grid: thresholds fixed in advance (e.g. of a log-likelihood-ratio score) for the
        Clopper–Pearson and Gaussian-DP estimators (Bonferroni over the grid); ``None``:
        the threshold is chosen on a random half of the canaries (split).
      seed: seed of the Clopper–Pearson / Gaussian-DP threshold split.
      info: description of the audited run, stored in the result.
    """
    claimed = check_float("claimed_epsilon", claimed_epsilon, positive=True)
    delta = check_float("delta", delta, open_unit=True)
    conf = check_float("confidence", confidence, open_unit=True)
    inc = np.asarray(included).astype(bool)
    if not scores:
        raise ValueError("scores must hold at least one score array.")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"methods must be a non-empty subset of {METHODS}, got {list(methods)}.")
    used = [m for m in methods if m != "gaussian-dp" or gaussian_claim]
    if not used:
        raise ValueError("'gaussian-dp' alone needs gaussian_claim=True (a claim that is a Gaussian mechanism).")
    k = len(scores) * len(used)
    each = 1.0 - (1.0 - conf) / k
    results = {}
    for name, s in scores.items():
        s = np.asarray(s, dtype=np.float64)
        if s.shape != inc.shape:
            raise ValueError(f"scores[{name!r}] must have shape {inc.shape}, got {s.shape}.")
        for method in used:
            if method == "clopper-pearson":
                b = bounds.epsilon_lower_bound(scores_in=s[inc], scores_out=s[~inc], delta=delta, confidence=each,
                                               seed=seed, thresholds="split" if grid is None else "bonferroni",
                                               grid=grid)
            elif method == "one-run":
                b = bounds.one_run_lower_bound(scores=s, included=inc, delta=delta, confidence=each)
            else:
                b = bounds.gaussian_dp_bound(scores_in=s[inc], scores_out=s[~inc], delta=delta, confidence=each,
                                             seed=seed, grid=grid)
            results[f"{name}/{method}"] = b
    best = max(results, key=lambda key: results[key].epsilon)
    lower = results[best].epsilon
    return AuditResult(
        claimed_epsilon=claimed, delta=delta, confidence=conf, epsilon_lower=lower, best=best, bounds=results,
        verdict="violation" if lower > claimed else "consistent", canaries_in=int(inc.sum()),
        canaries_out=int((~inc).sum()), info=dict(info or {}),
    )
