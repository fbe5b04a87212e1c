"""Statistics and the Markdown report of ``benchmarks/accuracy.py``.

Rows are *variants*: a label (``bandmf``, ``bandmf+rule``, ...), the solver objective and
whether its C was solved for the training rule (``matched``) or for plain SGD. ``final``
maps (ε, label) to the final runs' per-seed validation and test accuracies.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np


# ------------------------------------------------------------------------- statistics
def paired_test(ours, base) -> dict:
    """One-sided paired t-test and paired (sign-flip) permutation test of H1 "ours better than base"."""
    from scipy import stats

    ours, base = np.asarray(ours, dtype=float), np.asarray(base, dtype=float)
    diff = ours - base
    if len(diff) < 2 or np.allclose(diff, diff[0]):
        t_stat, p_t = float("nan"), (0.0 if diff.mean() > 0 else 1.0) if len(diff) else float("nan")
    else:
        res = stats.ttest_rel(ours, base, alternative="greater")
        t_stat, p_t = float(res.statistic), float(res.pvalue)
    # paired: under H0 each seed's difference is as likely negated (sign flips; exact for
    # up to 14 pairs, 20,000 random flips beyond)
    perm = stats.permutation_test(
        (diff,), lambda d, axis: np.mean(d, axis=axis),
        permutation_type="samples", alternative="greater", n_resamples=20000, random_state=0,
    )
    return {"t": t_stat, "p_t": p_t, "p_perm": float(perm.pvalue), "mean_diff": float(diff.mean()),
            "wins": int(np.sum(diff > 0)), "losses": int(np.sum(diff < 0))}


def pooled(final, epsilons, label, split="val"):
    """A label's accuracies on ``split`` over every (ε, final seed), in a fixed order (paired)."""
    return np.concatenate([np.asarray(final[(e, label)][split]) for e in epsilons])


def reference_bandmf(final, epsilons, bandmf_labels):
    """The DP-BandMF row the tests compare against: the bandmf variant with the highest pooled
    VALIDATION accuracy (ties: the first, i.e. the plain workload). Returns (label, scores)."""
    if not bandmf_labels:
        return None, {}
    scores = {lab: float(np.mean(pooled(final, epsilons, lab))) for lab in bandmf_labels}
    return max(bandmf_labels, key=lambda lab: scores[lab]), scores


def significance(final, epsilons, curvature_labels, ref):
    """(ε, label) → paired_test of each curvature label vs the DP-BandMF reference, test accuracy."""
    if ref is None:
        return {}
    return {(e, lab): paired_test(final[(e, lab)]["test"], final[(e, ref)]["test"])
            for e in epsilons for lab in curvature_labels}


def matched_vs_plain(final, epsilons, pairs):
    """(ε, matched label) → paired_test of matched vs plain workload (same objective, same rule),
    test accuracy, plus ``"plain"``: the plain label. ``pairs``: [(plain label, matched label)]."""
    out = {}
    for e in epsilons:
        for plain, matched in pairs:
            out[(e, matched)] = dict(paired_test(final[(e, matched)]["test"], final[(e, plain)]["test"]),
                                     plain=plain)
    return out


def decide_default(final, epsilons, labels, curvature_labels, ref, alpha: float = 0.05):
    """The default-objective rule of docs/results.md, on VALIDATION accuracy only.

    For every label, pool its validation accuracies over all (ε, final seed) pairs; a
    curvature variant *beats* DP-BandMF (the reference row ``ref``) if its pooled mean is
    higher AND a one-sided paired t-test over the (ε, seed) pairs (paired: same batches and
    raw noise) gives p < ``alpha``. The default is the winning variant with the highest
    mean; if none beats DP-BandMF, the default is DP-BandMF. A difference within the seed
    noise is not a win.
    """
    from scipy import stats

    if ref is None or not curvature_labels:
        return None
    score = {m: float(np.mean(pooled(final, epsilons, m))) for m in labels}
    per_eps = {m: {e: float(np.mean(final[(e, m)]["val"])) for e in epsilons} for m in labels}
    base = pooled(final, epsilons, ref)
    p_values = {}
    for m in curvature_labels:
        ours = pooled(final, epsilons, m)
        diff = ours - base
        if np.allclose(diff, diff[0]):
            p_values[m] = 0.0 if diff[0] > 0 else 1.0
        else:
            p_values[m] = float(stats.ttest_rel(ours, base, alternative="greater").pvalue)
    winners = [m for m in curvature_labels if score[m] > score[ref] and p_values[m] < alpha]
    best = max(curvature_labels, key=lambda m: score[m])
    default = max(winners, key=lambda m: score[m]) if winners else ref
    return {"score": score, "per_eps": per_eps, "winner": best, "p_values": p_values, "alpha": alpha,
            "beats_bandmf": bool(winners), "default": default, "reference": ref}


