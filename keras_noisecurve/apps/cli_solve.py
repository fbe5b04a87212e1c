"""``noisecurve solve``: solve for a mixing strategy C and save it as ``.npz``.

Usage::

    noisecurve solve --steps T --objective NAME [--strategy {banded,toeplitz,blt,bisr}]
                     [--bands b] [--buffers d] [--participations k --separation s]
                     [--spectrum FILE] [--learning-rate ETA] [--blend-weight LAMBDA|auto]
                     [--momentum BETA] [--schedule {constant,cosine,linear-cooldown}]
                     [--cooldown-fraction F] [--tol TOL] [--max-iterations N]
                     [--out FILE] [--quiet]

``--strategy`` picks the family of C (``keras_noisecurve.mixing.strategies``; default
``banded``) and the solve goes through ``keras_noisecurve.mixing.api.solve_mixing_matrix``:

==========  ===================  ==============================================================
strategy    size                 options only it takes
==========  ===================  ==============================================================
banded      ``--bands b``        ``--momentum``, ``--schedule``, ``--cooldown-fraction``,
                                 ``--blend-weight auto``, every objective
toeplitz    ``--bands b``        (objectives ``TOEPLITZ_OBJECTIVES`` only)
blt         ``--buffers d``      ``--participations k``, ``--separation s``
bisr        ``--bands p``        (closed form: no ``--tol``/``--max-iterations``)
==========  ===================  ==============================================================

An option that does not apply to the chosen strategy is a one-line error before any
solve work. The file is what the strategy's ``save`` writes (``MixingMatrix`` for
banded, the strategy format for the others; ``load_mixing`` reads both).

``--momentum``/``--schedule``/``--cooldown-fraction`` give the update rule training will
run (``keras_noisecurve.mixing.UpdateRule``: Keras's SGD with heavy-ball momentum and a
learning-rate schedule; default plain SGD with a constant rate); C is solved for it and
records it in ``metadata["update_rule"]``.

Prints a summary: the objective value Tr(W X⁻¹), the DP-SGD and DP-BandMF baselines
under the same W and the ratios to them, the noise state (model-sized buffers), the
update rule, solver statistics, and the headline noise diagnostics
(:mod:`keras_noisecurve.mixing.diagnostics`; banded only). For the other strategies: the
strategy and its size, the loss (for blt: sensitivity² × Tr(W X⁻¹) for the participation
pattern it was optimised for), the baselines stored by the solver, the noise state and
the solver statistics. Bad input gives a one-line error on stderr and exit status 2,
never a traceback.

numpy/scipy only: this module does not import TensorFlow.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
import warnings

from keras_noisecurve.apps import cli_predict
from keras_noisecurve.apps.strategy_table import KINDS, SOLVE_KINDS, kind_of, options_for
from keras_noisecurve.mixing.api import TOEPLITZ_OBJECTIVES
from keras_noisecurve.mixing.objectives import get_objective
from keras_noisecurve.mixing.update_rule import SCHEDULES, UpdateRule
from keras_noisecurve.mixing.workloads import CURVATURE_OBJECTIVES, OBJECTIVES

PROG = "noisecurve solve"


class CommandError(Exception):
    """A user error: printed as one line on stderr, exit status 2."""


def blend_weight_arg(text: str):
    """argparse type for ``--blend-weight``: a number in [0, 1] or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1] or 'auto', got {text!r}") from None
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1] or 'auto', got {text!r}")
    return value


