"""The BLT solver: a buffered linear Toeplitz C with d buffers that minimises sens²·Tr(W X⁻¹).

numpy/scipy only (no TensorFlow). ``solve_blt`` returns a ``BLTMixing``
(``keras_noisecurve.mixing.strategies``): ``C = α·Toeplitz(1, c_1, c_2, …)`` with
``c_k = Σ_{i<d} ω_i θ_i^{k−1}`` (k ≥ 1), θ_i ∈ [0, 1), ω_i ≥ 0, whose noise
``z̃ = C⁻¹z`` costs d model-sized buffers (``keras_noisecurve.mixing.stream``).

Loss. For a workload W (``keras_noisecurve.mixing.toeplitz_loss.ToeplitzWorkload``) and
k participations ``separation`` = s steps apart (fixed epoch order), the loss is

    L(θ, ω) = sens²(c) · Tr(W X⁻¹),   X = CᵀC,   C = Toeplitz(c), c = (1, c_1, …, c_{T−1}),

with ``sens² = ‖c‖²`` for one pass and ``‖Σ_{i<k} shift(c, i·s)‖²`` for k passes (c ≥ 0,
so start 0 is the worst start). L does not depend on the scale of c, so α is left out
of the optimisation and set by ``BLTMixing`` (first column of norm 1).

Parametrisation and gradient. L-BFGS-B (scipy) runs on x = (u, v) ∈ ℝ^{2d},
``θ = expit(u)``, ``ω = exp(v)`` (every iterate is a valid BLT with ω > 0; θ^j is
``exp(j·log_expit(u))``, accurate for θ within 1e-12 of 1), and minimises
``log L = log sens² + log Tr(W X⁻¹)``. ``toeplitz_loss`` and
``participation_sensitivity`` give gradients with respect to the column c (T,); the
chain rule through ``c_k = Σ_i ω_i θ_i^{k−1}``,

    ∂c_k/∂ω_i = θ_i^{k−1},   ∂c_k/∂θ_i = ω_i (k − 1) θ_i^{k−2},

costs O(T·d) (one (T − 1) × d table of powers).

Stopping. Converged means the relative optimality ``‖∇_x log L‖₂ = ‖∇_x L‖₂ / L`` fell
below ``tol`` (scale-free: the same for any scale of W). The solve also stops, with
``converged = False``, at ``max_iterations`` and when L fell by less than
``NO_PROGRESS_RELATIVE`` (relative) over the last ``NO_PROGRESS_WINDOW`` iterations;
steps that no longer change L are not worth their time.

Initialisation. Candidate starts: θ spread geometrically, ``1 − θ_i`` log-uniform
between lo ∈ {0.3/T, 1/T, 3/T} (and 1/s, 3/s for several participations) and
hi ∈ {0.5, 0.8}, each with ω the non-negative least-squares fit (relative errors, on
400 log-spaced k) of the BLT column to the Toeplitz square root of the prefix-sum
matrix, the coefficients of (1 − x)^{−1/2}; every ω is kept ≥ 1 % of the largest (a
buffer started at ω = 0 would stay unused). The ``INITIAL_STARTS`` candidates with the
lowest loss are optimised and the best result is kept (``metadata["solver"]["starts"]``
records each run). Timings, and a comparison with jax_privacy's BLT optimiser:
docs/performance.md.
"""

from __future__ import annotations

import math
import time

import numpy as np
import scipy.optimize
import scipy.special

from keras_noisecurve._validation import check_float, check_int
from keras_noisecurve.mixing.kernels import binomial_coefficients, library_version
from keras_noisecurve.mixing.strategies_toeplitz import BLTMixing
from keras_noisecurve.mixing.toeplitz_loss import (
    TOEPLITZ_OBJECTIVES,
    ToeplitzWorkload,
    participation_sensitivity,
    toeplitz_loss,
)

__all__ = [
    "BLT_OBJECTIVES",
    "MAX_BUFFERS",
    "blt_column",
    "blt_loss",
    "solve_blt",
]

