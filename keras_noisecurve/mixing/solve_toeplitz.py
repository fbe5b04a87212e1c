r"""The banded Toeplitz solver: the b coefficients c of ``C[t, s] = c_{t−s}`` minimising
``Tr(W X⁻¹)`` at unit first-column norm.

numpy/scipy only. The objective and its gradient come from
``keras_noisecurve.mixing.toeplitz_loss`` (O(T·b) per evaluation for b ≤
``LFILTER_MAX_SUPPORT``, O(T log T) otherwise, plus O(T log T) for a curvature part).

Scale. ``Tr(W X⁻¹)`` scales as 1/‖c‖² and the privacy cost (sensitivity², = ‖c‖² for
one participation) as ‖c‖², so the solver minimises the scale-free product

    f(x) = Tr(W X⁻¹)(x) · ‖x‖²,    x = (c_0, …, c_{b−1}), c_{b…T−1} = 0,

whose gradient is orthogonal to x (f is homogeneous of degree 0). The normalised C
(``ToeplitzMixing.normalised``) has ``Tr(W X⁻¹) = f``. c_0 is kept ≥ 1e-8·‖x₀‖ (a
bound; it is never active in practice: the loss grows like T/c_0²).

Stopping. Scale-free relative optimality ``‖∇f‖·‖x‖/f ≤ tol`` (checked after every
L-BFGS-B iteration); otherwise ``max_iterations``, or no progress (f falling by less
than 1e-13 relative over 200 iterations, or L-BFGS-B's own line-search stop). Only the
first sets ``metadata["solver"]["converged"] = True``.

Start: the first b coefficients of ``(1 − x)^{−1/2}`` (the Toeplitz square root of the
prefix-sum matrix AᵀA's factor A) for ``bandmf``; the Toeplitz DP-BandMF solution for
the curvature objectives.
"""

from __future__ import annotations

import time

import numpy as np
import scipy.optimize
import scipy.signal

from keras_noisecurve._validation import check_choice, check_float, check_int
from keras_noisecurve.mixing.kernels import binomial_coefficients, library_version
from keras_noisecurve.mixing.objectives import get_objective
from keras_noisecurve.mixing.strategies_toeplitz import ToeplitzMixing
from keras_noisecurve.mixing.toeplitz_loss import (
    LFILTER_MAX_SUPPORT,
    TOEPLITZ_OBJECTIVES,
    ToeplitzWorkload,
    inverse_loss,
    toeplitz_loss,
)
from keras_noisecurve.mixing.workloads import LOSS_SCALES, OBJECTIVES

__all__ = ["solve_toeplitz", "sqrt_prefix_coefficients"]

#: No-progress rule: stop when f fell by less than this (relative) over the last
#: ``_STALL_WINDOW`` iterations.
_STALL_RELATIVE = 1e-13
_STALL_WINDOW = 200
_BARRIER = 1e6
_PROGRESS_EVERY = 25
_C0_FLOOR = 1e-8
#: |inv| beyond this is treated as divergent (the loss would overflow near T·inv²).
_INVERSE_OVERFLOW = 1e100
#: The search variable is y = ‖y₀‖·x/‖x‖ with ‖y₀‖ = this, so L-BFGS-B's first step (of
#: length 1 in y) changes c by 1% relative; f is scale-invariant, so nothing else changes.
_START_NORM = 100.0

_BANDMF_CACHE: dict = {}


def sqrt_prefix_coefficients(bands: int) -> np.ndarray:
    """The first b coefficients of ``(1 − x)^{−1/2}``: 1, 1/2, 3/8, 5/16, …"""
    return binomial_coefficients(-0.5, check_int("bands", bands, minimum=1))


