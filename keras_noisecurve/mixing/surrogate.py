"""The objective the solver minimises: a workload W split for banded evaluation.

``Problem`` holds everything the optimiser needs for one (objective, T, spectrum, η, λ):
W is split as ``W ≈ RRᵀ + α·AᵀA + ε·I`` and ``Surrogate`` evaluates
``f(C) = ‖C⁻ᵀR‖_F² + α·‖A C⁻¹‖_F² + ε·‖C⁻¹‖_F² = Tr((RRᵀ + αAᵀA + εI) X⁻¹)``, X = CᵀC,
and its gradient on the band of C (``keras_noisecurve.mixing.banded``).

* R (T×k) is the pivoted Cholesky factor of the curvature part, stopped once the
  discarded trace is ≤ ``TRUNCATION_RELATIVE``·Tr(W) (the discarded part is PSD, so the
  surrogate never over-states a direction W weights). One evaluation costs O(T·b·k)
  for a rank-k curvature part, not O(T²·b); the prefix part (DP-BandMF) and the identity
  part (DP-SGD, the ridge) use an O(T·b²) block recursion.
* Ridge: when the curvature workload is numerically rank-deficient (pivoted Cholesky
  stops at k < T), ``ε = RIDGE_RELATIVE·Tr(W)/T`` is added (W + εI). Without it the
  infimum of ``Tr(W X⁻¹)`` may sit at a singular X (e.g. a one-value spectrum gives a
  rank-one W). With it, ``ε·Tr(X⁻¹) ≤ f(C_bandmf)`` bounds ``‖X⁻¹‖`` on the level set,
  so a minimiser with X ≻ 0 exists. ρ = ``RIDGE_RELATIVE`` is 10⁶ × the truncation
  tolerance, so the ridge, not the truncation, decides the directions W does not
  weight; smaller ρ leaves the optimiser drifting along them, larger ρ moves the
  optimum (measurements: docs/mixing.md, "Solver speed").
* ``Problem.exact_loss`` is always the exact ``Tr(W X⁻¹)``, without ridge or truncation.
* Update rules (momentum β, schedule s_t; ``keras_noisecurve.mixing.rule_workloads``):
  the prefix part becomes ``α·‖A_rule C⁻¹‖_F² = α·‖L⁻¹‖_F²`` with the (b + 2)-banded
  ``L = C·diag(s)⁻¹·(I − βS)·(I − S)`` (``PrefixMap.factor``), the same O(T·b²) block
  recursion, exact (no factorization of a dense W); the eq.-1 part is split as above.

numpy only.
"""

from __future__ import annotations

import math

import numpy as np

from keras_noisecurve.mixing.banded import (
    inverse_frobenius_term,
    lowrank_term,
    prefix_factor,
    prefix_factor_pullback,
)
from keras_noisecurve.mixing.objectives import get_objective
from keras_noisecurve.mixing.rule_workloads import PrefixMap, is_identity_rule

__all__ = [
    "RIDGE_RELATIVE",
    "TRUNCATION_RELATIVE",
    "Problem",
    "Surrogate",
    "exact_loss",
    "factor_workload",
    "pivoted_cholesky",
]

#: Ridge ρ: ε = ρ·Tr(W)/T is added to a numerically rank-deficient curvature workload.
RIDGE_RELATIVE = 1e-6
#: Pivoted Cholesky of W stops once the discarded trace is ≤ this × Tr(W).
TRUNCATION_RELATIVE = 1e-12


def exact_loss(ab: np.ndarray, *, objective: str, workload: np.ndarray | None = None,
               prefix_map: PrefixMap | None = None) -> float:
    """``Tr(W X⁻¹)``, X = CᵀC, for C in (b, T) band storage, with banded solves only.

    ``dpsgd`` (W = I, ``‖C⁻¹‖_F²``) and ``bandmf`` (W = AᵀA, ``‖A C⁻¹‖_F²``; with
    ``prefix_map`` W = A_ruleᵀA_rule, ``‖A_rule C⁻¹‖_F²``) use the O(T·b²) block
    recursion and need no ``workload``; every other objective needs its dense (T, T)
    ``workload`` and costs O(T²·b).
    """
    return get_objective(objective).exact_loss(ab, workload=workload, prefix_map=prefix_map)