# ------------------------------------------------------------------------------ report
def machine_description():
    cpu = platform.processor() or "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                cpu = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return f"{os.cpu_count()} CPU cores (`nproc` = {os.cpu_count()}), {cpu}, {platform.system()} {platform.release()}, Python {platform.python_version()}, numpy {np.__version__}"


def fmt_ms(values):
    v = 100 * np.asarray(values)
    sd = v.std(ddof=1) if len(v) > 1 else 0.0
    return f"{v.mean():.2f} ± {sd:.2f}"


def _test_rows(tests, name_of):
    rows = []
    for (e, m), s in tests.items():
        rows.append(f"| {e:g} | {name_of(m, s)} | {100 * s['mean_diff']:+.2f} | {s['wins']}/{s['losses']} | "
                    f"{s['t']:.2f} | {s['p_t']:.3g} | {s['p_perm']:.3g} |")
    return rows


def workload_lines(args, plan):
    """Setup bullets on the update rule, the workloads the C's were solved for, and skips."""
    rule = args.rule
    out = [f"- Update rule (every method, and the non-private reference): {rule.describe()} — Keras's "
           "`SGD(momentum=β)` with learning rate η·s_t: m ← β·m − η·s_t·ĝ_t, w ← w + m, m₀ = 0"
           + ("" if rule.schedule == "constant" else "; η below is the base rate") + "."]
    if rule.is_plain:
        out.append("- Workloads: plain SGD (the training rule is plain, so the matched workload is the plain one).")
    else:
        kinds = {"plain": "solved for plain constant-rate SGD (the workload without an update rule), "
                          "trained with the rule above",
                 "matched": "solved for the training rule (`update_rule=`: the generalised workloads), "
                            "labelled `+rule`"}
        chosen = ["plain", "matched"] if args.workload == "both" else [args.workload]
        out.append("- Workloads (`--workload " + args.workload + "`): matrix-factorisation C's "
                   + "; and ".join(kinds[k] for k in chosen) + ". Same grid and paired seeds for every row.")
    for label, reason in plan["skipped"]:
        out.append(f"- Skipped `{label}`: {reason}")
    return out


