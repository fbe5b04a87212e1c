"""L-BFGS-B over the band of a unit-column C, with scale-free stopping.

* Parametrisation: raw band values B (only the T·b − b(b−1)/2 entries inside the
  matrix); C = B with each column divided by its norm, so the unit-column constraint
  holds exactly at every iterate (no projection, and no Cholesky of X = CᵀC, whose
  ``numpy.linalg.cholesky`` factor has the wrong orientation X = LLᵀ). The gradient
  follows by the chain rule: ``∂f/∂B_col = (g_col − C_col·(C_colᵀ g_col)) / ‖B_col‖``.
  Rows with a negative diagonal are flipped at the end (``X = CᵀC`` is invariant under
  row signs).
* L-BFGS-B (scipy) on f/f₀ (f₀ = the loss at the initial C), which makes every
  iterate independent of the scale of W. For ill-conditioned objectives (the curvature
  workloads that needed a ridge) the variables are rescaled by a diagonal
  preconditioner (≈ |diag ∇²f|^{−1/2}, estimated by coloured finite-difference probes
  of the gradient, re-estimated every ``PRECONDITION_REFRESH`` iterations; see
  ``_diagonal_scaling``), which cuts the iterations several-fold. Full-rank workloads
  (DP-BandMF, all-iterates, convergence; no ridge) converge in tens to a few hundred
  plain iterations, fewer than the b × ``PROBE_COLOURS`` probe gradients cost.
* Stopping is scale-free: converged means the relative optimality ``‖P(∇_C f)‖₂ / f``
  (P: projection onto the tangent space of the unit-column constraint) fell below
  ``tol``; the other stops (``max_iterations``, no progress) say "not converged" (see
  ``_lbfgs_minimize``). The returned statistics record which rule fired, the relative
  optimality and the relative loss change over the last ``NO_PROGRESS_WINDOW``
  iterations.

The objective is any callable ``surrogate(ab, gradient=True) -> (f, ∂f/∂ab)`` on
``(b, T)`` band storage (``keras_noisecurve.mixing.banded``), e.g.
``keras_noisecurve.mixing.surrogate.Surrogate``. The measurements behind the constants
are in docs/mixing.md ("Solver speed"). numpy/scipy only.
"""

from __future__ import annotations

import math
import time

import numpy as np
from scipy.optimize import minimize

from keras_noisecurve.mixing.banded import valid_mask

__all__ = [
    "LBFGS_MEMORY",
    "NO_PROGRESS_RELATIVE",
    "NO_PROGRESS_WINDOW",
    "PRECONDITION",
    "PRECONDITION_REFRESH",
    "PROBE_COLOURS",
    "fix_row_signs",
    "minimize_band_values",
    "normalise_columns",
    "relative_optimality",
]


def normalise_columns(raw: np.ndarray):
    """``(C, norms)``: the (b, T) band storage ``raw`` with every column of the matrix
    divided by its L2 norm, and those norms (shape (T,))."""
    norms = np.sqrt(np.einsum("ij,ij->j", raw, raw))
    return raw / norms, norms


def fix_row_signs(ab: np.ndarray) -> np.ndarray:
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


def minimize_band_values(surrogate, ab0, *, tol, max_iterations, verbose, label, precondition=None):
    """Minimise ``surrogate`` over unit-column, lower-triangular banded C, from ``ab0``.

    Args:
      surrogate: ``surrogate(ab, gradient=True) -> (f, ∂f/∂ab)`` on (b, T) band storage.
      ab0: (b, T) starting point (its columns are normalised first).
      tol: relative optimality ``‖P∇f‖₂/f`` at which the solve has converged (> 0).
      max_iterations: L-BFGS-B iteration cap.
      verbose, label: print progress every 25 iterations, tagged with ``label``.
      precondition: diagonal preconditioner on or off (default ``PRECONDITION``).

    Returns:
      ``(ab, stats)``: the (b, T) band storage of C (unit columns, positive diagonal)
      and a dict of solver statistics (``converged``, ``stopping_reason``,
      ``relative_optimality``, ``iterations``, ...; see ``_lbfgs_minimize``).
    """
    try:  # small BLAS calls: threads only add contention
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl ships with scikit-learn
        return _lbfgs_minimize(surrogate, ab0, tol=tol, max_iterations=max_iterations, verbose=verbose,
                               label=label, precondition=precondition)
    with threadpool_limits(limits=1, user_api="blas"):
        return _lbfgs_minimize(surrogate, ab0, tol=tol, max_iterations=max_iterations, verbose=verbose,
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


def _lbfgs_minimize(surrogate, ab0, *, tol, max_iterations, verbose, label, precondition=None):
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
    ab0 = normalise_columns(ab0 * mask)[0]
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
        c, norms = normalise_columns(raw)
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
        with np.errstate(over="ignore"):  # a huge trial point: the norm is inf, rel = inf (as before, quietly)
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
    ab = fix_row_signs(normalise_columns(raw)[0])
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
