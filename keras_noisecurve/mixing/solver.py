"""The mixing-matrix solver: paper Problem (1) over C directly (public entry point).

``solve_mixing_matrix`` minimises ``Tr(W X⁻¹)``, X = CᵀC, over lower-triangular,
b-banded C whose columns have unit L2 norm (docs/design.md#notation), for any workload W
of ``keras_noisecurve.mixing.workloads``; ``objective_value`` evaluates ``Tr(W X⁻¹)``
for a given C. The work is split by job:

* ``keras_noisecurve.mixing.banded``: banded triangular solves and the block
  recursion; the objective and its gradient ``∂f/∂C = −2 C⁻ᵀWC⁻¹C⁻ᵀ`` (band entries
  only) never form a dense inverse.
* ``keras_noisecurve.mixing.surrogate``: W split as ``RRᵀ + α·AᵀA + ε·I`` (pivoted
  Cholesky, and a ridge ε when W is numerically rank-deficient); the reported ``loss``
  is always the exact ``Tr(W X⁻¹)`` without the ridge, ``metadata["ridge"]`` records ε
  and ``metadata["solver"]["surrogate_loss"]`` the minimised value.
* ``keras_noisecurve.mixing.optimize``: L-BFGS-B over the band values with columns
  normalised inside the objective, a diagonal preconditioner for the ill-conditioned
  (ridged) objectives, and scale-free stopping on the relative optimality
  ``‖P(∇_C f)‖₂ / f``; ``metadata["solver"]`` records which stopping rule fired.
* here: validation, the DP-BandMF baseline (cached per (T, b, tol, max_iterations,
  update rule)), ``blend_weight="auto"``, and the metadata. Curvature objectives start
  from the DP-BandMF solution for the same (T, b) and the same update rule, which is
  also the reported baseline; DP-BandMF starts from the banded, column-normalised
  Toeplitz square root of the prefix-sum matrix.
* update rules (``update_rule=``, heavy-ball momentum and learning-rate schedules): the
  workloads of ``keras_noisecurve.mixing.rule_workloads``; every solved C records
  ``metadata["update_rule"] = rule.to_metadata()`` (a C without the key means plain SGD).

The measurements behind the solver's settings are in docs/mixing.md ("Solver speed").
"""

from __future__ import annotations

import time

import numpy as np

from keras_noisecurve._validation import check_float, check_int
from keras_noisecurve.mixing.kernels import binomial_coefficients, library_version
from keras_noisecurve.mixing.banded import ab_to_band_values, band_values_to_ab, prefix_noise_std, valid_mask
from keras_noisecurve.mixing.matrix import MixingMatrix
from keras_noisecurve.mixing.strategies import is_mixing_matrix
from keras_noisecurve.mixing.objectives import get_objective
from keras_noisecurve.mixing.optimize import minimize_band_values, normalise_columns, relative_optimality
from keras_noisecurve.mixing.rule_workloads import PrefixMap, is_identity_rule, resolve_update_rule
from keras_noisecurve.mixing.surrogate import (
    RIDGE_RELATIVE,
    TRUNCATION_RELATIVE,
    Problem,
    pivoted_cholesky,
)
from keras_noisecurve.mixing.workloads import (
    AUTO_BLEND_GRID,
    DEFAULT_OBJECTIVE,
    check_blend_weight,
    check_curvature_inputs,
    prefix_workload,
)

#: ``blend_weight="auto"`` keeps the peak running-noise-sum std within this × DP-BandMF's.
AUTO_BLEND_FACTOR = 1.5
AUTO_BLEND_RULE = (
    "smallest λ in {grid} whose solved C has max_t ‖(A C⁻¹)[t,:]‖ <= {factor} × that of the "
    "DP-BandMF C (same T, b); λ = 1 is DP-BandMF, so the rule always terminates"
)


def _bandmf_initial(steps: int, bands: int) -> np.ndarray:
    """Banded Toeplitz square root of the prefix-sum matrix, columns normalised."""
    coef = binomial_coefficients(-0.5, bands)  # coefficients of (1 − x)^{−1/2}
    ab = np.repeat(coef[:, None], steps, axis=1) * valid_mask(bands, steps)
    return normalise_columns(ab)[0]


_BANDMF_CACHE: dict = {}


def _bandmf_key(steps, bands, tol, max_iterations, rule):
    """Cache key of a DP-BandMF solve; plain SGD (and rules equal to it) keep the old key."""
    key = (steps, bands, tol, max_iterations)
    if rule is None or is_identity_rule(rule, steps):
        return key
    return key + (repr(rule.to_metadata()),)