#: Objectives with a Toeplitz-structured workload that ``solve_blt`` accepts.
BLT_OBJECTIVES = TOEPLITZ_OBJECTIVES
#: Largest number of buffers (more buffers give no gain and an ill-conditioned fit).
MAX_BUFFERS = 16
#: No-progress stop: L fell by less than this (relative) over ``NO_PROGRESS_WINDOW`` iterations.
NO_PROGRESS_RELATIVE = 1e-9
NO_PROGRESS_WINDOW = 50
#: Number of starting points that are optimised (the best of the candidates by loss).
INITIAL_STARTS = 2
#: L-BFGS-B memory (correction pairs); with 2d ≤ 32 variables a full memory is cheap.
LBFGS_MEMORY = 20


# ---------------------------------------------------------------------- parametrisation
def _unpack(x):
    d = x.shape[0] // 2
    u, v = x[:d], x[d:]
    return scipy.special.expit(u), scipy.special.log_expit(u), np.exp(v)


def _pack(theta, omega):
    theta = np.clip(np.asarray(theta, dtype=np.float64), 1e-12, 1 - 1e-15)
    omega = np.maximum(np.asarray(omega, dtype=np.float64), 1e-300)
    return np.concatenate([scipy.special.logit(theta), np.log(omega)])


def _powers(log_theta, steps):
    """(T − 1, d) table ``P[j, i] = θ_i^j`` (j = 0 … T − 2), 0⁰ = 1."""
    return np.exp(np.arange(steps - 1, dtype=np.float64)[:, None] * log_theta[None, :])


def blt_column(theta, omega, steps) -> np.ndarray:
    """Unnormalised BLT column (1, c_1, …, c_{T−1}), c_k = Σ_i ω_i θ_i^{k−1}, shape (T,)."""
    theta = np.asarray(theta, dtype=np.float64)
    omega = np.asarray(omega, dtype=np.float64)
    col = np.ones(steps)
    if steps > 1:
        with np.errstate(divide="ignore"):
            log_theta = np.log(theta)
        powers = _powers(log_theta, steps)
        powers[0] = 1.0  # 0⁰ = 1 where θ = 0
        col[1:] = powers @ omega
    return col


def _column_and_pullback(x, steps):
    """The column c(x) and the map from ∂L/∂c (T,) to ∂L/∂x (2d,), both O(T·d)."""
    theta, log_theta, omega = _unpack(x)
    powers = _powers(log_theta, steps)
    col = np.ones(steps)
    col[1:] = powers @ omega

    def pullback(g):
        g = np.asarray(g, dtype=np.float64)
        g_omega = g[1:] @ powers  # Σ_{k≥1} g_k θ^{k−1}
        if steps > 2:
            j = np.arange(1, steps - 1, dtype=np.float64)  # c_{j+1} ∋ ω θ^j: ∂/∂θ = ω j θ^{j−1}
            g_theta = omega * ((j * g[2:]) @ powers[:-1])
        else:
            g_theta = np.zeros_like(omega)
        return np.concatenate([g_theta * theta * (1.0 - theta), g_omega * omega])

    return col, pullback


# ------------------------------------------------------------------------------ loss
def _loss_parts(column, workload, participations, separation, *, gradient):
    """``(sens², ∂sens²/∂c, Tr(W X⁻¹), ∂Tr/∂c)`` for the Toeplitz C with first column ``column``."""
    trace, g_trace = toeplitz_loss(column, workload, gradient=gradient)
    sens2, g_sens2 = participation_sensitivity(column, participations=participations,
                                               separation=separation, gradient=gradient)
    return float(sens2), g_sens2, float(trace), g_trace


def blt_loss(theta, omega, *, steps, workload, participations=1, separation=None) -> dict:
    """``sens²·Tr(W X⁻¹)`` of the BLT (θ, ω) (scale-free), with its two factors.

    Returns ``{"loss", "sensitivity_squared", "trace"}`` for the C with unit first column
    (sens² = 1 for one participation).
    """
    col = blt_column(theta, omega, steps)
    col = col / np.linalg.norm(col)
    sens2, _, trace, _ = _loss_parts(col, workload, participations, separation, gradient=False)
    return {"loss": sens2 * trace, "sensitivity_squared": sens2, "trace": trace}


