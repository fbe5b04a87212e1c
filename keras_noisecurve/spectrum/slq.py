"""Stochastic Lanczos quadrature (SLQ) eigenvalue counts (numpy only, no TensorFlow).

Counts the eigenvalues of a symmetric operator A (p × p) that are ≥ a threshold,
``#{i : μ_i ≥ τ} = Tr(1[A ≥ τ])``, with Hutchinson's estimator over Rademacher probes
and Gauss quadrature from m Lanczos steps per probe (Ubaru, Chen & Saad 2017; paper
§4.4 uses it for p₊, the number of eigenvalues ≥ μ_min):

    count ≈ (p / N) Σ_probes Σ_j (e₁ᵀ s_j)² · 1[θ_j ≥ τ]

where (θ_j, s_j) are the eigenpairs of the probe's m × m tridiagonal matrix.
The standard error is the sample standard deviation over probes / √N; it covers the
probe noise, not the quadrature bias (which shrinks as m grows and is largest when
many eigenvalues sit right at τ).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from keras_noisecurve._validation import check_float, check_int
from keras_noisecurve.spectrum.lanczos import Matvec, _progress, lanczos_tridiagonal, tridiagonal_eigh


@dataclasses.dataclass(frozen=True)
class SLQResult:
    """Output of ``slq_count``.

    Attributes:
      estimate: estimated number of eigenvalues ≥ threshold (a real number).
      stderr: standard error over probes.
      per_probe: (N,) the per-probe estimates.
      num_matvecs: matvec calls (N × m).
    """

    estimate: float
    stderr: float
    per_probe: np.ndarray
    num_matvecs: int


def slq_count(
    matvec: Matvec,
    *,
    dimension: int,
    threshold: float,
    probes: int = 16,
    steps: int = 80,
    seed: int | None = None,
    verbose: bool = False,
) -> SLQResult:
    """Estimate #{eigenvalues ≥ threshold} of a symmetric operator by SLQ.

    Args:
      matvec: v ↦ A·v, (p,) float64 → (p,).
      dimension: p.
      threshold: τ (same units as the eigenvalues).
      probes: N ≥ 2 Rademacher probe vectors.
      steps: m Lanczos steps per probe (fully reorthogonalised), ≤ p.
      seed: probe seed.
      verbose: progress bar over probes.

    Returns:
      ``SLQResult`` with the estimate, its standard error and the matvec count.
    """
    p = check_int("dimension", dimension, minimum=1)
    threshold = check_float("threshold", threshold)
    n = check_int("probes", probes, minimum=2)
    m = check_int("steps", steps, minimum=1)
    m = min(m, p)
    rng = np.random.default_rng(seed)
    per_probe = np.zeros(n)
    calls = 0
    bar = _progress(n, verbose, "SLQ count")
    for i in range(n):
        z = rng.integers(0, 2, size=p).astype(np.float64) * 2.0 - 1.0
        alpha, beta, _, c = lanczos_tridiagonal(matvec, z, m, reorthogonalize=True, rng=rng, keep_basis=False)
        calls += c
        theta, s = tridiagonal_eigh(alpha, beta)
        weights = s[0, :] ** 2
        per_probe[i] = p * float(np.sum(weights[theta >= threshold]))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return SLQResult(
        estimate=float(per_probe.mean()),
        stderr=float(per_probe.std(ddof=1) / np.sqrt(n)),
        per_probe=per_probe,
        num_matvecs=calls,
    )
