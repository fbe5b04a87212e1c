"""Independent prefix-sum loss of a mixing matrix C: sens² · ‖A C⁻¹‖_F².

numpy / scipy only, and deliberately no keras_noisecurve import, so the benchmark's loss
column does not trust either solver's own bookkeeping.

A is the T × T lower-triangular all-ones (prefix-sum) workload. sens² is the squared L2
sensitivity of C under the participation pattern:

* k = 1: the largest squared column norm of C;
* k > 1: participations at steps p, p + sep, …, p + (k − 1)·sep (fixed epoch order;
  sep defaults to T // k): sens² = max over the start offsets p (with the last step
  inside the T steps) of ‖Σ_{i<k} C[:, p + i·sep]‖².

C may be given as

* ``first_column`` — lower-triangular Toeplitz C (length ≤ T; missing entries are 0).
  C⁻¹'s first column comes from Newton's iteration for the power-series inverse with
  FFT products (O(T log T)); B = A C⁻¹ is Toeplitz with first column the running sums
  β_m = Σ_{j≤m} (C⁻¹)_{j0}, and ‖B‖_F² = Σ_m (T − m)·β_m². With s_t = Σ_{i<k} c_{t−i·sep}
  (terms with t − i·sep < 0 dropped), the participation vector for offset p is s
  shifted down by p and cut at T, so its squared norm is Σ_{t<T−p} s_t² (computed for
  every p; the maximum is always at p = 0, whatever the signs of c).
* ``band_values`` — (T, b) with ``band_values[t, j] == C[t, t − j]``.
* ``dense`` — the (T, T) lower-triangular C.

For band_values / dense: T ≤ 3000 uses dense numpy (triangular solve against the
identity). Banded C with 3000 < T ≤ 20 000 uses LAPACK's banded triangular solve
(``dtbtrs``; falling back to ``scipy.linalg.solve_banded``) on ``Cᵀ X = Aᵀ`` in chunks
of right-hand sides, as ‖A C⁻¹‖_F = ‖C⁻ᵀ Aᵀ‖_F. That costs O(T²·b) flops (4 s at
T = 10⁴, b = 64; minutes at T = 10⁵), so above T = 20 000 (or with
``method="recurrence"``) an O(T·b³) Gram-matrix recurrence is used instead (≈ 20 s at
T = 10⁵, b = 64). It is exact in exact arithmetic: the rows X_t of C⁻¹ obey
X_t = (e_t − Σ_{l≥1} C[t, t−l] X_{t−l}) / C[t, t], and e_t is orthogonal to every
earlier X and running sum, so the Gram matrix of (X_{t−b+2}, …, X_t, Σ_{u≤t} X_u)
updates as G ← M G Mᵀ + u uᵀ; ‖A C⁻¹‖_F² = Σ_t ‖Σ_{u≤t} X_u‖².

Run ``python benchmarks/_loss_check.py`` for a self-check against dense numpy.
"""

from __future__ import annotations

import numpy as np
import scipy.fft
import scipy.linalg

DENSE_MAX_STEPS = 3000
SOLVE_MAX_STEPS = 20_000     # above this "auto" uses the O(T·b³) recurrence for banded C


# --------------------------------------------------------------------------- helpers
def _fft_mul(a: np.ndarray, b: np.ndarray, n: int) -> np.ndarray:
    """First n coefficients of the product of the power series a and b."""
    size = scipy.fft.next_fast_len(len(a) + len(b) - 1, real=True)
    prod = scipy.fft.irfft(scipy.fft.rfft(a, size) * scipy.fft.rfft(b, size), size)
    return prod[:n]


def toeplitz_inverse_column(first_column, steps: int) -> np.ndarray:
    """First column (length T) of C⁻¹ for lower-triangular Toeplitz C, by Newton's method.

    g ← g + g·(1 − c·g) mod x^(2m), doubling the number of correct coefficients per step.
    """
    c = np.zeros(steps)
    fc = np.asarray(first_column, dtype=np.float64)[:steps]
    c[: fc.size] = fc
    if c[0] == 0.0:
        raise ValueError("C[0, 0] is 0: C is singular")
    g = np.array([1.0 / c[0]])
    m = 1
    while m < steps:
        m2 = min(2 * m, steps)
        e = _fft_mul(c[:m2], g, m2)           # c·g mod x^m2, = 1 + O(x^m)
        e[0] -= 1.0
        corr = _fft_mul(g, e, m2)             # g·(c·g − 1)
        g = np.concatenate([g, np.zeros(m2 - m)]) - corr
        m = m2
    return g


