"""Lanczos on a black-box symmetric matvec (numpy only, no TensorFlow).

Used for the top-k eigenvalues of a Hessian upper bound Ĥ (paper §4.4) and, through
``lanczos_tridiagonal``, by stochastic Lanczos quadrature (``slq.py``). Both run the
same iteration, the ``_Lanczos`` class at the end of this module.

Numerics: the Krylov basis and the tridiagonal matrix are float64; every new basis
vector is orthogonalised against all previous ones twice (classical Gram-Schmidt,
"twice is enough"), so no ghost eigenvalues appear. Memory is ``num_steps × p``
float64 values (400 steps × 40k parameters ≈ 128 MB).
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
      num_steps: Lanczos steps taken (= matvecs).
      num_matvecs: matvec calls.
      eigenvectors: (p, k) Ritz vectors when requested, else ``None``.
    """

    eigenvalues: np.ndarray
    residuals: np.ndarray
    converged: np.ndarray
    num_converged: int
    num_steps: int
    num_matvecs: int
    eigenvectors: np.ndarray | None = None


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
    """The k largest eigenvalues of a symmetric operator by Lanczos (paper §4.4).

    Runs ``num_steps`` steps, then, while some of the top-k Ritz values have not
    converged, continues in blocks of ``max(10, k // 2)`` steps up to ``max_steps``
    (the Krylov basis is kept, so continuing costs only the new matvecs).

    Convergence criterion: every returned value θ_i has residual ‖A·y_i − θ_i·y_i‖ =
    |β_m s_{m,i}| ≤ ``tol``·max|θ| (``converged``); an eigenvalue of A then lies within
    that residual of θ_i. Values still above it at ``max_steps`` are returned with a
    ``RuntimeWarning`` that names them (indices and relative residuals), never
    silently. Deterministic for a given ``seed`` (the start vector and any restart
    direction are drawn from ``numpy.random.default_rng(seed)``).

    Args:
      matvec: v ↦ A·v, (p,) float64 → (p,) (e.g. ``HessianOperator.matvec``).
      dimension: p.
      k: number of eigenvalues wanted, 1 ≤ k ≤ p.
      num_steps: initial Lanczos steps (= matvecs); default ``min(p, max(2k, k + 20))``.
      max_steps: step limit when continuing for convergence; default ``2 * num_steps``
        (capped at p). Clustered spectra may need more.
      tol: a Ritz value θ counts as converged when its residual bound |β_m s_m| ≤ tol·max|θ|.
      seed: seed of the Gaussian start vector.
      return_vectors: also return the (p, k) Ritz vectors.
      verbose: tqdm progress bar.

    Returns:
      ``LanczosResult`` (eigenvalues descending, residual bounds, converged counts).
    """
    p = check_int("dimension", dimension, minimum=1)
    k = check_int("k", k, minimum=1, maximum=p)
    if num_steps is None:
        num_steps = min(p, max(2 * k, k + 20))
    m = check_int("num_steps", num_steps, minimum=k, maximum=p)
    if max_steps is None:
        max_steps = 2 * m
    max_steps = check_int("max_steps", max_steps, minimum=m)
    max_steps = min(max_steps, p)
    tol = check_float("tol", tol, positive=True)
    rng = np.random.default_rng(seed)
    run = _Lanczos(matvec, rng.standard_normal(p), rng, capacity=m)
    bar = _progress(m, verbose, "lanczos top-k")
    block = max(10, k // 2)
    target = m
    while True:
        run.extend(target - run.steps, bar)
        theta, s = tridiagonal_eigh(run.alpha_array(), run.beta_array())
        order = np.argsort(-theta)[:k]
        residuals = np.abs(run.beta[-1] * s[-1, order])
        scale = max(float(np.max(np.abs(theta))), 1e-300)
        converged = residuals <= tol * scale
        if converged.all() or run.steps >= max_steps or run.exhausted:
            break
        target = min(max_steps, run.steps + block)
        if bar is not None:
            bar.total = target
    if bar is not None:
        bar.close()
    values = theta[order]
    if not converged.all():
        bad = np.flatnonzero(~converged)
        warnings.warn(
            f"lanczos_top_k: {bad.size} of the top {k} eigenvalues did not converge to tol={tol:g} in {run.steps} "
            f"steps (indices {bad[:10].tolist()}{' ...' if bad.size > 10 else ''}, relative residuals up to "
            f"{float(np.max(residuals[bad])) / scale:.2g}); raise max_steps or tol.",
            RuntimeWarning, stacklevel=2,
        )
    leading = int(np.argmin(converged)) if not converged.all() else k
    return LanczosResult(
        eigenvalues=values,
        residuals=residuals,
        converged=converged,
        num_converged=leading,
        num_steps=run.steps,
        num_matvecs=run.steps,
        eigenvectors=run.basis.T @ s[:, order] if return_vectors else None,
    )


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