class Surrogate:
    """``f(C) = ‖C⁻ᵀR‖_F² + α·‖A C⁻¹‖_F² + ε·‖C⁻¹‖_F² = Tr((RRᵀ + αAᵀA + εI) X⁻¹)``.

    Args:
      factor: R of shape (T, k), or None (k = 0).
      prefix_weight: α ≥ 0 (A the T×T lower-triangular all-ones matrix).
      identity_weight: ε ≥ 0.
      prefix_map: a ``rule_workloads.PrefixMap``: the prefix term is then
        ``α·‖A_rule C⁻¹‖_F²`` (None: A, plain SGD).

    Calling it on C in (b, T) band storage returns ``(f, ∂f/∂ab)`` (the gradient on the
    band entries, shape (b, T); None with ``gradient=False``).
    """

    def __init__(self, *, factor=None, prefix_weight=0.0, identity_weight=0.0, prefix_map=None):
        self.factor = factor
        self.prefix_weight = float(prefix_weight)
        self.identity_weight = float(identity_weight)
        self.prefix_map = prefix_map

    def __call__(self, ab, *, gradient=True):
        value = 0.0
        grad = np.zeros_like(ab) if gradient else None
        if self.factor is not None and self.factor.shape[1] > 0:
            v, g = lowrank_term(ab, self.factor, gradient=gradient)
            value += v
            if gradient:
                grad += g
        if self.prefix_weight and self.prefix_map is not None:
            v, g = inverse_frobenius_term(self.prefix_map.factor(ab), gradient=gradient)
            value += self.prefix_weight * v
            if gradient:
                grad += self.prefix_weight * self.prefix_map.pullback(g)
        elif self.prefix_weight:
            v, g = inverse_frobenius_term(prefix_factor(ab), gradient=gradient)
            value += self.prefix_weight * v
            if gradient:
                grad += self.prefix_weight * prefix_factor_pullback(g)
        if self.identity_weight:
            v, g = inverse_frobenius_term(ab, gradient=gradient)
            value += self.identity_weight * v
            if gradient:
                grad += self.identity_weight * g
        return value, grad


def pivoted_cholesky(workload: np.ndarray, *, relative_tolerance: float = TRUNCATION_RELATIVE,
                     max_rank: int | None = None):
    """Greedy pivoted Cholesky ``W ≈ RRᵀ`` of a symmetric PSD (T, T) matrix.

    Stops when the trace of the (PSD) remainder is ≤ ``relative_tolerance``·Tr(W) or at
    ``max_rank`` columns. O(T·k²) time for rank k.

    Returns:
      (R of shape (T, k), remainder trace, full) where ``full`` says whether the
      factorization used every step (W numerically positive definite).
    """
    steps = workload.shape[0]
    max_rank = steps if max_rank is None else min(max_rank, steps)
    diag = np.array(np.diagonal(workload), dtype=np.float64)
    total = float(diag.sum())
    factor = np.zeros((steps, max_rank))
    if not total > 0:
        return factor[:, :0], 0.0, False
    k = 0
    remainder = total
    while k < max_rank and remainder > relative_tolerance * total:
        p = int(np.argmax(diag))
        pivot = diag[p]
        if pivot <= 0:
            break
        col = workload[:, p] - factor[:, :k] @ factor[p, :k]
        col /= math.sqrt(pivot)
        factor[:, k] = col
        diag -= col * col
        diag[p] = 0.0
        np.maximum(diag, 0.0, out=diag)
        remainder = float(diag.sum())
        k += 1
    return factor[:, :k], remainder, k == steps