class _Objective:
    """``log L(x)`` and its gradient, with counters and the best point seen."""

    def __init__(self, steps, workload, participations, separation):
        self.steps = steps
        self.workload = workload
        self.participations = participations
        self.separation = separation
        self.evaluations = 0
        self.last_x = None
        self.last = (math.inf, None)

    def __call__(self, x):
        if self.last_x is not None and np.array_equal(x, self.last_x):
            return self.last
        self.evaluations += 1
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            col, pullback = _column_and_pullback(x, self.steps)
            try:
                sens2, g_sens2, trace, g_trace = _loss_parts(col, self.workload, self.participations,
                                                             self.separation, gradient=True)
            except (np.linalg.LinAlgError, FloatingPointError, ValueError):
                sens2 = trace = math.nan
            if not (np.isfinite(sens2) and np.isfinite(trace) and sens2 > 0 and trace > 0):
                out = (math.inf, np.zeros_like(x))
            else:
                grad = pullback(np.asarray(g_sens2) / sens2 + np.asarray(g_trace) / trace)
                out = (math.log(sens2) + math.log(trace), grad) if np.all(np.isfinite(grad)) \
                    else (math.inf, np.zeros_like(x))
        self.last_x = x.copy()
        self.last = out
        return out


# ------------------------------------------------------------------------ initialisation
def _geometric_theta(buffers, lo, hi):
    """θ with 1 − θ_i log-uniform in [lo, hi] (largest θ first)."""
    if buffers == 1:
        gaps = np.array([math.sqrt(lo * hi)])
    else:
        gaps = np.exp(np.linspace(math.log(lo), math.log(hi), buffers))
    return 1.0 - gaps


def _fit_omega(theta, target, steps):
    """ω ≥ 0 minimising Σ_k ((c_k − t_k)/t_k)² over k ≥ 1, on a log-spaced subset of k."""
    k = np.unique(np.geomspace(1, steps - 1, num=min(steps - 1, 400)).astype(np.int64))
    design = np.exp(np.outer(k - 1, np.log(theta))) / target[k][:, None]
    omega, _ = scipy.optimize.nnls(design, np.ones(k.shape[0]))
    # a buffer with ω = 0 stays unused (∂L/∂log ω ∝ ω): keep every ω ≥ 1 % of the largest
    return np.maximum(omega, 1e-2 * max(float(omega.max()), 1e-6))


def _candidates(steps, buffers, participations, separation):
    """Starting (θ, ω) pairs (see the module docstring)."""
    target = binomial_coefficients(-0.5, steps)
    his = (0.5, 0.8)
    los = [0.3 / steps, 1.0 / steps, 3.0 / steps]
    if participations > 1 and separation is not None:
        los += [1.0 / separation, 3.0 / separation]
    out = []
    for lo in los:
        for hi in his:
            lo_ = min(lo, hi / 2)
            theta = _geometric_theta(buffers, lo_, hi)
            out.append((theta, _fit_omega(theta, target, steps)))
    return out


# ----------------------------------------------------------------------------- solver
def _check_args(steps, buffers, objective, participations, separation, tol, max_iterations):
    if objective not in BLT_OBJECTIVES:
        allowed = ", ".join(repr(o) for o in BLT_OBJECTIVES)
        raise ValueError(
            f"objective must be one of {allowed} for a BLT (their workloads have the structure "
            f"toeplitz_loss evaluates in O(T log T)); got {objective!r}."
        )
    steps = check_int("steps", steps, minimum=2)
    buffers = check_int("buffers", buffers, minimum=1, maximum=MAX_BUFFERS)
    if buffers >= steps:
        raise ValueError(f"buffers must be < steps ({steps}); got buffers={buffers}.")
    participations = check_int("participations", participations, minimum=1)
    if participations > 1:
        if separation is None:
            raise ValueError(f"participations={participations} needs separation (the number of steps between "
                             "participations, an integer >= 1); got separation=None.")
        separation = check_int("separation", separation, minimum=1)
        if (participations - 1) * separation >= steps:
            raise ValueError(
                f"participations={participations} at separation={separation} needs (participations − 1) × "
                f"separation < steps ({steps}); got {(participations - 1) * separation}."
            )
    elif separation is not None:
        separation = check_int("separation", separation, minimum=1)
    tol = check_float("tol", tol, positive=True)
    max_iterations = check_int("max_iterations", max_iterations, minimum=0)
    return steps, buffers, participations, separation, tol, max_iterations


