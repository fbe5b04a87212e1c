"""``noisecurve inspect --plot``: the figure of a banded mixing matrix C.

Three panels: |C| on a log colour scale (block maxima when T is large), the per-step
noise std ``||C⁻¹[t, :]||`` and the running-sum noise std ``||(A C⁻¹)[t, :]||``, each
against DP-SGD (C = I) and, when given, the DP-BandMF reference. matplotlib (Agg), no
TensorFlow.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["MAX_IMAGE_PIXELS", "abs_image", "write_plot"]

#: |C| is drawn at most this many pixels wide (block maxima above it).
MAX_IMAGE_PIXELS = 800


def abs_image(mixing, max_pixels: int = MAX_IMAGE_PIXELS) -> tuple[np.ndarray, int]:
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


def write_plot(path: str, mixing, diag: dict, reference_diag: dict | None, title: str, *,
               sigmas: dict | None = None) -> None:
    """Figure: |C| (log colour scale), per-step noise std, running-sum noise std.

    ``sigmas`` (``{"this C": σ, "DP-SGD": σ₁, "DP-BandMF": σ_ref}``, each calibrated for the
    same (ε, δ)): the curves in the units the model sees, each times its own σ (units of ζ/B
    per coordinate of the noisy mean gradient, and of its running sum). Without it, per unit
    of each C's own σ, which hides that a correlated C needs a larger σ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    image, k = abs_image(mixing)
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
    scale = (lambda name: sigmas[name]) if sigmas else (lambda name: 1.0)  # noqa: E731
    unit = ("x its own sigma at the same eps, delta (units of clip/B)" if sigmas
            else "per unit of its own sigma (give --epsilon ... for model units)")
    for ax, key, label, sgd in (
        (axes[1], "step_std", "per-step noise std ||C^-1[t,:]||", np.ones(mixing.steps)),
        (axes[2], "prefix_std", "running-sum noise std ||(A C^-1)[t,:]||", np.sqrt(t + 1.0)),
    ):
        ax.plot(t, scale("this C") * np.asarray(diag[key]), label="this C", color="C0")
        if reference_diag is not None:
            ax.plot(t, scale("DP-BandMF") * np.asarray(reference_diag[key]), label="DP-BandMF", color="C1",
                    linestyle="--")
        ax.plot(t, scale("DP-SGD") * sgd, label="DP-SGD", color="0.5", linestyle=":")
        ax.set_yscale("log")
        ax.set_xlabel("step t")
        ax.set_title(f"{label}\n{unit}", fontsize=9)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