def factor_workload(workload: np.ndarray):
    """Low-rank factor of a dense curvature workload, falling back to eigh if the
    numerical rank is large (pivoted Cholesky would cost O(T³) in a Python loop)."""
    steps = workload.shape[0]
    limit = max(64, steps // 4)
    factor, remainder, full = pivoted_cholesky(workload, max_rank=limit)
    total = float(np.trace(workload))
    if factor.shape[1] < limit or full:
        return factor, full
    evals, evecs = np.linalg.eigh(workload)
    evals = np.maximum(evals, 0.0)
    order = np.argsort(evals)[::-1]
    evals, evecs = evals[order], evecs[:, order]
    tail = np.cumsum(evals[::-1])[::-1]  # tail[k] = Σ_{i>=k} λ_i
    keep = int(np.searchsorted(-tail, -TRUNCATION_RELATIVE * total, side="left"))
    keep = max(1, min(steps, keep))
    full = keep == steps and evals[-1] > TRUNCATION_RELATIVE * total / steps
    return evecs[:, :keep] * np.sqrt(evals[:keep]), full


class Problem:
    """Everything the solver needs for one (objective, T, spectrum, η, λ, update rule).

    Args:
      objective: one of ``keras_noisecurve.mixing.workloads.OBJECTIVES``.
      steps: T.
      inputs: validated ``CurvatureInputs`` (curvature objectives only).
      blend_weight: λ ∈ [0, 1] (``noisecurve-blend`` only).
      update_rule: a validated ``UpdateRule`` (None: plain SGD; a rule with β = 0 and
        every s_t = 1 is the same problem, bit for bit).

    The objective's ``surrogate_terms`` (``keras_noisecurve.mixing.objectives``) say how W
    splits; a ridge is added when the factored part is rank-deficient and no prefix term
    makes the sum full rank.

    Attributes: ``spec`` (the ``Objective``), ``surrogate`` (a ``Surrogate``), ``workload``
    (dense W of the curvature objectives, for exact reporting; None otherwise), ``ridge``
    (ε, 0.0 if none),
    ``rank`` (columns of R kept; T for full-rank workloads) and ``prefix_map`` (the
    rule's ``PrefixMap``; None for plain SGD).
    """

    def __init__(self, *, objective, steps, inputs=None, blend_weight=None, update_rule=None):
        self.objective = objective
        self.spec = get_objective(objective)
        self.steps = steps
        self.blend_weight = blend_weight
        self.update_rule = update_rule
        self.workload = None  # dense W for exact reporting (curvature objectives)
        self.ridge = 0.0
        self.rank = steps
        rule = None if update_rule is None or is_identity_rule(update_rule, steps) else update_rule
        self.prefix_map = None if rule is None else PrefixMap(steps, rule)
        terms = self.spec.surrogate_terms(steps=steps, inputs=inputs, blend_weight=blend_weight, rule=rule,
                                          prefix_map=self.prefix_map)
        self.workload = terms.workload
        factor, full = None, True
        if terms.lowrank is not None:
            factor, full = factor_workload(terms.lowrank)
            if terms.lowrank_scale is not None:
                factor = factor * math.sqrt(terms.lowrank_scale)
            self.rank = factor.shape[1]
        if not full and not terms.prefix_weight:  # rank-deficient, and no full-rank prefix term
            self.ridge = RIDGE_RELATIVE * float(np.trace(self.workload)) / steps
        self.surrogate = Surrogate(factor=factor, prefix_weight=terms.prefix_weight,
                                   identity_weight=terms.identity_weight + self.ridge, prefix_map=self.prefix_map)

    def exact_loss(self, ab) -> float:
        """``Tr(W X⁻¹)`` without ridge or truncation."""
        return self.spec.exact_loss(ab, workload=self.workload, prefix_map=self.prefix_map)

    def identity_loss(self) -> float:
        """Loss of C = I, i.e. Tr(W)."""
        return self.spec.identity_loss(steps=self.steps, workload=self.workload, prefix_map=self.prefix_map)
