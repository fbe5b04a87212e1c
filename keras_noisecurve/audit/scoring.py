"""White-box canary scores that use the mechanism's own noise correlation (numpy only).

**What the auditor observes.** A white-box gradient canary owns one coordinate w_k of
the model that no other example touches, and its clipped gradient there is −ζ whenever
it participates (ζ the clip norm). With plain SGD,
``w_{t+1} = w_t − (η/B)·(Σ_i clip(g_i) + ζσ·z̃_t)``, so the per-step observation

    y_t = B·(w_{t+1,k} − w_{t,k}) / (η·ζ) = p_t − σ·z̃_t,      z̃ = C⁻¹z, z ~ N(0, I_T)     (1)

where p ∈ {0, 1}^T is the canary's participation pattern (all zeros when it is left
out) and σ the noise multiplier. Every intermediate model is released in the threat
model, so y ∈ ℝ^T is known to the attacker.

**The Neyman–Pearson statistic.** Multiplying (1) by C gives C·y = C·p − σ·z: white
noise. The hypotheses "out" and "in with pattern p" are N(0, σ²I) and N(Cp, σ²I) for
C·y, and the log-likelihood ratio is

    log LR(p) = ⟨C·y, C·p⟩/σ² − ‖C·p‖²/(2σ²) = pᵀΛy − ½ pᵀΛp,   Λ = CᵀC/σ² = Σ⁻¹,        (2)

with Σ = σ²C⁻¹C⁻ᵀ the covariance of the noise in y. By the Neyman–Pearson lemma,
thresholding (2) is the most powerful test of "out" against "in with pattern p" at every
false-positive rate; without whitening (C = I in (2), ⟨y, p⟩) the correlated noise of
DP-BandMF, Toeplitz or BLT would be counted as signal and the test would be weaker.
Under "out", (2) is N(−μ²/2, μ²) and under "in" N(+μ²/2, μ²) with μ = ‖Cp‖/σ: the
audit is a test between two Gaussians μ apart, the μ-GDP curve. For a banded C of unit
columns and participations ≥ b steps apart (fixed epochs), ‖Cp‖ = √k, so μ = √k/σ is
exactly the Gaussian mechanism the accountant analyses: the audit can be tight.

Λ may be the CLAIMED precision CᵀC/σ² (:func:`claimed_precision`) or one ESTIMATED from
probe coordinates that no example touches (their y is pure noise; :func:`empirical_precision`).
Both give (2) when the mechanism is right; the estimate also whitens the noise of a
mechanism that is NOT the claimed one (e.g. one that applies C instead of C⁻¹).

Three scores, all log-likelihood ratios of the form (2):

- :func:`plan_scores`: the canary's pattern p is known (fixed epochs: the auditor knows
  the order; the guarantee does not rely on it being secret).
- :func:`poisson_log_likelihood_ratio`: cyclic Poisson sampling, where the canary's
  partition r (uniform over b) and its participations (probability q each) are secret.
  For a banded C the columns of steps ≥ b apart have disjoint supports, so

      LR = (1/b) Σ_r Π_{t ≡ r (mod b)} (1 − q + q·exp((Λy)_t − Λ_tt/2))                   (3)

  exactly (with Λ = CᵀC/σ²).
- :func:`any_step_scores`: (3) with one partition holding every step (b = 1): evidence of
  participation at any step, also at steps the plan does not predict (re-used batches).
"""

from __future__ import annotations

import numpy as np
from scipy import special

from keras_noisecurve._validation import check_float, check_int

__all__ = [
    "any_step_scores",
    "claimed_precision",
    "empirical_precision",
    "observations_from_iterates",
    "plan_scores",
    "poisson_log_likelihood_ratio",
]


def _matrix(name, value, rows=None) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim != 2 or (rows is not None and arr.shape[0] != rows):
        want = f"({rows}, m)" if rows is not None else "(T, m)"
        raise ValueError(f"{name} must have shape {want}, got {arr.shape}.")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite.")
    return arr


def observations_from_iterates(*, iterates, learning_rate: float, batch_size: int, l2_norm_clip: float,
                               direction: float = -1.0) -> np.ndarray:
    """y of eq. (1) from the released iterates of the canary coordinates.

    Args:
      iterates: (T + 1, m) array, row t = the canaries' coordinates before step t (row T:
        after the last step).
      learning_rate: η of plain SGD; batch_size: B, the optimizer's divisor; l2_norm_clip: ζ.
      direction: the sign of a canary's clipped gradient (−1: it pushes w_k up).

    Returns:
      (T, m) array y = −direction·B·(w_{t+1} − w_t)/(η·ζ): p_t − σ·z̃_t per canary.
    """
    w = _matrix("iterates", iterates)
    scale = check_float("learning_rate", learning_rate, positive=True) * check_float(
        "l2_norm_clip", l2_norm_clip, positive=True) / check_int("batch_size", batch_size, minimum=1)
    return -float(direction) * np.diff(w, axis=0) / scale


