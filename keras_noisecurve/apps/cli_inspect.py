"""``noisecurve inspect``: show a mixing-matrix or mixing-strategy file.

Usage::

    noisecurve inspect FILE [--spectrum FILE] [--objective NAME] [--learning-rate ETA]
                            [--reference FILE | --no-reference] [--plot out.png] [--json]
                            [--participations k [--separation s]]

Every kind that ``noisecurve solve --strategy`` writes is read (``banded``: a
``MixingMatrix`` file; ``toeplitz``, ``blt``, ``bisr``: the strategy format of
``keras_noisecurve.mixing.strategies``). ``--participations k --separation s`` adds the
L2 sensitivity of k participations s steps apart (and, for the Toeplitz kinds, their
loss sensitivity² × Tr(W X⁻¹)).

Toeplitz kinds (toeplitz, blt, bisr): the kind, T, the size (bands b, buffers d, or the
bands p of C⁻¹), the noise buffers the optimizer keeps, the parameters (toeplitz: the b
coefficients, abbreviated when long; blt: θ and ω; bisr: p and C⁻¹'s first column), the
sensitivity of one participation (and of k), the stored metadata, and Tr(W X⁻¹)
recomputed with ``api.objective_value`` next to DP-SGD's (C = I) — under the stored
objective, or ``--objective NAME`` if it is one of ``TOEPLITZ_OBJECTIVES`` (the others
are refused); curvature objectives need ``--spectrum`` as for banded files. A blt solved
for k participations also shows the loss for that pattern. ``--reference`` and
``--plot`` apply to banded files only and are refused for the others.

What follows describes banded files.

Shows the metadata, the column norms (all within 1e-9 of 1?), the expected error
Tr(W X⁻¹) of C relative to DP-SGD (C = I) and DP-BandMF (same T, b) under the stored
objective, and the noise diagnostics (:mod:`keras_noisecurve.mixing.diagnostics`).

The update rule C was solved for (``metadata["update_rule"]``; none recorded means plain
SGD) is shown, and the expected errors are computed under it: the workload of that rule,
and a DP-BandMF reference solved for that rule.

The expected error is *recomputed* with ``objective_value`` whenever everything the
workload needs is at hand: always for ``dpsgd``/``bandmf``; for the curvature
objectives only with ``--spectrum FILE`` (the file stores only the spectrum's
digest, which is not the spectrum) and a learning rate (stored, or
``--learning-rate``). Otherwise the solver's stored ``loss`` and
``baseline_losses`` are reported and labelled as stored. The DP-BandMF reference C is
solved here (``solve_mixing_matrix(objective="bandmf")``) unless ``--reference FILE``
gives one or ``--no-reference`` skips it.

A file that is not a valid artifact (tampered values, wrong digest, broken column
norms) prints the validation error on stderr and exits with status 2.

numpy/scipy/matplotlib (Agg) only: this module does not import TensorFlow.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings

import numpy as np

from keras_noisecurve.apps import cli_inspect_plot, cli_predict
from keras_noisecurve.apps.cli_inspect_strategy import (
    BLEND_OBJECTIVES,
    PROG,
    metadata_contradictions,
    metadata_lines,
    missing_curvature_inputs,
    run_strategy,
    sensitivity,
    sensitivity_lines,
    stored_blend_weight,
)
from keras_noisecurve.apps.cli_solve import (
    CommandError,
    diagnostics_lines,
    fail,
    load_spectrum,
    report_warnings,
    update_rule_text,
)
from keras_noisecurve.apps.strategy_table import kind_of
from keras_noisecurve.mixing.api import TOEPLITZ_OBJECTIVES
from keras_noisecurve.mixing.errors import InvalidMixingMatrixError
from keras_noisecurve.mixing.update_rule import UpdateRule
from keras_noisecurve.mixing.workloads import CURVATURE_OBJECTIVES, OBJECTIVES

# From this T on, say on stderr that the DP-BandMF reference is being solved (it takes a while).
_ANNOUNCE_REFERENCE_STEPS = 500


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``noisecurve inspect``."""
    parser.add_argument(
        "file", metavar="FILE", help="mixing-matrix or mixing-strategy .npz written by 'noisecurve solve'"
    )
    parser.add_argument(
        "--spectrum", metavar="FILE", help="Spectrum .npz to recompute curvature objectives (the file stores only its digest)"
    )
    parser.add_argument(
        "--objective",
        choices=tuple(OBJECTIVES),
        metavar="NAME",
        help="evaluate under this objective instead of the stored one: %(choices)s (toeplitz, blt, bisr files: "
        + ", ".join(TOEPLITZ_OBJECTIVES) + ")",
    )
    parser.add_argument("--learning-rate", type=float, metavar="ETA", help="learning rate (default: the stored one)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--reference", metavar="FILE", help="DP-BandMF mixing-matrix .npz to compare with")
    group.add_argument(
        "--no-reference", action="store_true", help="do not solve for the DP-BandMF reference (use stored baselines)"
    )
    parser.add_argument("--plot", metavar="PNG", help="write a figure: |C| and the noise std over the steps")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    parser.add_argument(
        "--participations",
        type=int,
        metavar="k",
        help="also show the L2 sensitivity of k participations (and, for toeplitz/blt/bisr, their loss)",
    )
    parser.add_argument(
        "--separation", type=int, metavar="s", help="with --participations k >= 2: steps between two participations"
    )
    cli_predict.add_budget_arguments(parser)


