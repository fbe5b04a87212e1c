"""Each strategy kind's solver and objective evaluation (the registry's second half).

numpy/scipy only. ``keras_noisecurve.mixing.api.solve_mixing_matrix(strategy=kind, ...)``
and ``objective_value`` look the kind up here; nothing else branches on it:

* ``"banded"``: ``keras_noisecurve.mixing.solver`` (b-banded C, any entries; every
  objective and update rule);
* ``"toeplitz"``: ``keras_noisecurve.mixing.solve_toeplitz`` (b coefficients);
* ``"blt"``: ``keras_noisecurve.mixing.solve_blt`` (d buffers; optimised for a single
  pass or for k participations ``separation`` steps apart);
* ``"bisr"``: the closed form (no optimisation), scored under the objective;
* ``"dpsgd"``: C = I for T steps (nothing to solve; :func:`solve_strategy` only).

Adding a kind: write its ``solve_<kind>(*, steps, objective, spectrum, learning_rate,
blend_weight, tol, verbose, iterations, **arguments)`` here and list it in ``SOLVERS``
with the arguments it takes (``SOLVE_ARGUMENTS``).
"""

from __future__ import annotations

import numpy as np

from keras_noisecurve._validation import check_int
from keras_noisecurve.mixing import solver as _banded
from keras_noisecurve.mixing.kernels import library_version
from keras_noisecurve.mixing.objectives import TOEPLITZ_OBJECTIVES
from keras_noisecurve.mixing.strategies import BISRMixing, IdentityMixing, strategy_class

__all__ = ["SOLVE_ARGUMENTS", "evaluate_objective", "solve_strategy"]

#: The kind-specific arguments each solver takes (the others must be None).
SOLVE_ARGUMENTS = {
    "banded": ("bands", "initial", "update_rule"),
    "toeplitz": ("bands", "update_rule"),
    "blt": ("buffers", "participations", "separation", "update_rule"),
    "bisr": ("bands", "update_rule"),
    "dpsgd": (),
}
_ALL_ARGUMENTS = ("bands", "buffers", "participations", "separation", "initial", "update_rule")
_REQUIRED = {
    "banded": ("bands", "b ≥ 1, the band width of C"),
    "toeplitz": ("bands", "b ≥ 1 coefficients"),
    "blt": ("buffers", "d ≥ 1; the optimizer keeps d noise buffers"),
    "bisr": ("bands", "p ≥ 1, the bands of C⁻¹"),
}


#: Kinds solved and scored by the Toeplitz loss (``TOEPLITZ_OBJECTIVES``, plain SGD only).
_TOEPLITZ_EVALUATED = ("toeplitz", "blt", "bisr")
#: Kinds with nothing to iterate.
_CLOSED_FORM = ("bisr", "dpsgd")


def check_toeplitz_objective(strategy, objective, update_rule):
    """Refuse an objective or update rule the Toeplitz-family evaluation does not model."""
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


def _solve_banded(*, steps, objective, spectrum, learning_rate, blend_weight, tol, verbose, iterations, bands,
                  initial, update_rule):
    mixing = _banded.solve_mixing_matrix(steps=steps, bands=bands, objective=objective, spectrum=spectrum,
                                         learning_rate=learning_rate, blend_weight=blend_weight, tol=tol,
                                         initial=initial, verbose=verbose, update_rule=update_rule, **iterations)
    return mixing.with_metadata(strategy="banded")


def _solve_toeplitz(*, steps, objective, spectrum, learning_rate, blend_weight, tol, verbose, iterations, bands,
                    update_rule):
    from keras_noisecurve.mixing.solve_toeplitz import solve_toeplitz

    return solve_toeplitz(steps=steps, bands=bands, objective=objective, spectrum=spectrum,
                          learning_rate=learning_rate, blend_weight=blend_weight, tol=tol, verbose=verbose,
                          **iterations)


def _solve_blt(*, steps, objective, spectrum, learning_rate, blend_weight, tol, verbose, iterations, buffers,
               participations, separation, update_rule):
    from keras_noisecurve.mixing.solve_blt import solve_blt

    return solve_blt(steps=steps, buffers=buffers, objective=objective, spectrum=spectrum,
                     learning_rate=learning_rate, blend_weight=blend_weight,
                     participations=1 if participations is None else participations, separation=separation,
                     tol=tol, verbose=verbose, **iterations)


