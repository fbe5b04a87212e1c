"""The public solve and evaluate entry points for every mixing strategy.

numpy/scipy only. ``solve_mixing_matrix(strategy=...)`` dispatches to the solver of
each kind (``keras_noisecurve.mixing.strategies`` lists them):

* ``"banded"``: ``keras_noisecurve.mixing.solver`` (b-banded C, any entries; every
  objective and update rule);
* ``"toeplitz"``: ``keras_noisecurve.mixing.solve_toeplitz`` (b coefficients);
* ``"blt"``: ``keras_noisecurve.mixing.solve_blt`` (d buffers; optimised for a single
  pass or for k participations ``separation`` steps apart);
* ``"bisr"``: the closed form (no optimisation), scored under the objective.

``objective_value`` evaluates ``Tr(W X⁻¹)`` for any strategy.
"""

from __future__ import annotations

import os

import numpy as np

from keras_noisecurve._validation import check_choice, check_int
from keras_noisecurve.mixing.kernels import library_version
from keras_noisecurve.mixing import solver as _banded
from keras_noisecurve.mixing.matrix import MixingMatrix
from keras_noisecurve.mixing.objectives import TOEPLITZ_OBJECTIVES
from keras_noisecurve.mixing.strategies import STRATEGIES, BISRMixing, _ToeplitzFamily
from keras_noisecurve.mixing.workloads import DEFAULT_OBJECTIVE

__all__ = ["STRATEGIES", "objective_value", "solve_mixing_matrix"]



def _refuse(strategy, **given):
    for name, value in given.items():
        if value is not None:
            raise ValueError(f"{name}={value!r} does not apply to strategy={strategy!r}.")


def _check_toeplitz_objective(strategy, objective, update_rule):
    if objective not in TOEPLITZ_OBJECTIVES:
        raise ValueError(
            f"strategy={strategy!r} supports objective in {TOEPLITZ_OBJECTIVES}; got {objective!r}. "
            "Use strategy='banded' for the others."
        )
    if update_rule is not None and not getattr(update_rule, "is_plain", False):
        raise ValueError(
            f"strategy={strategy!r} is solved for plain SGD with a constant learning rate; got "
            f"update_rule={update_rule!r}. Use strategy='banded' for momentum or a schedule."
        )


def _load_spectrum(spectrum):
    """``spectrum`` itself, or the ``Spectrum`` file it names (a path, as ``noisecurve
    solve --spectrum`` takes); a damaged file is one ``ValueError`` line naming it."""
    if isinstance(spectrum, (str, os.PathLike)):
        from keras_noisecurve.spectrum.artifact import Spectrum

        return Spectrum.load(spectrum)
    return spectrum


