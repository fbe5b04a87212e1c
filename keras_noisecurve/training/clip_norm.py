"""The clip norm of ``NoiseCurveOptimizer``: a fixed ζ, or an adaptive clip's ζ_t
(``keras_noisecurve.AdaptiveClip``), a float32 optimizer variable updated after each step
from the step's private count query (docs/privacy.md, "Adaptive clipping").

Neutral code (``keras.ops``); the count's N(0, 1) draw is the backend optimizer's
``_dp_count_normal(stream)``.
"""

from __future__ import annotations

import keras

__all__ = ["ClipNorm"]


class ClipNorm:
    """The clip-norm half of ``NoiseCurveOptimizer`` (it sets ``l2_norm_clip``, ``adaptive_clip``
    and ``_clip = None`` in ``__init__``; ``build`` calls :meth:`_dp_build_clip`)."""

    def _dp_build_clip(self):
        """Create ζ_t's variable (float32 scalar ``l2_norm_clip``, starting at ζ_0) for an adaptive clip."""
        if self.adaptive_clip is None:
            return
        self._dp_check_adaptive_replicas()
        self._clip = self.add_variable(
            shape=(), dtype="float32", name="l2_norm_clip",
            initializer=lambda shape, dtype=None: keras.ops.convert_to_tensor(self.adaptive_clip.initial, "float32"))

    def current_clip(self):
        """ζ_t, the clip norm of the next step: ``l2_norm_clip`` (a float), or an adaptive
        clip's current value (a float32 scalar variable of the backend). An adaptive clip's
        optimizer must be built first (``ValueError``): a step traced before would clip at a
        constant ζ_0 while its noise follows ζ_t."""
        if self.adaptive_clip is None:
            return self.l2_norm_clip
        if self._clip is None:
            raise ValueError(
                f"optimizer {self.name!r} has an adaptive clip and is not built yet: its clip norm is a variable that "
                "build() creates. Call optimizer.build(model.trainable_variables) before reading current_clip() or "
                "tracing a step with it (a step traced with a constant clip would not follow the clip's updates).")
        return self._clip.value

    def clip_value(self, optimizer_variables):
        """ζ_t read from the values of ``self.variables`` (a functional step's
        ``optimizer_variables``, e.g. under ``jax.jit``), as :meth:`current_clip` reads the
        variables; the float ``l2_norm_clip`` for a fixed clip."""
        if self.adaptive_clip is None:
            return self.l2_norm_clip
        if self._clip is None:
            self.current_clip()  # refuses an unbuilt optimizer
        return optimizer_variables[[id(v) for v in self.variables].index(id(self._clip))]

    def _dp_noise_std(self, dtype):
        """ζ_t·σ, the noise's standard deviation: a Python float for a fixed clip, the clip
        variable's value times σ in ``dtype`` for an adaptive clip."""
        if self._clip is None:
            return self.l2_norm_clip * self.noise_multiplier
        return keras.ops.cast(self._clip.value, dtype) * keras.ops.cast(self.noise_multiplier, dtype)

    def _dp_clip_update(self, norms, sample_weight, keep_clip=None):
        """ζ_{t+1} of an adaptive clip from this step's norms (its count query, drawn at step
        t = ``iterations``), or ``None`` for a fixed clip; assigned after the step's update.
        ``keep_clip`` (bool scalar): where true ζ stays (a step refused for reasons that do
        not depend on the data: its batch must not move ζ either)."""
        if self.adaptive_clip is None:
            return None
        if norms is None:
            raise ValueError(
                "this optimizer has an adaptive clip: apply_clipped_sum needs the step's per-example norms "
                "(norms=, and sample_weight= with the padding rows at weight 0) for its count query, and the sum "
                "must be clipped at optimizer.current_clip() (clip_value(optimizer_variables) in a functional "
                "step), not at l2_norm_clip, which is the first step's zeta_0.")
        from keras_noisecurve.privacy.adaptive_clip import COUNT_STREAM, clip_count

        clip = self._clip.value
        below, real = clip_count(norms, sample_weight, clip)
        updated = self.adaptive_clip.next_clip(clip, below, real, self._dp_count_normal(COUNT_STREAM),
                                               int(self.expected_batch_size))
        if keep_clip is not None:
            updated = keras.ops.where(keep_clip, keras.ops.cast(clip, "float32"), updated)
        return updated