def render(args, argv, problem, model, spectrum, res, wall, nonprivate, cache):
    """The Markdown report. ``res``: labels, final, plan, ref, ref_scores, stats, matched, decision."""
    labels, final, stats, matched, decision = res["labels"], res["final"], res["stats"], res["matched"], res["decision"]
    ref = res["ref"]
    cmd = "python benchmarks/accuracy.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = ["# Accuracy benchmark results", ""]
    lines += [
        "Generated by `benchmarks/accuracy.py` (do not edit by hand; re-run the command below).",
        "",
        "## Setup",
        "",
        f"- Command: `{cmd.strip()}`",
        f"- Machine: {machine_description()}",
        f"- Wall time: {wall / 60:.1f} min for this invocation; solving the {len(cache.mixings)} mixing matrices took "
        f"{cache.solve_seconds / 60:.1f} min of solver time in total (solved once, cached in `{args.cache_dir}`, "
        "possibly by an earlier `--precompute-only` run with the same arguments)",
        f"- Private data: bundled MNIST-5k, split seed 0: {len(problem.y_train)} train / "
        f"{len(problem.y_val)} validation / {len(problem.y_test)} test (stratified).",
        f"- Public data: scikit-learn digits (1,797, unlabeled), upsampled to 28×28. "
        f"Features: PCA({args.pca_dim}) fitted on the public images, unit-norm, + bias.",
        f"- Model: {model.name}" + (f" ({args.hidden} hidden ReLU units)" if args.model == "mlp" else "")
        + f", {model.p} parameters, trained from "
        + ("zero" if args.model == "softmax" else "a seeded random (He) initialisation")
        + f". Spectrum: exact Hessian after random-label pre-training ({args.pretrain_steps} full-batch GD steps, "
        f"η = {args.pretrain_lr:g}) on the public features "
        f"(μ_max = {spectrum.max_eigenvalue:.4g}, Tr = {spectrum.trace():.4g}).",
        f"- Privacy: δ = {args.delta:g}, cyclic Poisson sampling, expected batch size B = {args.batch_size}, "
        f"T = {args.steps} steps ({args.steps * args.batch_size / len(problem.y_train):.1f} epochs), PLD accounting.",
        *workload_lines(args, res["plan"]),
        f"- Tuning (validation only, same grid for every method): learning rate ∈ {args.lr_grid}, "
        f"clip norm ∈ {args.clip_grid}, bands ∈ {args.band_grid} (DP-SGD: b = 1); "
        f"each configuration scored by mean validation accuracy over {args.tune_seeds} seeds.",
        f"- NoiseCurve objectives use learning rate η·s(ζ), s = mean public clipping factor "
        f"(`--lr-scale {args.lr_scale}`).",
        f"- Final: {args.seeds} fresh seeds per (method, ε) at the tuned configuration; seeds are paired "
        f"across methods (same batches, same raw noise z).",
        f"- Non-private reference (full-batch GD{'' if args.rule.is_plain else ' with the update rule above'}, "
        f"same T, η = {nonprivate[2]:g} picked on validation): "
        f"validation {100 * nonprivate[0]:.2f} %, test {100 * nonprivate[1]:.2f} %.",
        f"- Curvature objectives solved with `tol={args.solver_tol:g}` (DP-BandMF with the library default); "
        "each artifact's exact objective value is logged by the script.",
    ]
    if ref is not None and len(res["ref_scores"]) > 1:
        others = ", ".join(f"`{lab}` {100 * v:.2f} %" for lab, v in res["ref_scores"].items() if lab != ref)
        lines.append(f"- DP-BandMF in the tests below is `{ref}`, the bandmf variant with the highest pooled "
                     f"validation accuracy, ties to the plain workload ({100 * res['ref_scores'][ref]:.2f} % vs "
                     f"{others}).")
    lines += ["", "## Test accuracy (%), mean ± std over seeds", ""]
    header = "| method | " + " | ".join(f"ε = {e:g}" for e in args.epsilons) + " |"
    lines += [header, "|---|" + "---|" * len(args.epsilons)]
    for m in labels:
        cells = [fmt_ms(final[(e, m)]["test"]) for e in args.epsilons]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "## Validation accuracy (%) at the tuned configuration, same seeds", ""]
    lines += [header, "|---|" + "---|" * len(args.epsilons)]
    for m in labels:
        cells = [fmt_ms(final[(e, m)]["val"]) for e in args.epsilons]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "## Tuned hyperparameters (learning rate, clip norm, bands) and σ", ""]
    lines += [header, "|---|" + "---|" * len(args.epsilons)]
    for m in labels:
        cells = [f"η={final[(e, m)]['lr']:g}, ζ={final[(e, m)]['clip']:g}, b={final[(e, m)]['bands']}, "
                 f"σ={final[(e, m)]['sigma']:.3f}" for e in args.epsilons]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    table_head = ["| ε | variant | mean diff (pp) | wins/losses | paired t | p (t-test) | p (permutation) |",
                  "|---|---|---|---|---|---|---|"]
    if stats:
        ref_note = "" if ref == "bandmf" else f" (`{ref}`)"
        lines += ["", f"## Significance vs DP-BandMF{ref_note} (test accuracy, one-sided, H1: variant better)", ""]
        lines += table_head + _test_rows(stats, lambda m, s: m)
    if matched:
        lines += ["", "## Matched vs plain workload (test accuracy, one-sided, H1: matched better)", "",
                  "Each row compares a C solved for the training rule with the C solved for plain SGD, same "
                  "objective, both trained with the same rule (each at its own tuned configuration).", ""]
        lines += table_head + _test_rows(matched, lambda m, s: f"{m} vs {s['plain']}")
    if decision:
        lines += decision_lines(args, labels, decision)
    lines += ["", "## Conclusion", ""] + conclusion(args, final, res) + [""]
    return "\n".join(lines)


