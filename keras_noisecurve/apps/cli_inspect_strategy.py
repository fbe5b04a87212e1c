"""``noisecurve inspect`` of a strategy-format file (toeplitz, blt, bisr), and the pieces
the banded report shares with it (sensitivity, metadata lines, the curvature inputs a
re-evaluation needs).

What each kind shows (its size, its parameters, whether its stored loss is for k
participations) comes from ``keras_noisecurve.apps.strategy_table``. numpy only.
"""

from __future__ import annotations

import json
import math
import numbers

from keras_noisecurve.apps.cli_solve import (
    CommandError,
    fail,
    load_spectrum,
    noise_state_text,
    participation_text,
    report_warnings,
    scored_objective,
    size_text,
    solver_lines,
)
from keras_noisecurve.apps.strategy_table import kind_of
from keras_noisecurve.mixing.api import TOEPLITZ_OBJECTIVES
from keras_noisecurve.mixing.objectives import get_objective
from keras_noisecurve.mixing.update_rule import UpdateRule
from keras_noisecurve.mixing.workloads import CURVATURE_OBJECTIVES, OBJECTIVES

__all__ = ["BLEND_OBJECTIVES", "PROG", "metadata_contradictions", "metadata_lines", "missing_curvature_inputs",
           "run_strategy", "sensitivity", "sensitivity_lines", "stored_blend_weight"]

PROG = "noisecurve inspect"

#: objectives that take a blend weight λ
BLEND_OBJECTIVES = tuple(name for name in OBJECTIVES if get_objective(name).blend)

#: relative tolerance of a stored sensitivity against the one computed from C
_SENSITIVITY_RTOL = 1e-6


def missing_curvature_inputs(objective, spectrum, learning_rate, blend_weight) -> list:
    """What a curvature objective's re-evaluation lacks (empty: it can be recomputed)."""
    missing = []
    if spectrum is None:
        missing.append("--spectrum FILE (the file stores only the spectrum digest, not the spectrum)")
    if learning_rate is None:
        missing.append("--learning-rate ETA (none stored)")
    if objective in BLEND_OBJECTIVES and blend_weight is None:
        missing.append("a numeric blend weight in the metadata")
    return missing


def stored_blend_weight(meta):
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


def sensitivity(args, mixing) -> dict | None:
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


def sensitivity_lines(sens: dict) -> list[str]:
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
    blend_weight = stored_blend_weight(meta) if objective in BLEND_OBJECTIVES else None
    same = objective == stored_objective
    baselines = (meta.get("baseline_losses") or {}) if same else {}
    if same and meta.get("loss") is not None:
        result["stored_loss"] = meta.get("loss")

    missing = []
    if objective not in TOEPLITZ_OBJECTIVES:
        missing.append(f"an objective in {TOEPLITZ_OBJECTIVES} (the file's is {objective!r}); pass --objective NAME")
    elif objective in CURVATURE_OBJECTIVES:
        missing += missing_curvature_inputs(objective, spectrum, learning_rate, blend_weight)
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
        if objective in BLEND_OBJECTIVES:
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


def run_strategy(args, mixing, caught) -> int:
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
        sens = sensitivity(args, mixing) or {"one": float(mixing.sensitivity())}
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
            "metadata_warnings": metadata_contradictions(mixing),
            "expected_error": expected,
            "warnings": seen,
        }
        print(json.dumps(document, indent=2, sort_keys=True))
        return 0
    lines = [f"{args.file}: mixing strategy {mixing.kind!r}, steps T = {mixing.steps}, {size_text(mixing)}, "
             f"digest {mixing.digest()[:16]}…",
             *metadata_contradictions(mixing),
             f"noise state: {noise_state_text(mixing)}",
             "parameters:"]
    lines.extend(kind_of(mixing).parameter_lines(mixing))
    lines.extend(sensitivity_lines(sens))
    lines.extend(metadata_lines(mixing.metadata))
    lines.append(f"update rule: {UpdateRule().describe()} (the {mixing.kind} strategy is solved for plain SGD)")
    lines.extend(_strategy_expected_lines(mixing, expected))
    for line in lines:
        print(line)
    return 0


def _same(stored, actual) -> bool:
    """Whether a metadata value says ``actual`` (an int, a str or a float)."""
    if isinstance(actual, str) or actual is None:
        return stored == actual
    if isinstance(stored, bool) or not isinstance(stored, numbers.Real):
        return False
    if isinstance(actual, float):
        return math.isclose(float(stored), actual, rel_tol=_SENSITIVITY_RTOL, abs_tol=1e-12)
    return float(stored) == actual


def _text(value) -> str:
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list, str)) or value is None else repr(value)


def metadata_contradictions(mixing) -> list[str]:
    """One ``WARNING: ...`` line per metadata entry that contradicts what the stored C
    says of itself (the digest covers C, not the metadata, so an edited metadata still
    loads): ``strategy`` (the kind), ``steps`` (T), the size (``bands`` b, ``buffers`` d,
    or a bisr file's ``bands`` p of C⁻¹), the solver's ``diagnostics`` ``steps``/``bands``
    (banded), a ``sensitivity`` of one participation, and a blt file's
    ``loss_components.sensitivity_squared`` for its ``participations``/``separation``.
    Entries the metadata does not hold are not checked; every value reported is C's."""
    meta = mixing.metadata
    kind = kind_of(mixing)
    facts = [("strategy", mixing.kind, "its kind"), ("steps", mixing.steps, "T")]
    if kind.size_option is not None:
        facts.append((kind.size_option.lstrip("-"), kind.size(mixing), kind.size_label))
    diagnostics = meta.get("diagnostics")
    if isinstance(diagnostics, dict) and kind.matrix_file:
        facts += [("diagnostics.steps", mixing.steps, "T"), ("diagnostics.bands", mixing.bands, "bands b")]
    sens = meta.get("sensitivity")
    if sens is not None and not isinstance(sens, (dict, list)):
        facts.append(("sensitivity", float(mixing.sensitivity()), "the sensitivity of one participation"))
    components = meta.get("loss_components")
    if isinstance(components, dict) and "sensitivity_squared" in components:
        k, s = meta.get("participations") or 1, meta.get("separation")
        try:
            value = float(mixing.sensitivity(participations=k, separation=s)) ** 2
        except (ValueError, TypeError) as exc:
            return _lines(meta, facts) + [
                f"WARNING: metadata participations = {_text(k)}, separation = {_text(s)} (of "
                f"loss_components.sensitivity_squared) do not fit the stored matrix: {' '.join(str(exc).split())}"]
        pattern = participation_text(k, s) if k > 1 else "one participation"
        facts.append(("loss_components.sensitivity_squared", value, f"the sensitivity^2 of {pattern}"))
    return _lines(meta, facts)


_ABSENT = object()


def _lines(meta, facts) -> list[str]:
    """The warnings of ``facts`` ((dotted metadata key, C's value, what it is)); a key the
    metadata does not hold is skipped."""
    lines = []
    for key, actual, label in facts:
        stored = meta
        for part in key.split("."):
            stored = stored.get(part, _ABSENT) if isinstance(stored, dict) else _ABSENT
        if stored is _ABSENT:
            continue
        if not _same(stored, actual):
            shown = f"{actual:.10g}" if isinstance(actual, float) else str(actual)
            lines.append(f"WARNING: metadata {key} = {_text(stored)} contradicts the stored matrix: {label} is "
                         f"{shown} (the report uses the matrix; the metadata was edited or is not this C's)")
    return lines


def metadata_lines(meta) -> list[str]:
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