def _minimise(objective, x0, *, tol, max_iterations, verbose, label, start_time):
    """L-BFGS-B from x0 with the stopping rules of the module docstring."""
    state = {"iter": 0, "best_f": math.inf, "best_x": x0.copy(), "reason": None, "rel": math.inf}
    history = []

    def fun(x):
        value, grad = objective(x)
        if value < state["best_f"]:
            state.update(best_f=value, best_x=x.copy(), rel=float(np.linalg.norm(grad)))
        return value, grad

    def callback(intermediate_result):
        state["iter"] += 1
        x = intermediate_result.x
        value, grad = fun(x)
        rel = float(np.linalg.norm(grad))
        history.append(value)
        if verbose and state["iter"] % 25 == 0:
            print(f"[noisecurve solve_blt {label}] iter {state['iter']:5d}  loss = {math.exp(value):.10g}  "
                  f"rel. optimality = {rel:.3e}  ({time.perf_counter() - start_time:.1f} s)", flush=True)
        if rel <= tol:
            state["reason"] = "relative optimality"
            raise StopIteration
        # log L falling by < r over the window ⇔ L falling by < r (relative), to first order
        if len(history) > NO_PROGRESS_WINDOW and history[-1 - NO_PROGRESS_WINDOW] - value < NO_PROGRESS_RELATIVE:
            state["reason"] = "no progress"
            raise StopIteration
        if state["iter"] >= max_iterations:
            state["reason"] = "max_iterations"
            raise StopIteration

    value0, grad0 = fun(x0)
    message = "initial point already optimal"
    if not math.isfinite(value0):
        raise ValueError("the initial BLT gives a non-finite loss; this is a bug in the initialisation.")
    if float(np.linalg.norm(grad0)) <= tol:
        state["reason"] = "relative optimality"
    elif max_iterations == 0:
        state["reason"] = "max_iterations"
    else:
        result = scipy.optimize.minimize(
            fun, x0, jac=True, method="L-BFGS-B", callback=callback,
            options={"maxiter": max_iterations, "maxfun": 20 * max_iterations + 20, "maxcor": LBFGS_MEMORY,
                     "ftol": 0.0, "gtol": 0.0},
        )
        message = str(result.message)
        if state["reason"] is None:
            state["reason"] = message
    return state["best_x"], {"iterations": state["iter"], "log_loss": state["best_f"],
                             "relative_optimality": state["rel"], "stopping_reason": state["reason"],
                             "message": message}