def _check_pattern(steps: int, participations: int, min_separation):
    k = int(participations)
    if k < 1:
        raise ValueError(f"participations must be >= 1, got {participations}")
    if k == 1:
        return 1, None
    sep = steps // k if min_separation is None else int(min_separation)
    if sep < 1 or (k - 1) * sep >= steps:
        raise ValueError(f"k={k} participations {sep} apart do not fit in T={steps}")
    return k, sep


def _starts(steps: int, k: int, sep: int) -> np.ndarray:
    """Start offsets p < sep whose last participation p + (k − 1)·sep is < T."""
    return np.arange(min(sep, steps - (k - 1) * sep))


def toeplitz_sensitivity_squared(first_column, steps: int, participations: int = 1,
                                 min_separation=None) -> float:
    c = np.zeros(steps)
    fc = np.asarray(first_column, dtype=np.float64)[:steps]
    c[: fc.size] = fc
    k, sep = _check_pattern(steps, participations, min_separation)
    if k == 1:
        return float(c @ c)   # column 0 holds all of c; column j holds c[:T−j]
    s = np.zeros(steps)
    for i in range(k):
        s[i * sep:] += c[: steps - i * sep]
    head = np.concatenate([[0.0], np.cumsum(s ** 2)])     # head[q] = Σ_{t < q} s_t²
    p = _starts(steps, k, sep)
    vals = head[steps - p]                                # ‖v_p‖² = Σ_{t < T − p} s_t²
    return float(vals.max())


def toeplitz_error(first_column, steps: int) -> float:
    """‖A C⁻¹‖_F² for Toeplitz C (prefix-sum workload)."""
    inv = toeplitz_inverse_column(first_column, steps)
    beta = np.cumsum(inv)
    weights = np.arange(steps, 0, -1, dtype=np.float64)   # T − m
    return float(weights @ (beta ** 2))


def _band_to_dense(band_values: np.ndarray) -> np.ndarray:
    steps, bands = band_values.shape
    dense = np.zeros((steps, steps))
    rows = np.arange(steps)
    for j in range(bands):
        dense[rows[j:], rows[j:] - j] = band_values[j:, j]
    return dense


def dense_sensitivity_squared(dense: np.ndarray, participations: int = 1, min_separation=None) -> float:
    steps = dense.shape[0]
    k, sep = _check_pattern(steps, participations, min_separation)
    if k == 1:
        return float((dense ** 2).sum(axis=0).max())
    best = 0.0
    for p in _starts(steps, k, sep):
        v = dense[:, p + sep * np.arange(k)].sum(axis=1)
        best = max(best, float(v @ v))
    return best


def banded_sensitivity_squared(band_values: np.ndarray, participations: int = 1, min_separation=None) -> float:
    steps, bands = band_values.shape
    k, sep = _check_pattern(steps, participations, min_separation)
    sq = np.zeros(steps)                                   # squared column norms
    for j in range(bands):
        sq[: steps - j] += band_values[j:, j] ** 2
    if k == 1:
        return float(sq.max())
    starts = _starts(steps, k, sep)
    cols = starts[:, None] + sep * np.arange(k)[None, :]   # (P, k) participating columns
    if bands <= sep:                                       # disjoint supports
        return float(sq[cols].sum(axis=1).max())
    # Overlapping columns: v_p[p + i·sep + j] += C[p + i·sep + j, p + i·sep] = band_values[·, j].
    best = 0.0
    offsets = (sep * np.arange(k)[:, None] + np.arange(bands)[None, :]).ravel()   # i·sep + j
    jj = np.broadcast_to(np.arange(bands)[None, :], (k, bands)).ravel()
    width = (k - 1) * sep + bands
    for p in starts:
        rows = p + offsets
        ok = rows < steps
        v = np.bincount(offsets[ok], weights=band_values[rows[ok], jj[ok]], minlength=width)
        best = max(best, float(v @ v))
    return best


def dense_error(dense: np.ndarray) -> float:
    steps = dense.shape[0]
    inv = scipy.linalg.solve_triangular(dense, np.eye(steps), lower=True)
    b = np.cumsum(inv, axis=0)                             # A C⁻¹
    return float((b ** 2).sum())


