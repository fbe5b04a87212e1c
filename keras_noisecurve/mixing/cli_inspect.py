"""``noisecurve inspect``: show a mixing-matrix file.

Usage::

    noisecurve inspect FILE [--spectrum FILE] [--objective NAME] [--learning-rate ETA]
                            [--reference FILE | --no-reference] [--plot out.png] [--json]

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

from keras_noisecurve.mixing.cli_solve import (
    CommandError,
    diagnostics_lines,
    fail,
    load_spectrum,
    report_warnings,
    solver_lines,
    update_rule_text,
)
from keras_noisecurve.mixing.update_rule import UpdateRule
from keras_noisecurve.mixing.workloads import CURVATURE_OBJECTIVES, OBJECTIVES

PROG = "noisecurve inspect"

# |C| is drawn at most this many pixels wide (block maxima above it).
_MAX_IMAGE_PIXELS = 800
# From this T on, say on stderr that the DP-BandMF reference is being solved (it takes a while).
_ANNOUNCE_REFERENCE_STEPS = 500


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``noisecurve inspect``."""
    parser.add_argument("file", metavar="FILE", help="mixing-matrix .npz written by 'noisecurve solve'")
    parser.add_argument(
        "--spectrum", metavar="FILE", help="Spectrum .npz to recompute curvature objectives (the file stores only its digest)"
    )
    parser.add_argument(
        "--objective",
        choices=tuple(OBJECTIVES),
        metavar="NAME",
        help="evaluate under this objective instead of the stored one: %(choices)s",
    )
    parser.add_argument("--learning-rate", type=float, metavar="ETA", help="learning rate (default: the stored one)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--reference", metavar="FILE", help="DP-BandMF mixing-matrix .npz to compare with")
    group.add_argument(
        "--no-reference", action="store_true", help="do not solve for the DP-BandMF reference (use stored baselines)"
    )
    parser.add_argument("--plot", metavar="PNG", help="write a figure: |C| and the noise std over the steps")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")


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
    blend_weight = _stored_blend_weight(meta) if objective == "noisecurve-blend" else None

    missing = []
    if objective is None:
        missing.append("the file has no objective in its metadata; pass --objective NAME")
    if objective in CURVATURE_OBJECTIVES:
        if spectrum is None:
            missing.append("--spectrum FILE (the file stores only the spectrum digest, not the spectrum)")
        if learning_rate is None:
            missing.append("--learning-rate ETA (none stored)")
        if objective == "noisecurve-blend" and blend_weight is None:
            missing.append("a numeric blend weight in the metadata")
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
        if objective == "noisecurve-blend":
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


# ----------------------------------------------------------------------------- plot
def _abs_image(mixing, max_pixels: int = _MAX_IMAGE_PIXELS) -> tuple[np.ndarray, int]:
    """|C| as an image, block maxima over k×k blocks when T > max_pixels; (image, k)."""
    steps, bands = mixing.steps, mixing.bands
    k = max(1, math.ceil(steps / max_pixels))
    size = math.ceil(steps / k)
    image = np.zeros((size, size))
    bv = np.abs(mixing.band_values)
    rows = np.arange(steps)
    for j in range(bands):
        t = rows[j:]
        np.maximum.at(image, (t // k, (t - j) // k), bv[j:, j])
    return image, k


def write_plot(path: str, mixing, diag: dict, reference_diag: dict | None, title: str) -> None:
    """Figure: |C| (log colour scale), per-step noise std, running-sum noise std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    image, k = _abs_image(mixing)
    positive = image[image > 0]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    masked = np.ma.masked_where(image <= 0, image)
    shown = ax.imshow(
        masked,
        norm=LogNorm(vmin=max(positive.min(), positive.max() * 1e-8), vmax=positive.max()),
        cmap="viridis",
        interpolation="nearest",
        extent=(0, mixing.steps, mixing.steps, 0),
    )
    fig.colorbar(shown, ax=ax, label="|C[t, s]|" + (f" (max over {k}x{k} blocks)" if k > 1 else ""))
    ax.set_xlabel("s (noise draw)")
    ax.set_ylabel("t (step)")
    ax.set_title(f"|C|, T = {mixing.steps}, b = {mixing.bands}")

    t = np.arange(mixing.steps)
    for ax, key, label, sgd in (
        (axes[1], "step_std", "per-step noise std ||C^-1[t,:]||", np.ones(mixing.steps)),
        (axes[2], "prefix_std", "running-sum noise std ||(A C^-1)[t,:]||", np.sqrt(t + 1.0)),
    ):
        ax.plot(t, diag[key], label="this C", color="C0")
        if reference_diag is not None:
            ax.plot(t, reference_diag[key], label="DP-BandMF", color="C1", linestyle="--")
        ax.plot(t, sgd, label="DP-SGD", color="0.5", linestyle=":")
        ax.set_yscale("log")
        ax.set_xlabel("step t")
        ax.set_title(label)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------ run
def _text_report(path, mixing, norms, expected, diag, ref_diag, reference_how) -> list[str]:
    meta = mixing.metadata
    lines = [f"{path}: mixing matrix, steps T = {mixing.steps}, bands b = {mixing.bands}, digest {mixing.digest()[:16]}…"]
    lines.append("metadata:")
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
        extra = " [stored]" if name == "bandmf" and expected.get("bandmf_source") == "stored" else ""
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
            mixing = _read_mixing_file(args.file)
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
            write_plot(args.plot, mixing, diag, ref_diag, title)
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
        print(json.dumps(document, indent=2, sort_keys=True))
    else:
        for line in _text_report(args.file, mixing, norms, expected, diag, ref_diag, reference_how):
            print(line)
        if args.plot is not None:
            print(f"plot written to {args.plot}")
    return 0
