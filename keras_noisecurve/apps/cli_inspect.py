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

from keras_noisecurve.mixing.api import TOEPLITZ_OBJECTIVES
from keras_noisecurve.apps.cli_solve import (
    CommandError,
    diagnostics_lines,
    fail,
    load_spectrum,
    noise_state_text,
    participation_text,
    report_warnings,
    scored_objective,
    size_text,
    solver_lines,
    update_rule_text,
)
from keras_noisecurve.mixing.errors import InvalidMixingMatrixError
from keras_noisecurve.mixing.objectives import get_objective
from keras_noisecurve.mixing.update_rule import UpdateRule
from keras_noisecurve.mixing.workloads import CURVATURE_OBJECTIVES, OBJECTIVES
from keras_noisecurve.apps import cli_inspect_plot
from keras_noisecurve.apps.strategy_table import kind_of

PROG = "noisecurve inspect"

#: objectives that take a blend weight λ
_BLEND_OBJECTIVES = tuple(name for name in OBJECTIVES if get_objective(name).blend)

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


def _missing_curvature_inputs(objective, spectrum, learning_rate, blend_weight) -> list:
    """What a curvature objective's re-evaluation lacks (empty: it can be recomputed)."""
    missing = []
    if spectrum is None:
        missing.append("--spectrum FILE (the file stores only the spectrum digest, not the spectrum)")
    if learning_rate is None:
        missing.append("--learning-rate ETA (none stored)")
    if objective in _BLEND_OBJECTIVES and blend_weight is None:
        missing.append("a numeric blend weight in the metadata")
    return missing


def _stored_blend_weight(meta):
    """The numeric blend weight λ the solver used, if the metadata has one."""
    for key in ("blend_weight", "blend_weight_chosen", "blend_weight_selected"):
        value = meta.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    auto = meta.get("blend_auto")
    if isinstance(auto, dict):
        for key in ("chosen", "selected", "blend_weight", "lambda"):
            value = auto.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
    return None


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
    blend_weight = _stored_blend_weight(meta) if objective in _BLEND_OBJECTIVES else None

    missing = []
    if objective is None:
        missing.append("the file has no objective in its metadata; pass --objective NAME")
    if objective in CURVATURE_OBJECTIVES:
        missing += _missing_curvature_inputs(objective, spectrum, learning_rate, blend_weight)
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
        if objective in _BLEND_OBJECTIVES:
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
    try:
        with np.load(path, allow_pickle=False) as fields:
            return str(fields["format"]) if "format" in fields.files else ""
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


def _sensitivity(args, mixing) -> dict | None:
    """Sensitivity of one participation and, with ``--participations k``, of k (None: not asked)."""
    k, s = args.participations, args.separation
    if k is None and s is None:
        return None
    if k is None:
        raise CommandError("--separation s is only used with --participations k.")
    if k < 1:
        raise CommandError(f"--participations must be >= 1, got {k}.")
    if k > 1 and s is None:
        raise CommandError(f"--participations {k} needs --separation s (the steps between two participations).")
    if s is not None and s < 1:
        raise CommandError(f"--separation must be >= 1, got {s}.")
    return {"one": float(mixing.sensitivity()), "participations": k, "separation": s,
            "value": float(mixing.sensitivity(participations=k, separation=s))}


def _sensitivity_lines(sens: dict) -> list[str]:
    lines = [f"sensitivity (L2, in units of the clip norm): one participation {sens['one']:.6g}"]
    if sens.get("participations") is not None:
        lines.append(f"  {participation_text(sens['participations'], sens['separation'])}: {sens['value']:.6g}")
    return lines


def _size(mixing) -> dict:
    kind = kind_of(mixing)
    return {kind.size_attribute: kind.size(mixing)}


