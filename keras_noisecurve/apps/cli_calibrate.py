"""``noisecurve calibrate``: the noise multiplier σ for a target (ε, δ).

Prints σ, the sampling probability q, the number of composed mechanisms, T, the
re-checked ε, the sampler's padded batch size and overflow probability, and the
total δ. Bad input: a message on stderr and exit status 2. No TensorFlow import.

Examples::

    noisecurve calibrate --epsilon 2 --delta 1e-5 --num-examples 60000 \\
        --batch-size 256 --epochs 10 --bands 8
    noisecurve calibrate --epsilon 8 --delta 1e-5 --num-examples 50000 \\
        --batch-size 500 --steps 2000 --bands 4 --sampling fixed_epochs --json
    noisecurve calibrate --epsilon 8 --delta 1e-5 --num-examples 3500 \\
        --batch-size 250 --steps 140 --mixing auto --momentum 0.9

``--mixing auto`` chooses the mechanism for the budget (``keras_noisecurve.choose_mixing``)
and prints the comparison and the predicted gain over DP-SGD; with a ``--mixing FILE`` of
the run's T steps the predicted gain of that C is printed too
(``keras_noisecurve.apps.cli_predict``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from keras_noisecurve.apps import cli_predict
from keras_noisecurve.privacy import accounting


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``calibrate`` options to ``parser``."""
    parser.add_argument("--epsilon", type=float, required=True, help="target epsilon (> 0)")
    parser.add_argument("--delta", type=float, required=True,
                        help="accounting delta in (0, 1), much smaller than 1/n (e.g. 1e-5 for n = 1000)")
    parser.add_argument("--num-examples", type=int, required=True, help="n, size of the private training set")
    parser.add_argument("--batch-size", type=int, required=True,
                        help="B: expected batch size (cyclic_poisson) or fixed batch size (fixed_epochs)")
    length = parser.add_mutually_exclusive_group(required=True)
    length.add_argument("--epochs", type=float,
                        help="passes over the data, a positive integer E: T = E*ceil(n/B) steps "
                             "(as PrivateRun(epochs=E))")
    length.add_argument("--steps", type=int, help="T, the number of optimizer steps")
    parser.add_argument("--bands", type=int, default=None,
                        help="b, band width of C (default 1, or the --mixing file's)")
    parser.add_argument("--sampling", choices=accounting.SAMPLINGS, default="cyclic_poisson")
    parser.add_argument("--accountant", choices=accounting.ACCOUNTANTS, default="pld")
    parser.add_argument("--mixing", default=None,
                        help="optional mixing file written by `noisecurve solve` (banded, toeplitz, blt or bisr): "
                             "its bands and column norms set b and the sensitivity; 'auto': choose the mechanism "
                             "with the least noise for this budget (DP-SGD and a grid of b up to the most the sampling allows) "
                             "and print the comparison")
    cli_predict.add_rule_arguments(parser)
    parser.add_argument("--overflow-probability", type=float, default=None,
                        help="target probability that any step's Poisson draw exceeds the padded batch size "
                             f"(default {accounting.DEFAULT_OVERFLOW_PROBABILITY:g}, smaller where the overflow rule "
                             "needs it: (1+e^eps)*p <= delta/10, as PrivateRun)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _resolve_steps(args) -> tuple[int, int | None]:
    """(T, epochs) from --steps / --epochs and the sampling scheme; --epochs E gives
    T = E·ceil(n/B) (``accounting.steps_for_epochs``, as ``PrivateRun(epochs=E)``)."""
    n, batch = args.num_examples, args.batch_size
    if n is None or n < 1 or batch is None or batch < 1:
        raise ValueError(f"--num-examples and --batch-size must be positive integers, got {n} and {batch}.")
    per_epoch = -(-n // batch)
    if args.epochs is not None:
        if not (args.epochs > 0 and math.isfinite(args.epochs) and args.epochs == int(args.epochs)):
            raise ValueError(
                f"--epochs must be a positive integer (T = epochs * ceil(n/B), as PrivateRun(epochs=)), got "
                f"{args.epochs:g}; give --steps for any other T."
            )
        epochs = int(args.epochs)
        steps = accounting.steps_for_epochs(num_examples=n, batch_size=batch, epochs=epochs)
        return steps, epochs if args.sampling == "fixed_epochs" else None
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}.")
    if args.sampling == "fixed_epochs":
        return args.steps, -(-args.steps // per_epoch)
    return args.steps, None


def run(args) -> int:
    """Run ``noisecurve calibrate``; returns the exit status (2 on bad input)."""
    try:
        mixing = choice = None
        auto = args.mixing == cli_predict.AUTO
        if not auto and (args.momentum is not None or args.max_bands is not None):
            raise ValueError("--momentum and --max-bands are for --mixing auto (a solved C records its own rule).")
        if auto and args.bands is not None:
            raise ValueError("--bands and --mixing auto exclude each other: auto chooses b.")
        if args.mixing is not None and not auto:
            from keras_noisecurve.mixing.strategies import load_mixing

            mixing = load_mixing(args.mixing)  # any strategy file `noisecurve solve` writes
        steps, epochs = _resolve_steps(args)
        if auto:
            choice, auto_text = cli_predict.auto_lines(args, steps=steps)
            mixing = choice.mixing
        result = accounting.calibrate(
            epsilon=args.epsilon, delta=args.delta, num_examples=args.num_examples,
            batch_size=args.batch_size, steps=steps, bands=args.bands, sampling=args.sampling,
            epochs=epochs, mixing=mixing, accountant=args.accountant,
            overflow_probability_target=args.overflow_probability,
        )
    except (ValueError, TypeError, OSError) as exc:
        print(f"noisecurve calibrate: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except (ArithmeticError, MemoryError) as exc:  # dp-accounting overflows on extreme runs
        print(f"noisecurve calibrate: error: the {args.accountant} accountant cannot evaluate this run "
              f"({type(exc).__name__}: {' '.join(str(exc).split())}); try --accountant rdp, or fewer steps.",
              file=sys.stderr)
        return 2

    if args.delta >= 1.0 / args.num_examples:
        print(f"noisecurve calibrate: warning: --delta {args.delta:g} is not much smaller than 1/n = "
              f"{1.0 / args.num_examples:.3g} (n = {args.num_examples}): a delta of 1/n or more allows releasing "
              "an example outright, so this epsilon means little; use a delta much smaller than 1/n.",
              file=sys.stderr)
    if args.json:
        record = result.to_dict()
        if choice is not None:
            record["choice"] = choice.to_metadata()
        print(json.dumps(record, sort_keys=True))
        return 0
    q = "n/a (fixed_epochs: no amplification)" if result.sampling_probability is None else f"{result.sampling_probability:.6g}"
    lines = [
        f"noise multiplier sigma : {result.noise_multiplier:.6f}",
        f"sampling               : {result.sampling} ({result.accountant} accountant)",
        f"sampling probability q : {q}",
        f"compositions           : {result.compositions}",
        f"steps T                : {result.steps} (bands b = {result.bands})",
    ]
    if result.epochs is not None:
        lines.append(f"epochs                 : {result.epochs} ({result.steps_per_epoch} steps per epoch)")
    lines += [
        f"sensitivity (max col)  : {result.sensitivity:.6g}",
        f"epsilon (re-checked)   : {result.epsilon:.6f} (target {result.target_epsilon:g})",
        f"delta                  : {result.delta:g} (accounting)",
        f"padded batch size P    : {result.padded_batch_size}",
        f"overflow probability   : {result.overflow_probability:.3g}",
        f"total delta            : {result.total_delta:.6g} (delta + (1+e^eps)*overflow)",
    ]
    if choice is not None:
        lines = auto_text + [""] + lines
    elif mixing is not None and mixing.steps == result.steps:
        lines += cli_predict.prediction_lines(mixing, args)
    elif mixing is not None:
        lines.append(f"predicted vs DP-SGD   : for a C of the run's T steps (this file's C has {mixing.steps})")
    elif result.bands > 1:
        lines.append("predicted vs DP-SGD   : depends on C: --mixing auto compares DP-SGD and a grid of b at this "
                     "budget (or give a solved C with --mixing FILE)")
    print("\n".join(lines))
    return 0
