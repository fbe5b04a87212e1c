"""Do the batches a run actually trains on follow the sampling the accountant analysed? (numpy only)

The accountant (:class:`~keras_noisecurve.privacy.spec.RunSpec`, docs/privacy.md) bounds
ε for one sampling plan, and nothing else:

- ``fixed_epochs``: one order repeated; every example takes part at most k = ``spec.epochs``
  times, consecutive participations at least ``spec.separation`` (= ⌈n/B⌉) steps apart
  (the sensitivity s·√k of a banded C needs gaps ≥ b; BLT/BISR's computed sensitivity
  assumes the epoch length);
- ``cyclic_poisson``: the examples are split into b fixed partitions; an example of
  partition r may take part only in steps t ≡ r (mod b), at most once per step, each
  time with probability q = B·b/n.

:func:`check_participations` counts, from the example ids of every step's batch over
the WHOLE plan, each example's participations and the gaps between them, and compares
them with that assumption exactly (plus, for cyclic Poisson, a test of the realised
rate against q). A pipeline that puts an example in more steps than planned, twice in
one step, or in a step of another partition fails it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np

__all__ = ["ParticipationCheck", "RATE_Z_LIMIT", "check_participations", "participation_counts"]

#: |z| of the realised cyclic-Poisson rate against q above which the check fails
#: (a correct sampler passes it except with probability ≈ 6·10⁻⁷)
RATE_Z_LIMIT = 5.0


@dataclasses.dataclass(frozen=True)
class ParticipationCheck:
    """The realised participations of a run against the accountant's assumption.

    Attributes:
      passed: every example's participations fit the assumption (and the rate test passed).
      sampling: the run's sampling.
      assumption: the assumption in words.
      histogram: ``{k: number of examples with k participations}`` (k = 0 included).
      max_allowed: the largest number of participations the accountant allows one example.
      separation: the smallest gap (in steps) it allows between two participations.
      min_gap: the smallest gap observed (``None``: no example took part twice).
      offenders: number of examples whose participations break the assumption.
      first_offender: ``(example id, its steps)`` of one of them, or ``None``.
      rate_z: cyclic Poisson: (observed − expected participations)/sd under rate q; else ``None``.
      line: one line for a report.
    """

    passed: bool
    sampling: str
    assumption: str
    histogram: dict
    max_allowed: int
    separation: int
    min_gap: Optional[int]
    offenders: int
    first_offender: Optional[tuple]
    rate_z: Optional[float]
    line: str


def _pairs(batches: Sequence, num_examples: int):
    """(step, id) of every participation, sorted by id then step."""
    steps, ids = [], []
    for t, batch in enumerate(batches):
        batch = np.asarray(batch, dtype=np.int64).reshape(-1)
        if batch.size and (batch.min() < 0 or batch.max() >= num_examples):
            raise ValueError(f"step {t} holds example ids outside 0 … {num_examples - 1}: "
                             f"{batch[(batch < 0) | (batch >= num_examples)][:3].tolist()}.")
        steps.append(np.full(batch.size, t, np.int64))
        ids.append(batch)
    step = np.concatenate(steps) if steps else np.zeros(0, np.int64)
    ident = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    order = np.lexsort((step, ident))
    return step[order], ident[order]


def participation_counts(batches: Sequence, num_examples: int) -> np.ndarray:
    """(n,) int: how many of the given steps' batches hold each example (ids 0 … n−1)."""
    _, ident = _pairs(batches, num_examples)
    return np.bincount(ident, minlength=num_examples)


