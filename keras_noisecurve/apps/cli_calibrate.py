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
    noisecurve calibrate --epsilon 2 --delta 1e-5 --num-examples 3500 \\
        --batch-size 250 --steps 140 --bands 4 --adaptive-clip --target-quantile 0.7

``--mixing auto`` chooses the mechanism for the budget (``keras_noisecurve.choose_mixing``)
and prints the comparison and the predicted gain over DP-SGD; with a ``--mixing FILE`` of
the run's T steps the predicted gain of that C is printed too
(``keras_noisecurve.apps.cli_predict``).

``--adaptive-clip`` calibrates σ for a run with ``keras_noisecurve.AdaptiveClip``
(``PrivateRun(adaptive_clip=...)``): its count query, noise multiplier σ_c = 2·s_b, enters
every participation beside the gradient (``RunSpec(count_noise_multiplier=σ_c)``), and the
report names σ_c. ``--target-quantile``, ``--clip-learning-rate`` and ``--count-stddev`` set
the clip (defaults: ``AdaptiveClip``'s) and are refused without ``--adaptive-clip``.

``--privacy-unit user --examples-per-user K`` plans a user-level run
(``PrivateRun(privacy_unit="user", num_users=n, examples_per_user=K)``): σ is the same as for
examples, with ``--num-examples`` and ``--batch-size`` counting users (n users, B users per
step); only the wording changes, and the report prints K.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from keras_noisecurve.apps import cli_predict
from keras_noisecurve.privacy import accounting
from keras_noisecurve.privacy.adaptive_clip import AdaptiveClip

#: the ``AdaptiveClip`` options: (flag, ``AdaptiveClip`` keyword)
_CLIP_OPTIONS = (("--target-quantile", "target_quantile"), ("--clip-learning-rate", "learning_rate"),
                 ("--count-stddev", "count_stddev"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``calibrate`` options to ``parser``."""
    parser.add_argument("--epsilon", type=float, required=True, help="target epsilon (> 0)")
    parser.add_argument("--delta", type=float, required=True,
                        help="accounting delta in (0, 1), much smaller than 1/n (e.g. 1e-5 for n = 1000)")
    parser.add_argument("--num-examples", type=int, required=True, help="n, size of the private training set (the number of users with --privacy-unit user)")
    parser.add_argument("--batch-size", type=int, required=True,
                        help="B: expected batch size (cyclic_poisson) or fixed batch size (fixed_epochs); "
                             "users per step with --privacy-unit user")
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
    _add_clip_arguments(parser)
    parser.add_argument("--privacy-unit", choices=("example", "user"), default="example",
                        help="the privacy unit: 'user' is user-level DP (PrivateRun(privacy_unit='user')): "
                             "--num-examples and --batch-size then count users (n users, B users per step)")
    parser.add_argument("--examples-per-user", type=int, default=None,
                        help="with --privacy-unit user (required there): K, the most examples of one user a step "
                             "uses (PrivateRun(examples_per_user=K)); it does not change sigma")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _add_clip_arguments(parser: argparse.ArgumentParser) -> None:
    """``--adaptive-clip`` and the options of its ``AdaptiveClip`` (defaults: the class's)."""
    default = AdaptiveClip()
    group = parser.add_argument_group(
        "adaptive clipping (keras_noisecurve.AdaptiveClip, as PrivateRun(adaptive_clip=...))",
        "sigma is calibrated with the clip's count queries, one beside every participation")
    group.add_argument("--adaptive-clip", action="store_true",
                       help="the run clips at a private quantile of the per-example norms: include its count "
                            "queries (noise multiplier 2*count stddev) in sigma")
    group.add_argument("--target-quantile", type=float, default=None,
                       help=f"with --adaptive-clip: gamma in (0, 1), the share of examples left unclipped "
                            f"(default {default.target_quantile:g})")
    group.add_argument("--clip-learning-rate", type=float, default=None,
                       help=f"with --adaptive-clip: eta >= 0 of the update zeta <- zeta*exp(-eta*(b - gamma)) "
                            f"(default {default.learning_rate:g})")
    group.add_argument("--count-stddev", type=float, default=None,
                       help="with --adaptive-clip: s_b > 0, the standard deviation of the count's noise in examples "
                            "(default B/20); the count noise multiplier is 2*s_b")


def _adaptive_clip(args):
    """The ``AdaptiveClip`` of ``--adaptive-clip`` and its options, or ``None``; ``ValueError``
    for a clip option given without ``--adaptive-clip``."""
    given = {key: getattr(args, flag[2:].replace("-", "_")) for flag, key in _CLIP_OPTIONS}
    given = {key: value for key, value in given.items() if value is not None}
    if not args.adaptive_clip:
        if given:
            flags = [flag for flag, key in _CLIP_OPTIONS if key in given]
            one = len(flags) == 1
            raise ValueError(f"{' and '.join(flags)} {'is' if one else 'are'} for --adaptive-clip (the adaptive clip "
                             "whose count queries sigma then includes): give --adaptive-clip too, or leave "
                             f"{'it' if one else 'them'} out for a fixed clip norm, which does not enter sigma.")
        return None
    try:
        return AdaptiveClip(**given)
    except (ValueError, TypeError) as exc:  # name the flag, not the keyword
        message = str(exc)
        for flag, key in _CLIP_OPTIONS:
            message = message.replace(key, flag)
        raise ValueError(message) from None


def _examples_per_user(args):
    """K of ``--privacy-unit user`` (``None`` for examples); ``ValueError`` when it is missing,
    below 1, or given for examples."""
    if args.privacy_unit == "example":
        if args.examples_per_user is not None:
            raise ValueError(f"--examples-per-user is for --privacy-unit user (user-level DP); got --examples-per-user "
                             f"{args.examples_per_user} with --privacy-unit example: leave it out, or give "
                             "--privacy-unit user.")
        return None
    if args.examples_per_user is None or args.examples_per_user < 1:
        raise ValueError(f"--privacy-unit user needs --examples-per-user K >= 1 (the most examples of one user a "
                         f"step uses); got {args.examples_per_user}.")
    return args.examples_per_user


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
        clip = _adaptive_clip(args)
        per_user = _examples_per_user(args)
        steps, epochs = _resolve_steps(args)
        counts = None if clip is None else clip.count_noise_multiplier(args.batch_size)
        if auto:
            choice, auto_text = cli_predict.auto_lines(args, steps=steps)
            mixing = choice.mixing
        result = accounting.calibrate(
            epsilon=args.epsilon, delta=args.delta, num_examples=args.num_examples,
            batch_size=args.batch_size, steps=steps, bands=args.bands, sampling=args.sampling,
            epochs=epochs, mixing=mixing, accountant=args.accountant,
            overflow_probability_target=args.overflow_probability, count_noise_multiplier=counts,
        )
    except (ValueError, TypeError, OSError) as exc:
        print(f"noisecurve calibrate: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except (ArithmeticError, MemoryError) as exc:  # dp-accounting overflows on extreme runs
        print(f"noisecurve calibrate: error: the {args.accountant} accountant cannot evaluate this run "
              f"({type(exc).__name__}: {' '.join(str(exc).split())}); try --accountant rdp, or fewer steps.",
              file=sys.stderr)
        return 2

    users = per_user is not None
    if args.delta >= 1.0 / args.num_examples:
        print(f"noisecurve calibrate: warning: --delta {args.delta:g} is not much smaller than 1/n = "
              f"{1.0 / args.num_examples:.3g} (n = {args.num_examples}{' users' if users else ''}): a delta of 1/n or "
              f"more allows releasing {'a user' if users else 'an example'} outright, so this epsilon means little; "
              "use a delta much smaller than 1/n.", file=sys.stderr)
    if args.json:
        record = result.to_dict()
        if clip is not None:
            record["adaptive_clip"] = {"target_quantile": clip.target_quantile, "learning_rate": clip.learning_rate,
                                       "count_stddev": clip.stddev(args.batch_size)}
        if choice is not None:
            record["choice"] = choice.to_metadata()
        if users:
            record.update(privacy_unit="user", examples_per_user=per_user)
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
        f"padded batch size P    : {result.padded_batch_size}"
        + (f" users ({result.padded_batch_size * per_user} rows per batch, {per_user} per user)" if users else ""),
        f"overflow probability   : {result.overflow_probability:.3g}",
        f"total delta            : {result.total_delta:.6g} (delta + (1+e^eps)*overflow)",
    ]
    if users:
        lines.insert(0, f"privacy unit           : user (n = {args.num_examples} users, B = {args.batch_size} users per "
                        f"step, at most K = {per_user} examples of a user per step)")
    if clip is not None:
        lines += _clip_lines(clip, result, args.batch_size)
    if choice is not None:
        lines = auto_text + [""] + lines + _clip_note(clip)
    elif mixing is not None and mixing.steps == result.steps:
        lines += cli_predict.prediction_lines(mixing, args) + _clip_note(clip)
    elif mixing is not None:
        lines.append(f"predicted vs DP-SGD   : for a C of the run's T steps (this file's C has {mixing.steps})")
    elif result.bands > 1:
        lines.append("predicted vs DP-SGD   : depends on C: --mixing auto compares DP-SGD and a grid of b at this "
                     "budget (or give a solved C with --mixing FILE)")
    print("\n".join(lines))
    return 0


def _clip_lines(clip, result, batch_size: int) -> list:
    """The report's lines on the adaptive clip: its count noise multiplier and settings."""
    stddev = clip.stddev(batch_size)
    source = "B/20" if clip.count_stddev is None else "--count-stddev"
    return [
        f"count noise multiplier : {result.count_noise_multiplier:.6g} (count stddev {stddev:g} examples ({source}), "
        "sensitivity 1/2; included in sigma)",
        f"adaptive clip          : AdaptiveClip(target_quantile={clip.target_quantile:g}, "
        f"learning_rate={clip.learning_rate:g}{'' if clip.count_stddev is None else f', count_stddev={stddev:g}'}), "
        "as PrivateRun(adaptive_clip=...) takes it",
    ]


def _clip_note(clip) -> list:
    """With an adaptive clip, a line saying that the comparison with DP-SGD (``choose_mixing``,
    ``predicted_gain``) was calibrated without the count queries."""
    if clip is None:
        return []
    return ["(the comparison with DP-SGD is calibrated without the count queries; sigma above includes them)"]