def _solve_bisr(*, steps, objective, spectrum, learning_rate, blend_weight, tol, verbose, iterations, bands,
                update_rule):
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


def _solve_identity(*, steps, objective, spectrum, learning_rate, blend_weight, tol, verbose, iterations):
    return IdentityMixing(steps=check_int("steps", steps, minimum=1), metadata={"objective": "dpsgd"})


SOLVERS = {"banded": _solve_banded, "toeplitz": _solve_toeplitz, "blt": _solve_blt, "bisr": _solve_bisr,
           "dpsgd": _solve_identity}


def solve_strategy(kind, *, steps, objective, spectrum=None, learning_rate=None, blend_weight=None, tol=1e-6,
                   max_iterations=None, verbose=False, ignore_unused=False, **arguments):
    """The strategy of ``kind`` for T = ``steps`` solved under ``objective`` (see the module docstring).

    ``arguments``: the kind-specific ones (``SOLVE_ARGUMENTS[kind]``); any other that is
    not None is refused (one line naming it), or dropped when ``ignore_unused``.
    """
    strategy_class(kind)
    unknown = sorted(set(arguments) - set(_ALL_ARGUMENTS))
    if unknown:
        raise TypeError(f"solve_strategy got unexpected arguments {unknown}; allowed: {_ALL_ARGUMENTS}.")
    takes = SOLVE_ARGUMENTS[kind]

    def refuse(*names):
        for name in names:
            if name not in takes and arguments.get(name) is not None and not ignore_unused:
                raise ValueError(f"{name}={arguments[name]!r} does not apply to strategy={kind!r}.")

    if kind in _TOEPLITZ_EVALUATED:
        refuse("initial")
        check_toeplitz_objective(kind, objective, arguments.get("update_rule"))
    refuse(*_ALL_ARGUMENTS)
    if kind in _CLOSED_FORM and max_iterations is not None and not ignore_unused:
        raise ValueError(f"max_iterations={max_iterations!r} does not apply to strategy={kind!r}.")
    if kind in _REQUIRED:
        name, what = _REQUIRED[kind]
        if arguments.get(name) is None:
            raise ValueError(f"strategy={kind!r} needs {name} ({what}).")
    iterations = {} if max_iterations is None else {"max_iterations": max_iterations}
    return SOLVERS[kind](steps=steps, objective=objective, spectrum=spectrum, learning_rate=learning_rate,
                         blend_weight=blend_weight, tol=tol, verbose=verbose, iterations=iterations,
                         **{name: arguments.get(name) for name in takes})


def _evaluate_banded(mixing, *, objective, spectrum, learning_rate, blend_weight, update_rule):
    return _banded.objective_value(mixing, objective=objective, spectrum=spectrum, learning_rate=learning_rate,
                                   blend_weight=blend_weight, update_rule=update_rule)


def _evaluate_toeplitz(mixing, *, objective, spectrum, learning_rate, blend_weight, update_rule):
    check_toeplitz_objective(mixing.kind, objective, update_rule)
    from keras_noisecurve.mixing.toeplitz_loss import ToeplitzWorkload, toeplitz_loss

    workload = ToeplitzWorkload.from_objective(objective=objective, steps=mixing.steps, spectrum=spectrum,
                                               learning_rate=learning_rate, blend_weight=blend_weight)
    value, _ = toeplitz_loss(np.asarray(mixing.first_column()), workload, gradient=False)
    return float(value)


_EVALUATORS = {"banded": _evaluate_banded, "toeplitz": _evaluate_toeplitz, "blt": _evaluate_toeplitz,
               "bisr": _evaluate_toeplitz, "dpsgd": _evaluate_toeplitz}


def evaluate_objective(mixing, *, objective, spectrum=None, learning_rate=None, blend_weight=None,
                       update_rule=None) -> float:
    """``Tr(W X⁻¹)`` of a strategy's C under ``objective`` (its kind's evaluation)."""
    return _EVALUATORS[mixing.kind](mixing, objective=objective, spectrum=spectrum, learning_rate=learning_rate,
                                    blend_weight=blend_weight, update_rule=update_rule)
