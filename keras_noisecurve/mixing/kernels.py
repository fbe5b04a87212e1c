"""Workload kernels shared by the objectives: validated curvature inputs, the power sums
h(n) = Σ_i a_i r_i^n and the matrices built from them, the prefix-sum and blend workloads.

numpy only. ``keras_noisecurve.mixing.workloads`` documents every workload and re-exports
these names; ``keras_noisecurve.mixing.objectives`` builds on them.
"""

from __future__ import annotations

import numpy as np

from keras_noisecurve._validation import check_float

__all__ = [
    "CurvatureInputs", "binomial_coefficients", "blend_workload", "check_blend_weight", "library_version",
    "power_sums", "prefix_workload",
]

# Largest number of (eigenvalue × exponent) entries held at once while forming h(n).
_CHUNK_ENTRIES = 4_000_000


class CurvatureInputs:
    """Validated (eigenvalues μ, multiplicities m, learning rate η, digest) of a spectrum."""

    def __init__(self, eigenvalues, multiplicities, learning_rate, digest):
        self.eigenvalues = eigenvalues
        self.multiplicities = multiplicities
        self.learning_rate = learning_rate
        self.digest = digest


def check_blend_weight(blend_weight, *, allow_auto: bool):
    """Return λ as a float in [0, 1] (or the string ``"auto"`` when allowed)."""
    if isinstance(blend_weight, str):
        if allow_auto and blend_weight == "auto":
            return "auto"
        allowed = "a number in [0, 1] or 'auto'" if allow_auto else "a number in [0, 1]"
        raise ValueError(f"blend_weight must be {allowed}; got {blend_weight!r}.")
    if blend_weight is None:
        raise ValueError(
            "objective='noisecurve-blend' needs blend_weight: a number λ in [0, 1]"
            + (" or 'auto'" if allow_auto else "")
            + "; got None."
        )
    lam = check_float("blend_weight", blend_weight)
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"blend_weight must lie in [0, 1]; got {lam}.")
    return lam


def _log_abs_and_sign(eta_mu: np.ndarray):
    """log|1 − ημ| and sign(1 − ημ) computed without cancellation (−inf where ημ = 1)."""
    log_abs = np.empty_like(eta_mu)
    below = eta_mu < 1.0
    log_abs[below] = np.log1p(-eta_mu[below])
    above = ~below
    with np.errstate(divide="ignore"):
        log_abs[above] = np.log(eta_mu[above] - 1.0)  # −inf at ημ = 1 exactly
    sign = np.where(below, 1.0, -1.0)
    return log_abs, sign


def power_sums(*, weights, eta_mu, max_power: int) -> np.ndarray:
    """``h(n) = Σ_i weights_i · (1 − ημ_i)^n`` for n = 0 … max_power, shape (max_power+1,).

    Each power is ``sign^n · exp(n·log|1 − ημ|)`` with ``log|1 − ημ|`` from ``log1p``,
    so it is accurate for ημ from 1e-12 to just below 2 and for n up to 2·10⁴;
    ``0⁰ = 1``. Cost O(K·max_power), memory bounded by chunking over eigenvalues.
    """
    weights = np.asarray(weights, dtype=np.float64)
    eta_mu = np.asarray(eta_mu, dtype=np.float64)
    log_abs, sign = _log_abs_and_sign(eta_mu)
    n = np.arange(max_power + 1, dtype=np.float64)
    parity = np.arange(max_power + 1) % 2
    out = np.zeros(max_power + 1)
    chunk = max(1, _CHUNK_ENTRIES // (max_power + 1))
    for start in range(0, eta_mu.size, chunk):
        sl = slice(start, start + chunk)
        la = log_abs[sl, None]
        with np.errstate(invalid="ignore"):
            expo = n[None, :] * la  # 0·(−inf) = nan at n = 0
        expo[:, 0] = 0.0  # 0⁰ = 1
        powers = np.exp(expo)
        powers *= np.where(parity[None, :] == 1, sign[sl, None], 1.0)
        out += weights[sl] @ powers
    return out


def _hankel_from_powers(h: np.ndarray, steps: int, rows=None) -> np.ndarray:
    """``W[j, l] = h(2T − 2 − j − l)`` for j in ``rows`` (default all), l < T."""
    j = np.arange(steps) if rows is None else np.asarray(rows)
    idx = (2 * steps - 2) - np.add.outer(j, np.arange(steps))
    return h[idx]


def _all_iterates_from_powers(h: np.ndarray, steps: int, rows=None) -> np.ndarray:
    """``W[j, l] = (1/T) Σ_{k=0}^{T−1−max(j,l)} h(|j−l| + 2k)`` via parity suffix sums.

    ``h`` must be given for n = 0 … 2T. With ``P(n) = Σ_{n'≥n, n'≡n mod 2} h(n')`` the
    sum is ``P(|j−l|) − P(2T − j − l)``.
    """
    total = h.size  # 2T + 1
    suffix = np.zeros(total + 2)
    for parity in (0, 1):
        idx = np.arange(parity, total, 2)
        # reversed cumulative sum: suffix[idx[k]] = Σ_{k' >= k} h[idx[k']]
        suffix[idx] = np.cumsum(h[idx][::-1])[::-1]
    j = np.arange(steps) if rows is None else np.asarray(rows)
    cols = np.arange(steps)
    diff = np.abs(np.subtract.outer(j, cols))
    far = 2 * steps - np.add.outer(j, cols)  # ≥ 2, ≤ 2T
    return (suffix[diff] - suffix[far]) / steps


def prefix_workload(steps: int) -> np.ndarray:
    """``AᵀA`` for the T×T lower-triangular all-ones A: ``(AᵀA)[j, l] = T − max(j, l)``."""
    j = np.arange(steps)
    return (steps - np.maximum.outer(j, j)).astype(np.float64)


def blend_workload(*, curvature: np.ndarray, blend_weight: float, prefix=None) -> np.ndarray:
    """``(1−λ)·W_curv/Tr(W_curv) + λ·AᵀA/Tr(AᵀA)``; ``Tr(AᵀA) = T(T+1)/2``.

    ``prefix``: a ``rule_workloads.PrefixMap`` to blend with ``A_ruleᵀA_rule`` instead
    of the plain prefix workload AᵀA (None).
    """
    steps = curvature.shape[0]
    lam = float(blend_weight)
    out = np.zeros_like(curvature)
    if lam < 1.0:
        tr = float(np.trace(curvature))
        if not tr > 0:
            raise ValueError(
                "the eq.-1 workload has zero trace (every eigenvalue is 0 or ημ = 1 with T > 1); "
                "it cannot be normalised for the blend."
            )
        out += (1.0 - lam) / tr * curvature
    if lam > 0.0:
        if prefix is None:
            out += lam / (steps * (steps + 1) / 2.0) * prefix_workload(steps)
        else:
            out += lam / prefix.trace() * prefix.workload()
    return out


def binomial_coefficients(exponent: float, count: int) -> np.ndarray:
    """The first ``count`` coefficients of ``(1 − x)^exponent``: f_0 = 1,
    f_k = f_{k−1}·(k − 1 − exponent)/k. exponent = −1/2 gives the Toeplitz square root of
    the prefix-sum matrix (1, 1/2, 3/8, …), +1/2 its inverse (1, −1/2, −1/8, …)."""
    k = np.arange(1, count, dtype=np.float64)
    out = np.ones(count)
    out[1:] = np.cumprod((k - 1.0 - exponent) / k)
    return out


def library_version() -> str:
    """``keras_noisecurve.__version__``, recorded in every solved C's metadata."""
    import keras_noisecurve

    return keras_noisecurve.__version__
