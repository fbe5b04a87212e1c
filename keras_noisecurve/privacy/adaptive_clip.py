"""``AdaptiveClip``: a clip norm that follows a private quantile of the per-example norms.

Andrew et al. 2021, "Differentially Private Learning with Adaptive Clipping" (geometric
update, Alg. 1), made sound under correlated noise (docs/privacy.md, "Adaptive clipping"):

- Step t clips every example at ζ_t and adds ``ζ_t·σ·z̃_t`` to the clipped sum S_t. This is
  ``ζ_t·(S_t/ζ_t + σ·z̃_t)``: the mechanism releases ``S_t/ζ_t + σ·(C⁻¹z)_t``, whose input
  has sensitivity 1 whatever ζ_t is, and multiplies by ζ_t afterwards (post-processing).
  ζ_t depends only on earlier releases, so the inputs are chosen adaptively, which a
  lower-triangular C allows (Denisov et al. 2022, adaptive streams).
- The count query of step t: ``b̃_t = (Σ_i (1[‖g_i‖ ≤ ζ_t] − ½) + N(0, s_b²)) / B + ½`` over
  the examples of the batch (each moves the sum by ½ when added or removed: sensitivity ½,
  noise multiplier ``2·s_b``). Then ``ζ_{t+1} = ζ_t·exp(−η·(b̃_t − γ))``.
- ζ stays within public bounds, ``[10⁻⁶·ζ_0, 10⁶·ζ_0]`` (post-processing): without a floor
  a run whose gradients are mostly exactly 0 would drive ζ to 0 and every factor ζ/max(‖g‖, ζ)
  to 0/0.
- Accounting: an example's count enters at the steps where its gradient does, so each
  participation is one Gaussian mechanism of the pair, with noise multiplier
  ``(s²/σ² + 1/σ_c²)^(−1/2)`` (σ_c = 2·s_b; s the column norm of C): the run's event is the
  example-level one at that multiplier (``RunSpec(count_noise_multiplier=σ_c)``), and σ is
  calibrated so that the whole, count queries included, meets (ε, δ).

numpy only: the update is written with ``keras.ops`` (imported where it runs) so both
backends use this one formula.
"""

from __future__ import annotations

import math
from typing import Optional

from keras_noisecurve._validation import check_float
from keras_noisecurve.backend.common.clip import clip_count, unit_weights  # noqa: F401 (re-exported)

__all__ = ["AdaptiveClip", "CLIP_RANGE", "COUNT_STREAM", "clip_count", "unit_weights"]

#: ζ_t stays within ``[ζ_0 / CLIP_RANGE, ζ_0·CLIP_RANGE]`` (public bounds).
CLIP_RANGE = 1e6

#: The noise index of the count query: its N(0, 1) draw of step t is the Philox stream
#: ``variable_seed(step_seed(noise_key, t), COUNT_STREAM)``, an index no model variable has.
COUNT_STREAM = 2**31 - 1


