"""The noise check: the noise the user's optimizer adds, measured on zero clipped sums (TensorFlow and JAX).

A twin of the user's optimizer (same class and config: strategy C, σ, ζ, B, inner
optimizer; ``type(opt).from_config(opt.get_config())``) steps a probe variable of N
coordinates on ZERO clipped sums for the first T' steps of the plan. Each step's
privatized gradient is then ĝ_t = ζσ·z̃_t / B with z̃ = C⁻¹z (docs/design.md, update rule), so

    y_t = B·ĝ_t / ζ = σ·z̃_t,    C·y / σ = z ~ N(0, I) entrywise, under the claim.

ĝ_t is read where privatization ends: the argument the optimizer hands to its inner
optimizer's ``update_step`` (recorded by a wrapper on the twin's inner optimizer), or,
without one (plain SGD), −Δw/η_t. Two tests of the whitened (T', N) matrix:

- **scale**: its root mean square is the claimed 1 (the noise has standard deviation ζσ
  per raw draw); under the claim T'N·mean(w²) is χ² with T'N degrees of freedom, and the
  check fails when |z| = |mean − 1|/√(2/(T'N)) > 5;
- **covariance** (the white-box audit's probe test): the largest entry of
  |w·wᵀ/N − I| stays below √(2/N)·Φ⁻¹(1 − 0.001/(T'(T'+1))) (a false alarm at most
  0.1 % of the time).

The claim is the run's σ and B when the optimizer has a run (else its own), and its ζ.
With an adaptive clip each step's ĝ_t is divided by that step's ζ_t (read before the
step): the claim is then that the noise is ζ_t·σ·z̃_t, whatever ζ_t, which the privacy
argument needs (docs/privacy.md, "Adaptive clipping"). Its count query sees a fixed,
public set of norms (log-spaced over four decades), so ζ_t moves during the check.

A user-level run's zero sums are handed over as clipped per user (``unit_rows`` its
``examples_per_user``): B is then users per step and the count's norms are the B users'.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy import stats

__all__ = ["NoiseCheck", "SCALE_Z_LIMIT", "check_noise", "covariance_test"]

#: |z| of the whitened mean square against 1 above which the scale test fails
SCALE_Z_LIMIT = 5.0


@dataclasses.dataclass(frozen=True)
class NoiseCheck:
    """The outcome of :func:`check_noise`.

    Attributes:
      passed: both tests passed.
      steps, probes: T' steps measured, N probe coordinates.
      scale: measured standard deviation of the whitened noise / the claimed one (1 = ζσ).
      scale_z: its z-score; covariance_error, covariance_threshold: the covariance test.
      line: one line for a report.
    """

    passed: bool
    steps: int
    probes: int
    scale: float
    scale_z: float
    covariance_error: float
    covariance_threshold: float
    line: str


def covariance_test(whitened):
    """``(max |w·wᵀ/N − I|, threshold)`` for whitened noise ``w`` (T, N) that should be i.i.d.
    N(0, 1): each entry of the empirical covariance has standard deviation ≤ √(2/N), and the
    threshold √(2/N)·Φ⁻¹(1 − 0.001/(T(T+1))) is passed by chance with probability ≤ 0.1 %."""
    whitened = np.asarray(whitened, np.float64)
    steps, probes = whitened.shape
    cov = whitened @ whitened.T / probes
    error = float(np.max(np.abs(cov - np.eye(steps))))
    threshold = float(math.sqrt(2.0 / probes) * stats.norm.isf(0.001 / (steps * (steps + 1))))
    return error, threshold


#: plans up to this many steps give C[:T', :T'] from the dense C; longer ones invert the
#: leading block of C⁻¹ computed by the strategy's numpy recurrence
DENSE_STEPS = 2048


def _claimed_c(mixing, steps):
    """The leading (T', T') block of the claimed C."""
    from scipy import linalg

    if not mixing.has_plan:
        return np.eye(steps)
    if mixing.steps <= DENSE_STEPS:
        return np.asarray(mixing.to_dense(), np.float64)[:steps, :steps]
    inverse = np.asarray(mixing.inverse_apply(np.eye(steps)), np.float64)
    return linalg.solve_triangular(inverse, np.eye(steps), lower=True)


def _twin(optimizer):
    return type(optimizer).from_config(optimizer.get_config())


def check_noise(*, optimizer, steps=32, probes=None) -> NoiseCheck:
    """Measure the noise of a twin of ``optimizer`` on zero clipped sums.

    Args:
      optimizer: the user's ``NoiseCurveOptimizer`` (any strategy, σ, ζ, inner optimizer).
      steps: T', the first steps of the plan measured (at most the plan's T).
      probes: N coordinates; default max(2000, 40·T').

    Returns:
      a :class:`NoiseCheck`.
    """
    import keras

    twin = _twin(optimizer)
    run = getattr(twin, "run", None)
    plan = twin.noise.steps
    steps = min(int(steps), plan) if plan is not None else int(steps)
    probes = max(2000, 40 * steps) if probes is None else int(probes)
    sigma = run.noise_multiplier if run is not None else float(optimizer.noise_multiplier)
    batch = run.batch_size if run is not None else int(optimizer.expected_batch_size)
    unit = {} if run is None or run.examples_per_user == 1 else {"unit_rows": run.examples_per_user}
    adaptive = twin.adaptive_clip is not None
    # B units' norms, per row as the engines return them (a user's on each of its k rows)
    norms = np.repeat(np.geomspace(0.01, 100.0, batch), unit.get("unit_rows", 1))
    norms = keras.ops.convert_to_tensor(norms, "float32") if adaptive else None
    variable = keras.Variable(np.zeros(probes, np.float32), name="noise_probe")
    seen = keras.Variable(np.zeros(probes, np.float32), trainable=False, name="noise_seen")
    inner = twin.inner
    if inner is not None:
        original = inner.update_step

        def recording(gradient, var, learning_rate):
            seen.assign(keras.ops.cast(gradient, "float32"))
            return original(gradient, var, learning_rate)

        inner.update_step = recording
    zero = keras.ops.zeros((probes,))
    rows = []
    for _ in range(steps):
        rate = float(np.asarray(keras.ops.convert_to_numpy(twin.learning_rate)))
        before = np.asarray(keras.ops.convert_to_numpy(variable.value), np.float64)
        if not twin.built:
            twin.build([variable])
        clip = float(np.asarray(keras.ops.convert_to_numpy(twin.current_clip())))  # ζ_t, before step t
        twin.apply_clipped_sum([zero], [variable], norms=norms, **unit)  # user-level: B users' clipped sums
        if inner is not None:
            g_hat = np.asarray(keras.ops.convert_to_numpy(seen.value), np.float64)
        else:
            g_hat = -(np.asarray(keras.ops.convert_to_numpy(variable.value), np.float64) - before) / rate
        rows.append(g_hat * batch / clip)
    y = np.stack(rows)  # (T', N): σ·z̃ under the claim
    whitened = _claimed_c(twin.mixing, steps) @ y / sigma
    mean_square = float(np.mean(whitened ** 2))
    scale_z = (mean_square - 1.0) / math.sqrt(2.0 / whitened.size)
    error, threshold = covariance_test(whitened)
    passed = abs(scale_z) <= SCALE_Z_LIMIT and error <= threshold
    verdict = "PASS" if passed else "FAIL"
    line = (f"noise: {verdict} - {steps} steps x {probes} probes on zero clipped sums: std = "
            f"{math.sqrt(mean_square):.4f} x zeta*sigma (z = {scale_z:+.2f}, |z| <= {SCALE_Z_LIMIT:g}); C-whitened "
            f"covariance max |cov - I| = {error:.3f} (<= {threshold:.3f})")
    return NoiseCheck(passed=bool(passed), steps=steps, probes=probes, scale=math.sqrt(mean_square),
                      scale_z=float(scale_z), covariance_error=error, covariance_threshold=threshold, line=line)
