"""The banded mixing-matrix solver: paper Problem (1) over C directly.

``solve_mixing_matrix`` minimises ``Tr(W X⁻¹)``, X = CᵀC, over lower-triangular,
b-banded C whose columns have unit L2 norm (docs/design.md#notation), for any workload W
of ``keras_noisecurve.mixing.workloads``. The measurements behind the settings below are
in docs/mixing.md ("Solver speed").

Method.

* Parametrisation: raw band values B (only the T·b − b(b−1)/2 entries inside the
  matrix); C = B with each column divided by its norm, so the unit-column constraint
  holds exactly at every iterate (no projection, and no Cholesky of X, whose
  ``numpy.linalg.cholesky`` factor has the wrong orientation X = LLᵀ). The gradient
  follows by the chain rule: ``∂f/∂B_col = (g_col − C_col·(C_colᵀ g_col)) / ‖B_col‖``.
  Rows with a negative diagonal are flipped at the end (``X = CᵀC`` is invariant under
  row signs).
* Objective and gradient ``∂f/∂C = −2 C⁻ᵀWC⁻¹C⁻ᵀ`` (band entries only) with banded
  triangular solves, never a dense inverse. W is split as
  ``W ≈ RRᵀ + α·AᵀA + ε·I``: R (T×k) by pivoted Cholesky of the curvature part,
  stopped once the discarded trace is ≤ ``TRUNCATION_RELATIVE``·Tr(W) (the discarded
  part is PSD, so the surrogate never over-states a direction W weights); the prefix
  part and the identity part use an O(T·b²) block recursion. One evaluation costs
  O(T·b·k) for a rank-k curvature part, not O(T²·b).
* Ridge: when the curvature workload is numerically rank-deficient (pivoted Cholesky
  stops at k < T), ``ε = RIDGE_RELATIVE·Tr(W)/T`` is added (W + εI). Without it the
  infimum of ``Tr(W X⁻¹)`` may sit at a singular X (e.g. a one-value spectrum gives a
  rank-one W). With it, ``ε·Tr(X⁻¹) ≤ f(C_bandmf)`` bounds ``‖X⁻¹‖`` on the level set,
  so a minimiser with X ≻ 0 exists. ρ = ``RIDGE_RELATIVE`` is 10⁶ × the truncation
  tolerance, so the ridge, not the truncation, decides the directions W does not
  weight; smaller ρ leaves the optimiser drifting along them, larger ρ moves the
  optimum. The reported ``loss`` is always the exact ``Tr(W X⁻¹)`` without the ridge;
  ``metadata["ridge"]`` records ε and ``metadata["solver"]["surrogate_loss"]`` the
  minimised value.
* L-BFGS-B (scipy) on f/f₀ (f₀ = the loss at the initial C), which makes every
  iterate independent of the scale of W. When the workload needed a ridge the
  variables are rescaled by a diagonal preconditioner (≈ |diag ∇²f|^{−1/2}, estimated by
  coloured finite-difference probes of the gradient, re-estimated every
  ``PRECONDITION_REFRESH`` iterations; see ``_diagonal_scaling``): the ridge makes the
  curvature objectives very ill-conditioned, and the rescaling cuts the iterations
  several-fold. Full-rank workloads (DP-BandMF, all-iterates, convergence; no ridge)
  converge in tens to a few hundred plain iterations, fewer than the
  b × ``PROBE_COLOURS`` probe gradients cost.
  Stopping is scale-free: converged means the relative optimality ``‖P(∇_C f)‖₂ / f``
  (P: projection onto the tangent space of the unit-column constraint) fell below
  ``tol``; the other stops (``max_iterations``, no progress) say "not converged" (see
  ``_minimize_impl``). ``metadata["solver"]`` records which rule fired, the relative
  optimality and the relative loss change over the last 200 iterations.
* Initialisation: curvature objectives start from the DP-BandMF solution for the same
  (T, b), which is also the reported baseline; DP-BandMF starts from the banded,
  column-normalised Toeplitz square root of the prefix-sum matrix.
"""
from __future__ import annotations

import math
import time

import numpy as np
from scipy.linalg import lapack
from scipy.optimize import minimize

from keras_noisecurve._validation import check_choice, check_float, check_int
from keras_noisecurve.mixing.matrix import MixingMatrix
from keras_noisecurve.mixing.workloads import (
    AUTO_BLEND_GRID,
    CURVATURE_OBJECTIVES,
    DEFAULT_OBJECTIVE,
    OBJECTIVES,
    blend_workload,
    check_blend_weight,
    check_curvature_inputs,
    check_unused_inputs,
    curvature_workload,
    prefix_workload,
)

#: Ridge ρ: ε = ρ·Tr(W)/T is added to a numerically rank-deficient curvature workload.
RIDGE_RELATIVE = 1e-6
#: Pivoted Cholesky of W stops once the discarded trace is ≤ this × Tr(W).
TRUNCATION_RELATIVE = 1e-12
#: ``blend_weight="auto"`` keeps the peak running-noise-sum std within this × DP-BandMF's.
AUTO_BLEND_FACTOR = 1.5
AUTO_BLEND_RULE = (
    "smallest λ in {grid} whose solved C has max_t ‖(A C⁻¹)[t,:]‖ <= {factor} × that of the "
    "DP-BandMF C (same T, b); λ = 1 is DP-BandMF, so the rule always terminates"
)