def _strategy_expected(args, mixing, spectrum) -> dict:
    """Tr(W X⁻¹) of a Toeplitz-family C and of C = I, recomputed with ``api.objective_value``
    when the workload is at hand (else the stored values), and the loss for the
    participation patterns (the one blt was optimised for, and ``--participations``)."""
    from keras_noisecurve.mixing.api import objective_value
    from keras_noisecurve.mixing.strategies import ToeplitzMixing

    meta = mixing.metadata
    stored_objective = scored_objective(meta)
    objective = args.objective or stored_objective
    result = {"objective": objective, "stored_objective": stored_objective}
    learning_rate = args.learning_rate if args.learning_rate is not None else meta.get("learning_rate")
    blend_weight = _stored_blend_weight(meta) if objective in _BLEND_OBJECTIVES else None
    same = objective == stored_objective
    baselines = (meta.get("baseline_losses") or {}) if same else {}
    if same and meta.get("loss") is not None:
        result["stored_loss"] = meta.get("loss")

    missing = []
    if objective not in TOEPLITZ_OBJECTIVES:
        missing.append(f"an objective in {TOEPLITZ_OBJECTIVES} (the file's is {objective!r}); pass --objective NAME")
    elif objective in CURVATURE_OBJECTIVES:
        missing += _missing_curvature_inputs(objective, spectrum, learning_rate, blend_weight)
    if missing:
        result["source"] = "stored"
        result["note"] = "not recomputed: needs " + "; ".join(missing) + "."
        trace = (meta.get("loss_components") or {}).get("trace", meta.get("loss")) if same else None
        result.update(trace=trace, dpsgd=None)
    else:
        if spectrum is not None and meta.get("spectrum_digest") and spectrum.digest() != meta["spectrum_digest"]:
            result["note"] = ("the given spectrum differs from the one the file was solved with (digest mismatch): "
                              "values are under the given spectrum.")
        kwargs = dict(objective=objective)
        if objective in CURVATURE_OBJECTIVES:
            kwargs.update(spectrum=spectrum, learning_rate=learning_rate)
            result["learning_rate"] = learning_rate
        if objective in _BLEND_OBJECTIVES:
            kwargs.update(blend_weight=blend_weight)
            result["blend_weight"] = blend_weight
        result["source"] = "recomputed"
        result["trace"] = float(objective_value(mixing, **kwargs))
        result["dpsgd"] = float(objective_value(ToeplitzMixing([1.0], steps=mixing.steps), **kwargs))
    if result["dpsgd"] is None and baselines.get("dpsgd") is not None:
        # blt stores the baseline of its participation pattern, k·Tr(W); one participation is Tr(W)
        k = (meta.get("participations") or 1) if kind_of(mixing).optimises_participations else 1
        result["dpsgd"] = baselines["dpsgd"] / k
    if kind_of(mixing).stores_bandmf_baseline and baselines.get("bandmf") is not None:
        result["bandmf"] = baselines["bandmf"]
    trace, dpsgd = result.get("trace"), result.get("dpsgd")
    result["ratio_vs_dpsgd"] = trace / dpsgd if (trace is not None and dpsgd) else None
    result["ratio_vs_bandmf"] = trace / result["bandmf"] if (trace is not None and result.get("bandmf")) else None

    patterns = []
    if kind_of(mixing).optimises_participations and (meta.get("participations") or 1) > 1:
        patterns.append(("optimised for", meta["participations"], meta.get("separation")))
    if args.participations is not None and args.participations > 1:
        patterns.append(("--participations", args.participations, args.separation))
    result["patterns"] = []
    for label, k, s in patterns:
        sens = float(mixing.sensitivity(participations=k, separation=s))
        entry = {"label": label, "participations": k, "separation": s, "sensitivity": sens,
                 "loss": sens * sens * trace if trace is not None else None,
                 "dpsgd": k * dpsgd if dpsgd is not None else None}
        entry["ratio_vs_dpsgd"] = entry["loss"] / entry["dpsgd"] if entry["loss"] is not None and entry["dpsgd"] \
            else None
        result["patterns"].append(entry)
    return result


def _strategy_expected_lines(mixing, expected) -> list[str]:
    lines = [f"expected error Tr(W X^-1) under objective {expected['objective']!r} ({expected['source']}"
             + (" with objective_value" if expected["source"] == "recomputed" else "") + "):"]
    if expected.get("note"):
        lines.append(f"  note: {expected['note']}")
    trace = expected.get("trace")
    lines.append(f"  {'this C (one participation)':<30} " + (f"{trace:.6g}" if trace is not None else "n/a"))
    for name, label, extra in (("dpsgd", "DP-SGD (C = I)", ""),
                               ("bandmf", f"Toeplitz DP-BandMF (b = {mixing.bands})", " [stored]")):
        if name not in expected:
            continue
        base, ratio = expected.get(name), expected.get(f"ratio_vs_{name}")
        if base is None:
            lines.append(f"  {label:<30} n/a")
            continue
        ratio_text = f"   this C / baseline = {ratio:.4f}" if ratio is not None else ""
        lines.append(f"  {label:<30} {base:.6g}{ratio_text}{extra}")
    for entry in expected["patterns"]:
        what = participation_text(entry["participations"], entry["separation"])
        if entry["label"] == "optimised for":
            what = "optimised for " + what
        loss = "n/a" if entry["loss"] is None else f"{entry['loss']:.6g}"
        line = f"  {what}: sensitivity^2 x Tr(W X^-1) = {loss}"
        if entry["dpsgd"] is not None:
            line += f"; DP-SGD {entry['dpsgd']:.6g}"
        if entry["ratio_vs_dpsgd"] is not None:
            line += f"; this C / baseline = {entry['ratio_vs_dpsgd']:.4f}"
        lines.append(line)
    if expected.get("stored_loss") is not None:
        meta = mixing.metadata
        k = meta.get("participations") or 1 if kind_of(mixing).optimises_participations else 1
        pattern = f" (sensitivity^2 x Tr(W X^-1), {participation_text(k, meta.get('separation'))})" if k > 1 else ""
        lines.append(f"  {'stored loss':<30} {expected['stored_loss']:.6g}{pattern}")
    return lines