# ---------------------------------------------------------------------------- pieces
def _read_mixing_file(path: str):
    from keras_noisecurve.mixing.matrix import InvalidMixingMatrixError, MixingMatrix

    if not os.path.isfile(path):
        raise CommandError(f"{path!r} does not exist.")
    try:
        return MixingMatrix.load(path)
    except (InvalidMixingMatrixError, OSError, ValueError, KeyError) as exc:
        raise CommandError(f"invalid mixing-matrix file: {exc}") from None


def _column_norm_summary(mixing) -> dict:
    from keras_noisecurve.mixing.matrix import COLUMN_NORM_TOLERANCE

    norms = mixing.column_norms()
    deviation = float(np.max(np.abs(norms - 1.0)))
    return {
        "min": float(norms.min()),
        "max": float(norms.max()),
        "max_abs_deviation": deviation,
        "tolerance": COLUMN_NORM_TOLERANCE,
        "all_within_tolerance": bool(deviation <= COLUMN_NORM_TOLERANCE),
    }


def _update_rule(mixing) -> UpdateRule:
    """The rule C was solved for (``metadata["update_rule"]``; absent: plain SGD)."""
    try:
        return UpdateRule.from_metadata(mixing.metadata.get("update_rule"))
    except (ValueError, TypeError, KeyError) as exc:
        raise CommandError(f"invalid update_rule record in the metadata: {exc}") from None


def _reference(args, mixing, rule=None):
    """(reference C or None, how it was obtained); solved for ``rule`` (None: plain SGD)."""
    from keras_noisecurve.mixing import solve_mixing_matrix

    if args.no_reference:
        return None, "skipped (--no-reference)"
    if args.reference is not None:
        ref = _read_mixing_file(args.reference)
        if ref.steps != mixing.steps:
            raise CommandError(
                f"--reference has {ref.steps} steps but {args.file!r} has {mixing.steps}; they must match."
            )
        how = f"loaded from {args.reference}"
        ref_rule = _update_rule(ref)
        if rule is not None and ref_rule != rule:
            how += f" (solved for {ref_rule.describe()}; this C for {rule.describe()})"
        return ref, how
    if mixing.steps >= _ANNOUNCE_REFERENCE_STEPS:
        print(
            f"{PROG}: solving the DP-BandMF reference (T = {mixing.steps}, b = {mixing.bands}); "
            "--reference FILE or --no-reference skips this",
            file=sys.stderr,
            flush=True,
        )
    ref = solve_mixing_matrix(steps=mixing.steps, bands=mixing.bands, objective="bandmf", update_rule=rule)
    how = f"solved here (objective 'bandmf', T = {mixing.steps}, b = {mixing.bands}"
    if rule is not None and not rule.is_plain:
        how += f", for {rule.describe()}"
    return ref, how + ")"


