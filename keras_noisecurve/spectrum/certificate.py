"""Dominance certificate ρ(H, Ĥ) of paper Theorem 4.1 (numpy only).

    ρ(H, Ĥ) = max_{v ≠ 0} vᵀHv / vᵀĤv        (convention 0/0 = 0),

with H symmetric and Ĥ positive semi-definite; H ⪯ Ĥ ⇔ ρ ≤ 1. Computed as the largest
generalised eigenvalue on the range of Ĥ: with Ĥ = U Λ Uᵀ and U_r the eigenvectors whose
eigenvalues exceed ``rcond · λ_max``, ρ = λ_max(Λ_r^{-1/2} U_rᵀ H U_r Λ_r^{-1/2}).
Directions in the null space N of Ĥ have vᵀĤv = 0: if H has positive curvature there,
or zero curvature coupled to the range, the quotient is unbounded and ρ = +∞ (H ⪯ Ĥ
fails); null directions with negative curvature enter through the Schur complement
H_rr − H_rn H_nn⁻¹ H_nr (the best null-space component for each range vector); null
directions where H vanishes give 0/0 = 0 and are ignored.
"""

from __future__ import annotations

import numpy as np

from keras_noisecurve._validation import check_float


def dominance_ratio(hessian, upper, *, rcond: float = 1e-10, return_details: bool = False):
    """ρ(H, Ĥ) of paper Theorem 4.1.

    Args:
      hessian: H, (p, p) symmetric (symmetrised here).
      upper: Ĥ, (p, p) symmetric PSD (negative eigenvalues below ``rcond·λ_max`` in
        magnitude are treated as 0; larger negative ones are an error).
      rcond: relative threshold separating range and null space of Ĥ.
      return_details: also return a dict (rank of Ĥ, null-space curvature).

    Returns:
      ρ (float, possibly ``inf``), or (ρ, details).
    """
    H = np.asarray(hessian, dtype=np.float64)
    U_hat = np.asarray(upper, dtype=np.float64)
    if H.ndim != 2 or H.shape[0] != H.shape[1] or U_hat.shape != H.shape:
        raise ValueError(f"hessian and upper must be square matrices of the same shape, got {H.shape} and {U_hat.shape}.")
    rcond = check_float("rcond", rcond, positive=True)
    H = 0.5 * (H + H.T)
    lam, U = np.linalg.eigh(0.5 * (U_hat + U_hat.T))
    lam_max = float(lam[-1]) if lam.size else 0.0
    if lam_max <= 0:
        raise ValueError("upper must be positive semi-definite with a positive eigenvalue.")
    if lam[0] < -1e-6 * lam_max:
        raise ValueError(f"upper is not positive semi-definite: smallest eigenvalue {lam[0]:.3g} (largest {lam_max:.3g}).")
    keep = lam > rcond * lam_max
    Ur, Un = U[:, keep], U[:, ~keep]
    h_scale = max(float(np.max(np.abs(H))), 1e-300)
    tol = max(rcond, 1e-9) * h_scale * H.shape[0]
    H_rr = Ur.T @ H @ Ur
    null_curv = 0.0
    coupling = 0.0
    unbounded = False
    if Un.shape[1]:
        mu_n, V_n = np.linalg.eigh(Un.T @ H @ Un)
        null_curv = float(mu_n[-1])
        C = (Ur.T @ H @ Un) @ V_n  # coupling to each null-space eigendirection
        coupling = float(np.max(np.abs(C))) if C.size else 0.0
        zero = np.abs(mu_n) <= tol
        neg = mu_n < -tol
        if null_curv > tol or (C.size and np.any(np.max(np.abs(C[:, zero]), axis=0, initial=0.0) > tol)):
            # Positive curvature in null(Ĥ), or zero curvature coupled to the range:
            # vᵀHv / vᵀĤv is unbounded.
            unbounded = True
        elif np.any(neg):
            # Maximising over the null-space component (negative curvature there) gives the
            # Schur complement H_rr − H_rn H_nn⁻¹ H_nr on the range.
            Cn = C[:, neg]
            H_rr = H_rr - (Cn / mu_n[neg]) @ Cn.T
    Wr = 1.0 / np.sqrt(lam[keep])
    rho = float("inf") if unbounded else float(np.linalg.eigvalsh(Wr[:, None] * H_rr * Wr[None, :])[-1])
    if return_details:
        return rho, {
            "rank_upper": int(np.count_nonzero(keep)),
            "null_space_max_curvature": null_curv,
            "null_space_coupling": coupling,
        }
    return rho