def _scaled_objective(x: np.ndarray, workload: ToeplitzWorkload):
    """f(x) = Tr(W X⁻¹)(x)·‖x‖² and ∇f (shape (b,)) for c = (x, 0, …, 0).

    Returns (nan, None) when the value overflows (c(x) has a root well inside the unit
    disc, so inv grows geometrically); ``_minimise`` turns that into a barrier.
    """
    steps, bands = workload.steps, x.shape[0]
    if not x[0] > 0:
        return np.nan, None
    norm2 = float(np.dot(x, x))
    with np.errstate(over="ignore", invalid="ignore"):
        if bands <= LFILTER_MAX_SUPPORT:
            impulse = np.zeros(steps)
            impulse[0] = 1.0
            inv = scipy.signal.lfilter([1.0], x, impulse)
            if not np.all(np.isfinite(inv)) or np.abs(inv).max() > _INVERSE_OVERFLOW:
                return np.nan, None
            value, g_inv = inverse_loss(inv, workload)
            if not np.isfinite(value):
                return np.nan, None
            # ∂L/∂c_j = −Σ_l inv_l z_{j+l}, z = C⁻ᵀ g_inv (toeplitz_loss's docstring); only j < b
            z = scipy.signal.lfilter([1.0], x, g_inv[::-1])[::-1]
            grad = np.array([-np.dot(inv[: steps - j], z[j:]) for j in range(bands)])
        else:
            column = np.zeros(steps)
            column[:bands] = x
            value, full = toeplitz_loss(column, workload)
            grad = full[:bands]
    f, g = value * norm2, grad * norm2 + (2.0 * value) * x
    if not (np.isfinite(f) and np.all(np.isfinite(g))):
        return np.nan, None
    return f, g


def _relative_optimality(x, f, grad) -> float:
    g = grad.copy()
    if x[0] <= _C0_FLOOR * 1.0000001 * np.linalg.norm(x) and g[0] > 0:  # projected gradient at the c_0 bound
        g[0] = 0.0
    return float(np.linalg.norm(g) * np.linalg.norm(x) / f) if f > 0 else 0.0