def fail(prog: str, message: str) -> int:
    """Print ``prog: error: message`` on stderr; return exit status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def report_warnings(prog: str, caught) -> list[str]:
    """Print captured warnings as ``prog: warning: …`` lines on stderr; return their texts."""
    texts = []
    for w in caught:
        text = f"{w.category.__name__}: {w.message}"
        texts.append(text)
        print(f"{prog}: warning: {text}", file=sys.stderr)
    return texts


def load_spectrum(path: str):
    """Load a :class:`~keras_noisecurve.spectrum.artifact.Spectrum` file or raise ``CommandError``."""
    from keras_noisecurve.spectrum.artifact import Spectrum

    if not os.path.isfile(path):
        raise CommandError(f"spectrum file {path!r} does not exist.")
    try:
        return Spectrum.load(path)
    except (ValueError, OSError, KeyError) as exc:
        raise CommandError(f"cannot read spectrum file {path!r}: {exc}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``noisecurve solve``."""
    parser.add_argument("--steps", type=int, required=True, metavar="T", help="number of training steps T (>= 1)")
    parser.add_argument(
        "--strategy",
        choices=SOLVE_KINDS,
        default="banded",
        help="family of C: %(choices)s (default banded; docs/mixing.md, 'Command line: the other strategies')",
    )
    parser.add_argument(
        "--bands",
        type=int,
        metavar="b",
        help="banded/toeplitz: band width b, 1 <= b <= T (b = 1 is DP-SGD); bisr: the bands p of C^-1. "
        "Required by those strategies; not used by blt",
    )
    parser.add_argument(
        "--buffers", type=int, metavar="d", help="blt only (required there): d noise buffers, 1 <= d < T"
    )
    parser.add_argument(
        "--participations",
        type=int,
        metavar="k",
        help="blt only: optimise for k participations per example (fixed epochs; default 1, one pass)",
    )
    parser.add_argument(
        "--separation",
        type=int,
        metavar="s",
        help="blt only, with --participations k >= 2: the steps between two participations, (k - 1) s < T",
    )
    parser.add_argument(
        "--objective",
        required=True,
        choices=OBJECTIVES,
        metavar="NAME",
        help="workload W of the objective Tr(W X^-1): %(choices)s (toeplitz, blt, bisr: "
        + ", ".join(TOEPLITZ_OBJECTIVES) + ")",
    )
    parser.add_argument(
        "--spectrum", metavar="FILE", help="Spectrum .npz (from 'noisecurve spectrum'); needed by curvature objectives"
    )
    parser.add_argument(
        "--learning-rate", type=float, metavar="ETA", help="learning rate eta; needed by curvature objectives"
    )
    parser.add_argument(
        "--blend-weight",
        type=blend_weight_arg,
        metavar="LAMBDA",
        help="noisecurve-blend only: weight in [0, 1] of the prefix-sum workload, or 'auto' (banded only)",
    )
    parser.add_argument(
        "--momentum",
        type=float,
        metavar="BETA",
        help="banded only: heavy-ball momentum beta in [0, 1) of the SGD training will run (default 0)",
    )
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES[:-1],
        help="banded only: learning-rate schedule of that SGD: %(choices)s (default constant)",
    )
    parser.add_argument(
        "--cooldown-fraction",
        type=float,
        metavar="F",
        help="banded, linear-cooldown only: share of the steps in (0, 1] spent cooling down (default 0.25)",
    )
    parser.add_argument(
        "--tol", type=float, help="relative optimality tolerance (default 1e-6; not for bisr, a closed form)"
    )
    parser.add_argument(
        "--max-iterations",
        type=int,
        metavar="N",
        help="solver iteration limit (default 10000 for banded, the solver's own for toeplitz and blt; "
        "not for bisr)",
    )
    parser.add_argument("--out", default="mixing.npz", metavar="FILE", help="output .npz file (default mixing.npz)")
    parser.add_argument("--quiet", action="store_true", help="print nothing but warnings and errors")
    cli_predict.add_budget_arguments(parser)


#: Options that only some strategies take (``StrategyOptions.options``): option -> attribute.
_ONLY_FOR = {
    "--bands": "bands",
    "--buffers": "buffers",
    "--participations": "participations",
    "--separation": "separation",
    "--momentum": "momentum",
    "--schedule": "schedule",
    "--cooldown-fraction": "cooldown_fraction",
    "--tol": "tol",
    "--max-iterations": "max_iterations",
}

_WHY_NOT = {
    "--momentum": "the toeplitz, blt and bisr strategies are solved for plain SGD with a constant learning rate",
    "--schedule": "the toeplitz, blt and bisr strategies are solved for plain SGD with a constant learning rate",
    "--cooldown-fraction": "the toeplitz, blt and bisr strategies are solved for plain SGD with a constant "
    "learning rate",
    "--tol": "bisr is a closed form, nothing is optimised",
    "--max-iterations": "bisr is a closed form, nothing is optimised",
    "--bands": "a blt C is sized by --buffers d",
    "--buffers": "only a blt C is sized by buffers; the others by --bands",
    "--participations": "the banded kinds need none: participations >= b steps apart do not overlap, so k only "
    "scales the loss",
    "--separation": "the banded kinds need none: participations >= b steps apart do not overlap, so k only "
    "scales the loss",
}


