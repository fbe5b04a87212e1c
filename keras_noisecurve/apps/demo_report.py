"""``noisecurve demo``'s report: the accuracy table, the paired differences and the plots.

The table and the differences are computed from the runs' results (plain Python); the
plots (matplotlib, Agg backend) from the spectrum, the mixing matrices and their noise
diagnostics. ``PLOT_FILES`` names the files ``write_plots`` writes into the output folder.
"""

from __future__ import annotations

import math
import os

from keras_noisecurve.apps.demo_configs import METHODS

__all__ = ["PLOT_FILES", "mean", "paired_differences", "paired_lines", "plot_bands", "plot_noise", "std", "table",
           "write_plots"]

#: Correlated methods (b >= 2, a solved C).
CORRELATED = tuple(m for m in METHODS if m != "DP-SGD")


def mean(values) -> float:
    return float(sum(values) / len(values))


def std(values):
    """Sample standard deviation (n − 1 in the denominator); None for a single value."""
    if len(values) < 2:
        return None
    mu = mean(values)
    return float(math.sqrt(sum((v - mu) ** 2 for v in values) / (len(values) - 1)))


def paired_differences(runs) -> dict:
    """Per-seed accuracy differences of each correlated method against DP-SGD (same seed)."""
    out = {}
    base = {r["seed"]: r["test_accuracy"] for r in runs["DP-SGD"]}
    for name in CORRELATED:
        diffs = [r["test_accuracy"] - base[r["seed"]] for r in runs[name]]
        out[f"{name} - DP-SGD"] = {"mean": mean(diffs), "std": std(diffs), "n": len(diffs), "per_seed": diffs}
    return out


def paired_lines(paired) -> list:
    if not paired:
        return []
    return ["Paired differences (same seed): " + "; ".join(
        f"{k} {100 * d['mean']:+.2f} ± {100 * d['std']:.2f} pp" for k, d in paired.items())]


def table(results) -> str:
    """One row per method. One seed: the accuracy of that run (as before ``--seeds``); N seeds:
    mean ± sample std over the N runs, N in the header, wall time per run."""
    n = next(iter(results.values()))["n"]
    if n == 1:
        lines = ["| method | test accuracy | epsilon | sigma | b | wall time |", "|---|---|---|---|---|---|"]
    else:
        lines = [f"| method | test accuracy (mean ± std, N = {n}) | epsilon | sigma | b | wall time per run |",
                 "|---|---|---|---|---|---|"]
    for name, r in results.items():
        acc = f"{100 * r['test_accuracy']:.2f} %" if n == 1 else \
            f"{100 * r['test_accuracy']:.2f} ± {100 * r['test_accuracy_std']:.2f} %"
        lines.append(f"| {name} | {acc} | {r['epsilon']:.3f} | {r['sigma']:.3f} | {r['bands']} | {r['seconds']:.0f} s |")
    return "\n".join(lines)


PLOT_FILES = ("spectrum.png", "mixing_bands.png", "noise.png", "accuracy.png")


def write_plots(out, spectrum, mixings, curves, results, steps_per_epoch) -> None:
    """The plots of ``PLOT_FILES``; ``curves``: per method the noise in model units
    (``demo_predict.noise_curves``: ``step_std``, ``sum_std``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    # spectrum: eigenvalue vs index (cumulative multiplicity), Lanczos part and fitted tail
    values, mults = spectrum.eigenvalues, spectrum.multiplicities
    index = np.cumsum(mults)
    tail = spectrum.tail_info()
    fig, ax = plt.subplots(figsize=(6, 4))
    keep = values > 0
    if tail:
        first = tail["first_index"]
        top = keep & (index < first)
        rest = keep & (index >= first)
        ax.loglog(index[top], values[top], "o", ms=3, label="Lanczos top-k")
        ax.loglog(index[rest], values[rest], "-", label=f"fitted tail (alpha={tail.get('alpha', float('nan')):.2f})")
    else:
        ax.loglog(index[keep], values[keep], "o-", ms=3, label="eigenvalues")
    ax.set_xlabel("index i (cumulative multiplicity)")
    ax.set_ylabel("eigenvalue mu_i of the Hessian upper bound")
    ax.set_title("Spectrum (public data, random-label pre-training)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "spectrum.png"), dpi=110)
    plt.close(fig)

    plot_bands(plt, np, os.path.join(out, "mixing_bands.png"), {k: v for k, v in mixings.items() if k != "DP-SGD"})

    plot_noise(plt, os.path.join(out, "noise.png"), curves, results)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in results.items():
        hist = np.array(r["accuracy_per_epoch"]) * 100
        epochs = np.arange(1, len(hist) + 1)
        if r["n"] > 1:
            runs = np.array([run_["accuracy_per_epoch"] for run_ in r["runs"]]) * 100
            std = runs.std(axis=0, ddof=1)
            line, = ax.plot(epochs, hist, "o-", label=f"{name} (mean ± std, N = {r['n']})")
            ax.fill_between(epochs, hist - std, hist + std, color=line.get_color(), alpha=0.2)
        else:
            ax.plot(epochs, hist, "o-", label=name)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Accuracy per epoch")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "accuracy.png"), dpi=110)
    plt.close(fig)


def plot_noise(plt, path, curves, results) -> None:
    """Each method's noise in the units the model sees, with its own σ and clip ζ: per-step
    std ζσ‖C⁻¹[t, :]‖ of the summed clipped gradients' noise, and the std of the noise in the
    weights after step t, ζσ‖(A_rule C⁻¹)[t, :]‖ (A_rule: the prefix map of the method's update
    rule, momentum included), in units of η/B (η the method's own learning rate)."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.4))
    for name, d in curves.items():
        label = f"{name} (b={results[name]['bands']}, sigma={results[name]['sigma']:.3g})"
        a1.plot(d["step_std"], label=label)
        a2.plot(d["sum_std"], label=label)
    a1.set_title("per-step noise: clip * sigma * ||C^-1[t,:]||")
    a1.set_ylabel("noise std of the step's summed gradient\n(per coordinate; divide by B for the mean)")
    a2.set_title("noise in the weights: clip * sigma * ||(A_rule C^-1)[t,:]||")
    a2.set_ylabel("noise std of the summed update after step t\n(units of eta / B, eta the method's learning rate)")
    for ax in (a1, a2):
        ax.set_xlabel("step t")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    a1.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bands(plt, np, path, mixings) -> None:
    """One panel per correlated C: the band values C[t, t − j] against the step t, one curve
    per diagonal j = 0 … b − 1 (j = 0 the diagonal; a curve starts at t = j)."""
    fig, axes = plt.subplots(1, len(mixings), figsize=(5.5 * len(mixings), 4.2), sharey=True, squeeze=False)
    for ax, (name, mixing) in zip(axes[0], mixings.items()):
        values = np.asarray(mixing.band_values)
        steps, bands = values.shape
        for j in range(bands):
            t = np.arange(j, steps)
            ax.plot(t, values[j:, j], lw=1.4, label=f"j = {j}" + (": diagonal C[t, t]" if j == 0 else f": C[t, t-{j}]"))
        ax.axhline(0.0, color="0.6", lw=0.8)
        ax.set_title(f"{name}: band values of C (T = {steps}, b = {bands})")
        ax.set_xlabel("step t")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", ncol=1 if bands <= 6 else 2)
    axes[0][0].set_ylabel("C[t, t - j]")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