def _minimise(workload, x0, *, tol, max_iterations, verbose, label):
    """L-BFGS-B on f from x0; returns (x normalised, stats)."""
    t_start = time.perf_counter()
    x0 = np.asarray(x0, dtype=np.float64) * (_START_NORM / np.linalg.norm(x0))
    bands = x0.shape[0]
    last = {"x": None, "f": None, "g": None, "good": None, "evaluations": 0}

    def fun(x):
        last["evaluations"] += 1
        f, g = _scaled_objective(x, workload)
        if g is None:
            # Barrier: far outside the region where C⁻¹ stays bounded. A huge finite value
            # whose gradient points back to the last good point makes the line search
            # shrink its step (L-BFGS-B cannot handle inf or nan).
            good = last["good"]
            step = x - good[0]
            f = min(good[1] * _BARRIER, 1e300)
            g = np.clip(2.0 * f * step / max(float(np.dot(step, step)), 1e-300), -1e300, 1e300)
            return f, g
        last.update(x=x.copy(), f=f, g=g, good=(x.copy(), f))
        if f < last["best"][1]:
            last["best"] = (x.copy(), f, g)
        return f, g

    f0, g0 = _scaled_objective(x0, workload)
    if g0 is None:
        raise ValueError("the starting coefficients give a non-finite loss (C⁻¹ overflows); "
                         "this should not happen for the built-in starts.")
    last.update(x=x0.copy(), f=f0, g=g0, good=(x0.copy(), f0), best=(x0.copy(), f0, g0), evaluations=1)
    state = {"iterations": 0, "history": [f0], "rel": _relative_optimality(x0, f0, g0), "reason": None}
    if bands == 1:
        return x0 / np.linalg.norm(x0), _stats(state, last, t_start, tol, "bands=1: C = I is the only unit-norm diagonal Toeplitz C")
    if state["rel"] <= tol:
        return x0 / np.linalg.norm(x0), _stats(state, last, t_start, tol, "the starting point is already optimal within tol")
    if max_iterations == 0:
        return x0 / np.linalg.norm(x0), _stats(state, last, t_start, tol, "max_iterations=0")

    def callback(intermediate_result):
        x = intermediate_result.x
        if last["x"] is None or not np.array_equal(last["x"], x):
            fun(x)
        state["iterations"] += 1
        state["history"].append(last["f"])
        state["rel"] = _relative_optimality(x, last["f"], last["g"])
        state["x"] = x.copy()
        it = state["iterations"]
        if verbose and it % _PROGRESS_EVERY == 0:
            print(f"[solve_toeplitz {label}] iteration {it}: f = {last['f']:.12g}, "
                  f"relative optimality = {state['rel']:.3g}", flush=True)
        if state["rel"] <= tol:
            state["reason"] = f"relative optimality {state['rel']:.3g} <= tol {tol:g}"
            raise StopIteration
        hist = state["history"]
        if len(hist) > _STALL_WINDOW and hist[-_STALL_WINDOW - 1] - hist[-1] <= _STALL_RELATIVE * abs(hist[-1]):
            state["reason"] = f"no progress: f fell by <= {_STALL_RELATIVE:g} relative over {_STALL_WINDOW} iterations"
            raise StopIteration

    bounds = [(_C0_FLOOR * _START_NORM, None)] + [(None, None)] * (bands - 1)
    result = scipy.optimize.minimize(
        fun, x0, jac=True, method="L-BFGS-B", bounds=bounds, callback=callback,
        options={"maxiter": max_iterations, "maxfun": 4 * max_iterations + 100, "ftol": 0.0, "gtol": 0.0,
                 "maxcor": 20},
    )
    x = np.asarray(result.x, dtype=np.float64)
    f, g = _scaled_objective(x, workload) if np.all(np.isfinite(x)) else (np.nan, None)
    if g is None or not f <= last["best"][1]:  # never return worse than the best point seen
        x, f, g = last["best"]
    state["rel"] = _relative_optimality(x, f, g)
    message = state["reason"] or str(result.message)
    if state["reason"] is None and "ABNORMAL" in message:
        message = ("L-BFGS-B's line search found no decrease (ABNORMAL): f is at its rounding floor; "
                   f"relative optimality {state['rel']:.3g}")
    return x / np.linalg.norm(x), _stats(state, last, t_start, tol, message)


def _stats(state, last, t_start, tol, message):
    return {"iterations": int(state["iterations"]), "function_evaluations": int(last["evaluations"]),
            "seconds": time.perf_counter() - t_start, "converged": bool(state["rel"] <= tol),
            "relative_optimality": float(state["rel"]), "tolerance": float(tol), "message": message}


def _solve_bandmf(steps, bands, *, tol, max_iterations, verbose):
    key = (steps, bands, tol, max_iterations)
    if key not in _BANDMF_CACHE:
        workload = ToeplitzWorkload.from_objective(objective="bandmf", steps=steps)
        x, stats = _minimise(workload, sqrt_prefix_coefficients(bands), tol=tol, max_iterations=max_iterations,
                             verbose=verbose, label="bandmf")
        if len(_BANDMF_CACHE) > 8:
            _BANDMF_CACHE.clear()
        _BANDMF_CACHE[key] = (x, stats)
    x, stats = _BANDMF_CACHE[key]
    return x.copy(), dict(stats)


def _column(coefficients, steps):
    column = np.zeros(steps)
    column[: coefficients.shape[0]] = coefficients
    return column