def _check_strategy(args) -> None:
    """Refuse options the strategy does not take; sizes and blt's participation pattern."""
    strategy = args.strategy
    kind = options_for(strategy)
    for option, attr in _ONLY_FOR.items():
        if getattr(args, attr) is not None and attr not in kind.options:
            allowed = [name for name in SOLVE_KINDS if attr in KINDS[name].options]
            raise CommandError(
                f"{option} does not apply to --strategy {strategy} ({_WHY_NOT[option]}); it is used by "
                f"--strategy {'/'.join(allowed)} only."
            )
    if not kind.every_objective:
        if args.objective not in TOEPLITZ_OBJECTIVES:
            raise CommandError(
                f"--strategy {strategy} supports --objective {', '.join(TOEPLITZ_OBJECTIVES)}; got "
                f"{args.objective!r}. Use --strategy banded for the others."
            )
        if args.blend_weight == "auto":
            raise CommandError(
                f"--blend-weight auto is only supported by --strategy banded; give --strategy {strategy} "
                "a number in [0, 1]."
            )
    if kind.size_option == "--bands":
        if args.bands is None:
            raise CommandError(f"--strategy {strategy} needs --bands {kind.size_requirement} <= steps ({args.steps}).")
        if not 1 <= args.bands <= args.steps:
            raise CommandError(f"--bands must satisfy 1 <= b <= steps ({args.steps}), got {args.bands}.")
        return
    # sized by --buffers (blt)
    if args.steps < kind.min_steps:
        raise CommandError(f"--strategy {strategy} needs --steps >= {kind.min_steps}, got {args.steps}.")
    if args.buffers is None:
        raise CommandError(f"--strategy {strategy} needs --buffers {kind.size_requirement} < steps.")
    max_buffers = _blt_max_buffers()
    if not 1 <= args.buffers < args.steps or args.buffers > max_buffers:
        raise CommandError(
            f"--buffers must satisfy 1 <= d <= {max_buffers} and d < steps ({args.steps}), got {args.buffers}."
        )
    k, s = args.participations, args.separation
    if k is not None and k < 1:
        raise CommandError(f"--participations must be >= 1, got {k}.")
    if k is not None and k > 1:
        if s is None:
            raise CommandError(f"--participations {k} needs --separation s (the steps between participations).")
        if s < 1:
            raise CommandError(f"--separation must be >= 1, got {s}.")
        if (k - 1) * s >= args.steps:
            raise CommandError(
                f"--participations {k} at --separation {s} needs (k - 1) * s < steps ({args.steps}); "
                f"got {(k - 1) * s}."
            )
    elif s is not None:
        raise CommandError("--separation is only used with --participations k >= 2.")


def _blt_max_buffers() -> int:
    try:
        from keras_noisecurve.mixing.solve_blt import MAX_BUFFERS
    except ImportError:  # solver not installed: the solve reports it
        return 10**9
    return int(MAX_BUFFERS)


#: float64 arrays of T (×b for banded) entries the solvers hold at once, at least: the
#: iterate, its gradient, the L-BFGS history and the FFT work arrays (an estimate used
#: only to refuse, before allocating, a size no machine here could solve).
_WORKING_ARRAYS = 16


