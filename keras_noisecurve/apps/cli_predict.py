"""The predicted gain over DP-SGD on the command line: ``noisecurve calibrate --mixing auto``
and the budget options of ``noisecurve solve``.

``calibrate --mixing auto`` runs :func:`keras_noisecurve.choose_mixing` for the run and prints
its comparison; ``calibrate --mixing FILE`` and ``solve ... --epsilon E --delta D
--num-examples N --batch-size B`` print the solved C's σ and its predicted noise against
DP-SGD's run at the same (ε, δ) (:func:`keras_noisecurve.privacy.choice.predicted_gain`), in
numbers and in words. No TensorFlow import.
"""

from __future__ import annotations

import argparse

from keras_noisecurve.privacy import accounting

__all__ = ["AUTO", "HINT", "sigmas", "add_budget_arguments", "add_rule_arguments", "auto_lines", "budget_given", "prediction_lines",
           "rule_of"]

#: ``--mixing auto``: choose the mechanism for the budget.
AUTO = "auto"

_BUDGET = ("epsilon", "delta", "num_examples", "batch_size")

#: ``noisecurve solve``'s last line without a budget.
HINT = ("predicted vs DP-SGD   : give --epsilon, --delta, --num-examples and --batch-size to see it (C's noise at "
        "the sigma its run needs, against DP-SGD's at the same budget)")


def add_budget_arguments(parser: argparse.ArgumentParser) -> None:
    """``noisecurve solve``'s optional budget: with all four, the summary ends with the predicted gain."""
    group = parser.add_argument_group(
        "predicted gain over DP-SGD (optional; give all four)",
        "the solved C's noise at the sigma its run needs for (epsilon, delta), against DP-SGD's at the same budget")
    group.add_argument("--epsilon", type=float, help="target epsilon (> 0)")
    group.add_argument("--delta", type=float, help="accounting delta, much smaller than 1/n")
    group.add_argument("--num-examples", type=int, help="n, the size of the private training set")
    group.add_argument("--batch-size", type=int, help="B, the expected batch size")
    group.add_argument("--sampling", choices=accounting.SAMPLINGS, default="cyclic_poisson",
                       help="the run's sampling (default cyclic_poisson)")
    group.add_argument("--accountant", choices=accounting.ACCOUNTANTS, default="pld")


def add_rule_arguments(parser: argparse.ArgumentParser) -> None:
    """``noisecurve calibrate --mixing auto``'s update rule and band cap."""
    parser.add_argument("--momentum", type=float, default=None,
                        help="with --mixing auto: the heavy-ball momentum of the SGD training runs (default 0)")
    parser.add_argument("--max-bands", type=int, default=None,
                        help="with --mixing auto: the most bands to consider (the optimizer keeps b - 1 noise "
                             "vectors per variable; default all the sampling allows)")


def budget_given(args) -> bool:
    """Whether the budget options are given; ``ValueError`` when only some are."""
    given = [name for name in _BUDGET if getattr(args, name, None) is not None]
    if given and len(given) < len(_BUDGET):
        missing = ", ".join("--" + name.replace("_", "-") for name in _BUDGET if name not in given)
        raise ValueError(f"the predicted gain needs --epsilon, --delta, --num-examples and --batch-size; "
                         f"missing {missing}.")
    return bool(given)


def rule_of(args):
    """The ``UpdateRule`` of ``--momentum`` (None: plain SGD)."""
    from keras_noisecurve.mixing.update_rule import UpdateRule

    return None if args.momentum is None else UpdateRule(momentum=args.momentum)


def prediction_lines(mixing, args) -> list:
    """The lines that say what ``mixing`` gains over DP-SGD at the budget of ``args``."""
    from keras_noisecurve.privacy.choice import expectation, predicted_gain

    try:
        candidate = predicted_gain(mixing, num_examples=args.num_examples, batch_size=args.batch_size,
                                   epsilon=args.epsilon, delta=args.delta, sampling=args.sampling,
                                   accountant=args.accountant)
    except (ValueError, TypeError, ArithmeticError) as exc:
        return [f"predicted vs DP-SGD   : not available for this budget: {' '.join(str(exc).split())}"]
    return [f"predicted vs DP-SGD   : sigma {candidate.noise_multiplier:.4g}, noise variance "
            f"x{candidate.relative_error:.3f} of DP-SGD's (std {-100 * candidate.noise_reduction:+.1f} %), "
            f"at eps={args.epsilon:g}, delta={args.delta:g}",
            expectation(candidate, epsilon=args.epsilon)]


def auto_lines(args, *, steps: int) -> tuple:
    """``(choice, its summary lines)`` of ``choose_mixing`` for ``calibrate --mixing auto``."""
    from keras_noisecurve.privacy.choice import choose_mixing

    choice = choose_mixing(num_examples=args.num_examples, batch_size=args.batch_size, steps=steps,
                           epsilon=args.epsilon, delta=args.delta, sampling=args.sampling,
                           accountant=args.accountant, update_rule=rule_of(args), max_bands=args.max_bands)
    return choice, choice.summary().splitlines()


def sigmas(args, mixing, reference=None) -> dict:
    """σ at the budget of ``args`` for ``"this C"``, ``"DP-SGD"`` (C = I of the same T) and,
    when given, the ``"DP-BandMF"`` reference: what ``inspect --plot`` scales each curve by."""
    from keras_noisecurve.mixing.matrix import MixingMatrix
    from keras_noisecurve.privacy.choice import sigma_for
    from keras_noisecurve.privacy.spec import RunSpec

    out = {}
    for name, c in (("this C", mixing), ("DP-SGD", MixingMatrix.identity(mixing.steps)), ("DP-BandMF", reference)):
        if c is not None:
            spec = RunSpec(num_examples=args.num_examples, batch_size=args.batch_size, steps=c.steps,
                           sampling=args.sampling, mixing=c)
            out[name] = sigma_for(spec, epsilon=args.epsilon, delta=args.delta, accountant=args.accountant)
    return out