def check_participations(*, batches: Sequence, spec, partitions: Optional[Sequence] = None,
                         unit: str = "example") -> ParticipationCheck:
    """Compare every example's realised participations with what the accountant assumed.

    Args:
      batches: for each step t = 0 … T−1 of the plan, the ids (0 … n−1) of the REAL
        examples of its batch (padding left out), e.g. from iterating the run's pipeline
        on ``x = arange(n)``. All T steps are needed: a participation count is a
        statement about the whole plan.
      spec: the run's :class:`~keras_noisecurve.privacy.spec.RunSpec` (n, T, b, sampling, q).
      partitions: cyclic Poisson only: the b partitions (arrays of ids) the run's
        sampler uses (``run.sampler().partitions``); when given, each example's steps must
        also be those of ITS partition, and the partitions must split 0 … n−1 into b
        parts whose sizes differ by at most 1.
      unit: what the ids name, ``"example"`` or ``"user"`` (a user-level run: the ids are user
        indices 0 … n−1, n = ``num_users``); only the wording of the line changes.

    Returns:
      a :class:`ParticipationCheck`.
    """
    n, steps = spec.num_examples, spec.steps
    if len(batches) != steps:
        raise ValueError(f"batches must hold the {steps} steps of the whole plan, got {len(batches)}.")
    step, ident = _pairs(batches, n)
    counts = np.bincount(ident, minlength=n)
    same = ident[1:] == ident[:-1]
    gaps = (step[1:] - step[:-1])[same]
    min_gap = int(gaps.min()) if gaps.size else None
    bad = np.zeros(n, bool)
    rate_z = None
    if spec.sampling == "fixed_epochs":
        allowed, separation = spec.participations(), spec.separation
        assumption = (f"fixed epochs: at most {allowed} participations per {unit}, consecutive ones at least "
                      f"{separation} steps apart")
        bad |= counts > allowed
        np.logical_or.at(bad, ident[1:][same], gaps < separation)
    else:
        b = spec.bands
        allowed, separation = spec.participations(), b
        assumption = (f"cyclic Poisson, b = {b}: each {unit} only in the steps t = r (mod {b}) of its partition r, "
                      f"at most once per step, with probability q = {spec.sampling_probability:.4g}")
        residue = step % b
        np.logical_or.at(bad, ident[1:][same], (residue[1:] != residue[:-1])[same] | (gaps == 0))
        home = None
        if partitions is not None:
            home, message = _partition_of(partitions, n, b)
            if message:
                return _result(False, spec, assumption + f"; {message}", counts, allowed, separation, min_gap,
                               n, None, None, unit)
            bad[ident[home[ident] != residue]] = True
        # the rate: each visit of an example's partition includes it with probability q
        q = spec.sampling_probability
        visits_by_residue = np.array([len(range(r, steps, b)) for r in range(b)], np.float64)
        if home is not None:
            visits = float(visits_by_residue[home].sum())
        else:  # partitions unknown: balanced partitions assumed
            sizes = np.array([len(p) for p in np.array_split(np.arange(n), b)], np.float64)
            visits = float(sizes @ visits_by_residue)
        expected, sd = q * visits, math.sqrt(max(q * (1 - q) * visits, 1e-300))
        rate_z = (float(counts.sum()) - expected) / sd
    offenders = np.flatnonzero(bad)
    first = None
    if offenders.size:
        e = int(offenders[0])
        first = (e, step[ident == e].tolist())
    passed = offenders.size == 0 and (rate_z is None or abs(rate_z) <= RATE_Z_LIMIT)
    return _result(passed, spec, assumption, counts, allowed, separation, min_gap, int(offenders.size), first, rate_z,
                   unit)


def _partition_of(partitions, n, b):
    """(n,) the partition index of every example, or a message saying why ``partitions`` is not
    a balanced split of 0 … n−1 into b parts."""
    if len(partitions) != b:
        return None, f"the sampler has {len(partitions)} partitions, not b = {b}"
    home = np.full(n, -1, np.int64)
    sizes = []
    for r, part in enumerate(partitions):
        part = np.asarray(part, np.int64).reshape(-1)
        sizes.append(part.size)
        if part.size and (part.min() < 0 or part.max() >= n or np.any(home[part] >= 0)
                          or np.unique(part).size != part.size):
            return None, f"partition {r} repeats an example or holds one of another partition"
        home[part] = r
    if np.any(home < 0):
        return None, f"{int(np.sum(home < 0))} examples belong to no partition"
    if max(sizes) - min(sizes) > 1:
        return None, f"the partitions are not balanced (sizes {min(sizes)} … {max(sizes)})"
    return home, ""


def _result(passed, spec, assumption, counts, allowed, separation, min_gap, offenders, first, rate_z, unit="example"):
    values, freq = np.unique(counts, return_counts=True)
    histogram = {int(v): int(f) for v, f in zip(values, freq)}
    shown = ", ".join(f"{f} x {v}" for v, f in list(histogram.items())[:6])
    if passed:
        line = (f"sampling: PASS - participations per {unit} {{{shown}}} (allowed <= {allowed}), smallest gap "
                f"{min_gap if min_gap is not None else '-'} (allowed >= {separation})")
    elif offenders:
        line = f"sampling: FAIL - {offenders} {unit}s break the assumption ({assumption}); counts {{{shown}}}"
        if first is not None:
            line += f"; e.g. {unit} {first[0]} at steps {first[1][:8]}"
    else:
        line = f"sampling: FAIL - the realised rate is not q ({assumption}); counts {{{shown}}}"
    if rate_z is not None:
        line += f"; rate vs q: z = {rate_z:+.2f} (|z| <= {RATE_Z_LIMIT:g})"
    return ParticipationCheck(passed=bool(passed), sampling=spec.sampling, assumption=assumption,
                              histogram=histogram, max_allowed=int(allowed), separation=int(separation),
                              min_gap=min_gap, offenders=int(offenders), first_offender=first, rate_z=rate_z,
                              line=line)
