"""Lanczos on a black-box symmetric matvec (numpy only, no TensorFlow).

Used for the top-k eigenvalues of a Hessian upper bound Ĥ (paper §4.4, ``lanczos_top_k``:
thick-restart Lanczos, the ``_ThickRestart`` class) and, through ``lanczos_tridiagonal``,
by stochastic Lanczos quadrature (``slq.py``, the plain iteration ``_Lanczos``).

Numerics: the Krylov basis and the projected matrix are float64; every new basis
vector is orthogonalised against all previous ones twice (classical Gram-Schmidt,
"twice is enough"), so no ghost eigenvalues appear. Memory is ``num_steps × p``
float64 values (400 vectors × 40k parameters ≈ 128 MB) whatever the number of restarts.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import numpy as np

from keras_noisecurve._validation import check_float, check_int

Matvec = Callable[[np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class LanczosResult:
    """Output of ``lanczos_top_k``.

    Attributes:
      eigenvalues: (k,) Ritz values, descending (estimates of the k largest eigenvalues).
      residuals: (k,) residual bounds |β_m · s_m| (the norm of A·y − θ·y for the Ritz
        pair (θ, y)); an eigenvalue of A lies within this distance of θ.
      converged: (k,) bool, residual ≤ ``tol · max|θ|``.
      num_converged: number of leading Ritz values (from the top, contiguous) that converged.
      num_steps: Lanczos steps taken (= matvecs, all restarts together).
      num_matvecs: matvec calls.
      eigenvectors: (p, k) Ritz vectors when requested, else ``None``.
      num_restarts: thick restarts taken (0: converged in the first basis).
    """

    eigenvalues: np.ndarray
    residuals: np.ndarray
    converged: np.ndarray
    num_converged: int
    num_steps: int
    num_matvecs: int
    eigenvectors: np.ndarray | None = None
    num_restarts: int = 0


def _progress(total: int, verbose: bool, desc: str):
    if not verbose:
        return None
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, leave=False)
    except ImportError:  # pragma: no cover
        return None


def lanczos_tridiagonal(
    matvec: Matvec,
    start: np.ndarray,
    num_steps: int,
    *,
    reorthogonalize: bool = True,
    rng: np.random.Generator | None = None,
    keep_basis: bool = True,
    verbose: bool = False,
    desc: str = "lanczos",
):
    """Run ``num_steps`` Lanczos steps from ``start``; return (alpha, beta, basis, matvecs).

    Args:
      matvec: v ↦ A·v for a symmetric A, (p,) float64 → (p,).
      start: (p,) nonzero start vector (normalised here).
      num_steps: m ≤ p.
      reorthogonalize: full reorthogonalisation (twice) against every previous vector.
      rng: used to restart with a fresh random direction when an invariant subspace is
        found (β ≈ 0); the coupling β is then exactly 0 (block-diagonal T).
      keep_basis: keep and return the (m, p) basis (needed for reorthogonalisation and
        Ritz vectors).

    Returns:
      alpha: (m,) diagonal of T; beta: (m,) with beta[j] the coupling between steps j and
      j+1 (beta[m-1] is the residual norm after the last step, used for residual bounds);
      basis: (m, p) float64 or None; matvecs: number of matvec calls.
    """
    q = np.asarray(start, dtype=np.float64).reshape(-1)
    m = check_int("num_steps", num_steps, minimum=1, maximum=q.size)
    norm = np.linalg.norm(q)
    if not np.isfinite(norm) or norm == 0:
        raise ValueError("start vector must be finite and nonzero.")
    run = _Lanczos(
        matvec,
        q,
        rng if rng is not None else np.random.default_rng(0),
        reorthogonalize=reorthogonalize,
        store_basis=keep_basis or reorthogonalize,
        capacity=m,
    )
    bar = _progress(m, verbose, desc)
    run.extend(m, bar)
    if bar is not None:
        bar.close()
    return run.alpha_array(), run.beta_array(), (run.basis if keep_basis else None), run.steps


def tridiagonal_eigh(alpha: np.ndarray, beta: np.ndarray):
    """Eigen-decomposition of the symmetric tridiagonal T (diag alpha, off-diag beta[:-1]).

    Returns (theta ascending, S) with T = S diag(theta) Sᵀ.
    """
    from scipy.linalg import eigh_tridiagonal

    m = alpha.size
    if m == 1:
        return alpha.copy(), np.ones((1, 1))
    return eigh_tridiagonal(alpha, beta[: m - 1])


def lanczos_top_k(
    matvec: Matvec,
    *,
    dimension: int,
    k: int,
    num_steps: int | None = None,
    max_steps: int | None = None,
    tol: float = 1e-8,
    seed: int | None = None,
    return_vectors: bool = False,
    verbose: bool = False,
) -> LanczosResult:
    """The k largest eigenvalues of a symmetric operator by thick-restart Lanczos (paper §4.4).

    Method (Wu & Simon's thick restart, the symmetric case of Stewart's Krylov–Schur, as
    ARPACK's implicit restart): build an orthonormal Krylov basis V of ``num_steps`` = m
    vectors (float64, every new vector reorthogonalised twice against the whole basis),
    with A·V = V·H + f·e_mᵀ and H = Vᵀ·A·V symmetric (tridiagonal plus, after a restart,
    an arrow); take the Ritz pairs (θ_i, V·s_i) of H; if some of the top k have not
    converged, restart from the ``l = k + ⌊(m − k)/2⌋`` largest Ritz vectors plus the
    residual direction f/‖f‖ and extend the basis back to m vectors. Repeat until every
    top-k value converges or the budget of ``max_steps`` matvecs is spent. Memory stays
    m × p float64 whatever the number of restarts.

    Convergence criterion: every returned value θ_i has residual ‖A·y_i − θ_i·y_i‖ =
    ‖f‖·|s_{m,i}| ≤ ``tol``·max|θ| (``converged``); an eigenvalue of A then lies within
    that residual of θ_i. Only when the budget is spent with values still above it are
    they returned with a ``RuntimeWarning`` that names them (indices and relative
    residuals), never silently. Deterministic for a given ``seed`` (the start vector
    and any direction drawn after an invariant subspace come from
    ``numpy.random.default_rng(seed)``).

    Args:
      matvec: v ↦ A·v, (p,) float64 → (p,) (e.g. ``HessianOperator.matvec``).
      dimension: p.
      k: number of eigenvalues wanted, 1 ≤ k ≤ p.
      num_steps: m, the Krylov basis size (vectors kept in memory), k ≤ m ≤ p; default
        ``min(p, max(2k, k + 20))``.
      max_steps: the budget, the largest number of matvecs (all restarts together);
        default ``min(20·m, max(p, 2·m))``: enough for tightly clustered top eigenvalues.
      tol: a Ritz value θ counts as converged when its residual ≤ tol·max|θ|.
      seed: seed of the Gaussian start vector.
      return_vectors: also return the (p, k) Ritz vectors.
      verbose: tqdm progress bar (over the budget).

    Returns:
      ``LanczosResult`` (eigenvalues descending, residual bounds, converged counts).
    """
    p = check_int("dimension", dimension, minimum=1)
    k = check_int("k", k, minimum=1, maximum=p)
    if num_steps is None:
        num_steps = min(p, max(2 * k, k + 20))
    m = check_int("num_steps", num_steps, minimum=k, maximum=p)
    if max_steps is None:
        max_steps = min(20 * m, max(p, 2 * m))
    max_steps = check_int("max_steps", max_steps, minimum=m)
    tol = check_float("tol", tol, positive=True)
    rng = np.random.default_rng(seed)
    run = _ThickRestart(matvec, rng.standard_normal(p), rng, basis_size=m)
    bar = _progress(max_steps, verbose, "lanczos top-k")
    keep = max(1, min(m - 1, k + (m - k) // 2))
    while True:
        run.fill(max_steps, bar)
        theta, s, residuals_all = run.ritz()
        order = np.argsort(-theta)[:k]
        residuals = residuals_all[order]
        scale = max(float(np.max(np.abs(theta))), 1e-300)
        converged = residuals <= tol * scale
        if converged.all() or run.matvecs >= max_steps or run.size >= p:
            break
        run.restart(np.argsort(-theta)[:keep], theta, s)
    if bar is not None:
        bar.close()
    values = theta[order]
    if not converged.all():
        bad = np.flatnonzero(~converged)
        warnings.warn(
            f"lanczos_top_k: {bad.size} of the top {k} eigenvalues did not converge to tol={tol:g} within the "
            f"budget of {max_steps} matvecs ({run.restarts} restarts of a {m}-vector basis; indices "
            f"{bad[:10].tolist()}{' ...' if bad.size > 10 else ''}, relative residuals up to "
            f"{float(np.max(residuals[bad])) / scale:.2g}); raise max_steps (the budget) or num_steps "
            f"(the basis size), or tol.",
            RuntimeWarning, stacklevel=2,
        )
    leading = int(np.argmin(converged)) if not converged.all() else k
    return LanczosResult(
        eigenvalues=values,
        residuals=residuals,
        converged=converged,
        num_converged=leading,
        num_steps=run.matvecs,
        num_matvecs=run.matvecs,
        eigenvectors=run.basis.T @ s[:, order] if return_vectors else None,
        num_restarts=run.restarts,
    )


class _ThickRestart:
    """The Krylov basis of ``lanczos_top_k``: A·V = V·H + f·e_nᵀ, restarted thick.

    ``V`` (n, p) rows orthonormal (n ≤ basis_size), ``H`` (n, n) = Vᵀ·A·V as computed
    (column i holds the Gram–Schmidt coefficients of A·v_i, H[i+1, i] = ‖f_i‖), ``f`` the
    last residual, stored as its norm ``beta`` and direction ``q``. When ‖f‖ falls below
    1e-12 × the largest coefficient seen (an invariant subspace) the coupling is exactly
    0 and the next direction is a fresh random one orthogonal to V.
    """

    def __init__(self, matvec, start, rng, *, basis_size):
        q = np.asarray(start, dtype=np.float64).reshape(-1)
        self.p, self.m, self.matvec, self.rng = q.size, basis_size, matvec, rng
        self.V = np.zeros((basis_size, self.p))
        self.H = np.zeros((basis_size, basis_size))
        self.size = 0
        self.q = q / np.linalg.norm(q)
        self.beta = 0.0
        self.scale = 0.0
        self.matvecs = 0
        self.restarts = 0

    @property
    def basis(self):
        return self.V[: self.size]

    def _orthogonalize(self, w, rows):
        Q = self.V[:rows]
        coefficients = np.zeros(rows)
        for _ in range(2):
            c = Q @ w
            w = w - Q.T @ c
            coefficients += c
        return w, coefficients

    def _fresh_direction(self):
        for _ in range(5):
            w, _ = self._orthogonalize(self.rng.standard_normal(self.p), self.size)
            nw = np.linalg.norm(w)
            if nw > 1e-8:
                return w / nw
        raise FloatingPointError("lanczos_top_k: no direction orthogonal to the Krylov basis could be drawn.")

    def fill(self, budget, bar=None):
        """Extend the basis to ``basis_size`` vectors (or p, or until ``budget`` matvecs)."""
        while self.size < min(self.m, self.p) and self.matvecs < budget:
            j = self.size
            if j > 0 and self.beta == 0.0:
                self.q = self._fresh_direction()
            self.V[j] = self.q
            w = np.asarray(self.matvec(self.q), dtype=np.float64).reshape(-1)
            self.matvecs += 1
            if bar is not None:
                bar.update(1)
            if w.shape != (self.p,):
                raise ValueError(f"matvec must return a vector of shape ({self.p},), got {w.shape}.")
            if not np.all(np.isfinite(w)):
                raise FloatingPointError(f"matvec returned non-finite values at Lanczos matvec {self.matvecs}.")
            w, h = self._orthogonalize(w, j + 1)
            self.H[: j + 1, j] = h
            self.H[j, :j] = h[:j]
            b = float(np.linalg.norm(w))
            self.scale = max(self.scale, float(np.max(np.abs(h))), b)
            self.size = j + 1
            if b <= 1e-12 * max(self.scale, 1e-300):
                self.beta = 0.0
            else:
                self.beta, self.q = b, w / b

    def ritz(self):
        """(theta, S, residuals): eigenpairs of the symmetric part of H, ‖f‖·|S[n−1, i]|."""
        n = self.size
        H = self.H[:n, :n]
        theta, S = np.linalg.eigh(0.5 * (H + H.T))
        return theta, S, np.abs(self.beta * S[n - 1, :])

    def restart(self, keep, theta, S):
        """Keep the Ritz vectors ``keep`` (indices into theta) and continue from f/‖f‖."""
        n, l = self.size, len(keep)
        self.V[:l] = S[:, keep].T @ self.V[:n]
        self.V[l:] = 0.0
        self.H[:] = 0.0
        self.H[np.arange(l), np.arange(l)] = theta[keep]
        self.size = l
        self.restarts += 1
        if self.beta == 0.0:
            self.q = self._fresh_direction()
            self.beta = 1.0  # a fresh direction, coupled by zero (computed in the next step)


class _Lanczos:
    """Lanczos iteration on ``matvec``, extendable step by step (the one implementation).

    State after n steps: ``alpha`` (n,) and ``beta`` (n,), the diagonal and couplings of
    the tridiagonal T, and (with ``store_basis``) the (n, p) float64 Krylov basis.
    Each new vector is reorthogonalised twice against the whole basis when
    ``reorthogonalize`` is set. When β falls below 1e-12 × the largest |α|, |β| seen
    (an invariant subspace), β is set to exactly 0 and the NEXT step, if any, starts
    from a fresh random direction drawn from ``rng`` (orthogonalised against the basis
    when it is stored): no draw is made after the last step, so a shared ``rng`` is
    consumed only by restarts that are used. ``exhausted`` is set once p steps are done.
    """

    def __init__(self, matvec, start, rng, *, reorthogonalize=True, store_basis=True, capacity=0):
        q = np.asarray(start, dtype=np.float64).reshape(-1)
        self.p = q.size
        self.matvec = matvec
        self.rng = rng
        self.reorthogonalize = bool(reorthogonalize)
        self.store_basis = bool(store_basis) or self.reorthogonalize
        self._Q = np.zeros((min(capacity, self.p) if self.store_basis else 0, self.p))
        self.alpha = []
        self.beta = []
        self.q = q / np.linalg.norm(q)
        self.q_prev = np.zeros(self.p)
        self.b_prev = 0.0
        self.scale = 0.0
        self.exhausted = False
        self._restart = False

    @property
    def steps(self):
        return len(self.alpha)

    @property
    def basis(self):
        """(steps, p) float64 Krylov basis (``None`` when it is not stored)."""
        return self._Q[: self.steps] if self.store_basis else None

    def alpha_array(self):
        return np.asarray(self.alpha)

    def beta_array(self):
        return np.asarray(self.beta)

    def _append(self, q):
        n = self.steps
        if n >= self._Q.shape[0]:
            grown = np.zeros((max(16, 2 * self._Q.shape[0]), self.p))
            grown[:n] = self._Q[:n]
            self._Q = grown
        self._Q[n] = q

    def _orthogonalize(self, w, rows):
        Q = self._Q[:rows]
        for _ in range(2):
            w -= Q.T @ (Q @ w)
        return w

    def _random_restart(self):
        """A fresh unit direction (orthogonal to the stored basis) after an invariant subspace."""
        for _ in range(5):
            w = self.rng.standard_normal(self.p)
            if self.store_basis:
                w = self._orthogonalize(w, self.steps)
            nw = np.linalg.norm(w)
            if nw > 1e-8:
                break
        self.q_prev, self.q, self.b_prev = self.q, w / nw, 0.0

    def extend(self, n, bar=None):
        """Take up to ``n`` more steps (fewer when all p directions are exhausted)."""
        for _ in range(max(0, n)):
            if self.steps >= self.p:
                self.exhausted = True
                return
            if self._restart:
                self._restart = False
                self._random_restart()
            q = self.q
            if self.store_basis:
                self._append(q)
            w = np.asarray(self.matvec(q), dtype=np.float64).reshape(-1)
            if w.shape != (self.p,):
                raise ValueError(f"matvec must return a vector of shape ({self.p},), got {w.shape}.")
            if not np.all(np.isfinite(w)):
                raise FloatingPointError(f"matvec returned non-finite values at Lanczos step {self.steps}.")
            a = float(np.dot(q, w))
            w = w - a * q - self.b_prev * self.q_prev
            if self.reorthogonalize:
                w = self._orthogonalize(w, self.steps + 1)
            b = float(np.linalg.norm(w))
            self.scale = max(self.scale, abs(a), b)
            self.alpha.append(a)
            self.beta.append(b)
            if bar is not None:
                bar.update(1)
            if b <= 1e-12 * max(self.scale, 1e-300):
                self.beta[-1] = 0.0
                self._restart = True
            else:
                self.q_prev, self.q, self.b_prev = q, w / b, b