def _run_strategy(args, mixing, caught) -> int:
    """``inspect`` of a toeplitz, blt or bisr file (text or JSON)."""
    try:
        if args.reference is not None:
            raise CommandError(
                f"--reference applies to banded mixing-matrix files only; {args.file!r} is a {mixing.kind!r} "
                "strategy (its baselines are recomputed or stored)."
            )
        if args.plot is not None:
            raise CommandError(
                f"--plot draws banded mixing-matrix files only; {args.file!r} is a {mixing.kind!r} strategy."
            )
        if args.objective is not None and args.objective not in TOEPLITZ_OBJECTIVES:
            raise CommandError(
                f"--objective {args.objective!r} cannot be evaluated for a {mixing.kind!r} strategy: objective_value "
                f"supports {', '.join(TOEPLITZ_OBJECTIVES)} for the toeplitz, blt and bisr kinds (every objective "
                "for banded files)."
            )
        sens = _sensitivity(args, mixing) or {"one": float(mixing.sensitivity())}
        spectrum = load_spectrum(args.spectrum) if args.spectrum is not None else None
        expected = _strategy_expected(args, mixing, spectrum)
    except (CommandError, ValueError, TypeError) as exc:
        report_warnings(PROG, caught)
        return fail(PROG, str(exc))
    seen = report_warnings(PROG, caught)
    if args.json:
        document = {
            "file": args.file,
            "kind": mixing.kind,
            "steps": mixing.steps,
            "size": _size(mixing),
            "buffers": mixing.buffers,
            "digest": mixing.digest(),
            "parameters": {k: v for k, v in mixing.to_config().items() if k not in ("kind", "steps", "metadata")},
            "sensitivity": sens,
            "metadata": mixing.metadata,
            "expected_error": expected,
            "warnings": seen,
        }
        print(json.dumps(document, indent=2, sort_keys=True))
        return 0
    lines = [f"{args.file}: mixing strategy {mixing.kind!r}, steps T = {mixing.steps}, {size_text(mixing)}, "
             f"digest {mixing.digest()[:16]}…",
             f"noise state: {noise_state_text(mixing)}",
             "parameters:"]
    lines.extend(kind_of(mixing).parameter_lines(mixing))
    lines.extend(_sensitivity_lines(sens))
    lines.extend(_metadata_lines(mixing.metadata))
    lines.append(f"update rule: {UpdateRule().describe()} (the {mixing.kind} strategy is solved for plain SGD)")
    lines.extend(_strategy_expected_lines(mixing, expected))
    for line in lines:
        print(line)
    return 0


# ------------------------------------------------------------------------------ run
def _metadata_lines(meta) -> list[str]:
    """``metadata:`` and one line per key (solver statistics on one line; no diagnostics)."""
    lines = ["metadata:"]
    for key in sorted(meta):
        if key == "diagnostics":
            continue
        value = meta[key]
        if key == "solver" and isinstance(value, dict):
            value = "; ".join(line[len("solver: "):] for line in solver_lines(value)) or json.dumps(value)
        elif isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=True)
        elif isinstance(value, float):
            value = f"{value:.6g}"
        lines.append(f"  {key}: {value}")
    return lines


def _text_report(path, mixing, norms, expected, diag, ref_diag, reference_how) -> list[str]:
    meta = mixing.metadata
    lines = [f"{path}: mixing matrix, steps T = {mixing.steps}, bands b = {mixing.bands}, digest {mixing.digest()[:16]}…"]
    lines.extend(_metadata_lines(meta))
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
            if args.learning_rate is not None and not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
                raise CommandError(f"--learning-rate must be a finite number > 0, got {args.learning_rate}.")
            if args.plot is not None:
                plot_dir = os.path.dirname(os.path.abspath(args.plot))
                if not os.path.isdir(plot_dir):
                    raise CommandError(f"the directory of --plot {args.plot!r} does not exist.")
            mixing = _read_file(args.file)
            if not kind_of(mixing).matrix_file:
                return _run_strategy(args, mixing, caught)
            sens = _sensitivity(args, mixing)
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

    if args.plot is not None:
        title = f"{os.path.basename(args.file)}: objective {mixing.metadata.get('objective', '?')!r}"
        try:
            cli_inspect_plot.write_plot(args.plot, mixing, diag, ref_diag, title)
        except OSError as exc:
            return fail(PROG, f"cannot write --plot {args.plot!r}: {exc}")

    if args.json:
        document = {
            "file": args.file,
            "steps": mixing.steps,
            "bands": mixing.bands,
            "digest": mixing.digest(),
            "metadata": mixing.metadata,
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
        print(json.dumps(document, indent=2, sort_keys=True))
    else:
        for line in _text_report(args.file, mixing, norms, expected, diag, ref_diag, reference_how):
            print(line)
        if sens is not None:
            for line in _sensitivity_lines(sens):
                print(line)
        if args.plot is not None:
            print(f"plot written to {args.plot}")
    return 0