def _expected_error(args, mixing, spectrum, reference, rule=None) -> dict:
    """Tr(W X⁻¹) of C and of the baselines under the workload of ``rule`` (None: plain
    SGD): recomputed when possible, else stored."""
    from keras_noisecurve.mixing import objective_value
    from keras_noisecurve.mixing.matrix import MixingMatrix

    meta = mixing.metadata
    stored_objective = meta.get("objective")
    objective = args.objective or stored_objective
    result = {"objective": objective, "stored_objective": stored_objective,
              "update_rule": (rule or UpdateRule()).describe()}
    learning_rate = args.learning_rate if args.learning_rate is not None else meta.get("learning_rate")
    blend_weight = stored_blend_weight(meta) if objective in BLEND_OBJECTIVES else None

    missing = []
    if objective is None:
        missing.append("the file has no objective in its metadata; pass --objective NAME")
    if objective in CURVATURE_OBJECTIVES:
        missing += missing_curvature_inputs(objective, spectrum, learning_rate, blend_weight)
    if missing:
        result["source"] = "stored"
        result["note"] = (
            "not recomputed: needs " + "; ".join(missing) + ". Values below are the ones the solver stored."
        )
        if objective != stored_objective:
            result.update(loss=None, dpsgd=None, bandmf=None)
        else:
            baselines = meta.get("baseline_losses") or {}
            result.update(loss=meta.get("loss"), dpsgd=baselines.get("dpsgd"), bandmf=baselines.get("bandmf"))
    else:
        if spectrum is not None and meta.get("spectrum_digest") and spectrum.digest() != meta["spectrum_digest"]:
            result["note"] = (
                "the given spectrum differs from the one the file was solved with (digest mismatch): "
                "values are under the given spectrum."
            )
        kwargs = dict(objective=objective, update_rule=rule)
        if objective in CURVATURE_OBJECTIVES:
            kwargs.update(spectrum=spectrum, learning_rate=learning_rate)
        if objective in BLEND_OBJECTIVES:
            kwargs.update(blend_weight=blend_weight)
        result["source"] = "recomputed"
        result["learning_rate"] = learning_rate
        if blend_weight is not None:
            result["blend_weight"] = blend_weight
        result["loss"] = float(objective_value(mixing, **kwargs))
        result["dpsgd"] = float(objective_value(MixingMatrix.identity(mixing.steps), **kwargs))
        if reference is not None:
            result["bandmf"] = float(objective_value(reference, **kwargs))
        else:
            stored = (meta.get("baseline_losses") or {}).get("bandmf") if objective == stored_objective else None
            result["bandmf"] = stored
            if stored is not None:
                result["bandmf_source"] = "stored"
    for name in ("dpsgd", "bandmf"):
        base, loss = result.get(name), result.get("loss")
        result[f"ratio_vs_{name}"] = (loss / base) if (loss is not None and base) else None
    return result


# ----------------------------------------------------------- the other strategies
def _format_field(path: str) -> str:
    """The ``format`` field of an ``.npz`` file ('' when there is none or it is unreadable:
    ``MixingMatrix.load`` then says why)."""
    from keras_noisecurve._npz import read_npz_field

    try:
        value = read_npz_field(path, "format", what="mixing")  # the other fields are left unread
        return "" if value is None else str(value)
    except Exception:  # noqa: BLE001 - any unreadable file
        return ""


def _read_file(path: str):
    """A banded ``MixingMatrix`` or a Toeplitz-family strategy, by the file's format."""
    from keras_noisecurve.mixing.strategies import STRATEGY_FORMAT, load_strategy

    if not os.path.isfile(path):
        raise CommandError(f"{path!r} does not exist.")
    if _format_field(path) != STRATEGY_FORMAT:
        return _read_mixing_file(path)
    try:
        return load_strategy(path)
    except (InvalidMixingMatrixError, OSError, ValueError, KeyError) as exc:
        raise CommandError(f"invalid mixing-strategy file: {exc}") from None