def _check_memory(args) -> None:
    from keras_noisecurve._validation import check_memory

    width = args.bands if options_for(args.strategy).dense_bands and args.bands else 1
    try:
        check_memory(f"solving --strategy {args.strategy} for --steps {args.steps}",
                     _WORKING_ARRAYS * 8 * args.steps * width,
                     hint="Use fewer --steps (or a toeplitz/blt strategy for long runs).")
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def _check_args(args) -> None:
    if args.steps < 1:
        raise CommandError(f"--steps must be >= 1, got {args.steps}.")
    _check_strategy(args)
    _check_memory(args)
    if args.tol is not None and not (math.isfinite(args.tol) and args.tol > 0):
        raise CommandError(f"--tol must be a finite number > 0, got {args.tol}.")
    if args.max_iterations is not None and args.max_iterations < 1:
        raise CommandError(f"--max-iterations must be >= 1, got {args.max_iterations}.")
    curvature = args.objective in CURVATURE_OBJECTIVES
    if curvature and args.spectrum is None:
        raise CommandError(f"objective {args.objective!r} needs --spectrum FILE (a Spectrum .npz).")
    if curvature and args.learning_rate is None:
        raise CommandError(f"objective {args.objective!r} needs --learning-rate ETA.")
    if not curvature and args.spectrum is not None:
        raise CommandError(f"--spectrum is only used by the curvature objectives {CURVATURE_OBJECTIVES}, "
                           f"not by {args.objective!r}.")
    if not curvature and args.learning_rate is not None and not options_for(args.strategy).update_rule:
        raise CommandError(f"--learning-rate is only used by the curvature objectives {CURVATURE_OBJECTIVES}, "
                           f"not by {args.objective!r}.")
    if args.learning_rate is not None and not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        raise CommandError(f"--learning-rate must be a finite number > 0, got {args.learning_rate}.")
    blend = get_objective(args.objective).blend
    if blend and args.blend_weight is None:
        raise CommandError(f"objective {args.objective!r} needs --blend-weight LAMBDA (in [0, 1]) or 'auto'.")
    if not blend and args.blend_weight is not None:
        blends = ", ".join(repr(name) for name in OBJECTIVES if get_objective(name).blend)
        raise CommandError(f"--blend-weight is only used by objective {blends}, not {args.objective!r}.")
    if args.momentum is not None and not (math.isfinite(args.momentum) and 0.0 <= args.momentum < 1.0):
        raise CommandError(f"--momentum must lie in [0, 1), got {args.momentum}.")
    if args.cooldown_fraction is not None:
        if args.schedule != "linear-cooldown":
            schedule = args.schedule or "constant"
            raise CommandError(f"--cooldown-fraction is only used by --schedule linear-cooldown, not {schedule!r}.")
        if not (math.isfinite(args.cooldown_fraction) and 0.0 < args.cooldown_fraction <= 1.0):
            raise CommandError(f"--cooldown-fraction must lie in (0, 1], got {args.cooldown_fraction}.")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise CommandError(f"the directory of --out {args.out!r} does not exist.")
    if os.path.isdir(args.out):
        raise CommandError(f"--out {args.out!r} is a directory; give a file name.")
    module = options_for(args.strategy).solver_module
    if module is not None:
        if importlib.util.find_spec(module) is None:
            raise CommandError(f"--strategy {args.strategy} is not available: its solver ({module}) is not installed.")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def summary_lines(mixing, *, seconds: float | None = None) -> list[str]:
    """Human-readable summary of a solved C from its metadata."""
    meta = mixing.metadata
    lines = []
    loss = meta.get("loss")
    baselines = meta.get("baseline_losses") or {}
    objective = meta.get("objective", "?")
    lines.append(f"objective {objective!r}: Tr(W X^-1) = {_fmt(loss)}")
    for name, label in (("dpsgd", "DP-SGD (C = I)"), ("bandmf", f"DP-BandMF (b = {mixing.bands})")):
        base = baselines.get(name)
        if base is None:
            continue
        ratio = f"{loss / base:.4f}" if isinstance(loss, (int, float)) and base else "n/a"
        lines.append(f"  {label:<22} {_fmt(base):>12}   this C / baseline = {ratio}")
    if meta.get("loss_scale"):
        lines.append(f"  ({meta['loss_scale']})")
    elif objective in CURVATURE_OBJECTIVES:
        lines.append("  (expected loss gap = (eta^2 sigma^2 / 2) * Tr(W X^-1) for a quadratic model, paper eq. 1)")
    lines.append(f"update rule: {update_rule_text(meta)}")
    lines.extend(solver_lines(meta.get("solver")))
    if seconds is not None:
        lines.append(f"wall time: {seconds:.2f} s")
    if "ridge" in meta:
        lines.append(f"ridge: {_fmt(meta['ridge'])}")
    if "blend_weight" in meta and meta.get("blend_weight") is not None:
        lines.append(f"blend weight: {_fmt(meta['blend_weight'])}")
    lines.extend(diagnostics_lines(meta.get("diagnostics"), steps=mixing.steps))
    return lines


def update_rule_text(meta) -> str:
    """The update rule a C was solved for, from ``metadata["update_rule"]`` (absent: plain SGD)."""
    record = meta.get("update_rule")
    try:
        text = UpdateRule.from_metadata(record).describe()
    except (ValueError, TypeError, KeyError) as exc:
        return f"unreadable record {record!r} ({exc})"
    return text + (" (no record: solved before update rules were recorded)" if record is None else "")