def decision_lines(args, labels, decision):
    ref = decision["reference"]
    ref_note = "" if ref == "bandmf" else f" (`{ref}`)"
    lines = ["", "## Default objective (decided on VALIDATION accuracy only)", "",
             "Rule: pool each method's validation accuracies over all (ε, final seed) pairs. A curvature "
             f"variant beats DP-BandMF{ref_note} if its pooled mean is higher and a one-sided paired t-test over "
             f"the pairs gives p < {decision['alpha']:g}; the default is the best such variant, else DP-BandMF. "
             "The test split plays no part in this decision.", "",
             "| method | pooled val. accuracy (%) | p vs DP-BandMF (val.) | "
             + " | ".join(f"val ε = {e:g}" for e in args.epsilons) + " |",
             "|---|---|---|" + "---|" * len(args.epsilons)]
    for m in labels:
        cells = [f"{100 * decision['per_eps'][m][e]:.2f}" for e in args.epsilons]
        pv = decision["p_values"].get(m)
        lines.append(f"| {m} | {100 * decision['score'][m]:.2f} | {'—' if pv is None else f'{pv:.3g}'} | "
                     + " | ".join(cells) + " |")
    lines.append("")
    if decision["beats_bandmf"]:
        lines.append(f"**Decision: `{decision['default']}`** — it beats DP-BandMF on validation "
                     f"({100 * decision['score'][decision['default']]:.2f} % vs "
                     f"{100 * decision['score'][ref]:.2f} %, p = {decision['p_values'][decision['default']]:.3g}).")
    else:
        lines.append(f"**Decision: no curvature variant beats DP-BandMF on validation** (best: "
                     f"`{decision['winner']}` {100 * decision['score'][decision['winner']]:.2f} % vs DP-BandMF "
                     f"{100 * decision['score'][ref]:.2f} %, one-sided paired p = "
                     f"{decision['p_values'][decision['winner']]:.3g}). DP-BandMF is the safe default.")
    return lines


def _verdict(s):
    if max(s["p_t"], s["p_perm"]) < 0.05:
        return "significantly better (p < 0.05, both tests)"
    return "higher, but not significantly (p >= 0.05 in a test)" if s["mean_diff"] > 0 else "not higher"


def conclusion(args, final, res):
    """Plain-language summary computed from the numbers (no hand-written claims)."""
    out = []
    ref, decision = res["ref"], res["decision"]
    if ref is not None and "dpsgd" in res["labels"]:
        for e in args.epsilons:
            d = 100 * (np.mean(final[(e, ref)]["test"]) - np.mean(final[(e, "dpsgd")]["test"]))
            out.append(f"- ε = {e:g}: DP-BandMF (`{ref}`) vs DP-SGD: {d:+.2f} pp test accuracy.")
    for (e, m), s in res["stats"].items():
        out.append(f"- ε = {e:g}: {m} vs DP-BandMF: {100 * s['mean_diff']:+.2f} pp "
                   f"({s['wins']} wins / {s['losses']} losses over paired seeds) — {_verdict(s)}.")
    for (e, m), s in res["matched"].items():
        out.append(f"- ε = {e:g}: matched workload {m} vs plain {s['plain']}: {100 * s['mean_diff']:+.2f} pp "
                   f"({s['wins']} wins / {s['losses']} losses over paired seeds) — {_verdict(s)}.")
    if decision:
        ref = decision["reference"]
        out.append("")
        if decision["beats_bandmf"]:
            d = decision["default"]
            out.append(f"On validation data `{d}` beats DP-BandMF by "
                       f"{100 * (decision['score'][d] - decision['score'][ref]):.2f} pp (pooled over ε and seeds, "
                       f"p = {decision['p_values'][d]:.3g}), so it is the recommended default objective.")
        else:
            out.append(f"No curvature objective beats DP-BandMF on validation data (best: `{decision['winner']}`, "
                       f"{100 * (decision['score'][decision['winner']] - decision['score'][ref]):+.2f} pp averaged "
                       "over ε). DP-BandMF is the safe default.")
    return out
