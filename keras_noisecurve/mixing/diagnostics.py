"""Noise diagnostics of a mixing matrix C: what its noise looks like over training.

An objective value Tr(W X⁻¹) is one number; it says nothing about *when* the
noise lands. The known risk of the paper's eq. 1 (docs/mixing.md, "The known risk of
eq. 1"): its exact optimum can put several times DP-BandMF's noise into single steps and let the
running sum of the noise swing far mid-training, cancelling only at the very
end. A quadratic model forgives that; a real, clipped, non-convex model does not.
This module measures that behaviour so every C can be looked at before training:

- :func:`noise_diagnostics` – per-step noise std, running-sum std, diagonal,
  condition number (a JSON-serialisable dict, stored by the solver under
  ``metadata["diagnostics"]``);
- :func:`warn_if_excursive` – the peak running-sum std of C relative to a
  reference C (DP-BandMF with the same T and b), with a
  :class:`NoiseExcursionWarning` when the ratio is large.

Units: everything is in units of the per-coordinate std of the *uncorrelated*
noise z_t ~ N(0, I), i.e. of ζ·σ/B in the noisy gradient
``ĝ_t = (Σ clip(g_i) + ζσ z̃_t)/B`` (docs/design.md#update-rule). DP-SGD (C = I) has
``step_std[t] = 1`` and ``prefix_std[t] = √(t+1)``.

Cost: O(T²·b) time with banded triangular solves (LAPACK ``dtbtrs``) over
blocks of columns of C⁻¹, O(T·block) memory; no dense inverse. The exact
condition number uses a dense SVD, O(T³), for T ≤ ``EXACT_CONDITION_MAX_STEPS`` (1000),
a Lanczos estimate with banded products and solves above.

numpy/scipy only: nothing here imports TensorFlow.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import scipy.sparse.linalg as sparse_linalg

from keras_noisecurve._validation import check_float
from keras_noisecurve.mixing.banded import band_values_to_ab, solve_lower
from keras_noisecurve.mixing.matrix import MixingMatrix
from keras_noisecurve.mixing.strategies import is_mixing_matrix

__all__ = [
    "EXACT_CONDITION_MAX_STEPS",
    "NoiseExcursionWarning",
    "noise_diagnostics",
    "noise_profile",
    "warn_if_excursive",
]

#: Largest T for which the condition number is computed exactly from the singular
#: values of the dense C (an O(T³) SVD); above it a Lanczos estimate is used, which agrees
#: with ``np.linalg.cond`` to 1e-6 relative in the tests. The solver calls
#: :func:`noise_diagnostics` on every solve, so the exact path is kept to small T
#: (timings: docs/mixing.md, "Diagnostics timings").
EXACT_CONDITION_MAX_STEPS = 1000

# Number of matrix entries of C⁻¹ held at once while sweeping its columns (32 MiB).
_BLOCK_ENTRIES = 1 << 22


class NoiseExcursionWarning(UserWarning):
    """The running noise sum of a C swings far beyond that of a reference C.

    Raised (as a warning) by :func:`warn_if_excursive`. See docs/mixing.md ("The known
    risk of eq. 1"): on a real model such a C has cost accuracy although its eq.-1
    objective was lower.
    """


def _check_mixing(name: str, mixing) -> MixingMatrix:
    if not is_mixing_matrix(mixing):
        raise TypeError(
            f"{name} must be a keras_noisecurve.MixingMatrix, got {type(mixing).__name__}. "
            "Build one with MixingMatrix.from_dense / MixingMatrix.load or solve_mixing_matrix."
        )
    return mixing


def noise_profile(mixing: MixingMatrix) -> tuple[np.ndarray, np.ndarray]:
    """Per-step and running-sum noise std of C, by banded solves.

    Args:
      mixing: a :class:`MixingMatrix` C of shape (T, T), band b.

    Returns:
      ``(step_std, prefix_std)``, two float64 arrays of shape (T,):
      ``step_std[t] = ‖C⁻¹[t, :]‖₂`` (std of one coordinate of z̃_t = (C⁻¹z)_t) and
      ``prefix_std[t] = ‖(A C⁻¹)[t, :]‖₂`` with A the all-ones lower-triangular
      matrix (std of one coordinate of the running sum Σ_{s≤t} z̃_s).

    Cost O(T²·b) time, O(T·block) memory: C⁻¹ is swept a block of columns at a
    time; column block [s0, s1) of C⁻¹ is zero above row s0 (C⁻¹ is lower
    triangular), so only the trailing system C[s0:, s0:] is solved.
    """
    mixing = _check_mixing("mixing", mixing)
    steps = mixing.steps
    ab = band_values_to_ab(mixing.band_values)
    block = max(1, min(steps, _BLOCK_ENTRIES // steps))
    step_sq = np.zeros(steps)
    prefix_sq = np.zeros(steps)
    for s0 in range(0, steps, block):
        s1 = min(steps, s0 + block)
        rhs = np.zeros((steps - s0, s1 - s0), order="F")
        rhs[np.arange(s1 - s0), np.arange(s1 - s0)] = 1.0
        cols = solve_lower(ab[:, s0:], rhs, transpose=False)  # = C⁻¹[s0:, s0:s1]
        step_sq[s0:] += np.einsum("ij,ij->i", cols, cols)
        np.cumsum(cols, axis=0, out=cols)  # rows of A C⁻¹ restricted to these columns
        prefix_sq[s0:] += np.einsum("ij,ij->i", cols, cols)
    return np.sqrt(step_sq), np.sqrt(prefix_sq)


def _condition_number_exact(mixing: MixingMatrix) -> float:
    singular = np.linalg.svd(mixing.to_dense(), compute_uv=False)
    return float(singular[0] / singular[-1])


def _condition_number_lanczos(mixing: MixingMatrix) -> float:
    """Lanczos (ARPACK) estimate of σ_max(C)/σ_min(C) with banded products/solves.

    σ_max² is the largest eigenvalue of CᵀC (banded products), σ_min⁻² the largest
    eigenvalue of C⁻¹C⁻ᵀ (two banded triangular solves per product). Ritz values
    never exceed the largest eigenvalue, so in exact arithmetic the estimate is a
    lower bound on the true condition number; with ``tol=1e-10`` it is normally
    accurate to many digits.
    """
    bv = mixing.band_values
    steps, bands = bv.shape
    ab = band_values_to_ab(bv)

    def c_matvec(v):
        y = bv[:, 0] * v
        for j in range(1, bands):
            y[j:] += bv[j:, j] * v[: steps - j]
        return y

    def ct_matvec(u):
        x = bv[:, 0] * u
        for j in range(1, bands):
            x[: steps - j] += bv[j:, j] * u[j:]
        return x

    def gram(v):
        return ct_matvec(c_matvec(np.ravel(v)))

    def inverse_gram(v):
        y = solve_lower(ab, np.ravel(v), transpose=True)
        return solve_lower(ab, y, transpose=False)

    def largest(matvec):
        op = sparse_linalg.LinearOperator((steps, steps), matvec=matvec, dtype=np.float64)
        # A fixed random start (deterministic result) that is not an eigenvector.
        v0 = np.random.default_rng(0).standard_normal(steps)
        try:
            values = sparse_linalg.eigsh(op, k=1, which="LA", tol=1e-10, v0=v0, return_eigenvectors=False)
        except sparse_linalg.ArpackNoConvergence as exc:  # pragma: no cover - keep the best Ritz value
            values = exc.eigenvalues
        return float(np.max(values))

    if bands == 1:  # C is diagonal: exact
        return float(bv[:, 0].max() / bv[:, 0].min())
    return math.sqrt(largest(gram) * largest(inverse_gram))


def noise_diagnostics(mixing) -> dict:
    """How the noise of C behaves over training: per-step and running-sum noise std.

    With z_t ~ N(0, I) i.i.d., the optimiser adds z̃ = C⁻¹z (scaled by ζσ/B) to the
    gradient at step t, and for small curvature the weights drift from the
    noise-free path by −η Σ_{s≤t} z̃_s (paper, proof of Theorem 3.1:
    w̃_i − w_i = −η Σ_j (I − ηH)^j z̃_{i−j−1}). The returned numbers describe
    those two quantities per coordinate, in units of the uncorrelated noise std:

    - ``step_std`` (list of T floats): ``‖C⁻¹[t, :]‖₂``, the std of the noise added
      at step t. DP-SGD has 1 everywhere. Values ≫ 1 are single steps with many
      times DP-SGD's noise: a clipped, non-convex model can be knocked off course
      by them even when later steps cancel them on paper.
    - ``step_std_max``: ``max_t step_std[t]``.
    - ``prefix_std`` (list of T floats): ``‖(A C⁻¹)[t, :]‖₂`` with A the all-ones
      lower-triangular matrix: the std of the running noise sum Σ_{s≤t} z̃_s, i.e.
      of the weight displacement it causes (units of ηζσ/B) if curvature is
      ignored. DP-SGD has √(t+1); DP-BandMF keeps it small throughout.
    - ``prefix_std_max`` and ``prefix_std_argmax`` (step index): the worst
      mid-training swing of the running sum. A C optimised only for the final
      iterate (eq. 1) can have a large peak that cancels only at the end —
      the known risk of eq. 1 (docs/mixing.md). Compare it with DP-BandMF's
      (:func:`warn_if_excursive`).
    - ``prefix_std_final``: ``prefix_std[T−1]``, the running sum at the end.
    - ``min_diagonal``: ``min_t C[t, t]``. Fresh noise z_t enters z̃_t with gain
      1/C[t, t]; a tiny diagonal (eq.-1 optima can have entries near 0.03)
      means a huge per-step noise that the following steps must undo.
    - ``condition_number``: the 2-norm condition number σ_max(C)/σ_min(C). The
      online recurrence z̃_t = (z_t − Σ_j C[t, t−j] z̃_{t−j}) / C[t, t] amplifies
      rounding errors by up to this factor; in float32 (the usual dtype of the optimiser's variables)
      a value near 1e6 or more means the generated noise is no longer the noise
      the accounting and the objective assume.
    - ``condition_number_method``: ``"svd"`` (exact, from the singular values of
      the dense C, used for T ≤ ``EXACT_CONDITION_MAX_STEPS`` = 1000) or
      ``"lanczos"`` (for larger T: ARPACK estimates of the largest eigenvalues of
      CᵀC and of C⁻¹C⁻ᵀ with banded products and solves, ``tol=1e-10``; a lower
      bound on the exact value, normally accurate to many digits).
    - ``steps``, ``bands``: T and b of C.

    Args:
      mixing: a :class:`MixingMatrix` (T, T), band b.

    Returns:
      A JSON-serialisable dict with the keys above (Python floats/ints/lists).

    Cost: O(T²·b) for the noise profile (banded solves, no dense inverse), plus
    O(T³) for the exact condition number when T ≤ 1000, or O(T·b) per Lanczos step
    above (timings: docs/mixing.md, "Diagnostics timings").
    """
    mixing = _check_mixing("mixing", mixing)
    step_std, prefix_std = noise_profile(mixing)
    if mixing.steps <= EXACT_CONDITION_MAX_STEPS:
        condition, method = _condition_number_exact(mixing), "svd"
    else:
        condition, method = _condition_number_lanczos(mixing), "lanczos"
    argmax = int(np.argmax(prefix_std))
    return {
        "steps": int(mixing.steps),
        "bands": int(mixing.bands),
        "step_std": [float(v) for v in step_std],
        "step_std_max": float(step_std.max()),
        "prefix_std": [float(v) for v in prefix_std],
        "prefix_std_max": float(prefix_std[argmax]),
        "prefix_std_argmax": argmax,
        "prefix_std_final": float(prefix_std[-1]),
        "min_diagonal": float(mixing.band_values[:, 0].min()),
        "condition_number": float(condition),
        "condition_number_method": method,
    }


def warn_if_excursive(mixing, *, reference, factor: float = 3.0) -> float:
    """Ratio of the peak running-noise-sum std of C to that of a reference C.

    ``ratio = max_t ‖(A C⁻¹)[t,:]‖ / max_t ‖(A C_ref⁻¹)[t,:]‖`` (see
    :func:`noise_diagnostics`, ``prefix_std_max``). ``reference`` is meant to be
    the DP-BandMF C with the same T and b; the ratio then says how much further
    than DP-BandMF's the running noise sum of C swings at its worst (docs/mixing.md, "The
    known risk of eq. 1").

    Args:
      mixing: the :class:`MixingMatrix` C to check (T steps).
      reference: a :class:`MixingMatrix` with the same T (normally DP-BandMF,
        same b).
      factor: threshold > 0; a :class:`NoiseExcursionWarning` is issued when
        ``ratio > factor``. Default 3.

    Returns:
      The ratio (float). The solver stores it as
      ``metadata["diagnostics"]["excursion_vs_bandmf"]``.
    """
    mixing = _check_mixing("mixing", mixing)
    reference = _check_mixing("reference", reference)
    factor = check_float("factor", factor, positive=True)
    if reference.steps != mixing.steps:
        raise ValueError(
            f"reference must have the same number of steps as mixing ({mixing.steps}), got {reference.steps}."
        )
    _, prefix = noise_profile(mixing)
    _, ref_prefix = noise_profile(reference)
    peak, ref_peak = float(prefix.max()), float(ref_prefix.max())
    ratio = peak / ref_peak
    if ratio > factor:
        t = int(np.argmax(prefix))
        warnings.warn(
            NoiseExcursionWarning(
                f"the running noise sum of this mixing matrix swings {ratio:.3g}x further than the "
                f"reference's (DP-BandMF): its std peaks at {peak:.4g} at step {t} of {mixing.steps} "
                f"(reference peak {ref_peak:.4g}; threshold factor {factor:g}). An objective that scores "
                "only the final iterate (paper eq. 1) can cancel such swings on paper, but on a real "
                "clipped, non-convex model they have cost accuracy. Inspect it with "
                "'noisecurve inspect FILE --plot out.png', and consider objective='noisecurve-blend' "
                "with blend_weight='auto' or 'noisecurve-all-iterates'."
            ),
            stacklevel=2,
        )
    return ratio
