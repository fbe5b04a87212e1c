r"""Workloads W for SGD with heavy-ball momentum and a learning-rate schedule (an ``UpdateRule``).

numpy only. Conventions as in ``keras_noisecurve.mixing.workloads``: steps t = 0 … T−1,
the correlated noise is ``z̃ = C⁻¹z`` with ``Cov(z̃) = X⁻¹`` per unit σ², X = CᵀC, and
every objective is ``Tr(W X⁻¹)``. The update rule is Keras's SGD
(``keras_noisecurve.mixing.update_rule``)::

    m_{t+1} = β·m_t − η_t·ĝ_t,    w_{t+1} = w_t + m_{t+1},    m_0 = 0,    η_t = η·s_t,

with the privatized gradient ``ĝ_t = g_t + σ·z̃_t``. β = 0, s_t = 1 is plain SGD, for
which everything here reduces to the workloads of ``workloads.py`` (tested).

Prefix map (``bandmf`` for a rule)
    Unrolling the rule, ``w_{t+1} − w_0 = −η Σ_{j≤t} A_rule[t, j]·ĝ_j`` with

        A_rule[t, j] = s_j · Σ_{k=j}^{t} β^{k−j} = s_j · a(t − j),   a(n) = Σ_{k=0}^{n} β^k   (t ≥ j),

    i.e. ``A_rule = A·M_β·diag(s)``, A the all-ones lower-triangular matrix (prefix sums),
    ``M_β[k, j] = β^{k−j}`` (the momentum buffer). Its workload ``W = A_ruleᵀA_rule``
    gives, for a zero Hessian, ``Σ_t E‖w̃_{t+1} − w_{t+1}‖² = η²σ²·p·Tr(W X⁻¹)`` (p the
    number of coordinates): the total variance of the iterate noise. For the plain rule
    A_rule = A and W = ``prefix_workload``.

    Banded evaluation: ``M_β⁻¹ = I − βS`` and ``A⁻¹ = I − S`` (S the lower shift), so
    ``A_rule C⁻¹ = L⁻¹`` with ``L = C·diag(s)⁻¹·(I − βS)·(I − S)``, lower triangular with
    bandwidth b + 2, and ``Tr(W X⁻¹) = ‖L⁻¹‖_F²`` is the O(T·b²) block recursion of
    ``banded.inverse_frobenius_term`` (``PrefixMap.factor`` builds L in band storage,
    ``PrefixMap.pullback`` is its adjoint for the gradient). No dense W is needed.

Final loss (``noisecurve``, paper eq. 1, for a rule)
    On ``L(w) = ½(w − d)ᵀH(w − d)``, per Hessian eigenvalue μ the deviations
    ``e_t = w̃_t − w_t`` and ``δ_t = m̃_t − m_t`` follow

        δ_{t+1} = β δ_t − η_t(μ e_t + σ z̃_t),    e_{t+1} = e_t + δ_{t+1},

    i.e. ``(e, δ)_{t+1} = M_t (e, δ)_t − η_t σ z̃_t (1, 1)ᵀ`` with
    ``M_t = [[1 − η_t μ, β], [−η_t μ, β]]``. Hence ``e_T = −ησ Σ_j u(j) z̃_j`` with

        u(j) = s_j · [M_{T−1} ⋯ M_{j+1} (1, 1)ᵀ]_e,

    and, the cross term having mean zero,
    ``E[L(w̃_T) − L(w_T)] = (η²σ²/2)·Tr(W X⁻¹)`` with

        W[j, l] = Σ_i m_i μ_i u_i(j) u_i(l)    (W = U diag(mμ) Uᵀ, U of shape (T, K)).

    U is formed by a backward recursion on the row vector ``p_j = (1, 0)·M_{T−1}⋯M_{j+1}``
    (``p_{T−1} = (1, 0)``, ``p_j = p_{j+1}·M_{j+1}``, ``u(j) = s_j (p_j)·(1, 1)ᵀ``),
    vectorised over the K eigenvalues: O(K·T) time; the dense W costs O(T²·K) flops
    (a symmetric rank-K product, chunked over eigenvalues) and 8·T² bytes. For the plain
    rule ``u_i(j) = r_i^{T−1−j}``, r_i = 1 − ημ_i, and W is the Hankel workload.

Stability: heavy ball on a quadratic with a constant rate is stable iff
``0 < η_t·μ < 2(1 + β)`` (``UpdateRule.max_stable_rate``); a rule with
``η·max(s)·μ_max ≥ 2(1 + β)`` is refused. The all-iterates and convergence objectives
are only derived for plain constant-rate SGD and are refused for any other rule.
"""