# ------------------------------------------------------------------------------ run
def _text_report(path, mixing, norms, expected, diag, ref_diag, reference_how) -> list[str]:
    meta = mixing.metadata
    lines = [f"{path}: mixing matrix, steps T = {mixing.steps}, bands b = {mixing.bands}, digest {mixing.digest()[:16]}…"]
    lines.extend(metadata_contradictions(mixing))
    lines.extend(metadata_lines(meta))
    lines.append(
        f"column norms: min {norms['min']:.17g}, max {norms['max']:.17g}, max |norm - 1| = "
        f"{norms['max_abs_deviation']:.3g} -> all within {norms['tolerance']:g}: "
        f"{'yes' if norms['all_within_tolerance'] else 'NO'}"
    )
    lines.append(f"update rule: {update_rule_text(meta)}")
    lines.append(f"expected error Tr(W X^-1) under objective {expected['objective']!r} ({expected['source']}):")
    if expected.get("note"):
        lines.append(f"  note: {expected['note']}")
    loss = expected.get("loss")
    lines.append(f"  this C                 {loss:.6g}" if loss is not None else "  this C                 n/a")
    for name, label in (("dpsgd", "DP-SGD (C = I)"), ("bandmf", f"DP-BandMF (b = {mixing.bands})")):
        base = expected.get(name)
        if base is None:
            lines.append(f"  {label:<22} n/a")
            continue
        ratio = expected.get(f"ratio_vs_{name}")
        extra = " [stored]" if expected.get(f"{name}_source") == "stored" else ""
        ratio_text = f"   this C / baseline = {ratio:.4f}" if ratio is not None else ""
        lines.append(f"  {label:<22} {base:.6g}{ratio_text}{extra}")
    lines.append(f"DP-BandMF reference: {reference_how}")
    lines.extend(diagnostics_lines(diag, steps=mixing.steps, reference=ref_diag))
    return lines


def run(args) -> int:
    """Print the report (text or JSON), optionally write the plot. 0, or 2 on error."""
    from keras_noisecurve.mixing.diagnostics import noise_diagnostics

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            budget = cli_predict.budget_given(args)
            if args.learning_rate is not None and not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
                raise CommandError(f"--learning-rate must be a finite number > 0, got {args.learning_rate}.")
            if args.plot is not None:
                plot_dir = os.path.dirname(os.path.abspath(args.plot))
                if not os.path.isdir(plot_dir):
                    raise CommandError(f"the directory of --plot {args.plot!r} does not exist.")
            mixing = _read_file(args.file)
            if not kind_of(mixing).matrix_file:
                return run_strategy(args, mixing, caught)
            sens = sensitivity(args, mixing)
            rule = _update_rule(mixing)
            spectrum = load_spectrum(args.spectrum) if args.spectrum is not None else None
            reference, reference_how = _reference(args, mixing, rule)
            expected = _expected_error(args, mixing, spectrum, reference, rule)
        except (CommandError, ValueError, TypeError) as exc:
            report_warnings(PROG, caught)
            return fail(PROG, str(exc))
        norms = _column_norm_summary(mixing)
        diag = noise_diagnostics(mixing)
        ref_diag = noise_diagnostics(reference) if reference is not None else None
    seen = report_warnings(PROG, caught)
    if ref_diag is not None:
        diag["excursion_vs_bandmf"] = diag["prefix_std_max"] / ref_diag["prefix_std_max"]

    scales = cli_predict.sigmas(args, mixing, reference) if budget else None
    if args.plot is not None:
        title = f"{os.path.basename(args.file)}: objective {mixing.metadata.get('objective', '?')!r}"
        try:
            cli_inspect_plot.write_plot(args.plot, mixing, diag, ref_diag, title, sigmas=scales)
        except OSError as exc:
            return fail(PROG, f"cannot write --plot {args.plot!r}: {exc}")

    if args.json:
        document = {
            "file": args.file,
            "steps": mixing.steps,
            "bands": mixing.bands,
            "digest": mixing.digest(),
            "metadata": mixing.metadata,
            "metadata_warnings": metadata_contradictions(mixing),
            "column_norms": norms,
            "expected_error": expected,
            "reference": reference_how,
            "diagnostics": diag,
            "reference_diagnostics": ref_diag,
            "warnings": seen,
            "plot": args.plot,
        }
        if sens is not None:
            document["sensitivity"] = sens
        if scales is not None:
            document["noise_multipliers"] = scales
        print(json.dumps(document, indent=2, sort_keys=True))
    else:
        for line in _text_report(args.file, mixing, norms, expected, diag, ref_diag, reference_how):
            print(line)
        if sens is not None:
            for line in sensitivity_lines(sens):
                print(line)
        for line in cli_predict.prediction_lines(mixing, args) if budget else [cli_predict.HINT]:
            print(line)
        if args.plot is not None:
            print(f"plot written to {args.plot}")
    return 0
