"""Deliberately broken variants of the real training path, for the audit self-tests ONLY.

Each is a test-side subclass, wrapper or monkeypatch of the library's own objects; the
library has no flag that produces any of them.
"""

from __future__ import annotations

import tensorflow as tf

import keras_noisecurve as knc
from keras_noisecurve.privacy.run_data import RunData
from keras_noisecurve.training import optimizer as optimizer_module
from keras_noisecurve.training.noise import StateWrite, StreamNoise


class ScaledNoiseOptimizer(knc.NoiseCurveOptimizer):
    """Adds ζ·(factor·σ)·z̃_t while the run (and its ε) still says σ."""

    factor = 0.5

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.noise_multiplier = self.noise_multiplier * self.factor


class _ForwardC(StreamNoise):
    """z̃ = C·z instead of C⁻¹·z for a banded or Toeplitz C: z̃_t = Σ_j C[t, t−j]·z_{t−j},
    the ring holding past DRAWS z (slot layout as the library's rings)."""

    def advance(self, z, step, state=None, coefficients=None):
        if coefficients is None:
            coefficients = self.step_coefficients(step, z.dtype)
        if self.buffers == 0:
            return z * coefficients.lead, None
        past = tf.tensordot(coefficients.mix, state, axes=1)
        return coefficients.lead * z + past, StateWrite(coefficients.slot, z)


class ForwardCOptimizer(knc.NoiseCurveOptimizer):
    """The C⁻¹ recurrence replaced by C."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._noise = _ForwardC(self._mixing.stream())


class IndependentNoiseOptimizer(knc.NoiseCurveOptimizer):
    """C⁻¹ replaced by I (independent noise) with the σ calibrated for the banded C."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._noise = StreamNoise(knc.MixingMatrix.identity(self._mixing.steps).stream())


def skip_clipping(private):
    """``model_hook``: the clipping engine runs with a clip norm of 10⁹ (no clipping) while
    the noise is still scaled by the real ζ."""
    engine = private._engine()

    def unclipped(*args, l2_norm_clip, **kwargs):
        return engine(*args, l2_norm_clip=1e9, **kwargs)

    private._dp_engine = unclipped


def two_replica_noise(monkeypatch):
    """Different noise on two replicas whose updates are averaged: every noise draw becomes
    the mean of two independent draws (seeds ``seed`` and ``fold_in(seed, 1234)``), i.e.
    standard deviation σ/√2. Simulated at the level of the noise stream."""
    draw = optimizer_module.normal_from_seed

    def averaged(seed, shape, dtype=tf.float32, scale=None):
        other = tf.random.experimental.stateless_fold_in(seed, tf.constant(1234, tf.int64))
        return 0.5 * (draw(seed, shape, dtype, scale=scale) + draw(other, shape, dtype, scale=scale))

    monkeypatch.setattr(optimizer_module, "normal_from_seed", averaged)


class _DuplicatedBatches(RunData):
    """The run's examples, whose batches each hold the plan's batch twice."""

    def batches(self, optimizer=None, *, input_context=None):
        def twice(bx, by, bm, step):
            return ({k: tf.concat([v, v], 0) for k, v in bx.items()}, tf.concat([by, by], 0),
                    tf.concat([bm, bm], 0), tf.concat([step, step], 0))

        return super().batches(optimizer, input_context=input_context).map(twice)


def duplicated_batches(run, x, y):
    """``dataset_factory``: every batch of the plan is processed twice in the same step (an
    input pipeline that is not sharded across two workers, each summing the whole global
    batch): each participating example enters the clipped sum twice. The fault sits inside
    the pipeline, where fit's check of the data (a ``RunData`` of the run) cannot see it."""
    return _DuplicatedBatches(run, x, y)


def reset_noise_state_on_resume(private):
    """``model_hook``: after a resume the noise state (ring / BLT buffers) starts from
    zeros instead of the saved values, as if one path forgot to restore it."""
    optimizer = private.optimizer
    if optimizer.built and int(optimizer.iterations.numpy()) > 0:
        for state in optimizer._rings:
            if state is not None:
                state.assign(tf.zeros_like(state))
