"""Banded linear algebra for the mixing-matrix solver (numpy/scipy only).

Layout: a lower-triangular matrix L with bandwidth w (``L[r, c] = 0`` unless
``0 <= r − c < w``) is stored column-wise as ``ab`` of shape (w, T) with
``ab[d, c] = L[c + d, c]`` (LAPACK lower band storage); entries with ``c + d >= T``
are 0. The artifact's ``band_values[t, j] = C[t, t − j]`` converts with
``ab[j, :T−j] = band_values[j:, j]``.

Nothing here forms a dense T×T inverse or does an O(T³) solve:

* ``lowrank_term``: ``‖L⁻ᵀR‖_F²`` (= ``Tr(RRᵀ X⁻¹)`` for X = LᵀL) and its band
  gradient ``−2 L⁻ᵀRRᵀL⁻¹L⁻ᵀ`` with two banded triangular solves (LAPACK ``dtbtrs``),
  O(T·w·k) for R of shape (T, k).
* ``inverse_frobenius_term``: ``‖L⁻¹‖_F² = Tr((LᵀL)⁻¹)`` and its band gradient in
  O(T·β²) by a block recursion over β×β blocks (β ≥ w − 1) and its adjoint. With
  block rows ``N_t`` of L⁻¹, ``N_t = L_t⁻¹(E_t − B_t N_{t−1})`` (L_t the diagonal
  block, B_t the sub-diagonal block) so the diagonal blocks of ``L⁻¹L⁻ᵀ`` obey
  ``S_t = L_t⁻¹(I + B_t S_{t−1} B_tᵀ)L_t⁻ᵀ`` and ``‖L⁻¹‖_F² = Σ_t Tr S_t``.
  Applied to L = C it is the DP-SGD workload (W = I); applied to L = C·A⁻¹ (bandwidth
  w + 1, ``prefix_factor``) it is the prefix-sum workload ``‖A C⁻¹‖_F²`` (DP-BandMF),
  and ``diag S_t`` gives the running-noise-sum variances (``prefix_noise_std``).
* ``trace_w_xinv``: ``Tr(C⁻ᵀ W C⁻¹)`` for a dense W with two banded solves of T
  right-hand sides each, O(T²·w) (used for exact reporting).
"""

from __future__ import annotations

import numpy as np
from scipy.linalg import lapack

__all__ = [
    "ab_to_band_values",
    "band_values_to_ab",
    "inverse_frobenius_term",
    "lowrank_term",
    "prefix_factor",
    "prefix_factor_pullback",
    "prefix_noise_std",
    "solve_lower",
    "trace_w_xinv",
    "valid_mask",
]


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


def prefix_noise_std(ab: np.ndarray) -> np.ndarray:
    """``‖(A C⁻¹)[t, :]‖`` for t = 0 … T−1 (std of the running noise sum), O(T·b²)."""
    return np.sqrt(inverse_frobenius_term(prefix_factor(ab), gradient=False, return_diagonal=True)[2])