# --------------------------------------------------------------------------- banded linear algebra
# Banded linear algebra for the mixing-matrix solver (numpy/scipy only).
#
# Layout: a lower-triangular matrix L with bandwidth w (``L[r, c] = 0`` unless
# ``0 <= r − c < w``) is stored column-wise as ``ab`` of shape (w, T) with
# ``ab[d, c] = L[c + d, c]`` (LAPACK lower band storage); entries with ``c + d >= T``
# are 0. The artifact's ``band_values[t, j] = C[t, t − j]`` converts with
# ``ab[j, :T−j] = band_values[j:, j]``.
#
# Nothing here forms a dense T×T inverse or does an O(T³) solve:
#
# * ``lowrank_term``: ``‖L⁻ᵀR‖_F²`` (= ``Tr(RRᵀ X⁻¹)`` for X = LᵀL) and its band
#   gradient ``−2 L⁻ᵀRRᵀL⁻¹L⁻ᵀ`` with two banded triangular solves (LAPACK ``dtbtrs``),
#   O(T·w·k) for R of shape (T, k).
# * ``inverse_frobenius_term``: ``‖L⁻¹‖_F² = Tr((LᵀL)⁻¹)`` and its band gradient in
#   O(T·β²) by a block recursion over β×β blocks (β ≥ w − 1) and its adjoint. With
#   block rows ``N_t`` of L⁻¹, ``N_t = L_t⁻¹(E_t − B_t N_{t−1})`` (L_t the diagonal
#   block, B_t the sub-diagonal block) so the diagonal blocks of ``L⁻¹L⁻ᵀ`` obey
#   ``S_t = L_t⁻¹(I + B_t S_{t−1} B_tᵀ)L_t⁻ᵀ`` and ``‖L⁻¹‖_F² = Σ_t Tr S_t``.
#   Applied to L = C it is the DP-SGD workload (W = I); applied to L = C·A⁻¹ (bandwidth
#   w + 1) it is the prefix-sum workload ``‖A C⁻¹‖_F²`` (DP-BandMF), and ``diag S_t``
#   gives the running-noise-sum variances.
# * ``trace_w_xinv``: ``Tr(C⁻ᵀ W C⁻¹)`` for a dense W with two banded solves of T
#   right-hand sides each, O(T²·w) (used for exact reporting).


def band_values_to_ab(band_values: np.ndarray) -> np.ndarray:
    """(T, b) artifact band values → (b, T) column band storage."""
    steps, bands = band_values.shape
    ab = np.zeros((bands, steps))
    for j in range(bands):
        ab[j, : steps - j] = band_values[j:, j]
    return ab


def ab_to_band_values(ab: np.ndarray) -> np.ndarray:
    """(b, T) column band storage → (T, b) artifact band values."""
    bands, steps = ab.shape
    bv = np.zeros((steps, bands))
    for j in range(bands):
        bv[j:, j] = ab[j, : steps - j]
    return bv


def valid_mask(bands: int, steps: int) -> np.ndarray:
    """Boolean (b, T) mask of the entries of ``ab`` that lie inside the matrix."""
    d = np.arange(bands)[:, None]
    c = np.arange(steps)[None, :]
    return c + d < steps


def solve_lower(ab: np.ndarray, rhs: np.ndarray, *, transpose: bool) -> np.ndarray:
    """``L⁻¹ rhs`` (or ``L⁻ᵀ rhs``) for banded lower-triangular L in ``ab`` storage.

    Raises:
      np.linalg.LinAlgError: if L has a zero diagonal entry.
    """
    rhs2 = rhs.reshape(rhs.shape[0], -1)
    x, info = lapack.dtbtrs(ab, np.asfortranarray(rhs2), uplo="L", trans="T" if transpose else "N")
    if info != 0:
        raise np.linalg.LinAlgError(f"banded triangular solve failed (dtbtrs info={info}): singular C.")
    return x.reshape(rhs.shape)


def lowrank_term(ab: np.ndarray, factor: np.ndarray, *, gradient: bool = True):
    """``f = ‖L⁻ᵀR‖_F²`` and ``∂f/∂ab`` (band entries of ``−2 L⁻ᵀRRᵀL⁻¹L⁻ᵀ``)."""
    s = solve_lower(ab, factor, transpose=True)  # L⁻ᵀ R
    value = float(np.einsum("ij,ij->", s, s))
    if not gradient:
        return value, None
    q = solve_lower(ab, s, transpose=False)  # L⁻¹ L⁻ᵀ R
    width, steps = ab.shape
    grad = np.zeros_like(ab)
    for d in range(width):
        # ∂f/∂L[c+d, c] = −2 Σ_k S[c+d, k] Q[c, k]
        grad[d, : steps - d] = -2.0 * np.einsum("ij,ij->i", s[d:], q[: steps - d])
    return value, grad


