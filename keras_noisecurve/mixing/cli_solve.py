"""``noisecurve solve``: solve for a banded mixing matrix C and save it as ``.npz``.

Usage::

    noisecurve solve --steps T --bands b --objective NAME [--spectrum FILE]
                     [--learning-rate ETA] [--blend-weight LAMBDA|auto]
                     [--momentum BETA] [--schedule {constant,cosine,linear-cooldown}]
                     [--cooldown-fraction F] [--tol TOL] [--max-iterations N]
                     [--out FILE] [--quiet]

``--momentum``/``--schedule``/``--cooldown-fraction`` give the update rule training will
run (``keras_noisecurve.mixing.UpdateRule``: Keras's SGD with heavy-ball momentum and a
learning-rate schedule; default plain SGD with a constant rate); C is solved for it and
records it in ``metadata["update_rule"]``.

Prints a summary: the objective value Tr(W X⁻¹), the DP-SGD and DP-BandMF baselines
under the same W and the ratios to them, the update rule, solver statistics, and the
headline noise diagnostics (:mod:`keras_noisecurve.mixing.diagnostics`). Bad input gives a one-line
error on stderr and exit status 2, never a traceback.

numpy/scipy only: this module does not import TensorFlow.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings

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
        "--bands", type=int, required=True, metavar="b", help="band width b, 1 <= b <= T (b = 1 is DP-SGD)"
    )
    parser.add_argument(
        "--objective",
        required=True,
        choices=OBJECTIVES,
        metavar="NAME",
        help="workload W of the objective Tr(W X^-1): %(choices)s",
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
        help="noisecurve-blend only: weight in [0, 1] of the prefix-sum workload, or 'auto'",
    )
    parser.add_argument(
        "--momentum",
        type=float,
        default=0.0,
        metavar="BETA",
        help="heavy-ball momentum beta in [0, 1) of the SGD training will run (default 0)",
    )
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES[:-1],
        default="constant",
        help="learning-rate schedule of that SGD: %(choices)s (default constant)",
    )
    parser.add_argument(
        "--cooldown-fraction",
        type=float,
        metavar="F",
        help="linear-cooldown only: share of the steps in (0, 1] spent cooling down (default 0.25)",
    )
    parser.add_argument("--tol", type=float, default=1e-6, help="relative optimality tolerance (default 1e-6)")
    parser.add_argument(
        "--max-iterations", type=int, default=10_000, metavar="N", help="solver iteration limit (default 10000)"
    )
    parser.add_argument("--out", default="mixing.npz", metavar="FILE", help="output .npz file (default mixing.npz)")
    parser.add_argument("--quiet", action="store_true", help="print nothing but warnings and errors")


def _check_args(args) -> None:
    if args.steps < 1:
        raise CommandError(f"--steps must be >= 1, got {args.steps}.")
    if not 1 <= args.bands <= args.steps:
        raise CommandError(f"--bands must satisfy 1 <= b <= steps ({args.steps}), got {args.bands}.")
    if not (math.isfinite(args.tol) and args.tol > 0):
        raise CommandError(f"--tol must be a finite number > 0, got {args.tol}.")
    if args.max_iterations < 1:
        raise CommandError(f"--max-iterations must be >= 1, got {args.max_iterations}.")
    curvature = args.objective in CURVATURE_OBJECTIVES
    if curvature and args.spectrum is None:
        raise CommandError(f"objective {args.objective!r} needs --spectrum FILE (a Spectrum .npz).")
    if curvature and args.learning_rate is None:
        raise CommandError(f"objective {args.objective!r} needs --learning-rate ETA.")
    if not curvature and args.spectrum is not None:
        raise CommandError(f"--spectrum is only used by the curvature objectives {CURVATURE_OBJECTIVES}, "
                           f"not by {args.objective!r}.")
    if args.learning_rate is not None and not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        raise CommandError(f"--learning-rate must be a finite number > 0, got {args.learning_rate}.")
    if args.objective == "noisecurve-blend" and args.blend_weight is None:
        raise CommandError("objective 'noisecurve-blend' needs --blend-weight LAMBDA (in [0, 1]) or 'auto'.")
    if args.objective != "noisecurve-blend" and args.blend_weight is not None:
        raise CommandError(f"--blend-weight is only used by objective 'noisecurve-blend', not {args.objective!r}.")
    if not (math.isfinite(args.momentum) and 0.0 <= args.momentum < 1.0):
        raise CommandError(f"--momentum must lie in [0, 1), got {args.momentum}.")
    if args.cooldown_fraction is not None:
        if args.schedule != "linear-cooldown":
            raise CommandError(f"--cooldown-fraction is only used by --schedule linear-cooldown, not {args.schedule!r}.")
        if not (math.isfinite(args.cooldown_fraction) and 0.0 < args.cooldown_fraction <= 1.0):
            raise CommandError(f"--cooldown-fraction must lie in (0, 1], got {args.cooldown_fraction}.")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise CommandError(f"the directory of --out {args.out!r} does not exist.")
    if os.path.isdir(args.out):
        raise CommandError(f"--out {args.out!r} is a directory; give a file name.")


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


def run(args) -> int:
    """Solve, save, print the summary. Returns 0, or 2 on a user error."""
    try:
        _check_args(args)
        spectrum = load_spectrum(args.spectrum) if args.spectrum is not None else None
        try:
            rule = UpdateRule(momentum=args.momentum, schedule=args.schedule,
                              cooldown_fraction=args.cooldown_fraction)
        except (ValueError, TypeError) as exc:
            raise CommandError(str(exc)) from None
    except CommandError as exc:
        return fail(PROG, str(exc))

    from keras_noisecurve.mixing import solve_mixing_matrix

    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            mixing = solve_mixing_matrix(
                steps=args.steps,
                bands=args.bands,
                objective=args.objective,
                spectrum=spectrum,
                learning_rate=args.learning_rate,
                blend_weight=args.blend_weight,
                tol=args.tol,
                max_iterations=args.max_iterations,
                verbose=not args.quiet,
                update_rule=rule,
            )
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
        print(f"saved {args.out}: steps T = {mixing.steps}, bands b = {mixing.bands}")
        for line in summary_lines(mixing, seconds=seconds):
            print(line)
        if seen:
            print(f"{len(seen)} warning(s) on stderr")
    return 0