def solve_blt(*, steps, buffers, objective="bandmf", spectrum=None, learning_rate=None, blend_weight=None,
              participations=1, separation=None, tol=1e-6, max_iterations=1000, verbose=False) -> BLTMixing:
    """The BLT C with ``buffers`` = d buffers minimising ``sens²·Tr(W X⁻¹)``, X = CᵀC.

    Args:
      steps: T ≥ 2.
      buffers: d, 1 ≤ d ≤ min(``MAX_BUFFERS``, T − 1): the noise state is d model-sized arrays.
      objective: one of ``BLT_OBJECTIVES``: ``"bandmf"`` (prefix sums), ``"noisecurve"``
        (paper eq. 1), ``"noisecurve-blend"`` (see ``keras_noisecurve.mixing.workloads``).
      spectrum, learning_rate: Hessian eigenvalues (or a ``Spectrum``) and η; the
        curvature objectives only.
      blend_weight: λ ∈ [0, 1]; ``"noisecurve-blend"`` only (no ``"auto"``).
      participations: k ≥ 1, the participations of one example (fixed epoch order).
      separation: s, the steps between participations; required for k > 1, with
        (k − 1)·s < T.
      tol: relative optimality ``‖∇ log L‖₂`` at which the solve has converged (> 0).
      max_iterations: L-BFGS-B iterations per start (≥ 0).
      verbose: print progress every 25 iterations.

    Returns:
      ``BLTMixing`` (first column of norm 1) whose ``metadata`` holds strategy
      (``"blt"``), objective, steps, buffers, participations, separation, learning_rate,
      blend_weight, spectrum_digest, loss (sens²·Tr(W X⁻¹) of the returned C),
      loss_components {"sensitivity_squared", "trace"}, baseline_losses {"dpsgd":
      k·Tr(W), the loss of C = I}, solver statistics and version.

    Raises:
      ValueError, TypeError: invalid arguments (each message names the value received
        and what is allowed).
    """
    (steps, buffers, participations, separation, tol,
     max_iterations) = _check_args(steps, buffers, objective, participations, separation, tol, max_iterations)
    start_time = time.perf_counter()
    # validates spectrum, learning_rate and blend_weight (and refuses those the objective does not use)
    workload = ToeplitzWorkload.from_objective(objective=objective, steps=steps, spectrum=spectrum,
                                               learning_rate=learning_rate, blend_weight=blend_weight)
    result = _solve(steps, buffers, workload, participations, separation, tol=tol,
                    max_iterations=max_iterations, verbose=verbose, start_time=start_time)
    theta, omega, stats = result
    strategy = BLTMixing(theta, omega, steps=steps)
    col = strategy.first_column()
    trace = float(toeplitz_loss(col, workload, gradient=False)[0])
    sens = strategy.sensitivity(participations=participations, separation=separation)
    impulse = np.zeros(steps)
    impulse[0] = 1.0
    trace_w = float(toeplitz_loss(impulse, workload, gradient=False)[0])
    stats["seconds"] = time.perf_counter() - start_time
    meta = {
        "strategy": "blt",
        "objective": objective,
        "steps": steps,
        "buffers": buffers,
        "participations": participations,
        "separation": separation,
        "learning_rate": workload.learning_rate,
        "blend_weight": workload.blend_weight,
        "spectrum_digest": workload.spectrum_digest,
        "loss": sens * sens * trace,
        "loss_components": {"sensitivity_squared": sens * sens, "trace": trace},
        "baseline_losses": {"dpsgd": trace_w * participations},
        "solver": stats,
        "version": library_version(),
    }
    if verbose:
        print(f"[noisecurve solve_blt {objective}] done: loss = {meta['loss']:.10g} in {stats['seconds']:.1f} s "
              f"({stats['iterations']} iterations, stopped on {stats['stopping_reason']})", flush=True)
    return strategy.with_metadata(**meta)


def _solve(steps, buffers, workload, participations, separation, *, tol, max_iterations, verbose, start_time):
    """Optimise from the best ``INITIAL_STARTS`` candidates; ``(θ, ω, stats)`` of the best."""
    objective = _Objective(steps, workload, participations, separation)
    scored = []
    for theta, omega in _candidates(steps, buffers, participations, separation):
        x0 = _pack(theta, omega)
        scored.append((objective(x0)[0], x0))
    scored.sort(key=lambda item: item[0])
    runs = []
    for number, (value0, x0) in enumerate(scored[:INITIAL_STARTS]):
        x, run = _minimise(objective, x0, tol=tol, max_iterations=max_iterations, verbose=verbose,
                           label=f"start {number}", start_time=start_time)
        run["initial_loss"] = math.exp(value0)
        runs.append((x, run))
    best_x, best = min(runs, key=lambda item: item[1]["log_loss"])
    theta, _, omega = _unpack(best_x)
    theta = np.minimum(theta, np.nextafter(1.0, 0.0))  # expit rounds to 1 only for u > 36
    order = np.argsort(-theta)
    stats = {
        "iterations": int(sum(r["iterations"] for _, r in runs)),
        "function_evaluations": objective.evaluations,
        "converged": best["stopping_reason"] == "relative optimality",
        "stopping_reason": best["stopping_reason"],
        "relative_optimality": best["relative_optimality"],
        "tolerance": tol,
        "message": best["message"],
        "starts": [{"initial_loss": r["initial_loss"], "loss": math.exp(r["log_loss"]),
                    "iterations": r["iterations"], "stopping_reason": r["stopping_reason"]} for _, r in runs],
        "candidates": len(scored),
    }
    return theta[order], omega[order], stats