class _BlockIndex:
    """Index maps between band storage (w, T) and stacks of β×β blocks."""

    def __init__(self, width: int, steps: int, block: int):
        self.width, self.steps, self.block = width, steps, block
        n = -(-steps // block)
        self.n = n
        self.padded = n * block
        i = np.arange(block)[:, None]
        k = np.arange(block)[None, :]
        starts = (np.arange(n) * block)[:, None, None]
        d_diag = np.broadcast_to(i - k, (n, block, block))
        self.diag_valid = (d_diag >= 0) & (d_diag < width)
        self.diag_d = np.where(self.diag_valid, d_diag, width)  # row `width` of the extended array is 0
        self.diag_c = np.broadcast_to(starts + k, (n, block, block))
        d_sub = np.broadcast_to(block + i - k, (n, block, block))
        self.sub_valid = (d_sub < width) & (starts >= block)
        self.sub_d = np.where(self.sub_valid, d_sub, width)
        self.sub_c = np.broadcast_to(np.maximum(starts - block, 0) + k, (n, block, block))
        # flat indices into the extended (w + 1, padded) array: ``take`` and ``put`` on them
        # are several times faster than 2-D fancy indexing
        shape = (width + 1, self.padded)
        self.diag_flat = np.ravel_multi_index((self.diag_d, self.diag_c), shape)
        self.sub_flat = np.ravel_multi_index((self.sub_d, self.sub_c), shape)
        self.diag_valid_flat = self.diag_flat[self.diag_valid]
        self.sub_valid_flat = self.sub_flat[self.sub_valid]

    def blocks(self, ab: np.ndarray):
        ext = np.zeros((self.width + 1, self.padded))
        ext[: self.width, : self.steps] = ab
        ext[0, self.steps :] = 1.0  # identity padding
        flat = ext.ravel()
        return flat.take(self.diag_flat), flat.take(self.sub_flat)

    def scatter(self, g_diag: np.ndarray, g_sub: np.ndarray) -> np.ndarray:
        ext = np.zeros((self.width + 1, self.padded))
        flat = ext.ravel()
        flat.put(self.diag_valid_flat, g_diag[self.diag_valid])
        flat.put(self.sub_valid_flat, g_sub[self.sub_valid])
        return ext[: self.width, : self.steps]


_INDEX_CACHE: dict = {}


def _block_index(width: int, steps: int) -> _BlockIndex:
    # β = max(w, 16): the recursion costs O(T·β²) flops plus a Python step per block, so
    # β should be small but not so small that the Python loop dominates.
    block = max(width, 16)
    key = (width, steps, block)
    if key not in _INDEX_CACHE:
        if len(_INDEX_CACHE) > 16:
            _INDEX_CACHE.clear()
        _INDEX_CACHE[key] = _BlockIndex(width, steps, block)
    return _INDEX_CACHE[key]


def _lower_triangular_inverse(blocks: np.ndarray) -> np.ndarray:
    """Inverses of a stack (n, β, β) of lower-triangular blocks, row by row (forward
    substitution batched over the n blocks; faster than a batched LU solve at small β)."""
    n, size, _ = blocks.shape
    out = np.zeros_like(blocks)
    inv_diag = 1.0 / np.diagonal(blocks, axis1=1, axis2=2)
    for i in range(size):
        out[:, i, :i] = -(blocks[:, i : i + 1, :i] @ out[:, :i, :i])[:, 0, :] * inv_diag[:, i, None]
        out[:, i, i] = inv_diag[:, i]
    return out


def _congruence_recursion(k: np.ndarray, f: np.ndarray) -> np.ndarray:
    """``S_0 = K_0``, ``S_t = K_t + F_t S_{t−1} F_tᵀ`` for stacks (n, β, β); ``F_0`` unused.

    Two steps at a time (``S_t = K_t + F_t K_{t−1} F_tᵀ + (F_t F_{t−1}) S_{t−2} (F_t F_{t−1})ᵀ``
    for even t, batched; then every odd t from its even predecessor, batched): the Python
    loop, which dominates at small β, runs n/2 times instead of n.
    """
    n = k.shape[0]
    out = np.array(k)  # a copy, so that k is left alone
    if n < 3:
        for t in range(1, n):
            out[t] = k[t] + f[t] @ out[t - 1] @ f[t].T
        return out
    even = np.arange(2, n, 2)
    f_even, f_before = f[even], f[even - 1]
    k2 = k[even] + f_even @ k[even - 1] @ np.transpose(f_even, (0, 2, 1))
    f2 = f_even @ f_before
    f2_t = np.transpose(f2, (0, 2, 1))
    prev = out[0]
    for i, t in enumerate(even):
        prev = k2[i] + f2[i] @ prev @ f2_t[i]
        out[t] = prev
    odd = np.arange(1, n, 2)
    f_odd = f[odd]
    out[odd] = k[odd] + f_odd @ out[odd - 1] @ np.transpose(f_odd, (0, 2, 1))
    return out


def inverse_frobenius_term(ab: np.ndarray, *, gradient: bool = True, return_diagonal: bool = False):
    """``f = ‖L⁻¹‖_F²`` and ``∂f/∂ab`` in O(T·β²) by the block recursion (module doc).

    Returns ``(value, grad)`` or, with ``return_diagonal``, ``(value, grad, d)`` where
    ``d[t] = ‖L⁻¹[t, :]‖²`` (shape (T,)).
    """
    width, steps = ab.shape
    idx = _block_index(width, steps)
    blk = idx.block
    l_blocks, b_blocks = idx.blocks(ab)
    if np.any(np.abs(np.diagonal(l_blocks, axis1=1, axis2=2)) == 0):
        raise np.linalg.LinAlgError("singular C: a zero diagonal entry.")
    eye = np.eye(blk)
    l_inv = _lower_triangular_inverse(l_blocks)
    # S_t = L_t⁻¹(I + B_t S_{t−1} B_tᵀ)L_t⁻ᵀ = K_t + F_t S_{t−1} F_tᵀ with the batched
    # K_t = L_t⁻¹L_t⁻ᵀ, F_t = L_t⁻¹B_t (two products per step in the Python loop, not four)
    l_inv_t = np.transpose(l_inv, (0, 2, 1))
    s = l_inv @ l_inv_t
    f_blocks = l_inv @ b_blocks
    s = _congruence_recursion(s, f_blocks)  # B_0 = 0
    diag = np.diagonal(s, axis1=1, axis2=2).reshape(-1)
    value = float(diag[:steps].sum())
    out_grad = None
    if gradient:
        # P̂_t = L_t⁻ᵀ(I + B_{t+1}ᵀ P̂_{t+1} B_{t+1})L_t⁻¹ = J_t + E_tᵀ P̂_{t+1} E_t with
        # J_t = L_t⁻ᵀL_t⁻¹, E_t = B_{t+1}L_t⁻¹ (and P̂_{n−1} = J_{n−1})
        p_hat = l_inv_t @ l_inv
        e_blocks = b_blocks[1:] @ l_inv[:-1]
        # the same recursion run backwards: index u = n − 1 − t, F_u = E_{n−1−u}ᵀ
        e_rev_t = np.transpose(e_blocks[::-1], (0, 2, 1))
        p_hat = _congruence_recursion(p_hat[::-1], np.concatenate([np.zeros((1, blk, blk)), e_rev_t]))[::-1]
        # Ĝ_t = I + B_{t+1}ᵀ P̂_{t+1} B_{t+1} (and I for the last block)
        g_hat = np.broadcast_to(eye, l_blocks.shape).copy()
        g_hat[:-1] += np.transpose(b_blocks[1:], (0, 2, 1)) @ p_hat[1:] @ b_blocks[1:]
        g_diag = -2.0 * l_inv_t @ g_hat @ s
        s_prev = np.concatenate([np.zeros((1, blk, blk)), s[:-1]])
        g_sub = 2.0 * p_hat @ b_blocks @ s_prev
        out_grad = idx.scatter(g_diag, g_sub)
    if return_diagonal:
        return value, out_grad, diag[:steps].copy()
    return value, out_grad


def prefix_factor(ab: np.ndarray) -> np.ndarray:
    """Band storage (b+1, T) of ``C·A⁻¹`` (A = all-ones lower triangular), so that
    ``‖(C A⁻¹)⁻¹‖_F² = ‖A C⁻¹‖_F²``. ``(C A⁻¹)[:, c] = C[:, c] − C[:, c+1]``."""
    bands, steps = ab.shape
    out = np.zeros((bands + 1, steps))
    out[:bands] = ab
    out[1:, : steps - 1] -= ab[:, 1:]
    return out


def prefix_factor_pullback(grad: np.ndarray) -> np.ndarray:
    """Adjoint of ``prefix_factor``: (b+1, T) gradient → (b, T) gradient."""
    bands = grad.shape[0] - 1
    out = grad[:bands].copy()
    out[:, 1:] -= grad[1:, :-1]
    return out


def trace_w_xinv(ab: np.ndarray, workload: np.ndarray, *, chunk: int = 1024) -> float:
    """``Tr(W X⁻¹) = Tr(C⁻ᵀ W C⁻¹)`` for a dense symmetric W, with banded solves only.

    Y = C⁻ᵀW (T right-hand sides), then the diagonal of C⁻ᵀYᵀ column block by column
    block. O(T²·b) time, O(T²) memory.
    """
    steps = ab.shape[1]
    y = solve_lower(ab, np.asfortranarray(workload.T), transpose=True)  # C⁻ᵀ W (W symmetric)
    total = 0.0
    for start in range(0, steps, chunk):
        stop = min(steps, start + chunk)
        u = solve_lower(ab, np.asfortranarray(y[start:stop].T), transpose=True)  # C⁻ᵀ (Yᵀ)[:, cols]
        total += float(np.trace(u[start:stop]))
    return total


# --------------------------------------------------------------------------- surrogate
class _Surrogate:
    """``f(C) = ‖C⁻ᵀR‖_F² + α·‖A C⁻¹‖_F² + ε·‖C⁻¹‖_F² = Tr((RRᵀ + αAᵀA + εI) X⁻¹)``."""

    def __init__(self, *, factor=None, prefix_weight=0.0, identity_weight=0.0):
        self.factor = factor
        self.prefix_weight = float(prefix_weight)
        self.identity_weight = float(identity_weight)

    def __call__(self, ab, *, gradient=True):
        value = 0.0
        grad = np.zeros_like(ab) if gradient else None
        if self.factor is not None and self.factor.shape[1] > 0:
            v, g = lowrank_term(ab, self.factor, gradient=gradient)
            value += v
            if gradient:
                grad += g
        if self.prefix_weight:
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


def _factor_workload(workload: np.ndarray):
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


class _Problem:
    """Everything the solver needs for one (objective, T, spectrum, η, λ)."""

    def __init__(self, *, objective, steps, inputs=None, blend_weight=None):
        self.objective = objective
        self.steps = steps
        self.blend_weight = blend_weight
        self.workload = None  # dense W for exact reporting (curvature objectives)
        self.ridge = 0.0
        self.rank = steps
        if objective == "dpsgd":
            self.surrogate = _Surrogate(identity_weight=1.0)
            return
        if objective == "bandmf":
            self.surrogate = _Surrogate(prefix_weight=1.0)
            return
        if objective == "noisecurve-blend":
            lam = float(blend_weight)
            w_curv = curvature_workload(objective="noisecurve", steps=steps, inputs=inputs)
            self.workload = blend_workload(curvature=w_curv, blend_weight=lam)
            factor, full = (None, True)
            if lam < 1.0:
                factor, full = _factor_workload(w_curv)
                factor = factor * math.sqrt((1.0 - lam) / float(np.trace(w_curv)))
                self.rank = factor.shape[1]
            prefix_weight = lam / (steps * (steps + 1) / 2.0)
            if lam == 0.0 and not full:
                self.ridge = RIDGE_RELATIVE * float(np.trace(self.workload)) / steps
            self.surrogate = _Surrogate(factor=factor, prefix_weight=prefix_weight, identity_weight=self.ridge)
            return
        self.workload = curvature_workload(objective=objective, steps=steps, inputs=inputs)
        factor, full = _factor_workload(self.workload)
        self.rank = factor.shape[1]
        if not full:
            self.ridge = RIDGE_RELATIVE * float(np.trace(self.workload)) / steps
        self.surrogate = _Surrogate(factor=factor, identity_weight=self.ridge)

    def exact_loss(self, ab) -> float:
        """``Tr(W X⁻¹)`` without ridge or truncation."""
        if self.objective == "dpsgd":
            return inverse_frobenius_term(ab, gradient=False)[0]
        if self.objective == "bandmf":
            return inverse_frobenius_term(prefix_factor(ab), gradient=False)[0]
        return trace_w_xinv(ab, self.workload)

    def identity_loss(self) -> float:
        """Loss of C = I, i.e. Tr(W)."""
        if self.objective == "dpsgd":
            return float(self.steps)
        if self.objective == "bandmf":
            return self.steps * (self.steps + 1) / 2.0
        return float(np.trace(self.workload))


# --------------------------------------------------------------------------- optimiser
def _normalise(raw: np.ndarray):
    norms = np.sqrt(np.einsum("ij,ij->j", raw, raw))
    return raw / norms, norms


def _fix_row_signs(ab: np.ndarray) -> np.ndarray:
    """Flip rows of C with a negative diagonal (X = CᵀC and column norms unchanged)."""
    bands, steps = ab.shape
    sign = np.where(ab[0] < 0, -1.0, 1.0)  # per row r (diagonal C[r, r] = ab[0, r])
    out = ab.copy()
    for d in range(bands):
        out[d, : steps - d] *= sign[d:]
    return out


def relative_optimality(surrogate, ab) -> float:
    """``‖P(∇_C f)‖₂ / f`` at a unit-column C (P: tangent projection per column)."""
    value, grad = surrogate(ab)
    proj = grad - ab * np.einsum("ij,ij->j", ab, grad)
    proj *= valid_mask(*ab.shape)
    return float(np.linalg.norm(proj) / value)


def _minimize(surrogate, ab0, *, tol, max_iterations, verbose, label, precondition=None):
    try:  # small BLAS calls: threads only add contention
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl ships with scikit-learn
        return _minimize_impl(surrogate, ab0, tol=tol, max_iterations=max_iterations, verbose=verbose,
                              label=label, precondition=precondition)
    with threadpool_limits(limits=1, user_api="blas"):
        return _minimize_impl(surrogate, ab0, tol=tol, max_iterations=max_iterations, verbose=verbose,
                              label=label, precondition=precondition)


#: L-BFGS-B memory (correction pairs); its own step costs O(LBFGS_MEMORY²·n) flops, which
#: with many pairs is a large share of an iteration: 10 pairs need a few more iterations
#: than 30 but less time.
LBFGS_MEMORY = 10
#: Rescale the L-BFGS variables by an estimate of the inverse square root of the Hessian diagonal.
PRECONDITION = True
#: Columns c ≡ r (mod PROBE_COLOURS) of one band are probed together (see ``_diagonal_scaling``).
PROBE_COLOURS = 20
#: Re-estimate the preconditioner (and restart L-BFGS) every this many iterations (0: never),
#: or every 2 × (its number of probe gradients, b × ``PROBE_COLOURS``) iterations if that is
#: more, so that the probes never cost more than a third of the gradient evaluations.
PRECONDITION_REFRESH = 500


def _diagonal_scaling(gradient, x, g0, bands, steps, mask, *, colours=None, step=1e-6):
    """Diagonal preconditioner ``s_i = (median(h)/h_i)^{1/2}``, h ≈ |diag ∇²f|, for L-BFGS.

    h is estimated by ``bands × colours`` forward differences of the gradient along
    probe vectors that switch on one band's entries in every ``colours``-th column
    (entries far apart along the band interact weakly, so ``(∇f(x + δv) − ∇f(x))_i/δ``
    ≈ H_ii for the switched-on i). Only the variables change, not the objective or the
    stopping test.
    """
    cols = np.broadcast_to(np.arange(steps)[None, :], (bands, steps))
    est = np.zeros((bands, steps))
    colours = min(PROBE_COLOURS if colours is None else colours, steps)
    for d in range(bands):
        for r in range(colours):
            probe = np.zeros((bands, steps), dtype=bool)
            probe[d] = (cols[d] % colours == r) & mask[d]
            if not probe.any():
                continue
            v = probe[mask].astype(np.float64)
            g1 = gradient(x + step * v)
            if not np.all(np.isfinite(g1)):
                continue
            est[probe] = ((g1 - g0) / step)[v > 0]
    h = np.abs(est[mask])
    positive = h[h > 0]
    if positive.size == 0:
        return None
    median = float(np.median(positive))
    h = np.maximum(h, 1e-8 * float(positive.max()))
    return np.sqrt(median / h)


#: No-progress guard (not a convergence test): stop, with ``converged = False``, when f fell
#: by at most ``NO_PROGRESS_RELATIVE`` (relative; the rounding level of f, a sum of T·k
#: products) over the last ``NO_PROGRESS_WINDOW`` iterations.
NO_PROGRESS_WINDOW = 200
NO_PROGRESS_RELATIVE = 1e-13
_MAX_RESTARTS = 20


def _minimize_impl(surrogate, ab0, *, tol, max_iterations, verbose, label, precondition=None):
    """L-BFGS-B over the raw band values with scale-free stopping.

    Converges only when the relative optimality ``‖P∇f‖₂/f ≤ tol`` (reason "relative
    optimality"; relative to f, so the iterates do not depend on the scale of W). It also
    stops, NOT converged, at ``max_iterations`` or when f fell by at most
    ``NO_PROGRESS_RELATIVE`` (relative) over ``NO_PROGRESS_WINDOW`` iterations (reason
    "no progress": f is at its rounding level). There is no loss-change convergence rule:
    on the flat, ill-conditioned tails of the curvature objectives f keeps falling by ever
    smaller amounts, and such a rule stops with no certificate of how far f is from its
    infimum. Line-search failures (a trial step that makes C numerically
    singular, or L-BFGS-B's own "no relative reduction" stop) restart L-BFGS from the best
    point with a fresh preconditioner; two restarts in a row without progress give up.

    With ``precondition`` (default ``PRECONDITION``) L-BFGS runs on y = x / s, s from
    ``_diagonal_scaling``, re-estimated at the best point every ``PRECONDITION_REFRESH``
    iterations (a planned restart, not counted in ``restarts``); the objective, the
    gradient test and the stall rule are those of x, so only the path changes.
    """
    bands, steps = ab0.shape
    mask = valid_mask(bands, steps)
    start = time.perf_counter()
    ab0 = _normalise(ab0 * mask)[0]
    f0, _ = surrogate(ab0, gradient=False)
    if not (np.isfinite(f0) and f0 > 0):
        raise ValueError(f"the initial C gives a non-finite or zero objective ({f0}); is it singular?")
    last = {"x": None, "rel": math.inf, "f": f0}
    best = {"x": None, "f": math.inf, "rel": math.inf}
    counts = {"fun": 0, "iter": 0}
    history = []
    reason = {"value": None}

    scale = None

    def fun(y):
        if scale is None:
            return _fun(y)
        value, grad = _fun(y * scale)
        return value, grad * scale

    def _fun(x, record=True):
        counts["fun"] += 1
        raw = np.zeros((bands, steps))
        raw[mask] = x
        c, norms = _normalise(raw)
        try:
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                value, grad = surrogate(c)
        except np.linalg.LinAlgError:
            return math.inf, np.zeros_like(x)
        if not (np.isfinite(value) and np.all(np.isfinite(grad))):
            return math.inf, np.zeros_like(x)
        if not record:
            return value / f0, ((grad - c * np.einsum("ij,ij->j", c, grad)) * mask / norms)[mask] / f0
        proj = grad - c * np.einsum("ij,ij->j", c, grad)
        proj *= mask
        last["x"] = x.copy()
        last["f"] = value
        last["rel"] = float(np.linalg.norm(proj) / value)
        if value < best["f"]:
            best.update(x=last["x"], f=value, rel=last["rel"])
        return value / f0, (proj / norms)[mask] / f0

    def callback(intermediate_result):
        counts["iter"] += 1
        x = intermediate_result.x if scale is None else intermediate_result.x * scale
        if last["x"] is None or not np.array_equal(x, last["x"]):
            fun(x)
        history.append(last["f"])
        if verbose and (counts["iter"] % 25 == 0 or last["rel"] <= tol):
            print(
                f"[noisecurve solve {label}] iter {counts['iter']:5d}  f = {last['f']:.10g}  "
                f"rel. optimality = {last['rel']:.3e}  ({time.perf_counter() - start:.1f} s)",
                flush=True,
            )
        if last["rel"] <= tol:
            reason["value"] = "relative optimality"
            raise StopIteration
        if len(history) > NO_PROGRESS_WINDOW:
            old = history[-1 - NO_PROGRESS_WINDOW]
            if old - last["f"] <= NO_PROGRESS_RELATIVE * abs(last["f"]):
                reason["value"] = "no progress"
                raise StopIteration
        if counts["iter"] >= max_iterations:
            reason["value"] = "max_iterations"
            raise StopIteration

    def probe_gradient(z):  # NaN where C(z) is singular, so that the probe is skipped
        value, grad = _fun(z, record=False)
        return grad if math.isfinite(value) else np.full_like(z, np.nan)

    x = ab0[mask]
    _, g_at_x0 = _fun(x)
    if precondition is None:
        precondition = PRECONDITION
    if precondition and last["rel"] > tol:
        scale = _diagonal_scaling(probe_gradient, x, g_at_x0, bands, steps, mask)
    refresh = 0
    if scale is not None and PRECONDITION_REFRESH:
        probes = bands * min(PROBE_COLOURS, steps)
        refresh = max(PRECONDITION_REFRESH, 2 * probes)
    messages = []
    if last["rel"] <= tol:
        reason["value"] = "relative optimality"
    restarts = 0
    failed_in_a_row = 0
    while reason["value"] is None and counts["iter"] < max_iterations and restarts <= _MAX_RESTARTS:
        before = best["f"]
        segment_start = counts["iter"]
        segment = max_iterations - counts["iter"]
        if refresh:
            segment = min(segment, refresh)
        result = minimize(
            fun,
            x if scale is None else x / scale,
            jac=True,
            method="L-BFGS-B",
            callback=callback,
            options={"maxiter": segment, "maxfun": 4 * max_iterations + 20,
                     "maxcor": LBFGS_MEMORY, "ftol": 1e-16, "gtol": 0.0},
        )
        messages.append(str(result.message))
        x = best["x"] if best["x"] is not None else x
        if reason["value"] is not None:
            break
        if refresh and counts["iter"] - segment_start >= segment:
            # planned refresh of the preconditioner at the best point, not a failure
            scale = _diagonal_scaling(probe_gradient, x, probe_gradient(x), bands, steps, mask)
            continue
        restarts += 1
        failed_in_a_row = 0 if best["f"] < before else failed_in_a_row + 1
        if failed_in_a_row >= 2:  # no progress in two restarts: give up
            reason["value"] = "line search failed: " + messages[-1]
            break
        if scale is not None:  # restart with the curvature estimate of the best point
            scale = _diagonal_scaling(probe_gradient, x, probe_gradient(x), bands, steps, mask)
    if reason["value"] is None:
        reason["value"] = "max_iterations" if counts["iter"] >= max_iterations else messages[-1]
    x = best["x"] if best["x"] is not None else x
    raw = np.zeros((bands, steps))
    raw[mask] = x
    ab = _fix_row_signs(_normalise(raw)[0])
    rel = relative_optimality(surrogate, ab)
    value, _ = surrogate(ab, gradient=False)
    window_change = None
    if len(history) > NO_PROGRESS_WINDOW:
        window_change = (history[-1 - NO_PROGRESS_WINDOW] - history[-1]) / abs(history[-1])
    stats = {
        "iterations": counts["iter"],
        "function_evaluations": counts["fun"],
        "seconds": time.perf_counter() - start,
        "converged": reason["value"] == "relative optimality",
        "stopping_reason": reason["value"],
        "relative_optimality": rel,
        "relative_loss_change_last_window": window_change,
        "tolerance": tol,
        "restarts": restarts,
        "surrogate_loss": float(value),
        "message": "; ".join(messages) if messages else "initial point already optimal",
    }
    if verbose:
        print(f"[noisecurve solve {label}] done: {stats['iterations']} iterations, f = {value:.10g}, "
              f"rel. optimality = {rel:.3e}, stopped on {reason['value']}", flush=True)
    return ab, stats


def _bandmf_initial(steps: int, bands: int) -> np.ndarray:
    """Banded Toeplitz square root of the prefix-sum matrix, columns normalised."""
    coef = np.ones(bands)
    for k in range(1, bands):
        coef[k] = coef[k - 1] * (k - 0.5) / k  # coefficients of (1 − x)^{−1/2}
    ab = np.repeat(coef[:, None], steps, axis=1) * valid_mask(bands, steps)
    return _normalise(ab)[0]


_BANDMF_CACHE: dict = {}


def _solve_bandmf(steps, bands, *, tol, max_iterations, verbose):
    key = (steps, bands, tol, max_iterations)
    if key not in _BANDMF_CACHE:
        problem = _Problem(objective="bandmf", steps=steps)
        # no preconditioner: a full-rank workload converges in about as many iterations
        # without one, and the probe gradients would double the CPU time
        ab, stats = _minimize(problem.surrogate, _bandmf_initial(steps, bands), tol=tol,
                              max_iterations=max_iterations, verbose=verbose, label="bandmf",
                              precondition=False)
        if len(_BANDMF_CACHE) > 8:
            _BANDMF_CACHE.clear()
        _BANDMF_CACHE[key] = (ab, stats)
    ab, stats = _BANDMF_CACHE[key]
    return ab.copy(), dict(stats)


def prefix_noise_std(ab: np.ndarray) -> np.ndarray:
    """``‖(A C⁻¹)[t, :]‖`` for t = 0 … T−1 (std of the running noise sum), O(T·b²)."""
    return np.sqrt(inverse_frobenius_term(prefix_factor(ab), gradient=False, return_diagonal=True)[2])


# --------------------------------------------------------------------------- public API
def _check_common(objective, steps, bands):
    check_choice("objective", objective, OBJECTIVES)
    steps = check_int("steps", steps, minimum=1)
    bands = check_int("bands", bands, minimum=1)
    if bands > steps:
        raise ValueError(f"bands must be <= steps ({steps}); got bands={bands}.")
    return steps, bands


def _version() -> str:
    import keras_noisecurve

    return keras_noisecurve.__version__


def _attach_diagnostics(meta: dict, band_values, *, reference_ab=None) -> dict:
    """Store ``noise_diagnostics`` (and ``warn_if_excursive`` against DP-BandMF) in ``meta``."""
    from keras_noisecurve.mixing.diagnostics import noise_diagnostics, warn_if_excursive

    mixing = MixingMatrix(band_values)
    diagnostics = noise_diagnostics(mixing)
    if reference_ab is not None:
        reference = MixingMatrix(ab_to_band_values(reference_ab))
        diagnostics["excursion_vs_bandmf"] = float(warn_if_excursive(mixing, reference=reference))
    meta["diagnostics"] = diagnostics
    return meta


def solve_mixing_matrix(*, steps, bands, objective=DEFAULT_OBJECTIVE, spectrum=None, learning_rate=None,
                        blend_weight=None, tol=1e-6, max_iterations=10_000, initial=None,
                        verbose=False) -> MixingMatrix:
    """Solve paper Problem (1): the b-banded, unit-column, lower-triangular C minimising
    ``Tr(W X⁻¹)``, X = CᵀC, for the workload W of ``objective``.

    Args:
      steps: T ≥ 1, the number of training steps (rows of C).
      bands: b, 1 ≤ b ≤ T; ``C[t, s] = 0`` unless ``0 <= t − s < b``.
      objective: one of ``OBJECTIVES`` (see ``keras_noisecurve.mixing.workloads``);
        default ``DEFAULT_OBJECTIVE`` (``"bandmf"``, chosen by the accuracy benchmark,
        docs/results.md). ``"dpsgd"`` requires ``bands == 1`` and returns C = I.
      spectrum: ``Spectrum`` or array of Hessian(-bound) eigenvalues ≥ 0; curvature
        objectives only.
      learning_rate: η > 0 with η·μ_max < 2 (warns above 1); curvature objectives only.
      blend_weight: λ ∈ [0, 1] or ``"auto"``; ``"noisecurve-blend"`` only. ``"auto"``
        picks the smallest λ of ``AUTO_BLEND_GRID`` whose C keeps the peak running-noise
        -sum std within ``AUTO_BLEND_FACTOR`` × DP-BandMF's.
      tol: relative optimality ``‖P∇f‖₂/f`` at which the solve has converged (scale-free;
        > 0). The only other stops are ``max_iterations`` and f no longer falling (by
        more than 1e-13 relative over 200 iterations); both leave
        ``metadata["solver"]["converged"] = False``.
      max_iterations: L-BFGS-B iteration cap (≥ 0).
      initial: optional ``MixingMatrix`` with the same (T, b) to start from; default
        the DP-BandMF solution (curvature objectives) or a Toeplitz guess (bandmf).
      verbose: print progress (f and relative optimality) every 25 iterations.

    Returns:
      ``MixingMatrix`` whose ``metadata`` holds objective, steps, bands, learning_rate,
      blend_weight, spectrum_digest, loss = exact Tr(W X⁻¹) (for curvature objectives
      the expected loss gap of a quadratic model is (η²σ²/2)·loss, paper eq. 1),
      baseline_losses {"dpsgd": Tr(W), "bandmf": loss of the DP-BandMF C}, solver
      statistics, ridge, workload_rank, version and diagnostics.

    Raises:
      ValueError: invalid arguments (each message names the value received).
    """
    steps, bands = _check_common(objective, steps, bands)
    check_unused_inputs(objective, spectrum=spectrum, learning_rate=learning_rate, blend_weight=blend_weight)
    tol = check_float("tol", tol, positive=True)
    max_iterations = check_int("max_iterations", max_iterations, minimum=0)
    if objective == "dpsgd" and bands != 1:
        raise ValueError(
            f"objective='dpsgd' means C = I, which has bands=1; got bands={bands}. Use bands=1 "
            "(or objective='bandmf' for a banded C)."
        )
    inputs = None
    lam = None
    if objective in CURVATURE_OBJECTIVES:
        inputs = check_curvature_inputs(objective=objective, spectrum=spectrum, learning_rate=learning_rate)
    if objective == "noisecurve-blend":
        lam = check_blend_weight(blend_weight, allow_auto=True)
    start_ab = None
    if initial is not None:
        if not isinstance(initial, MixingMatrix):
            raise ValueError(f"initial must be a MixingMatrix or None; got {type(initial).__name__}.")
        if (initial.steps, initial.bands) != (steps, bands):
            raise ValueError(
                f"initial has (steps, bands) = ({initial.steps}, {initial.bands}); expected ({steps}, {bands})."
            )
        start_ab = band_values_to_ab(np.asarray(initial.band_values))
    t_start = time.perf_counter()

    if bands == 1:
        # Unit columns and one band force C = I: nothing to optimise.
        bandmf_ab = np.ones((1, steps))
        bandmf_stats = None
    else:
        bandmf_ab, bandmf_stats = _solve_bandmf(steps, bands, tol=tol, max_iterations=max_iterations,
                                                verbose=verbose)

    auto_record = None
    if lam == "auto":
        bandmf_peak = float(prefix_noise_std(bandmf_ab).max())
        auto_record = {"rule": AUTO_BLEND_RULE.format(grid=list(AUTO_BLEND_GRID), factor=AUTO_BLEND_FACTOR),
                       "bandmf_peak_prefix_std": bandmf_peak, "tried": []}
        for candidate in AUTO_BLEND_GRID:
            problem = _Problem(objective=objective, steps=steps, inputs=inputs, blend_weight=candidate)
            ab, stats = _solve_problem(problem, bands, start_ab, bandmf_ab, tol, max_iterations, verbose)
            peak = float(prefix_noise_std(ab).max())
            auto_record["tried"].append({"blend_weight": candidate, "peak_prefix_std": peak,
                                         "ratio": peak / bandmf_peak})
            if peak <= AUTO_BLEND_FACTOR * bandmf_peak * (1 + 1e-9) or candidate == 1.0:
                lam = candidate
                break
    else:
        problem = _Problem(objective=objective, steps=steps, inputs=inputs, blend_weight=lam)
        ab, stats = _solve_problem(problem, bands, start_ab, bandmf_ab, tol, max_iterations, verbose)

    loss = problem.exact_loss(ab)
    bandmf_loss = problem.exact_loss(bandmf_ab)
    meta = {
        "objective": objective,
        "steps": steps,
        "bands": bands,
        "learning_rate": None if inputs is None else inputs.learning_rate,
        "blend_weight": lam,
        "spectrum_digest": None if inputs is None else inputs.digest,
        "loss": float(loss),
        "baseline_losses": {"dpsgd": float(problem.identity_loss()), "bandmf": float(bandmf_loss)},
        "solver": dict(stats, total_seconds=time.perf_counter() - t_start,
                       bandmf_solver=bandmf_stats),
        "ridge": float(problem.ridge),
        "ridge_relative": RIDGE_RELATIVE if problem.ridge else 0.0,
        "workload_rank": int(problem.rank),
        "loss_scale": _loss_scale(objective),
        "version": _version(),
    }
    if auto_record is not None:
        meta["blend_rule"] = auto_record
    band_values = ab_to_band_values(ab)
    _attach_diagnostics(meta, band_values, reference_ab=bandmf_ab if objective in CURVATURE_OBJECTIVES else None)
    return MixingMatrix(band_values, meta)


def _loss_scale(objective: str) -> str:
    if objective in ("noisecurve", "noisecurve-all-iterates", "noisecurve-blend"):
        return "E[loss gap] = (eta^2 sigma^2 / 2) * loss for a quadratic model (blend: of the normalised mix)"
    if objective == "noisecurve-convergence":
        return "mean squared gradient norm = k* + eta^2 sigma^2 * loss for a quadratic model"
    if objective == "bandmf":
        return "total variance of the running noise sum (sigma = 1)"
    return "total per-step noise variance (sigma = 1)"


def _solve_problem(problem, bands, start_ab, bandmf_ab, tol, max_iterations, verbose):
    steps = problem.steps
    if bands == 1:
        ab = np.ones((1, steps))
        rel = relative_optimality(problem.surrogate, ab) if steps > 1 else 0.0
        return ab, {"iterations": 0, "function_evaluations": 0, "seconds": 0.0, "converged": True,
                    "relative_optimality": rel, "tolerance": tol,
                    "surrogate_loss": float(problem.surrogate(ab, gradient=False)[0]),
                    "message": "bands=1: C = I is the only unit-column diagonal C"}
    if problem.objective == "bandmf" and start_ab is None:
        return bandmf_ab.copy(), _cached_bandmf_stats(steps, bands, tol, max_iterations)
    if problem.objective == "noisecurve-blend" and problem.blend_weight == 1.0 and start_ab is None:
        return bandmf_ab.copy(), _cached_bandmf_stats(steps, bands, tol, max_iterations)
    ab0 = start_ab if start_ab is not None else bandmf_ab
    return _minimize(problem.surrogate, ab0, tol=tol, max_iterations=max_iterations, verbose=verbose,
                     label=problem.objective, precondition=problem.ridge > 0)


def _cached_bandmf_stats(steps, bands, tol, max_iterations):
    return dict(_BANDMF_CACHE[(steps, bands, tol, max_iterations)][1])


def objective_value(mixing, *, objective, spectrum=None, learning_rate=None, blend_weight=None) -> float:
    """``Tr(W X⁻¹)`` for the C of ``mixing`` (X = CᵀC) under ``objective``'s workload.

    Banded triangular solves only: O(T·b²) for ``dpsgd``/``bandmf``, O(T²·b) for the
    curvature objectives (dense W, 8·T² bytes). For ``noisecurve`` the expected final
    loss gap of a quadratic model is ``(η²σ²/2)·objective_value`` (paper eq. 1).

    Args:
      mixing: a ``MixingMatrix``.
      objective, spectrum, learning_rate, blend_weight: as in ``workload_matrix``
        (``blend_weight`` must be a number here, not ``"auto"``).
    """
    if not isinstance(mixing, MixingMatrix):
        raise ValueError(f"mixing must be a MixingMatrix; got {type(mixing).__name__}.")
    check_choice("objective", objective, OBJECTIVES)
    check_unused_inputs(objective, spectrum=spectrum, learning_rate=learning_rate, blend_weight=blend_weight)
    steps = mixing.steps
    ab = band_values_to_ab(np.asarray(mixing.band_values))
    if objective == "dpsgd":
        return inverse_frobenius_term(ab, gradient=False)[0]
    if objective == "bandmf":
        return inverse_frobenius_term(prefix_factor(ab), gradient=False)[0]
    inputs = check_curvature_inputs(objective=objective, spectrum=spectrum, learning_rate=learning_rate)
    if objective == "noisecurve-blend":
        lam = check_blend_weight(blend_weight, allow_auto=False)
        workload = blend_workload(curvature=curvature_workload(objective="noisecurve", steps=steps, inputs=inputs),
                                  blend_weight=lam)
    else:
        workload = curvature_workload(objective=objective, steps=steps, inputs=inputs)
    return trace_w_xinv(ab, workload)


__all__ = ["solve_mixing_matrix", "objective_value", "prefix_noise_std", "pivoted_cholesky",
           "RIDGE_RELATIVE", "TRUNCATION_RELATIVE", "AUTO_BLEND_FACTOR", "prefix_workload"]
