"""Power-law tail fit of a Hessian spectrum (paper eq. 3; numpy/scipy only).

Paper eq. 3 models the i-th largest eigenvalue as

    log μ_i = C · [log(p₊ / i)]^α + log μ_{p₊},        i = 1 … p₊,

with μ_{p₊} = μ_min the smallest eigenvalue one cares about and p₊ the number of
eigenvalues ≥ μ_min (from an SLQ count, or exact). C > 0 and α > 0 are fitted by
least squares on log μ_i over the lower part of the k computed top eigenvalues,
indices ⌈fit_from·k⌉ … k (default fit_from = 0.5): the extrapolation into the tail is
governed by the local slope there, and fitting all of the top-k lets the few steep
leading eigenvalues pull the curve under the true tail (docs/spectrum.md, "Tail fit",
compares both fits on spectra known exactly). ``fit_from=0`` fits all top-k as in the
paper. The tail k+1 … p₊ is then represented by a few hundred geometric bins of
indices; each bin takes the fitted value at its FIRST (largest) index, so the
compressed tail lies on or above the fitted (decreasing) curve, and is capped at μ_k
(the smallest computed value, which every tail eigenvalue is below). Eigenvalues past
p₊ are taken as 0.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from keras_noisecurve._validation import check_float, check_int


@dataclasses.dataclass(frozen=True)
class TailFit:
    """Fitted parameters of paper eq. 3.

    Attributes:
      C, alpha: the fitted constants (both > 0).
      p_plus: index of the smallest eigenvalue ≥ mu_min (integer ≥ k + 1).
      mu_min: μ_{p₊}.
      k: number of computed top eigenvalues.
      fit_start: first (1-based) index used in the least-squares fit.
      r2: coefficient of determination of log μ_i over the fitted points.
      max_log_residual: max |log μ_i − fitted log μ_i| over the fitted points.
      r2_top_k, max_log_residual_top_k: the same over all top-k points (μ_i > μ_min).
    """

    C: float
    alpha: float
    p_plus: int
    mu_min: float
    k: int
    fit_start: int
    r2: float
    max_log_residual: float
    r2_top_k: float
    max_log_residual_top_k: float

    def values(self, indices) -> np.ndarray:
        """Fitted μ_i at 1-based ``indices`` (array), for 1 ≤ i ≤ p₊."""
        i = np.asarray(indices, dtype=np.float64)
        x = np.log(self.p_plus / i)
        x = np.maximum(x, 0.0)
        return np.exp(self.C * x**self.alpha + np.log(self.mu_min))

    def as_dict(self) -> dict:
        """JSON-friendly dict of the fit."""
        return {k: (float(v) if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items()}


def fit_tail(top_eigenvalues, *, p_plus: int, mu_min: float, fit_from: float = 0.5) -> TailFit:
    """Fit C and α of paper eq. 3 to the computed top eigenvalues.

    Args:
      top_eigenvalues: (k,) the largest eigenvalues, descending (μ_1 ≥ … ≥ μ_k).
        Only entries > mu_min with index < p₊ enter the fit (at least 2 are needed).
      p_plus: p₊, the number of eigenvalues ≥ mu_min (must exceed the number of fitted points).
      mu_min: μ_{p₊} > 0.
      fit_from: fraction in [0, 1): fit indices ⌈fit_from·k⌉ … k (0: all; at least 2 points).

    Returns:
      ``TailFit`` with R² and the max log-residual over the fitted points.
    """
    from scipy.optimize import least_squares

    mu = np.asarray(top_eigenvalues, dtype=np.float64).reshape(-1)
    mu_min = check_float("mu_min", mu_min, positive=True)
    p_plus = check_int("p_plus", p_plus, minimum=2)
    if mu.size < 2:
        raise ValueError(f"top_eigenvalues needs at least 2 values, got {mu.size}.")
    if np.any(np.diff(mu) > 1e-12 * max(abs(mu[0]), 1e-300)):
        raise ValueError("top_eigenvalues must be sorted in descending order.")
    if isinstance(fit_from, bool) or not 0.0 <= float(fit_from) < 1.0:
        raise ValueError(f"fit_from must lie in [0, 1), got {fit_from!r}.")
    idx = np.arange(1, mu.size + 1, dtype=np.float64)
    valid = (mu > mu_min) & (idx < p_plus)
    first = max(1, int(np.ceil(float(fit_from) * mu.size)))
    keep = valid & (idx >= first)
    if np.count_nonzero(keep) < 2:
        keep = valid
        first = 1
    if np.count_nonzero(keep) < 2:
        raise ValueError(
            f"the tail fit needs at least 2 eigenvalues > mu_min={mu_min:g} with index < p_plus={p_plus}; "
            f"got {int(np.count_nonzero(keep))}."
        )
    x = np.log(p_plus / idx[keep])
    y = np.log(mu[keep]) - np.log(mu_min)  # > 0
    # Initial guess from the log-log line log y = log C + α log x.
    A = np.stack([np.ones_like(x), np.log(x)], axis=1)
    coef, *_ = np.linalg.lstsq(A, np.log(y), rcond=None)
    c0 = float(np.exp(coef[0]))
    a0 = float(np.clip(coef[1], 1e-3, 50.0))

    def residual(theta):
        c, a = theta
        return c * x**a - y

    sol = least_squares(residual, x0=[c0, a0], bounds=([1e-12, 1e-4], [np.inf, 100.0]), method="trf")
    c, a = (float(t) for t in sol.x)

    def quality(mask):
        xs = np.log(p_plus / idx[mask])
        ys = np.log(mu[mask]) - np.log(mu_min)
        r = c * xs**a - ys
        ss_tot = float(np.sum((ys - ys.mean()) ** 2))
        return (1.0 - float(np.sum(r**2)) / ss_tot if ss_tot > 0 else 1.0), float(np.max(np.abs(r)))

    r2, max_res = quality(keep)
    r2_all, max_res_all = quality(valid)
    return TailFit(
        C=c,
        alpha=a,
        p_plus=p_plus,
        mu_min=mu_min,
        k=int(mu.size),
        fit_start=int(first),
        r2=r2,
        max_log_residual=max_res,
        r2_top_k=r2_all,
        max_log_residual_top_k=max_res_all,
    )


def tail_pairs(fit: TailFit, *, start: int, cap: float | None = None, num_bins: int = 256):
    """Compressed tail: (values, multiplicities) for indices ``start … p₊``.

    Indices are split into ≤ ``num_bins`` geometric bins [a, b); each bin's value is
    the fitted μ_a (its first, largest index), its multiplicity b − a. Values are
    capped at ``cap`` (the smallest computed eigenvalue μ_k) when given.

    Args:
      fit: a ``TailFit``.
      start: first tail index (k + 1), 1-based.
      cap: optional upper cap on tail values.
      num_bins: maximum number of bins.

    Returns:
      (values (B,), multiplicities (B,)), both float64; empty arrays when start > p₊.
    """
    start = check_int("start", start, minimum=1)
    num_bins = check_int("num_bins", num_bins, minimum=1)
    stop = fit.p_plus + 1  # exclusive
    if start >= stop:
        return np.zeros(0), np.zeros(0)
    edges = np.unique(np.round(np.geomspace(start, stop, num_bins + 1)).astype(np.int64))
    edges[0], edges[-1] = start, stop
    edges = np.unique(edges)
    lo, hi = edges[:-1], edges[1:]
    values = fit.values(lo)
    if cap is not None:
        values = np.minimum(values, float(cap))
    return values, (hi - lo).astype(np.float64)
