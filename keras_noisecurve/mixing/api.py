"""The public solve and evaluate entry points for every mixing strategy.

numpy/scipy only. ``solve_mixing_matrix(strategy=...)`` calls the solver registered for
each kind (``keras_noisecurve.mixing.strategies_solve``; ``keras_noisecurve.mixing.strategies``
lists the kinds):

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


from keras_noisecurve._validation import check_choice
from keras_noisecurve.mixing.objectives import TOEPLITZ_OBJECTIVES
from keras_noisecurve.mixing.strategies import STRATEGIES, load_mixing
from keras_noisecurve.mixing.strategies_solve import evaluate_objective, solve_strategy
from keras_noisecurve.mixing.workloads import DEFAULT_OBJECTIVE

__all__ = ["STRATEGIES", "TOEPLITZ_OBJECTIVES", "objective_value", "solve_mixing_matrix"]


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
    return solve_strategy(strategy, steps=steps, objective=objective, spectrum=_load_spectrum(spectrum),
                          learning_rate=learning_rate, blend_weight=blend_weight, tol=tol,
                          max_iterations=max_iterations, verbose=verbose, bands=bands, buffers=buffers,
                          participations=participations, separation=separation, initial=initial,
                          update_rule=update_rule)


def objective_value(mixing, *, objective, spectrum=None, learning_rate=None, blend_weight=None,
                    update_rule=None) -> float:
    """``Tr(W X⁻¹)`` of any strategy's C (X = CᵀC) under ``objective``'s workload.

    A ``MixingMatrix`` goes to the banded evaluation (every objective and update rule);
    a Toeplitz-family strategy to ``keras_noisecurve.mixing.toeplitz_loss`` (O(T log T);
    ``TOEPLITZ_OBJECTIVES`` and plain SGD only). Single participation: multiply by the
    squared sensitivity of a participation pattern yourself. ``spectrum``: a ``Spectrum``
    or the path of its ``.npz`` file.
    """
    if isinstance(mixing, str):
        raise ValueError(f"mixing must be a MixingMatrix or a mixing strategy; got {type(mixing).__name__}.")
    try:
        mixing = load_mixing(mixing)
    except ValueError:
        raise ValueError(f"mixing must be a MixingMatrix or a mixing strategy; got {type(mixing).__name__}.") from None
    return evaluate_objective(mixing, objective=objective, spectrum=_load_spectrum(spectrum),
                              learning_rate=learning_rate, blend_weight=blend_weight, update_rule=update_rule)
