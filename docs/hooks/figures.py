"""MkDocs hook: draws the figures of the docs at build time, so that no image is committed.

``mkdocs.yml`` names this file under ``hooks:``. Before the pages are collected
(``on_pre_build``) it writes three PNGs into ``docs/figures/`` (git-ignored; created when
missing), which the pages reference as ``figures/NAME.png``:

- ``bands.png``: the band values C[t, t − j] of the banded C that ``mixing="auto"`` chooses
  for the demo's run at ε = 2 (b = 5) and ε = 8 (b = 13), solved for momentum 0.9;
- ``noise.png``: the noise over time in the units the model sees, DP-SGD against those C,
  each at the σ calibrated for its b at the same (ε, δ);
- ``sampling.png``: a schematic of cyclic Poisson sampling (steps × partitions).

The library's numpy/scipy parts only (solver, diagnostics, calibration; no Keras, TensorFlow
or JAX) and matplotlib's Agg backend. Four σ calibrations dominate the time (about 1–3 s
each); nothing is cached between builds. A file is rewritten only when its bytes change, so
``mkdocs serve`` does not rebuild in a loop. The PNG metadata carry no date or version, so
the bytes depend on the inputs alone.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.figures")

#: the folder, inside docs_dir, the figures are written to (git-ignored)
FOLDER = "figures"

#: the demo's run (docs/howto.md's worked example): n, B, T, δ, momentum
N, B, T, DELTA, MOMENTUM = 3500, 250, 140, 1e-5, 0.9
#: the band counts ``choose_mixing`` picks for that run (docs/howto.md prints its tables);
#: fixed here, since running the chooser itself would cost a σ calibration per b on its grid
#: (10 of them per ε): update them, and the how-to's tables, when the chooser changes
CHOSEN = {2.0: 5, 8.0: 13}

_PNG = {"dpi": 100, "metadata": {"Software": None}}


def on_pre_build(config, **kwargs):
    started = time.perf_counter()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(config["docs_dir"]) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    with matplotlib.rc_context({"font.size": 9, "axes.grid": True, "grid.alpha": 0.3}):
        figures = {"sampling.png": _sampling(plt)}
        figures.update(_mixing_figures(plt))
    written = [name for name, fig in figures.items() if _save(plt, fig, folder / name)]
    log.info("figures: %d PNGs in %s (%s rewritten) in %.1f s", len(figures), folder,
             ", ".join(written) or "none", time.perf_counter() - started)


def _save(plt, fig, path: Path) -> bool:
    """Write ``fig`` to ``path`` unless the file already holds the same bytes."""
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", **_PNG)
    plt.close(fig)
    data = buffer.getvalue()
    if path.is_file() and path.read_bytes() == data:
        return False
    path.write_bytes(data)
    return True


def _mixing_figures(plt) -> dict:
    """``bands.png`` and ``noise.png``: the chosen C, and the noise they put into the model."""
    import numpy as np

    from keras_noisecurve.mixing.api import solve_mixing_matrix
    from keras_noisecurve.mixing.diagnostics import noise_profile
    from keras_noisecurve.mixing.matrix import MixingMatrix
    from keras_noisecurve.mixing.rule_workloads import prefix_map_matrix
    from keras_noisecurve.mixing.update_rule import UpdateRule
    from keras_noisecurve.privacy.calibration import calibrate_noise_multiplier

    rule = UpdateRule(momentum=MOMENTUM)
    prefix = prefix_map_matrix(T, rule)  # A_rule: the gradients' noise -> the weights' noise
    mixings = {1: MixingMatrix.identity(T)}
    mixings.update({b: solve_mixing_matrix(steps=T, bands=b, objective="bandmf", update_rule=rule)
                    for b in sorted(set(CHOSEN.values()))})

    figures = {}
    labels = {b: f"mixing='auto' at ε = {eps:g}" for eps, b in CHOSEN.items()}
    _draw_bands(plt, np, {f"{labels[b]} (b = {b})": mixings[b] for b in sorted(labels)}, figures)

    fig, axes = plt.subplots(2, len(CHOSEN), figsize=(11, 6.4), sharex=True, squeeze=False)
    t = np.arange(1, T + 1)
    for column, (eps, b) in enumerate(sorted(CHOSEN.items())):
        rows = {}
        for bands in (1, b):
            sigma = calibrate_noise_multiplier(epsilon=eps, delta=DELTA, num_examples=N, batch_size=B,
                                               steps=T, bands=bands)
            step_std, _ = noise_profile(mixings[bands])
            weights = np.linalg.norm(np.linalg.solve(mixings[bands].to_dense().T, prefix.T).T, axis=1)
            rows[bands] = (sigma, sigma * step_std, sigma * weights)
        ratio = float(np.sum(rows[b][2] ** 2) / np.sum(rows[1][2] ** 2))
        for bands, style in ((1, {"color": "0.35", "ls": "--"}), (b, {"color": "C0"})):
            sigma, step, weights = rows[bands]
            name = "DP-SGD" if bands == 1 else f"banded b = {bands}"
            axes[0][column].plot(t, step, lw=1.3, label=f"{name}, σ = {sigma:.3g}", **style)
            axes[1][column].plot(t, weights, lw=1.3, label=name, **style)
        axes[0][column].set_title(f"ε = {eps:g}: noise of the mean gradient at step t")
        axes[1][column].set_title(f"ε = {eps:g}: noise of the weights after step t\n"
                                  f"(summed variance x{ratio:.2f} of DP-SGD's)")
        axes[1][column].set_xlabel("step t")
        axes[0][column].set_ylim(bottom=0)
        axes[1][column].set_ylim(bottom=0)
        for row in axes[:, column]:
            row.legend(loc="upper left")
    axes[0][0].set_ylabel("std per coordinate, units of ζ/B")
    axes[1][0].set_ylabel("std per coordinate, units of η·ζ/B")
    fig.suptitle(f"n = {N}, B = {B}, T = {T}, δ = {DELTA:g}, SGD with momentum {MOMENTUM:g}: "
                 "each mechanism at the σ calibrated for its b", fontsize=10)
    fig.tight_layout()
    figures["noise.png"] = fig
    return figures


def _draw_bands(plt, np, mixings: dict, figures: dict) -> None:
    """``bands.png``: one panel per C, one curve per diagonal j (the layout of ``noisecurve demo``)."""
    fig, axes = plt.subplots(1, len(mixings), figsize=(11, 4.0), sharey=True, squeeze=False)
    for ax, (name, mixing) in zip(axes[0], mixings.items()):
        values = np.asarray(mixing.band_values)
        steps, bands = values.shape
        for j in range(bands):
            ax.plot(np.arange(j, steps), values[j:, j], lw=1.2,
                    label="j = 0: C[t, t]" if j == 0 else f"j = {j}")
        ax.axhline(0.0, color="0.6", lw=0.8)
        ax.set_title(f"{name}: band values C[t, t - j], T = {steps}")
        ax.set_xlabel("step t")
        ax.legend(fontsize="small", ncol=2, loc="upper right")
    axes[0][0].set_ylabel("C[t, t - j]")
    fig.tight_layout()
    figures["bands.png"] = fig


def _sampling(plt):
    """``sampling.png``: n examples in b partitions; step t samples partition t mod b, each of
    its examples independently with probability q = B·b/n. One example is ringed: it can be in
    the batches of its partition's steps only, b steps apart."""
    import numpy as np
    from matplotlib.patches import Rectangle

    n, batch, bands, steps = 32, 2, 4, 12
    size, q = n // bands, batch * bands / n
    marked = (1, 5)  # (partition, example within it)
    rng = np.random.default_rng(3)
    fig, ax = plt.subplots(figsize=(10, 3.9))
    for t in range(steps):
        active = t % bands
        for p in range(bands):
            y0 = (bands - 1 - p) * (size + 1)
            ax.add_patch(Rectangle((t - 0.42, y0 - 0.6), 0.84, size + 0.2, color="C0" if p == active else "0.93",
                                   alpha=0.18 if p == active else 1.0, lw=0))
            if p != active:
                continue
            drawn = rng.random(size) < q
            rows = y0 + np.arange(size)
            ax.scatter(np.full(size, t)[drawn], rows[drawn], s=24, color="C0", zorder=3)
            ax.scatter(np.full(size, t)[~drawn], rows[~drawn], s=6, color="0.6", zorder=3)
            if p == marked[0]:
                ax.scatter([t], [y0 + marked[1]], s=110, facecolors="none", edgecolors="C3", lw=1.5, zorder=4)
    ax.set_xlim(-0.6, steps - 0.4)
    ax.set_ylim(-1.2, bands * (size + 1) - 1)
    ax.set_xticks(range(steps))
    ax.set_yticks([(bands - 1 - p) * (size + 1) + (size - 1) / 2 for p in range(bands)])
    ax.set_yticklabels([f"partition {p}\n({size} examples)" for p in range(bands)])
    ax.set_xlabel("step t")
    ax.grid(False)
    ax.set_title(f"Cyclic Poisson sampling: n = {n} examples in b = {bands} partitions, expected batch B = {batch}.\n"
                 f"Step t samples partition t mod b only, each of its examples with probability q = B·b/n = {q:g} "
                 "(large dots: in the batch).\nThe ringed example can be in steps "
                 f"{marked[0]}, {marked[0] + bands}, {marked[0] + 2 * bands}, … only: at most ⌈T/b⌉ times, b apart.",
                 fontsize=9)
    fig.tight_layout()
    return fig
