r"""Objective ``Tr(W X⁻¹)`` of a lower-triangular Toeplitz C, its gradient, and the
multi-participation sensitivity, in O(T log T) (prefix sums: O(T·b) for a b-banded C).

numpy/scipy only. Conventions as in ``keras_noisecurve.mixing.workloads``: steps
t = 0 … T−1, C lower-triangular T×T, noise ``z̃ = C⁻¹z``, ``X = CᵀC``. A Toeplitz C is
given by its first column c (length T, c₀ > 0): ``C[t, s] = c_{t−s}``.

Workloads (:class:`ToeplitzWorkload`)::

    W = α·AᵀA + β·Σ_i a_i u_i u_iᵀ,     u_i(j) = r_i^{T−1−j},

A the all-ones lower-triangular matrix. ``bandmf`` is (α, β) = (1, 0); ``noisecurve``
(paper eq. 1) is (0, 1) with ``a_i = m_i μ_i``, ``r_i = 1 − ημ_i``; ``noisecurve-blend``
is ``α = λ/Tr(AᵀA)``, ``β = (1 − λ)/Tr(W_curv)``. The other objectives are not sums of
this form and are refused.

Derivation. Lower-triangular Toeplitz matrices are the power series truncated at
x^T: they commute, and C⁻¹ is Toeplitz with first column ``inv = 1/c(x) mod x^T``.

* Prefix part. ``A C⁻¹`` is Toeplitz with first column ``P = cumsum(inv)``, so
  ``‖A C⁻¹‖_F² = Σ_m (T − m) P_m²``. Its gradient in ``inv`` is the reverse cumulative
  sum of ``2 (T − m) P_m``.
* Curvature part. ``Tr(W_curv X⁻¹) = Σ_i a_i ‖u_iᵀ C⁻¹‖²`` and
  ``(u_iᵀ C⁻¹)[s] = v_i(T−1−s)`` with ``v_i(n) = Σ_{m≤n} r_i^{n−m} inv_m`` (a first-order
  IIR filter of inv), so the part is ``Σ_i a_i Σ_n v_i(n)²``. Expanding the square,
  this is the quadratic form ``invᵀ G inv`` with

      G[m, m'] = Σ_i a_i Σ_{n=max(m,m')}^{T−1} r_i^{2n−m−m'} = S(|m − m'|) − S(2T − m − m'),

  ``h(n) = Σ_i a_i r_i^n`` (n = 0 … 2T) and the parity suffix sums
  ``S(n) = Σ_{n' ≥ n, n' ≡ n (mod 2)} h(n')`` — the construction of the all-iterates
  workload in ``workloads.py`` (no ``1/(1 − r²)`` factor, so no cancellation when ημ is
  tiny). G is Toeplitz minus Hankel, so ``G·inv`` is two FFT convolutions whose kernel
  transforms are cached on the workload. Cost: O(K·T) once per workload (``h``, by
  ``workloads.power_sums``), then O(T log T) per evaluation whatever K is. The gradient
  in inv is ``2 G inv``.
* Chain rule to c. ``inv·c = 1`` gives ``d inv = −inv * dc * inv`` (truncated
  convolution), hence with ``g = ∂L/∂inv``

      ∂L/∂c_j = −Σ_{k ≥ j} g_k (inv * inv)_{k−j} = −(C⁻ᵀ C⁻ᵀ g)_j,

  two correlations with inv.

Numerics. If the column has at most ``LFILTER_MAX_SUPPORT`` leading non-zeros (a banded
C), inv and both correlations are exact recursions (``scipy.signal.lfilter``, O(T·b),
forward substitution). Otherwise inv is the Newton iteration ``g ← g − g·(c·g − 1)`` on
doubling lengths and the correlations use ``scipy.fft`` at ``next_fast_len`` sizes
(absolute rounding error ≈ ε·‖·‖ per convolution). The curvature matvec always uses FFTs.
Both paths are tested against dense ``np.linalg.inv`` in ``tests/mixing/test_toeplitz_loss.py``.

Sensitivity (:func:`participation_sensitivity`): for k participations ``separation``
steps apart starting at step 0, ``‖Σ_{i<k} shift(c, i·sep)‖²`` with each shifted copy
truncated at T — the square of ``ToeplitzFamily.sensitivity`` whenever that one uses
the shifted-sum formula.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import scipy.fft
import scipy.signal

from keras_noisecurve._validation import check_int
from keras_noisecurve.mixing.objectives import TOEPLITZ_OBJECTIVES, get_objective
from keras_noisecurve.mixing.workloads import (
    check_curvature_inputs,
    check_unused_inputs,
    power_sums,
    prefix_workload,
)

__all__ = [
    "LFILTER_MAX_SUPPORT",
    "TOEPLITZ_OBJECTIVES",
    "ToeplitzWorkload",
    "inverse_column",
    "inverse_loss",
    "participation_sensitivity",
    "toeplitz_loss",
]

#: Columns with at most this many leading non-zeros use exact O(T·b) recursions.
LFILTER_MAX_SUPPORT = 128


def _fast_len(n: int) -> int:
    return scipy.fft.next_fast_len(int(n), real=True)


@dataclasses.dataclass(frozen=True, eq=False)
class ToeplitzWorkload:
    """``W = α·AᵀA + β·Σ_i a_i u_i u_iᵀ`` with ``u_i(j) = r_i^{T−1−j}`` (module docstring).

    Attributes:
      steps: T ≥ 1.
      alpha: α ≥ 0, weight of the prefix-sum workload AᵀA.
      beta: β ≥ 0, weight of the eq.-1 (curvature) part.
      r: shape (K,), the ratios r_i (``1 − ημ_i`` for eq. 1); K may be 0.
      a: shape (K,), the weights a_i ≥ 0 (``m_i μ_i`` for eq. 1).
      eta_mu: optional shape (K,), ``1 − r`` given exactly (powers of r are formed
        from ``log1p(−ημ)``, accurate when ημ is tiny); default ``1 − r``.
      objective, learning_rate, blend_weight, spectrum_digest: provenance, set by
        :meth:`from_objective` (None otherwise).
    """

    steps: int
    alpha: float
    beta: float
    r: np.ndarray
    a: np.ndarray
    eta_mu: Optional[np.ndarray] = None
    objective: Optional[str] = None
    learning_rate: Optional[float] = None
    blend_weight: Optional[float] = None
    spectrum_digest: Optional[str] = None
    _cache: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        steps = check_int("steps", self.steps, minimum=1)
        alpha, beta = float(self.alpha), float(self.beta)
        for name, value in (("alpha", alpha), ("beta", beta)):
            if not (np.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0; got {value!r}.")
        r = np.array(self.r, dtype=np.float64, copy=True).reshape(-1)
        a = np.array(self.a, dtype=np.float64, copy=True).reshape(-1)
        if r.shape != a.shape:
            raise ValueError(f"r and a must have the same shape; got {r.shape} and {a.shape}.")
        if not (np.all(np.isfinite(r)) and np.all(np.isfinite(a))):
            raise ValueError("r and a must be finite.")
        if np.any(a < 0):
            raise ValueError(f"every a_i must be >= 0 (W is PSD); got {a[a < 0][:3].tolist()}.")
        if beta > 0 and r.size and np.any(np.abs(r) > 1.0):
            raise ValueError(f"every |r_i| must be <= 1 (gradient descent converges); got "
                             f"{r[np.abs(r) > 1][:3].tolist()}.")
        eta_mu = 1.0 - r if self.eta_mu is None else np.array(self.eta_mu, dtype=np.float64, copy=True).reshape(-1)
        if eta_mu.shape != r.shape:
            raise ValueError(f"eta_mu must have the shape of r {r.shape}; got {eta_mu.shape}.")
        for arr in (r, a, eta_mu):
            arr.setflags(write=False)
        object.__setattr__(self, "steps", steps)
        object.__setattr__(self, "alpha", alpha)
        object.__setattr__(self, "beta", beta)
        object.__setattr__(self, "r", r)
        object.__setattr__(self, "a", a)
        object.__setattr__(self, "eta_mu", eta_mu)

    @classmethod
    def from_objective(cls, *, objective, steps, spectrum=None, learning_rate=None,
                       blend_weight=None) -> "ToeplitzWorkload":
        """The workload of ``objective`` ∈ ``TOEPLITZ_OBJECTIVES`` (validated as in
        ``workloads.workload_matrix``; plain constant-rate SGD only).

        Raises:
          ValueError: another objective (``dpsgd``, ``noisecurve-all-iterates``,
            ``noisecurve-convergence`` are not of the Toeplitz-workload form), steps < 1,
            or invalid / unused spectrum, learning rate or blend weight.
        """
        spec = get_objective(objective)
        if not spec.toeplitz:
            spec.toeplitz_workload(cls, steps=steps)  # raises: the message lists the supported ones
        steps = check_int("steps", steps, minimum=1)
        check_unused_inputs(objective, spectrum=spectrum, learning_rate=learning_rate, blend_weight=blend_weight)
        inputs = None
        if spec.curvature:
            inputs = check_curvature_inputs(objective=objective, spectrum=spectrum, learning_rate=learning_rate)
        return spec.toeplitz_workload(cls, steps=steps, inputs=inputs, blend_weight=blend_weight)

    # ----------------------------------------------------------- curvature part
    @property
    def has_curvature(self) -> bool:
        return self.beta > 0 and self.a.size > 0 and bool(np.any(self.a > 0))

    def _suffix_sums(self) -> np.ndarray:
        """S(n), n = 0 … 2T (module docstring); O(K·T) once, cached."""
        if "suffix" not in self._cache:
            h = power_sums(weights=self.a, eta_mu=self.eta_mu, max_power=2 * self.steps)
            suffix = np.zeros_like(h)
            for parity in (0, 1):
                suffix[parity::2] = np.cumsum(h[parity::2][::-1])[::-1]
            self._cache["suffix"] = suffix
        return self._cache["suffix"]

    def curvature_trace(self) -> float:
        """``Tr(Σ_i a_i u_i u_iᵀ) = Σ_{k<T} h(2k) = S(0) − S(2T)``."""
        s = self._suffix_sums()
        return float(s[0] - s[2 * self.steps])

    def _curvature_kernels(self):
        """rfft of the Toeplitz kernel S(|n − (T−1)|) and the Hankel kernel S(2T − n), n < 2T−1."""
        if "kernels" not in self._cache:
            steps = self.steps
            s = self._suffix_sums()
            n = np.arange(2 * steps - 1)
            size = _fast_len(2 * steps - 1)
            toep = scipy.fft.rfft(s[np.abs(n - (steps - 1))], size)
            hank = scipy.fft.rfft(s[2 * steps - n], size)
            self._cache["kernels"] = (size, toep, hank)
        return self._cache["kernels"]

    def curvature_matvec(self, x: np.ndarray) -> np.ndarray:
        """``G x`` with ``G[m, m'] = S(|m − m'|) − S(2T − m − m')`` (no β), by FFT."""
        steps = self.steps
        size, toep, hank = self._curvature_kernels()
        spec = scipy.fft.rfft(x, size) * toep - scipy.fft.rfft(x[::-1], size) * hank
        return scipy.fft.irfft(spec, size)[steps - 1: 2 * steps - 1]

    # ------------------------------------------------------------------- dense
    def dense(self) -> np.ndarray:
        """The dense (T, T) W (O(K·T + T²) memory; for tests at small T)."""
        steps = self.steps
        w = self.alpha * prefix_workload(steps) if self.alpha else np.zeros((steps, steps))
        if self.beta and self.a.size:
            u = self.r[:, None] ** np.arange(steps - 1, -1, -1)[None, :].astype(np.float64)  # 0⁰ = 1
            w += self.beta * (u.T * self.a) @ u
        return w


def _check_column(column, steps: int) -> np.ndarray:
    c = np.asarray(column, dtype=np.float64)
    if c.ndim != 1 or c.shape[0] != steps:
        raise ValueError(f"column must have shape ({steps},) (the workload's steps); got {c.shape}.")
    if not np.all(np.isfinite(c)):
        raise ValueError("column must be finite.")
    if not c[0] > 0:
        raise ValueError(f"column[0] = c_0 must be > 0 (C has a positive diagonal); got {c[0]!r}.")
    return c


def _support(c: np.ndarray) -> int:
    nz = np.flatnonzero(c)
    return int(nz[-1]) + 1


def _newton_inverse(c: np.ndarray) -> np.ndarray:
    """1/c(x) mod x^T by Newton's iteration on doubling lengths (FFT products)."""
    steps = c.shape[0]
    g = np.array([1.0 / c[0]])
    n = 1
    while n < steps:
        m = min(2 * n, steps)
        size = _fast_len(m)  # ≥ m: wrap-around only lands in the known low part [0, n)
        gf = scipy.fft.rfft(g, size)
        high = scipy.fft.irfft(scipy.fft.rfft(c[:m], size) * gf, size)[n:m]  # (c·g)[n:m]
        delta = scipy.fft.irfft(gf * scipy.fft.rfft(high, size), size)[: m - n]
        g = np.concatenate([g, -delta])
        n = m
    return g


def inverse_column(column) -> np.ndarray:
    """inv, the first column of C⁻¹ (``1/c(x) mod x^T``), shape (T,)."""
    c = np.asarray(column, dtype=np.float64)
    if c.ndim != 1 or c.size == 0 or not c[0] > 0:
        raise ValueError(f"column must be a non-empty 1-d array with column[0] > 0; got shape {c.shape}.")
    support = _support(c)
    if support <= LFILTER_MAX_SUPPORT:
        impulse = np.zeros(c.shape[0])
        impulse[0] = 1.0
        return scipy.signal.lfilter([1.0], c[:support], impulse)
    return _newton_inverse(c)


def inverse_loss(inverse, workload: ToeplitzWorkload, *, gradient: bool = True):
    """``Tr(W X⁻¹)`` as a function of inv = first column of C⁻¹, and ``∂/∂inv``.

    For strategies whose inverse has a cheap closed form (e.g. a rational one); see
    :func:`toeplitz_loss` for the formulas. Returns ``(value, grad or None)``.
    """
    inv = np.asarray(inverse, dtype=np.float64)
    steps = workload.steps
    if inv.shape != (steps,):
        raise ValueError(f"inverse must have shape ({steps},); got {inv.shape}.")
    value = 0.0
    grad = np.zeros(steps) if gradient else None
    if workload.alpha:
        weights = np.arange(steps, 0, -1, dtype=np.float64)  # T − m
        prefix = np.cumsum(inv)
        value += workload.alpha * float(np.dot(weights, prefix * prefix))
        if gradient:
            grad += (2.0 * workload.alpha) * np.cumsum((weights * prefix)[::-1])[::-1]
    if workload.has_curvature:
        g_inv = workload.curvature_matvec(inv)
        value += workload.beta * float(np.dot(inv, g_inv))
        if gradient:
            grad += (2.0 * workload.beta) * g_inv
    return value, grad


def _double_correlation(x: np.ndarray, c: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """``C⁻ᵀ C⁻ᵀ x``: ``Σ_{k ≥ j} x_k (inv * inv)_{k−j}`` for j < T."""
    steps = x.shape[0]
    support = _support(c)
    if support <= LFILTER_MAX_SUPPORT:
        y = scipy.signal.lfilter([1.0], c[:support], x[::-1])
        y = scipy.signal.lfilter([1.0], c[:support], y)
        return y[::-1]
    size = _fast_len(3 * steps - 2)  # the triple product is linear up to index 3T−3
    inv_f = scipy.fft.rfft(inv, size)
    return scipy.fft.irfft(scipy.fft.rfft(x[::-1], size) * inv_f * inv_f, size)[:steps][::-1]


def toeplitz_loss(column, workload: ToeplitzWorkload, *, gradient: bool = True):
    """``Tr(W X⁻¹)`` for the Toeplitz C with first column ``column``, and its gradient.

    Args:
      column: c, shape (T,) with T = ``workload.steps`` and c₀ > 0. Not normalised:
        the privacy cost of C is the caller's (multiply by sensitivity², e.g.
        :func:`participation_sensitivity`).
      workload: a :class:`ToeplitzWorkload`.
      gradient: also return ``∂/∂c`` (shape (T,)); otherwise None.

    Returns:
      ``(value, grad)``. Derivation in the module docstring: inv = 1/c(x) mod x^T;
      ``value = α Σ_m (T−m) P_m² + β invᵀ G inv`` (P = cumsum(inv)), and
      ``grad = −C⁻ᵀC⁻ᵀ (∂value/∂inv)``.

    Cost: prefix part O(T·b) for a column with b ≤ ``LFILTER_MAX_SUPPORT`` leading
    non-zeros, else O(T log T); curvature part O(T log T) per call after an O(K·T)
    precomputation cached on the workload.
    """
    if not isinstance(workload, ToeplitzWorkload):
        raise TypeError(f"workload must be a ToeplitzWorkload; got {type(workload).__name__}.")
    c = _check_column(column, workload.steps)
    inv = inverse_column(c)
    value, g_inv = inverse_loss(inv, workload, gradient=gradient)
    if not gradient:
        return value, None
    return value, -_double_correlation(g_inv, c, inv)


def participation_sensitivity(column, *, participations, separation=None, gradient: bool = True):
    """Squared L2 sensitivity of k participations ``separation`` steps apart, from step 0.

    ``sens² = ‖Σ_{i<k} shift(c, i·sep)‖²``, each shifted copy truncated at T (k = 1:
    ``‖c‖²``), and its gradient ``2 Σ_{i<k} s[j + i·sep]`` (s the shifted sum). Equals
    ``ToeplitzFamily.sensitivity(...)²`` where that uses the shifted-sum formula
    (non-negative coefficients; for a b-banded C with sep ≥ b and every participation
    starting before T − b + 1 both give k·‖c‖²).

    Returns ``(sens², grad or None)``.
    """
    c = np.asarray(column, dtype=np.float64)
    if c.ndim != 1 or c.size == 0:
        raise ValueError(f"column must be a non-empty 1-d array; got shape {c.shape}.")
    k = check_int("participations", participations, minimum=1)
    if k == 1:
        return float(np.dot(c, c)), (2.0 * c if gradient else None)
    sep = check_int("separation", separation, minimum=1)
    steps = c.shape[0]
    rows = -(-steps // sep)
    padded = np.zeros(rows * sep)
    padded[:steps] = c
    grid = np.cumsum(padded.reshape(rows, sep), axis=0)  # [r, j] = Σ_{i ≤ r} c[(r − i)s + j]
    if k < rows:
        grid[k:] -= grid[:-k].copy()
    total = grid.reshape(-1)[:steps]
    value = float(np.dot(total, total))
    if not gradient:
        return value, None
    padded = np.zeros(rows * sep)
    padded[:steps] = total
    back = np.cumsum(padded.reshape(rows, sep)[::-1], axis=0)  # reversed rows: Σ_{i ≤ r'} s[...]
    if k < rows:
        back[k:] -= back[:-k].copy()
    return value, 2.0 * back[::-1].reshape(-1)[:steps]