from __future__ import annotations

import warnings

import numpy as np

from keras_noisecurve.mixing.update_rule import UpdateRule

__all__ = [
    "PLAIN_ONLY_OBJECTIVES",
    "PrefixMap",
    "check_rule_objective",
    "check_rule_stability",
    "final_loss_factor",
    "final_loss_workload",
    "is_identity_rule",
    "prefix_map_matrix",
    "resolve_update_rule",
]

#: Objectives whose workload is only derived for plain SGD with a constant learning rate.
#: (``Objective.plain_sgd_only`` reads this table.)
PLAIN_ONLY_OBJECTIVES = ("noisecurve-convergence", "noisecurve-all-iterates")

# Largest number of (step × eigenvalue) entries of U held at once.
_CHUNK_ENTRIES = 4_000_000


def resolve_update_rule(update_rule, steps: int) -> UpdateRule:
    """``update_rule`` as an ``UpdateRule`` (None → plain SGD, ``UpdateRule()``).

    Raises:
      TypeError: neither None nor an ``UpdateRule``.
      ValueError: a custom schedule whose length is not ``steps``.
    """
    if update_rule is None:
        return UpdateRule()
    if not isinstance(update_rule, UpdateRule):
        raise TypeError(
            "update_rule must be a keras_noisecurve.mixing.UpdateRule or None (plain SGD); got "
            f"{update_rule!r} ({type(update_rule).__name__})."
        )
    update_rule.multipliers(steps)  # a custom schedule of another length raises here
    return update_rule


def is_identity_rule(rule: UpdateRule, steps: int) -> bool:
    """True when the rule is literally ``w ← w − η·ĝ_t`` over the T steps (β = 0, every
    s_t = 1): the workloads are then those of ``workloads.py``, bit for bit."""
    return rule.momentum == 0.0 and bool(np.all(rule.multipliers(steps) == 1.0))


def check_rule_objective(objective: str, rule: UpdateRule) -> None:
    """Refuse the objectives that are only derived for plain constant-rate SGD."""
    if objective in PLAIN_ONLY_OBJECTIVES and not rule.is_plain:
        raise ValueError(
            f"objective={objective!r} is only derived for plain constant-rate SGD (momentum 0, constant "
            f"learning rate); the update rule is {rule.describe()}. Use 'noisecurve', 'noisecurve-blend' "
            "or 'bandmf', which support momentum and learning-rate schedules."
        )


def check_rule_stability(*, learning_rate: float, max_eigenvalue: float, rule: UpdateRule, steps: int,
                         stacklevel: int = 3) -> None:
    """Refuse ``η·max(s)·μ_max ≥ 2(1 + β)`` (heavy ball diverges on the quadratic model).

    For a rule with β = 0 and a constant schedule (``rule.is_plain``) it also warns, as
    ``check_curvature_inputs`` does for plain SGD, when the effective ``η·s·μ_max > 1``
    (the assumption of the paper's Theorem 3.2).
    """
    s_max = float(np.max(rule.multipliers(steps)))
    rate = learning_rate * s_max * max_eigenvalue
    limit = rule.max_stable_rate()
    if rate >= limit:
        raise ValueError(
            f"learning_rate × max schedule multiplier × max eigenvalue = {learning_rate} × {s_max:.6g} × "
            f"{max_eigenvalue:.6g} = {rate:.6g} >= 2(1 + momentum) = {limit:.6g}: SGD with momentum "
            f"{rule.momentum:g} diverges on the quadratic model (stable iff η_t·μ < 2(1 + β)); use "
            f"learning_rate < {limit / (s_max * max_eigenvalue):.6g}."
        )
    if rule.is_plain and rate > 1.0:
        warnings.warn(
            f"learning_rate × schedule multiplier × max eigenvalue = {rate:.6g} > 1 violates the assumption "
            "ημ_max <= 1 of the paper's Theorem 3.2; the workload is still exact for a quadratic loss.",
            UserWarning,
            stacklevel=stacklevel,
        )