def banded_error_solve(band_values: np.ndarray, chunk: int = 512) -> float:
    """‖C⁻ᵀ Aᵀ‖_F² by a banded upper-triangular solve, chunk right-hand sides at a time."""
    steps, bands = band_values.shape
    # Cᵀ upper banded, LAPACK upper band storage ab[bands−1 + i − j, j] = Cᵀ[i, j] = C[j, i]
    # with j − i = d ∈ [0, bands): C[i + d, i] = band_values[i + d, d].
    ab = np.zeros((bands, steps))
    for d in range(bands):
        ab[bands - 1 - d, d:] = band_values[d:, d]
    tbtrs = getattr(scipy.linalg.lapack, "dtbtrs", None)
    total = 0.0
    for m0 in range(0, steps, chunk):
        m1 = min(steps, m0 + chunk)
        # Aᵀ[:, m] = 1 on rows ≤ m.
        rhs = (np.arange(steps)[:, None] <= np.arange(m0, m1)[None, :]).astype(np.float64)
        # The solution vanishes below row m (Cᵀ upper triangular): solve the top m1 rows only.
        rhs = rhs[:m1]
        ab_top = ab[:, :m1]
        if tbtrs is not None:
            x, info = tbtrs(ab_top, rhs, uplo="U", trans="N", diag="N")
            if info != 0:
                raise np.linalg.LinAlgError(f"dtbtrs failed with info={info}")
        else:
            x = scipy.linalg.solve_banded((0, bands - 1), ab_top, rhs)
        total += float((x ** 2).sum())
    return total


def banded_error_recurrence(band_values: np.ndarray) -> float:
    """‖A C⁻¹‖_F² in O(T·b³) by the Gram-matrix recurrence described in the module doc."""
    steps, bands = band_values.shape
    q = bands - 1                      # X rows kept: X_{t−q+1}, …, X_t ; then running sum
    size = q + 1
    G = np.zeros((size, size))         # Gram of (X_{t−q+1}, …, X_t, S_t), S_t = Σ_{u≤t} X_u
    M = np.zeros((size, size))
    if q > 0:
        M[np.arange(q - 1), np.arange(1, q)] = 1.0     # shift the kept X's up by one
    total = 0.0
    for t in range(steps):
        d = band_values[t, 0]
        if d == 0.0:
            raise np.linalg.LinAlgError(f"C[{t}, {t}] is 0: C is singular")
        # X_t = (e_t − Σ_{l=1}^{q} C[t, t−l] X_{t−l}) / d ; X_{t−l} sits at slot q − l.
        coef = np.zeros(size)
        if q > 0:
            lmax = min(q, t)
            ls = np.arange(1, lmax + 1)
            coef[q - ls] = -band_values[t, ls] / d
        # new X row: coef · old state + (1/d) e_t ; new S = old S + new X.
        M_t = M.copy()
        u = np.zeros(size)
        if q > 0:
            M_t[q - 1] = coef
            u[q - 1] = 1.0 / d
        M_t[q] = coef
        M_t[q, q] += 1.0
        u[q] = 1.0 / d
        G = M_t @ G @ M_t.T + np.outer(u, u)
        total += G[q, q]
    return float(total)


# --------------------------------------------------------------------------- public
def prefix_loss(*, first_column=None, band_values=None, dense=None, steps, participations=1,
                min_separation=None, method: str = "auto") -> float:
    """sens² · ‖A C⁻¹‖_F² for the prefix-sum workload A (see the module docstring).

    Exactly one of ``first_column`` (Toeplitz C), ``band_values`` ((T, b),
    ``band_values[t, j] == C[t, t − j]``) or ``dense`` ((T, T)) must be given.
    ``method`` applies to band_values: "auto" (dense for T ≤ 3000, "solve" for
    T ≤ 20 000, else "recurrence"; the two agree to ~1e-15 relative at T = 10⁴),
    "dense", "solve" (chunked banded triangular solve, O(T²·b)) or "recurrence"
    (O(T·b³)).
    """
    given = [x is not None for x in (first_column, band_values, dense)]
    if sum(given) != 1:
        raise ValueError("give exactly one of first_column, band_values, dense")
    steps = int(steps)
    if first_column is not None:
        fc = np.asarray(first_column, dtype=np.float64)
        if fc.ndim != 1 or fc.size < 1 or fc.size > steps:
            raise ValueError(f"first_column must be 1-D of length 1 … T={steps}, got shape {fc.shape}")
        if not np.all(np.isfinite(fc)):
            raise ValueError("first_column is not finite")
        sens2 = toeplitz_sensitivity_squared(fc, steps, participations, min_separation)
        return sens2 * toeplitz_error(fc, steps)
    if dense is not None:
        c = np.asarray(dense, dtype=np.float64)
        if c.shape != (steps, steps):
            raise ValueError(f"dense must have shape ({steps}, {steps}), got {c.shape}")
        c = np.tril(c)
        return dense_sensitivity_squared(c, participations, min_separation) * dense_error(c)
    bv = np.asarray(band_values, dtype=np.float64)
    if bv.ndim != 2 or bv.shape[0] != steps or not 1 <= bv.shape[1] <= steps:
        raise ValueError(f"band_values must have shape ({steps}, b), got {bv.shape}")
    bv = bv.copy()
    for j in range(1, bv.shape[1]):        # entries above the first row are not part of C
        bv[:j, j] = 0.0
    sens2 = banded_sensitivity_squared(bv, participations, min_separation)
    if method == "auto":
        method = ("dense" if steps <= DENSE_MAX_STEPS else
                  "solve" if steps <= SOLVE_MAX_STEPS else "recurrence")
    if method == "dense":
        err = dense_error(_band_to_dense(bv))
    elif method == "solve":
        err = banded_error_solve(bv)
    elif method == "recurrence":
        err = banded_error_recurrence(bv)
    else:
        raise ValueError(f"unknown method {method!r}")
    return sens2 * err


