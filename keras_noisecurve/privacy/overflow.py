"""Padding of the cyclic Poisson sampler's batches, and the δ that truncation adds.

numpy/scipy only: this module never imports TensorFlow.

The sampler (:mod:`keras_noisecurve.privacy.sampler`) pads every batch to a fixed size
P; :func:`padded_batch_size` picks P from a bound on the probability that a step draws
more than P examples, :func:`overflow_probability`; :func:`padding` gives (P, its
probability) for any run spec (fixed epochs: P = B). All take a
:class:`~keras_noisecurve.privacy.spec.RunSpec`.

Total δ: a step that samples more than P examples is truncated. The δ of
``compute_epsilon`` and ``calibrate_noise_multiplier`` is the accounting δ of the ideal
(untruncated) mechanism; the run's total δ is ``delta + overflow_delta(...)`` (see
:func:`overflow_delta`). With the sampler's default (overflow probability ≤ 1e-12)
this addition is below 1e-12·(1 + e^ε).

The overflow rule (:data:`OVERFLOW_DELTA_SHARE`): a run's padded batch size is accepted
only if the δ its overflow adds is at most a tenth of the accounting δ,
``(1 + e^ε)·p ≤ δ/10``, so the run's total δ is at most 1.1·δ and ε stays a guarantee
at (nearly) the δ it is reported at. :func:`checked_padding` applies it (``PrivateRun``
and :func:`~keras_noisecurve.privacy.calibration.calibrate` call it): a ``max_batch_size``
or ``overflow_probability`` that breaks it is refused, naming the smallest
``max_batch_size`` that passes (:func:`smallest_allowed_padded_size`); the default P is
raised past 1e-12 where the rule needs it.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

from typing import Callable, Optional

from keras_noisecurve._validation import check_float, check_int
from keras_noisecurve.privacy.spec import RunSpec

__all__ = [
    "DEFAULT_OVERFLOW_PROBABILITY",
    "OVERFLOW_DELTA_SHARE",
    "allowed_overflow_probability",
    "checked_padding",
    "overflow_delta",
    "overflow_probability",
    "padded_batch_size",
    "padding",
    "smallest_allowed_padded_size",
]

#: Default bound on the probability that any step of the cyclic Poisson sampler
#: draws more examples than its padded batch size (see :func:`padded_batch_size`).
DEFAULT_OVERFLOW_PROBABILITY = 1e-12

#: The overflow rule: the δ that truncation adds, ``overflow_delta(ε, p) = (1 + e^ε)·p``,
#: may be at most this share of the accounting δ (so the total δ is at most 1.1·δ).
#: A tenth, not "negligible": the rule refuses padded sizes whose guarantee has moved
#: away from the δ that ε is reported at, and costs little padding (the Binomial tail
#: falls fast: the smallest passing P is a few examples above the one that just fails).
OVERFLOW_DELTA_SHARE = 0.1


def _largest_partition(num_examples: int, bands: int) -> int:
    return -(-num_examples // bands)


def _check_cyclic(spec, caller: str) -> RunSpec:
    if not isinstance(spec, RunSpec):
        raise TypeError(f"{caller}: spec must be a keras_noisecurve.RunSpec, got {type(spec).__name__}.")
    if spec.sampling != "cyclic_poisson":
        raise ValueError(f"{caller} applies to sampling='cyclic_poisson' only; got {spec.sampling!r} "
                         "(fixed epochs pad to batch_size and never overflow).")
    return spec


def overflow_probability(*, spec: RunSpec, padded_size: int) -> float:
    """Union bound on P(some step of cyclic Poisson sampling draws > P examples).

    Step t draws Binomial(m_t, q) examples, m_t ≤ ⌈n/b⌉ the size of partition
    ``t mod b``. To cover a neighbouring dataset (one more example) the bound uses
    m = ⌈n/b⌉ + 1 for every step: ``min(1, T · P[Binomial(m, q) > P])``.
    """
    spec = _check_cyclic(spec, "overflow_probability")
    padded = check_int("padded_size", padded_size, minimum=0)
    return _overflow_probability(spec, padded)


def _overflow_probability(spec: RunSpec, padded: int) -> float:
    m = _largest_partition(spec.num_examples, spec.bands) + 1
    return float(min(1.0, spec.steps * stats.binom.sf(padded, m, spec.sampling_probability)))


#: Partitions up to this size are searched by evaluating every P at once (O(n/b)
#: memory); larger ones by bisection (O(log(n/b)) evaluations, no allocation).
_DIRECT_SEARCH = 1_000_000


def padded_batch_size(*, spec: RunSpec, overflow_probability: float = DEFAULT_OVERFLOW_PROBABILITY) -> int:
    """Smallest padded batch size P whose :func:`overflow_probability` is ≤ the target.

    Computed exactly from the Binomial tail (scipy ``binom.logsf``), never above the
    largest partition size ⌈n/b⌉ (a real partition can never overflow that).
    """
    spec = _check_cyclic(spec, "padded_batch_size")
    target = check_float("overflow_probability", overflow_probability, open_unit=True)
    return _padded_batch_size(spec, target)


def _padded_batch_size(spec: RunSpec, target: float) -> int:
    steps, q = spec.steps, spec.sampling_probability
    m_real = _largest_partition(spec.num_examples, spec.bands)
    m = m_real + 1
    if m_real > _DIRECT_SEARCH:  # the tail decreases in P: bisect instead of evaluating every P
        def fits(k):
            return math.log(steps) + float(stats.binom.logsf(k, m, q)) <= math.log(target)

        if not fits(m_real):
            return int(m_real)
        lo, hi = -1, m_real  # fits(hi); not fits(lo) (lo = -1: nothing tried yet)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid
        return int(hi)
    candidates = np.arange(0, m_real + 1)
    log_tail = math.log(steps) + stats.binom.logsf(candidates, m, q)
    ok = np.flatnonzero(log_tail <= math.log(target))
    return int(candidates[ok[0]]) if ok.size else int(m_real)


def padding(*, spec: RunSpec, max_batch_size: Optional[int] = None,
            overflow_probability: Optional[float] = None) -> tuple[int, float]:
    """``(P, overflow probability of P)``: the sampler's padded batch size for ``spec``.

    Cyclic Poisson: P is the smallest size whose union-bound overflow probability is ≤
    ``overflow_probability`` (default :data:`DEFAULT_OVERFLOW_PROBABILITY` = 1e-12), or
    ``max_batch_size`` if given (its overflow probability is reported); at most one of
    the two. Fixed epochs: P = B, probability 0 (neither may be given).
    """
    if not isinstance(spec, RunSpec):
        raise TypeError(f"padding: spec must be a keras_noisecurve.RunSpec, got {type(spec).__name__}.")
    if max_batch_size is not None and overflow_probability is not None:
        raise ValueError(
            f"give max_batch_size or overflow_probability, not both; got max_batch_size={max_batch_size!r}, "
            f"overflow_probability={overflow_probability!r}."
        )
    if spec.sampling == "fixed_epochs":
        if max_batch_size is not None or overflow_probability is not None:
            raise ValueError("max_batch_size / overflow_probability apply to cyclic_poisson only; fixed_epochs pads to batch_size.")
        return spec.batch_size, 0.0
    if max_batch_size is not None:
        padded = check_int("max_batch_size", max_batch_size, minimum=1)
    else:
        target = DEFAULT_OVERFLOW_PROBABILITY if overflow_probability is None else overflow_probability
        padded = _padded_batch_size(spec, check_float("overflow_probability", target, open_unit=True))
    return padded, _overflow_probability(spec, padded)


def overflow_delta(*, epsilon: float, overflow_probability: float) -> float:
    """Extra δ caused by truncating overflowing batches: ``(1 + e^ε) · p``.

    Let M be the ideal (untruncated) mechanism and M' the truncated one; on every
    dataset they differ only on the overflow event, so their outputs are within
    total variation p (the union bound :func:`overflow_probability`, which already
    covers the neighbour's extra example). If M is (ε, δ)-DP then for neighbours D, D'
    ``P[M'(D)∈S] ≤ P[M(D)∈S] + p ≤ e^ε P[M(D')∈S] + δ + p ≤ e^ε P[M'(D')∈S] + δ + (1+e^ε)p``.
    The total δ of a run is ``delta + overflow_delta(epsilon=ε, overflow_probability=p)``.
    """
    epsilon = check_float("epsilon", epsilon, nonnegative=True)
    p = check_float("overflow_probability", overflow_probability, nonnegative=True)
    if p > 1:
        raise ValueError(f"overflow_probability must be <= 1, got {p}.")
    return float(min(1.0, (1.0 + math.exp(min(epsilon, 700.0))) * p))


def allowed_overflow_probability(*, epsilon: float, delta: float) -> float:
    """The largest overflow probability p the overflow rule allows at (ε, δ):
    ``OVERFLOW_DELTA_SHARE · δ / (1 + e^ε)``, i.e. ``overflow_delta(ε, p) ≤ δ/10``."""
    epsilon = check_float("epsilon", epsilon, nonnegative=True)
    delta = check_float("delta", delta, open_unit=True)
    return _allowed(epsilon, delta)


def _allowed(epsilon: float, delta: float) -> float:
    return OVERFLOW_DELTA_SHARE * delta / (1.0 + math.exp(min(epsilon, 700.0)))


def smallest_allowed_padded_size(*, spec: RunSpec, epsilon: float, delta: float) -> int:
    """The smallest padded batch size P of a cyclic Poisson run that meets the overflow
    rule at (ε, δ): :func:`overflow_probability` ≤ :func:`allowed_overflow_probability`.

    At most ⌈n/b⌉ + 1, whose overflow probability is 0 (not even the neighbouring
    dataset's largest partition exceeds it).
    """
    spec = _check_cyclic(spec, "smallest_allowed_padded_size")
    epsilon = check_float("epsilon", epsilon, nonnegative=True)
    delta = check_float("delta", delta, open_unit=True)
    return _smallest_allowed(spec, _allowed(epsilon, delta))


def _smallest_allowed(spec: RunSpec, allowed: float) -> int:
    m_real = _largest_partition(spec.num_examples, spec.bands)
    if allowed <= 0.0:  # e^ε overflowed the allowance: only P = ⌈n/b⌉ + 1 never overflows
        return m_real + 1
    padded = _padded_batch_size(spec, allowed)
    return padded if _overflow_probability(spec, padded) <= allowed else m_real + 1


def checked_padding(*, spec: RunSpec, delta: float, epsilon: Callable[[], float],
                    epsilon_bound: Optional[float] = None, max_batch_size: Optional[int] = None,
                    overflow_probability: Optional[float] = None) -> tuple[int, float]:
    """:func:`padding` under the overflow rule: ``(P, p)`` with ``overflow_delta(ε, p) ≤ δ/10``.

    Args (keyword-only):
      spec, max_batch_size, overflow_probability: as :func:`padding`.
      delta: the run's accounting δ.
      epsilon: a function returning the run's ε at δ (``run.epsilon``); called only when
        ``epsilon_bound`` does not settle the rule (with PLD it may take a second).
      epsilon_bound: optional cheap upper bound on that ε: if the rule holds at it, it holds.

    Neither ``max_batch_size`` nor ``overflow_probability`` given: P is the default
    (overflow probability ≤ 1e-12), raised to :func:`smallest_allowed_padded_size` where
    the rule needs more. Either given and the rule broken: ``ValueError`` giving p, δ, ε,
    the overflow δ and the smallest ``max_batch_size`` that passes.
    """
    padded, p = padding(spec=spec, max_batch_size=max_batch_size, overflow_probability=overflow_probability)
    if p == 0.0:
        return padded, p
    if epsilon_bound is not None and p <= _allowed(epsilon_bound, delta):
        return padded, p
    try:
        eps = float(epsilon())
    except (ArithmeticError, ValueError):  # an accountant that cannot represent the loss (σ ≈ 0): no bound
        eps = math.inf
    allowed = _allowed(eps, delta)
    if p <= allowed:
        return padded, p
    smallest = _smallest_allowed(spec, allowed)
    if max_batch_size is None and overflow_probability is None:
        return smallest, _overflow_probability(spec, smallest)
    given = (f"max_batch_size={max_batch_size}" if max_batch_size is not None
             else f"overflow_probability={overflow_probability:g} (padded batch size P = {padded})")
    total = delta + overflow_delta(epsilon=eps, overflow_probability=p) if math.isfinite(eps) else math.inf
    raise ValueError(
        f"{given} has an overflow probability p = {p:.3g} (union bound over the T = {spec.steps} steps): the run "
        f"would be (epsilon = {eps:.4g}, delta + (1 + e^epsilon)*p = {total:.3g})-DP, not (epsilon, delta = "
        f"{delta:g})-DP. A padded batch size is accepted when the delta its overflow adds, "
        f"(1 + e^epsilon)*p, is at most delta/10 (p <= {allowed:.3g} here). Use max_batch_size >= {smallest} "
        f"(overflow probability {_overflow_probability(spec, smallest):.3g}), or give neither max_batch_size nor "
        "overflow_probability for the default padding."
    )