# ----------------------------------------------------------------------------- prefix map
def _momentum_sums(momentum: float, steps: int) -> np.ndarray:
    """``a(n) = Σ_{k=0}^{n} β^k`` for n = 0 … T−1 (positive terms: no cancellation)."""
    if momentum == 0.0:
        return np.ones(steps)
    return np.cumsum(momentum ** np.arange(steps, dtype=np.float64))


def prefix_map_matrix(steps: int, rule: UpdateRule | None = None) -> np.ndarray:
    """Dense ``A_rule`` (T, T): ``A_rule[t, j] = s_j·Σ_{k=j}^{t} β^{k−j}`` for t ≥ j, else 0,
    the map from the gradients g_0 … g_t to ``(w_{t+1} − w_0)/(−η)``. O(T²)."""
    rule = resolve_update_rule(rule, steps)
    a = _momentum_sums(rule.momentum, steps)
    diff = np.subtract.outer(np.arange(steps), np.arange(steps))
    out = np.where(diff >= 0, a[np.clip(diff, 0, None)], 0.0)
    return out * rule.multipliers(steps)[None, :]


class PrefixMap:
    """The prefix map ``A_rule = A·M_β·diag(s)`` of a rule over T steps.

    Args:
      steps: T.
      rule: an ``UpdateRule`` (None: plain SGD).

    Methods: ``workload()`` the dense (T, T) ``A_ruleᵀA_rule``; ``trace()`` its trace;
    ``factor(ab)`` the band storage of ``L = C·diag(s)⁻¹·(I − βS)·(I − S)`` so that
    ``‖L⁻¹‖_F² = ‖A_rule C⁻¹‖_F² = Tr(A_ruleᵀA_rule X⁻¹)``; ``pullback(grad)`` the
    adjoint of ``factor`` (gradient with respect to L → gradient with respect to C).
    """

    def __init__(self, steps: int, rule: UpdateRule | None = None):
        rule = resolve_update_rule(rule, steps)
        self.steps = steps
        self.momentum = rule.momentum
        self.multipliers = rule.multipliers(steps)
        self._a = _momentum_sums(self.momentum, steps)

    # ------------------------------------------------------------------ dense
    def workload(self) -> np.ndarray:
        """``W = A_ruleᵀA_rule``, shape (T, T), in O(T²) time and two T×T arrays.

        ``W[j, l] = s_j s_l G(|j − l|, T − 1 − max(j, l))`` with
        ``G(d, K) = Σ_{u=0}^{K} a(u + d)·a(u)``, the running sums of positive products
        along each diagonal (relative rounding error O(T·ε)).
        """
        steps, a = self.steps, self._a
        padded = np.concatenate([a, np.zeros(steps)])
        # shifted[d, u] = a(u + d) (0 once u + d >= T)
        shifted = np.lib.stride_tricks.sliding_window_view(padded, steps)[:steps]
        g = shifted * a[None, :]
        np.cumsum(g, axis=1, out=g)
        out = np.empty((steps, steps))
        cols = np.arange(steps)
        for j in range(steps):
            out[j] = g[np.abs(cols - j), steps - 1 - np.maximum(cols, j)]
        s = self.multipliers
        out *= s[:, None]
        out *= s[None, :]
        return out

    def trace(self) -> float:
        """``Tr(A_ruleᵀA_rule) = Σ_j s_j² Σ_{u=0}^{T−1−j} a(u)²``, O(T)."""
        cum = np.cumsum(self._a * self._a)
        return float(np.sum(self.multipliers**2 * cum[::-1]))

    # ----------------------------------------------------------------- banded
    def factor(self, ab: np.ndarray) -> np.ndarray:
        """(b + 2, T) band storage of ``L = C·diag(s)⁻¹·(I − βS)·(I − S)`` from C's (b, T)
        band storage (``keras_noisecurve.mixing.banded``); (b + 1, T) when β = 0."""
        out = ab / self.multipliers[None, :]
        if self.momentum != 0.0:
            out = _shift_subtract(out, self.momentum)
        return _shift_subtract(out, 1.0)

    def pullback(self, grad: np.ndarray) -> np.ndarray:
        """Adjoint of ``factor``: gradient on L's band → gradient on C's (b, T) band."""
        out = _shift_subtract_adjoint(grad, 1.0)
        if self.momentum != 0.0:
            out = _shift_subtract_adjoint(out, self.momentum)
        return out / self.multipliers[None, :]