# --------------------------------------------------------------------------- self-check
def _dense_reference(C: np.ndarray, k: int, sep) -> float:
    """Straight from the definition: np.linalg.inv and explicit column sums."""
    T = C.shape[0]
    A = np.tril(np.ones((T, T)))
    err = float(np.linalg.norm(A @ np.linalg.inv(C), "fro") ** 2)
    if k == 1:
        sens2 = float(np.max(np.sum(C ** 2, axis=0)))
    else:
        sep = T // k if sep is None else sep
        sens2 = max(float(np.sum(C[:, [p + i * sep for i in range(k)]].sum(axis=1) ** 2))
                    for p in range(sep) if p + (k - 1) * sep < T)
    return sens2 * err


def _self_check() -> float:
    rng = np.random.default_rng(0)
    T = 300
    worst = 0.0

    def report(name, got, ref):
        nonlocal worst
        rel = abs(got - ref) / abs(ref)
        worst = max(worst, rel)
        print(f"  {name:<44} loss {got:.12e}  reference {ref:.12e}  rel.diff {rel:.1e}")

    cols = {}
    for i in range(3):        # random positive columns with Σ_{k≥1} c_k = 0.8·c_0 (C⁻¹ stays bounded)
        c = np.abs(rng.standard_normal(T)) / (1.0 + np.arange(T)) ** rng.uniform(0.3, 1.0)
        c[0] = 1.0
        c[1:] *= 0.8 / c[1:].sum()
        cols[f"random positive #{i}"] = c
    theta = np.array([0.999, 0.95, 0.6, 0.1])
    omega = np.array([0.02, 0.1, 0.2, 0.15])
    kk = np.arange(1, T)
    cols["BLT d=4"] = np.concatenate([[1.0], (omega[None, :] * theta[None, :] ** (kk[:, None] - 1)).sum(axis=1)])
    sq = np.cumprod(np.concatenate([[1.0], (2 * kk - 1) / (2 * kk)]))   # (1 − x)^(−1/2)
    cols["(1-x)^(-1/2) truncated to 16"] = np.where(np.arange(T) < 16, sq, 0.0)
    mixed = rng.standard_normal(T) * 0.3 / (1 + np.arange(T))
    mixed[0] = 1.0
    cols["mixed signs"] = mixed
    from scipy.linalg import toeplitz as sp_toeplitz
    print(f"Toeplitz path (FFT Newton inverse) vs np.linalg.inv, T = {T}:")
    for name, c in cols.items():
        C = np.tril(sp_toeplitz(c))
        for k in (1, 3):
            report(f"{name}, k={k}", prefix_loss(first_column=c, steps=T, participations=k),
                   _dense_reference(C, k, None))
    print(f"banded path vs np.linalg.inv, T = {T}:")
    for b in (1, 5, 120):
        bv = rng.uniform(0.05, 1.0, size=(T, b)) * (0.6 ** np.arange(b))[None, :]
        bv[:, 0] += 1.0
        for j in range(1, b):
            bv[:j, j] = 0.0
        C = _band_to_dense(bv)
        for k in (1, 3):
            ref = _dense_reference(C, k, None)
            report(f"band b={b}, k={k}, dense", prefix_loss(band_values=bv, steps=T, participations=k), ref)
            report(f"band b={b}, k={k}, solve",
                   prefix_loss(band_values=bv, steps=T, participations=k, method="solve"), ref)
            report(f"band b={b}, k={k}, recurrence",
                   prefix_loss(band_values=bv, steps=T, participations=k, method="recurrence"), ref)
            report(f"band b={b}, k={k}, dense input", prefix_loss(dense=C, steps=T, participations=k), ref)
    print(f"max relative difference: {worst:.2e}")
    return worst


if __name__ == "__main__":
    import sys
    sys.exit(0 if _self_check() < 1e-9 else 1)