def solver_lines(solver) -> list[str]:
    """One line of solver statistics (convergence, iterations, relative optimality, time)."""
    if not isinstance(solver, dict) or not solver:
        return []
    parts = []
    if "converged" in solver:
        reason = solver.get("stopping_reason")
        parts.append(("converged" if solver["converged"] else "NOT converged") + (f" ({reason})" if reason else ""))
    if "iterations" in solver:
        parts.append(f"{solver['iterations']} iterations")
    if "function_evaluations" in solver:
        parts.append(f"{solver['function_evaluations']} function evaluations")
    if "relative_optimality" in solver:
        tol = solver.get("tolerance")
        parts.append(f"relative optimality {solver['relative_optimality']:.3g}" + (f" (tol {tol:g})" if tol else ""))
    seconds = solver.get("total_seconds", solver.get("seconds"))
    if isinstance(seconds, (int, float)):
        parts.append(f"{seconds:.2f} s")
    return ["solver: " + ", ".join(parts)] if parts else []


def diagnostics_lines(diag, *, steps: int, reference=None) -> list[str]:
    """Headline of a ``noise_diagnostics`` dict (optionally with a reference's)."""
    if not diag:
        return []
    lines = [
        "noise (units of the uncorrelated noise std; DP-SGD: per-step 1, running sum sqrt(t+1)):",
        f"  per-step std max          {diag['step_std_max']:.4g}",
        f"  running-sum std peak      {diag['prefix_std_max']:.4g} at step {diag['prefix_std_argmax']} "
        f"(final {diag['prefix_std_final']:.4g}; DP-SGD final {math.sqrt(steps):.4g})",
        f"  min diagonal of C         {diag['min_diagonal']:.4g}",
        f"  condition number of C     {diag['condition_number']:.4g} ({diag.get('condition_number_method', '?')})",
    ]
    if reference is not None:
        lines.append(
            f"  DP-BandMF running-sum peak {reference['prefix_std_max']:.4g}: "
            f"ratio {diag['prefix_std_max'] / reference['prefix_std_max']:.3g}"
        )
    elif diag.get("excursion_vs_bandmf") is not None:
        lines.append(f"  running-sum peak / DP-BandMF's  {diag['excursion_vs_bandmf']:.3g}")
    return lines


def noise_state_text(mixing) -> str:
    """``N buffers x model size``: the noise state the optimizer keeps for C."""
    n = mixing.buffers
    if n == 0:
        return "0 buffers (independent noise at every step, as DP-SGD)"
    return f"{n} buffer{'' if n == 1 else 's'} x model size (the optimizer keeps {n} model-sized noise array" \
           f"{'' if n == 1 else 's'})"


def size_text(mixing) -> str:
    """The size of a strategy: ``bands b = …``, ``buffers d = …`` or ``C^-1 bands p = …``."""
    return kind_of(mixing).size_text(mixing)


def participation_text(participations, separation) -> str:
    k = 1 if participations is None else int(participations)
    if k == 1:
        return "a single participation (one pass)"
    return f"{k} participations {separation} steps apart (fixed epoch order)"


def scored_objective(meta):
    """The objective a strategy's loss is under (``metadata["objective"]``)."""
    return meta.get("objective")


def strategy_summary_lines(mixing, *, seconds: float | None = None) -> list[str]:
    """Human-readable summary of a solved Toeplitz-family strategy from its metadata."""
    meta = mixing.metadata
    objective = scored_objective(meta)
    loss = meta.get("loss")
    lines = [f"noise state: {noise_state_text(mixing)}"]
    baselines = dict(meta.get("baseline_losses") or {})
    kind = kind_of(mixing)
    if kind.optimises_participations:
        k, s = meta.get("participations") or 1, meta.get("separation")
        sens = mixing.sensitivity(participations=k, separation=s) if k > 1 else mixing.max_column_norm()
        one = "" if k == 1 else f" (one participation {mixing.max_column_norm():.6g})"
        lines.append(f"optimised for {participation_text(k, s)}: sensitivity {sens:.6g}{one}")
        if k > 1:
            parts = meta.get("loss_components") or {}
            detail = ""
            if "sensitivity_squared" in parts and "trace" in parts:
                detail = (f" (sensitivity^2 {_fmt(parts['sensitivity_squared'])} x Tr(W X^-1) "
                          f"{_fmt(parts['trace'])})")
            lines.append(f"objective {objective!r}: sensitivity^2 x Tr(W X^-1) = {_fmt(loss)}{detail}")
        else:
            lines.append(f"objective {objective!r}: Tr(W X^-1) = {_fmt(loss)}")
    else:
        how = " (closed form, scored under the objective; nothing optimised)" if kind.closed_form else ""
        lines.append(f"objective {objective!r}: Tr(W X^-1) = {_fmt(loss)}{how}")
    labels = (("dpsgd", "DP-SGD (C = I)"), ("bandmf", f"Toeplitz DP-BandMF (b = {getattr(mixing, 'bands', '?')})"))
    for name, label in labels:
        base = baselines.get(name)
        if base is None:
            continue
        ratio = f"{loss / base:.4f}" if isinstance(loss, (int, float)) and base else "n/a"
        lines.append(f"  {label:<26} {_fmt(base):>12}   this C / baseline = {ratio}")
    if meta.get("loss_scale"):
        lines.append(f"  ({meta['loss_scale']})")
    lines.append(f"update rule: {UpdateRule().describe()} (the {mixing.kind} strategy is solved for plain SGD)")
    lines.extend(solver_lines(meta.get("solver")))
    if seconds is not None:
        lines.append(f"wall time: {seconds:.2f} s")
    if meta.get("blend_weight") is not None:
        lines.append(f"blend weight: {_fmt(meta['blend_weight'])}")
    return lines