def solve_toeplitz(*, steps, bands, objective="bandmf", spectrum=None, learning_rate=None, blend_weight=None,
                   tol=1e-6, max_iterations=2000, verbose=False) -> ToeplitzMixing:
    """The b-banded Toeplitz C (``C[t, s] = c_{t−s}``, 0 ≤ t − s < b, ‖c‖ = 1) minimising
    ``Tr(W X⁻¹)`` for the workload W of ``objective``.

    Args:
      steps: T ≥ 1.
      bands: b, 1 ≤ b ≤ T, the number of free coefficients.
      objective: one of ``"bandmf"`` (prefix sums, the default), ``"noisecurve"``
        (paper eq. 1), ``"noisecurve-blend"`` (see ``keras_noisecurve.mixing.workloads``).
      spectrum: ``Spectrum`` or array of Hessian eigenvalues ≥ 0; curvature objectives only.
      learning_rate: η > 0, η·μ_max < 2; curvature objectives only.
      blend_weight: λ ∈ [0, 1]; ``"noisecurve-blend"`` only (no ``"auto"``).
      tol: relative optimality ``‖∇f‖·‖c‖/f`` at which the solve has converged (> 0).
      max_iterations: L-BFGS-B iteration cap (≥ 0), per solve (the curvature objectives
        first solve ``bandmf`` for their start and baseline).
      verbose: print f and the relative optimality every 25 iterations.

    Returns:
      ``ToeplitzMixing`` whose metadata holds strategy ``"toeplitz"``, objective, steps,
      bands, learning_rate, blend_weight, spectrum_digest (None without a spectrum),
      loss (Tr(W X⁻¹) of the normalised C, recomputed), loss_scale, baseline_losses
      {"dpsgd": Tr(W), "bandmf": loss of the Toeplitz DP-BandMF C under W}, solver
      {iterations, function_evaluations, seconds, converged, relative_optimality,
      tolerance, message} (plus ``bandmf_solver`` for a curvature objective) and version.

    Raises:
      ValueError / TypeError: invalid arguments, each message naming the value received
        and what is allowed.
    """
    check_choice("objective", objective, OBJECTIVES)
    steps = check_int("steps", steps, minimum=1)
    bands = check_int("bands", bands, minimum=1)
    if bands > steps:
        raise ValueError(f"bands must be <= steps ({steps}); got bands={bands}.")
    tol = check_float("tol", tol, positive=True)
    max_iterations = check_int("max_iterations", max_iterations, minimum=0)
    if not isinstance(verbose, (bool, np.bool_)):
        raise TypeError(f"verbose must be True or False; got {verbose!r}.")
    workload = ToeplitzWorkload.from_objective(objective=objective, steps=steps, spectrum=spectrum,
                                               learning_rate=learning_rate, blend_weight=blend_weight)
    t_start = time.perf_counter()
    bandmf_x, bandmf_stats = _solve_bandmf(steps, bands, tol=tol, max_iterations=max_iterations, verbose=verbose)
    chosen = get_objective(objective)
    if chosen.reduces_to_bandmf(workload.blend_weight):
        x, stats = bandmf_x, bandmf_stats
        if chosen.blend:
            stats = dict(stats, message="blend_weight=1 is the bandmf workload up to scale: " + stats["message"])
    else:
        x, stats = _minimise(workload, bandmf_x, tol=tol, max_iterations=max_iterations, verbose=verbose,
                             label=objective)
        stats["bandmf_solver"] = bandmf_stats
    stats["total_seconds"] = time.perf_counter() - t_start

    mixing = ToeplitzMixing.normalised(x, steps=steps)
    loss = toeplitz_loss(mixing.first_column(), workload, gradient=False)[0]
    bandmf_loss = toeplitz_loss(_column(bandmf_x / np.linalg.norm(bandmf_x), steps), workload, gradient=False)[0]
    identity = _column(np.ones(1), steps)
    meta = {
        "strategy": "toeplitz",
        "objective": objective,
        "steps": steps,
        "bands": bands,
        "learning_rate": workload.learning_rate,
        "blend_weight": workload.blend_weight,
        "spectrum_digest": workload.spectrum_digest,
        "loss": float(loss),
        "loss_scale": LOSS_SCALES[objective],
        "baseline_losses": {"dpsgd": float(toeplitz_loss(identity, workload, gradient=False)[0]),
                            "bandmf": float(bandmf_loss)},
        "solver": stats,
        "version": library_version(),
    }
    return mixing.with_metadata(**meta)


assert set(TOEPLITZ_OBJECTIVES) <= set(OBJECTIVES)