def claimed_precision(*, mixing_dense, noise_multiplier: float) -> np.ndarray:
    """Λ = CᵀC/σ² (T × T) for the dense lower-triangular C of the claim and σ."""
    c = np.asarray(mixing_dense, dtype=np.float64)
    if c.ndim != 2 or c.shape[0] != c.shape[1]:
        raise ValueError(f"mixing_dense must be a square (T, T) matrix, got shape {c.shape}.")
    sigma = check_float("noise_multiplier", noise_multiplier, positive=True)
    return c.T @ c / sigma**2


def empirical_precision(*, probe_observations, ridge: float = 1e-6) -> np.ndarray:
    """Λ = Σ̂⁻¹ with Σ̂ = Y·Yᵀ/N the noise covariance of N probe coordinates (mean 0 known).

    Args:
      probe_observations: (T, N) observations (eq. 1) of coordinates no example touches;
        N > T is needed (N ≥ 10·T keeps the loss of power small).
      ridge: relative ridge added to the diagonal, times the mean variance.
    """
    y = _matrix("probe_observations", probe_observations)
    steps, count = y.shape
    if count <= steps:
        raise ValueError(f"need more probe coordinates than steps to estimate the noise covariance, got "
                         f"{count} probes for {steps} steps.")
    cov = y @ y.T / count
    cov += check_float("ridge", ridge, nonnegative=True) * np.trace(cov) / steps * np.eye(steps)
    return np.linalg.inv(cov)


def plan_scores(*, observations, patterns, precision) -> np.ndarray:
    """log LR (eq. 2) per canary: pᵀΛy − ½pᵀΛp.

    Args:
      observations: (T, m) y, one column per canary.
      patterns: (T, m) participation patterns p (0/1 or counts), known to the auditor.
      precision: (T, T) Λ.

    Returns:
      (m,) scores; larger = more likely included.
    """
    y = _matrix("observations", observations)
    p = _matrix("patterns", patterns, rows=y.shape[0])
    if p.shape != y.shape:
        raise ValueError(f"patterns must have the shape of observations {y.shape}, got {p.shape}.")
    lam = _precision(precision, y.shape[0])
    lp = lam @ p
    return np.einsum("tm,tm->m", lp, y) - 0.5 * np.einsum("tm,tm->m", lp, p)


def poisson_log_likelihood_ratio(*, observations, precision, bands: int, rate: float) -> np.ndarray:
    """log LR (eq. 3) per canary for cyclic Poisson sampling with b partitions and rate q.

    Args:
      observations: (T, m) y.
      precision: (T, T) Λ.
      bands: b, the number of partitions (step t belongs to partition t mod b).
      rate: q ∈ (0, 1], the per-step inclusion probability within the partition.
    """
    y = _matrix("observations", observations)
    lam = _precision(precision, y.shape[0])
    b = check_int("bands", bands, minimum=1)
    q = check_float("rate", rate, positive=True)
    if q > 1:
        raise ValueError(f"rate must be in (0, 1], got {q}.")
    evidence = lam @ y - 0.5 * np.diag(lam)[:, None]  # (T, m): log LR of one participation at t
    if q == 1.0:
        per_step = evidence
    else:  # log(1 − q + q·e^x), stable
        per_step = np.logaddexp(np.log1p(-q), np.log(q) + evidence)
    steps = y.shape[0]
    sums = np.stack([per_step[r::b].sum(axis=0) for r in range(min(b, steps))])  # (b, m)
    return special.logsumexp(sums, axis=0) - np.log(sums.shape[0])


def any_step_scores(*, observations, precision, rate: float) -> np.ndarray:
    """log LR (eq. 3 with b = 1) per canary: participation at any step with probability
    ``rate``; sensitive to participations the plan does not predict."""
    return poisson_log_likelihood_ratio(observations=observations, precision=precision, bands=1, rate=rate)


def _precision(value, steps) -> np.ndarray:
    lam = np.asarray(value, dtype=np.float64)
    if lam.shape != (steps, steps):
        raise ValueError(f"precision must have shape ({steps}, {steps}), got {lam.shape}.")
    return lam