def _solve_kwargs(args, spectrum, rule) -> dict:
    kwargs = dict(steps=args.steps, strategy=args.strategy, objective=args.objective, spectrum=spectrum,
                  learning_rate=args.learning_rate, blend_weight=args.blend_weight, verbose=not args.quiet)
    kind = options_for(args.strategy)
    kwargs.update(kind.solve_kwargs(args))
    if kind.update_rule:
        kwargs.update(update_rule=rule)
    return kwargs


def _complete_metadata(mixing, args, spectrum):
    """BISR: record what the scoring used (the closed form does not), so ``inspect`` can
    re-evaluate it, and the DP-SGD baseline under the same workload."""
    if not options_for(args.strategy).closed_form:
        return mixing
    from keras_noisecurve.mixing.api import objective_value
    from keras_noisecurve.mixing.strategies import ToeplitzMixing
    from keras_noisecurve.mixing.workloads import LOSS_SCALES

    meta = mixing.metadata
    extra = {"learning_rate": args.learning_rate, "blend_weight": args.blend_weight,
             "spectrum_digest": spectrum.digest() if spectrum is not None else None,
             "loss_scale": LOSS_SCALES.get(args.objective)}
    if "baseline_losses" not in meta:
        identity = ToeplitzMixing([1.0], steps=args.steps)
        extra["baseline_losses"] = {"dpsgd": objective_value(
            identity, objective=args.objective, spectrum=spectrum, learning_rate=args.learning_rate,
            blend_weight=args.blend_weight)}
    return mixing.with_metadata(**{k: v for k, v in extra.items() if k not in meta})


def run(args) -> int:
    """Solve, save, print the summary. Returns 0, or 2 on a user error."""
    try:
        _check_args(args)
        try:
            budget = cli_predict.budget_given(args)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        spectrum = load_spectrum(args.spectrum) if args.spectrum is not None else None
        rule = None
        if options_for(args.strategy).update_rule:
            try:
                rule = UpdateRule(momentum=0.0 if args.momentum is None else args.momentum,
                                  schedule=args.schedule or "constant", cooldown_fraction=args.cooldown_fraction)
            except (ValueError, TypeError) as exc:
                raise CommandError(str(exc)) from None
    except CommandError as exc:
        return fail(PROG, str(exc))

    from keras_noisecurve.mixing.api import solve_mixing_matrix

    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            mixing = solve_mixing_matrix(**_solve_kwargs(args, spectrum, rule))
            mixing = _complete_metadata(mixing, args, spectrum)
        except (ValueError, TypeError) as exc:
            report_warnings(PROG, caught)
            return fail(PROG, str(exc))
    seconds = time.perf_counter() - start
    seen = report_warnings(PROG, caught)
    try:
        mixing.save(args.out)
    except OSError as exc:
        return fail(PROG, f"cannot write {args.out!r}: {exc}")
    if not args.quiet:
        if kind_of(mixing).matrix_file:
            print(f"saved {args.out}: steps T = {mixing.steps}, bands b = {mixing.bands}")
            print(f"noise state: {noise_state_text(mixing)}")
            lines = summary_lines(mixing, seconds=seconds)
        else:
            print(f"saved {args.out}: strategy {mixing.kind!r}, steps T = {mixing.steps}, {size_text(mixing)}")
            lines = strategy_summary_lines(mixing, seconds=seconds)
        for line in lines + (cli_predict.prediction_lines(mixing, args) if budget else [cli_predict.HINT]):
            print(line)
        if seen:
            print(f"{len(seen)} warning(s) on stderr")
    return 0