class AdaptiveClip:
    """A clip norm that tracks the ``target_quantile`` of the per-example gradient norms.

    Give it as ``PrivateRun(..., adaptive_clip=knc.AdaptiveClip())``; the run's optimizer
    (``NoiseCurveOptimizer(run=run)``) then clips at ζ_t, and the run's σ and ε include the
    count queries. Without a run, ``NoiseCurveOptimizer(l2_norm_clip=AdaptiveClip(...),
    noise_multiplier=σ, ...)`` runs it, and ε is yours to compute with
    ``compute_epsilon(..., count_noise_multiplier=clip.count_noise_multiplier(B))``.

    Args (keyword-only; defaults are the paper's):
      initial: ζ_0 > 0, the first step's clip norm (default 0.1).
      target_quantile: γ in (0, 1), the share of examples left unclipped (default 0.5,
        the median norm).
      learning_rate: η ≥ 0 of the geometric update ζ ← ζ·exp(−η·(b̃ − γ)) (default 0.2).
        0 keeps ζ at ``initial`` (the counts are then never used, but still drawn).
      count_stddev: s_b > 0, the standard deviation of the count's noise, in examples;
        ``None`` (default): B/20 for the run's expected batch size B.

    ``count_noise_multiplier(B) = 2·s_b`` is the count's noise over its sensitivity ½.
    """

    def __init__(self, *, initial: float = 0.1, target_quantile: float = 0.5, learning_rate: float = 0.2,
                 count_stddev: Optional[float] = None):
        self.initial = check_float("initial", initial, positive=True)
        self.target_quantile = check_float("target_quantile", target_quantile, open_unit=True)
        self.learning_rate = check_float("learning_rate", learning_rate, nonnegative=True)
        self.count_stddev = None if count_stddev is None else check_float("count_stddev", count_stddev,
                                                                           positive=True)

    def stddev(self, batch_size: int) -> float:
        """s_b: ``count_stddev``, or B/20 when it was left ``None``."""
        return float(self.count_stddev) if self.count_stddev is not None else float(batch_size) / 20.0

    def count_noise_multiplier(self, batch_size: int) -> float:
        """σ_c = 2·s_b, the count query's noise multiplier (its sensitivity is ½)."""
        return 2.0 * self.stddev(batch_size)

    def next_clip(self, clip, below, real, normal, batch_size):
        """``ζ_{t+1} = ζ_t·exp(−η·(b̃_t − γ))``, ``b̃_t = (below − real/2 + s_b·normal)/B + ½``
        (backend scalars, float32).

        Args:
          clip: ζ_t, scalar.
          below: the number of the batch's examples with norm ≤ ζ_t, scalar.
          real: the number of the batch's examples (padding rows excluded), scalar.
          normal: one N(0, 1) draw (the count's noise, stream :data:`COUNT_STREAM`).
          batch_size: B, the expected batch size (Python int).
        """
        from keras import ops

        f32 = "float32"
        below, real, normal, clip = (ops.cast(v, f32) for v in (below, real, normal, clip))
        estimate = (below - 0.5 * real + self.stddev(batch_size) * normal) / float(batch_size) + 0.5
        updated = clip * ops.exp(-self.learning_rate * (estimate - self.target_quantile))
        return ops.clip(updated, self.initial / CLIP_RANGE, self.initial * CLIP_RANGE)

    # ------------------------------------------------------------------ config
    def get_config(self) -> dict:
        return {"initial": self.initial, "target_quantile": self.target_quantile,
                "learning_rate": self.learning_rate, "count_stddev": self.count_stddev}

    @classmethod
    def from_config(cls, config: dict) -> "AdaptiveClip":
        if not isinstance(config, dict) or set(config) != {"initial", "target_quantile", "learning_rate",
                                                           "count_stddev"}:
            raise ValueError(f"an AdaptiveClip config holds exactly the keys of get_config(), got {config!r}.")
        return cls(**config)

    @classmethod
    def coerce(cls, value) -> Optional["AdaptiveClip"]:
        """``value`` as an ``AdaptiveClip`` (one, or its config dict), or ``None`` for a number."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict) and value.get("class_name") == "AdaptiveClip":
            return cls.from_config(value["config"])
        return None

    def to_config(self) -> dict:
        """``{"class_name": "AdaptiveClip", "config": get_config()}``, JSON-able (saved in
        optimizer and run configs)."""
        return {"class_name": "AdaptiveClip", "config": self.get_config()}

    def __eq__(self, other) -> bool:
        return isinstance(other, AdaptiveClip) and other.get_config() == self.get_config()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.get_config().items())))

    def __repr__(self) -> str:
        stddev = "B/20" if self.count_stddev is None else f"{self.count_stddev:g}"
        return (f"AdaptiveClip(initial={self.initial:g}, target_quantile={self.target_quantile:g}, "
                f"learning_rate={self.learning_rate:g}, count_stddev={stddev})")


def combined_noise_multiplier(noise_multiplier: float, sensitivity: float,
                              count_noise_multiplier: Optional[float]) -> float:
    """The noise multiplier of one participation's pair (gradient of sensitivity ``s``
    under noise σ, count under σ_c): ``(s²/σ² + 1/σ_c²)^(−1/2)``; ``σ/s`` without counts."""
    if count_noise_multiplier is None:
        return noise_multiplier / sensitivity
    return 1.0 / math.sqrt((sensitivity / noise_multiplier) ** 2 + 1.0 / count_noise_multiplier ** 2)