def _solve_bandmf(steps, bands, *, tol, max_iterations, verbose, update_rule=None):
    key = _bandmf_key(steps, bands, tol, max_iterations, update_rule)
    if key not in _BANDMF_CACHE:
        problem = Problem(objective="bandmf", steps=steps, update_rule=update_rule)
        # plain SGD: no preconditioner; a full-rank workload converges in about as many
        # iterations without one, and the probe gradients would double the CPU time. A
        # momentum/schedule workload (column scales s_t down to ~1e-6 for a cosine decay)
        # is ill-conditioned: there the preconditioner cuts the time several-fold
        # (docs/mixing.md, "Momentum and learning-rate schedules")
        ab, stats = minimize_band_values(problem.surrogate, _bandmf_initial(steps, bands), tol=tol,
                                         max_iterations=max_iterations, verbose=verbose, label="bandmf",
                                         precondition=problem.prefix_map is not None)
        if len(_BANDMF_CACHE) > 8:
            _BANDMF_CACHE.clear()
        _BANDMF_CACHE[key] = (ab, stats)
    ab, stats = _BANDMF_CACHE[key]
    return ab.copy(), dict(stats)


def _check_common(objective, steps, bands):
    spec = get_objective(objective)
    steps = check_int("steps", steps, minimum=1)
    bands = check_int("bands", bands, minimum=1)
    if bands > steps:
        raise ValueError(f"bands must be <= steps ({steps}); got bands={bands}.")
    return spec, steps, bands


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
                        verbose=False, update_rule=None) -> MixingMatrix:
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
      update_rule: the ``UpdateRule`` training will run (heavy-ball momentum β,
        learning-rate multipliers s_t; Keras's SGD), or None for plain SGD with a
        constant learning rate. ``bandmf``, ``noisecurve`` and ``noisecurve-blend`` use
        the rule's workloads (``keras_noisecurve.mixing.rule_workloads``), ``dpsgd``
        accepts any rule, the all-iterates and convergence objectives only plain
        constant-rate SGD. The curvature objectives start from (and report as the
        baseline) the DP-BandMF C for the same rule. With momentum, η·max(s)·μ_max
        must stay below 2(1 + β).

    Returns:
      ``MixingMatrix`` whose ``metadata`` holds objective, steps, bands, learning_rate,
      blend_weight, spectrum_digest, update_rule (``UpdateRule.to_metadata()``, also for
      plain SGD), loss = exact Tr(W X⁻¹) (for curvature objectives the expected loss gap
      of a quadratic model is (η²σ²/2)·loss, paper eq. 1), baseline_losses
      {"dpsgd": Tr(W), "bandmf": loss of the DP-BandMF C for the same rule}, solver
      statistics, ridge, workload_rank, version and diagnostics.

    Raises:
      ValueError: invalid arguments (each message names the value received).
      TypeError: ``update_rule`` is not an ``UpdateRule`` or None.
    """
    spec, steps, bands = _check_common(objective, steps, bands)
    spec.check_unused(spectrum=spectrum, learning_rate=learning_rate, blend_weight=blend_weight)
    rule = resolve_update_rule(update_rule, steps)
    spec.check_rule(rule)
    tol = check_float("tol", tol, positive=True)
    max_iterations = check_int("max_iterations", max_iterations, minimum=0)
    spec.check_bands(bands)
    inputs = None
    lam = None
    if spec.curvature:
        inputs = check_curvature_inputs(objective=objective, spectrum=spectrum, learning_rate=learning_rate,
                                        update_rule=rule, steps=steps)
    if spec.blend:
        lam = check_blend_weight(blend_weight, allow_auto=True)
    start_ab = None
    if initial is not None:
        if not is_mixing_matrix(initial):
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
                                                verbose=verbose, update_rule=rule)

    auto_record = None
    if lam == "auto":
        bandmf_peak = float(prefix_noise_std(bandmf_ab).max())
        auto_record = {"rule": AUTO_BLEND_RULE.format(grid=list(AUTO_BLEND_GRID), factor=AUTO_BLEND_FACTOR),
                       "bandmf_peak_prefix_std": bandmf_peak, "tried": []}
        for candidate in AUTO_BLEND_GRID:
            problem = Problem(objective=objective, steps=steps, inputs=inputs, blend_weight=candidate,
                              update_rule=rule)
            ab, stats = _solve_problem(problem, bands, start_ab, bandmf_ab, tol, max_iterations, verbose)
            peak = float(prefix_noise_std(ab).max())
            auto_record["tried"].append({"blend_weight": candidate, "peak_prefix_std": peak,
                                         "ratio": peak / bandmf_peak})
            if peak <= AUTO_BLEND_FACTOR * bandmf_peak * (1 + 1e-9) or candidate == 1.0:
                lam = candidate
                break
    else:
        problem = Problem(objective=objective, steps=steps, inputs=inputs, blend_weight=lam, update_rule=rule)
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
        "update_rule": rule.to_metadata(),
        "loss": float(loss),
        "baseline_losses": {"dpsgd": float(problem.identity_loss()), "bandmf": float(bandmf_loss)},
        "solver": dict(stats, total_seconds=time.perf_counter() - t_start,
                       bandmf_solver=bandmf_stats),
        "ridge": float(problem.ridge),
        "ridge_relative": RIDGE_RELATIVE if problem.ridge else 0.0,
        "workload_rank": int(problem.rank),
        "loss_scale": spec.loss_scale_for(plain_sgd=problem.prefix_map is None),
        "version": library_version(),
    }
    if auto_record is not None:
        meta["blend_rule"] = auto_record
    band_values = ab_to_band_values(ab)
    _attach_diagnostics(meta, band_values, reference_ab=bandmf_ab if spec.curvature else None)
    return MixingMatrix(band_values, meta)


def _solve_problem(problem, bands, start_ab, bandmf_ab, tol, max_iterations, verbose):
    steps = problem.steps
    if bands == 1:
        ab = np.ones((1, steps))
        rel = relative_optimality(problem.surrogate, ab) if steps > 1 else 0.0
        return ab, {"iterations": 0, "function_evaluations": 0, "seconds": 0.0, "converged": True,
                    "relative_optimality": rel, "tolerance": tol,
                    "surrogate_loss": float(problem.surrogate(ab, gradient=False)[0]),
                    "message": "bands=1: C = I is the only unit-column diagonal C"}
    if problem.spec.reduces_to_bandmf(problem.blend_weight) and start_ab is None:
        return bandmf_ab.copy(), _cached_bandmf_stats(steps, bands, tol, max_iterations, problem.update_rule)
    ab0 = start_ab if start_ab is not None else bandmf_ab
    return minimize_band_values(problem.surrogate, ab0, tol=tol, max_iterations=max_iterations,
                                verbose=verbose, label=problem.objective, precondition=problem.ridge > 0)


def _cached_bandmf_stats(steps, bands, tol, max_iterations, rule=None):
    return dict(_BANDMF_CACHE[_bandmf_key(steps, bands, tol, max_iterations, rule)][1])


def objective_value(mixing, *, objective, spectrum=None, learning_rate=None, blend_weight=None,
                    update_rule=None) -> float:
    """``Tr(W X⁻¹)`` for the C of ``mixing`` (X = CᵀC) under ``objective``'s workload.

    Banded triangular solves only: O(T·b²) for ``dpsgd``/``bandmf`` (also with a rule),
    O(T²·b) for the curvature objectives (dense W, 8·T² bytes). For ``noisecurve`` the
    expected final loss gap of a quadratic model is ``(η²σ²/2)·objective_value``
    (paper eq. 1).

    Args:
      mixing: a ``MixingMatrix``.
      objective, spectrum, learning_rate, blend_weight: as in ``workload_matrix``
        (``blend_weight`` must be a number here, not ``"auto"``).
      update_rule: the ``UpdateRule`` whose workload is evaluated; None (the default) is
        plain SGD with a constant learning rate, whatever rule ``mixing`` was solved for.
        It is never read from ``mixing.metadata["update_rule"]``: pass
        ``UpdateRule.from_metadata(mixing.metadata.get("update_rule"))`` to score C
        under the rule it was solved for.
    """
    if not is_mixing_matrix(mixing):
        raise ValueError(f"mixing must be a MixingMatrix; got {type(mixing).__name__}.")
    spec = get_objective(objective)
    spec.check_unused(spectrum=spectrum, learning_rate=learning_rate, blend_weight=blend_weight)
    rule = resolve_update_rule(update_rule, mixing.steps)
    spec.check_rule(rule)
    steps = mixing.steps
    workload_rule = None if is_identity_rule(rule, steps) else rule  # None: plain SGD
    ab = band_values_to_ab(np.asarray(mixing.band_values))
    inputs = lam = None
    if spec.curvature:
        inputs = check_curvature_inputs(objective=objective, spectrum=spectrum, learning_rate=learning_rate,
                                        update_rule=rule, steps=steps)
    if spec.blend:
        lam = check_blend_weight(blend_weight, allow_auto=False)
    workload = spec.exact_workload(steps, inputs, lam, workload_rule)
    prefix_map = None if workload_rule is None else PrefixMap(steps, workload_rule)
    return spec.exact_loss(ab, workload=workload, prefix_map=prefix_map)


__all__ = ["solve_mixing_matrix", "objective_value", "prefix_noise_std", "pivoted_cholesky",
           "RIDGE_RELATIVE", "TRUNCATION_RELATIVE", "AUTO_BLEND_FACTOR", "prefix_workload"]