def solve_mixing_matrix(*, steps, bands=None, strategy="banded", buffers=None, objective=DEFAULT_OBJECTIVE,
                        spectrum=None, learning_rate=None, blend_weight=None, participations=None,
                        separation=None, tol=1e-6, max_iterations=None, initial=None, verbose=False,
                        update_rule=None):
    """Solve a mixing strategy C for a workload (paper Problem (1) over the strategy's family).

    Args:
      steps: T ≥ 1.
      bands: b for ``"banded"``, ``"toeplitz"`` and ``"bisr"`` (for BISR the bands of C⁻¹).
      strategy: one of ``STRATEGIES``: ``"banded"`` (default), ``"toeplitz"``, ``"blt"``,
        ``"bisr"``.
      buffers: d for ``"blt"`` (the optimizer keeps d noise buffers).
      objective, spectrum, learning_rate, blend_weight: the workload, as for the banded
        solver; ``spectrum`` is a ``Spectrum`` or the path of its ``.npz`` file. The Toeplitz kinds support ``TOEPLITZ_OBJECTIVES`` only.
      participations, separation: ``"blt"`` only: optimise for k participations at least
        ``separation`` steps apart (fixed epochs). Default: one pass. The banded kinds need
        none: participations ≥ b steps apart do not overlap, so k only scales the loss.
      tol, max_iterations, verbose: solver controls (``max_iterations`` None: the
        solver's default).
      initial: ``"banded"`` only: a ``MixingMatrix`` to start from.
      update_rule: ``"banded"`` only (the Toeplitz kinds are solved for plain SGD).

    Returns:
      A ``MixingMatrix`` (banded), ``ToeplitzMixing``, ``BLTMixing`` or ``BISRMixing``,
      with ``metadata["strategy"]``, the objective, the exact loss and solver statistics.

    Raises:
      ValueError: an argument that does not apply to ``strategy``, or an invalid value
        (each message names what was received and what is allowed).
    """
    strategy = check_choice("strategy", strategy, STRATEGIES)
    spectrum = _load_spectrum(spectrum)
    iterations = {} if max_iterations is None else {"max_iterations": max_iterations}
    if strategy == "banded":
        _refuse(strategy, buffers=buffers, participations=participations, separation=separation)
        if bands is None:
            raise ValueError("strategy='banded' needs bands (b ≥ 1, the band width of C).")
        mixing = _banded.solve_mixing_matrix(steps=steps, bands=bands, objective=objective, spectrum=spectrum,
                                             learning_rate=learning_rate, blend_weight=blend_weight, tol=tol,
                                             initial=initial, verbose=verbose, update_rule=update_rule,
                                             **iterations)
        return mixing.with_metadata(strategy="banded")
    _refuse(strategy, initial=initial)
    _check_toeplitz_objective(strategy, objective, update_rule)
    if strategy == "toeplitz":
        _refuse(strategy, buffers=buffers, participations=participations, separation=separation)
        if bands is None:
            raise ValueError("strategy='toeplitz' needs bands (b ≥ 1 coefficients).")
        from keras_noisecurve.mixing.solve_toeplitz import solve_toeplitz

        return solve_toeplitz(steps=steps, bands=bands, objective=objective, spectrum=spectrum,
                              learning_rate=learning_rate, blend_weight=blend_weight, tol=tol, verbose=verbose,
                              **iterations)
    if strategy == "blt":
        _refuse(strategy, bands=bands)
        if buffers is None:
            raise ValueError("strategy='blt' needs buffers (d ≥ 1; the optimizer keeps d noise buffers).")
        from keras_noisecurve.mixing.solve_blt import solve_blt

        return solve_blt(steps=steps, buffers=buffers, objective=objective, spectrum=spectrum,
                         learning_rate=learning_rate, blend_weight=blend_weight,
                         participations=1 if participations is None else participations, separation=separation,
                         tol=tol, verbose=verbose, **iterations)
    _refuse(strategy, buffers=buffers, participations=participations, separation=separation,
            max_iterations=max_iterations)
    if bands is None:
        raise ValueError("strategy='bisr' needs bands (p ≥ 1, the bands of C⁻¹).")
    steps = check_int("steps", steps, minimum=1)
    bands = check_int("bands", bands, minimum=1, maximum=steps)
    from keras_noisecurve.mixing.toeplitz_loss import ToeplitzWorkload, toeplitz_loss
    from keras_noisecurve.mixing.workloads import LOSS_SCALES

    workload = ToeplitzWorkload.from_objective(objective=objective, steps=steps, spectrum=spectrum,
                                               learning_rate=learning_rate, blend_weight=blend_weight)
    mixing = BISRMixing.closed_form(steps=steps, bands=bands)
    identity = np.zeros(steps)
    identity[0] = 1.0
    return mixing.with_metadata(
        objective=objective, learning_rate=learning_rate, blend_weight=blend_weight,
        spectrum_digest=workload.spectrum_digest,
        loss=float(toeplitz_loss(mixing.first_column(), workload, gradient=False)[0]),
        loss_scale=LOSS_SCALES[objective],
        baseline_losses={"dpsgd": float(toeplitz_loss(identity, workload, gradient=False)[0])},
        solver={"iterations": 0, "seconds": 0.0, "converged": True, "message": "closed form: no optimisation"},
        version=library_version())


def objective_value(mixing, *, objective, spectrum=None, learning_rate=None, blend_weight=None,
                    update_rule=None) -> float:
    """``Tr(W X⁻¹)`` of any strategy's C (X = CᵀC) under ``objective``'s workload.

    A ``MixingMatrix`` goes to the banded evaluation (every objective and update rule);
    a Toeplitz-family strategy to ``keras_noisecurve.mixing.toeplitz_loss`` (O(T log T);
    ``TOEPLITZ_OBJECTIVES`` and plain SGD only). Single participation: multiply by the
    squared sensitivity of a participation pattern yourself. ``spectrum``: a ``Spectrum``
    or the path of its ``.npz`` file.
    """
    spectrum = _load_spectrum(spectrum)
    if isinstance(mixing, MixingMatrix):
        return _banded.objective_value(mixing, objective=objective, spectrum=spectrum, learning_rate=learning_rate,
                                       blend_weight=blend_weight, update_rule=update_rule)
    if not isinstance(mixing, _ToeplitzFamily):
        raise ValueError(f"mixing must be a MixingMatrix or a mixing strategy; got {type(mixing).__name__}.")
    _check_toeplitz_objective(mixing.kind, objective, update_rule)
    from keras_noisecurve.mixing.toeplitz_loss import ToeplitzWorkload, toeplitz_loss

    workload = ToeplitzWorkload.from_objective(objective=objective, steps=mixing.steps, spectrum=spectrum,
                                               learning_rate=learning_rate, blend_weight=blend_weight)
    value, _ = toeplitz_loss(np.asarray(mixing.first_column()), workload, gradient=False)
    return float(value)
