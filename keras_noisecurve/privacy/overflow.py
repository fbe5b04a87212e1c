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
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

from typing import Optional

from keras_noisecurve._validation import check_float, check_int
from keras_noisecurve.privacy.spec import RunSpec

__all__ = ["DEFAULT_OVERFLOW_PROBABILITY", "overflow_delta", "overflow_probability", "padded_batch_size", "padding"]

#: Default bound on the probability that any step of the cyclic Poisson sampler
#: draws more examples than its padded batch size (see :func:`padded_batch_size`).
DEFAULT_OVERFLOW_PROBABILITY = 1e-12


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