def _shift_subtract(ab: np.ndarray, gamma: float) -> np.ndarray:
    """Band storage of ``L·(I − γS)``: column c becomes ``L[:, c] − γ·L[:, c+1]`` (one band more)."""
    width, steps = ab.shape
    out = np.zeros((width + 1, steps))
    out[:width] = ab
    out[1:, : steps - 1] -= gamma * ab[:, 1:]
    return out


def _shift_subtract_adjoint(grad: np.ndarray, gamma: float) -> np.ndarray:
    width = grad.shape[0] - 1
    out = grad[:width].copy()
    out[:, 1:] -= gamma * grad[1:, :-1]
    return out


# ---------------------------------------------------------------------- final loss (eq. 1)
def final_loss_factor(*, steps: int, eigenvalues, learning_rate: float, rule: UpdateRule | None = None) -> np.ndarray:
    """U of shape (T, K): ``U[j, i] = u_i(j) = s_j·[M_{T−1}⋯M_{j+1}(1, 1)ᵀ]_e`` for eigenvalue
    μ_i, ``M_k = [[1 − η_k μ_i, β], [−η_k μ_i, β]]`` (module docstring).

    Backward recursion on ``p = (p_e, p_d)``: ``p_{T−1} = (1, 0)`` and
    ``p_j = p_{j+1}·M_{j+1}``, i.e. with ``q = p_e + p_d``,
    ``p_e ← p_e − η_{j+1} μ q``, ``p_d ← β q``; ``u(j) = s_j (p_e + p_d)``. O(K·T).
    """
    rule = resolve_update_rule(rule, steps)
    mu = np.asarray(eigenvalues, dtype=np.float64).reshape(-1)
    beta = rule.momentum
    rates = learning_rate * rule.multipliers(steps)  # η_t
    s = rule.multipliers(steps)
    out = np.empty((steps, mu.size))
    pe = np.ones(mu.size)
    pd = np.zeros(mu.size)
    out[steps - 1] = s[steps - 1]
    for j in range(steps - 2, -1, -1):
        q = pe + pd
        pe = pe - (rates[j + 1] * mu) * q
        pd = beta * q
        np.multiply(pe + pd, s[j], out=out[j])
    return out


def final_loss_workload(*, steps: int, eigenvalues, multiplicities, learning_rate: float,
                        rule: UpdateRule | None = None) -> np.ndarray:
    """``W = U diag(m μ) Uᵀ`` (T, T), the eq.-1 workload of the rule:
    ``E[L(w̃_T) − L(w_T)] = (η²σ²/2)·Tr(W X⁻¹)`` on the quadratic model.

    U (``final_loss_factor``) is formed for chunks of eigenvalues at a time (at most
    ~4·10⁶ entries), each chunk adding its rank-k product; eigenvalues with
    m_i μ_i = 0 contribute nothing and are skipped. O(K·T) for U, O(T²·K) for W.
    """
    rule = resolve_update_rule(rule, steps)
    mu = np.asarray(eigenvalues, dtype=np.float64).reshape(-1)
    weights = np.asarray(multiplicities, dtype=np.float64).reshape(-1) * mu
    keep = weights > 0
    mu, weights = mu[keep], weights[keep]
    out = np.zeros((steps, steps))
    chunk = max(1, _CHUNK_ENTRIES // steps)
    for start in range(0, mu.size, chunk):
        sl = slice(start, start + chunk)
        u = final_loss_factor(steps=steps, eigenvalues=mu[sl], learning_rate=learning_rate, rule=rule)
        u *= np.sqrt(weights[sl])[None, :]
        out += u @ u.T
    return out
