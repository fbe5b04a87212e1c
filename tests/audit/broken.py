"""Deliberately broken variants of the real training path, for the audit self-tests ONLY.

Each is a test-side subclass, wrapper or monkeypatch of the library's own objects; the
library has no flag that produces any of them.
"""

from __future__ import annotations

import tensorflow as tf

import keras_noisecurve as knc
from keras_noisecurve.privacy.run_data import RunData
from keras_noisecurve.backend.tensorflow import optimizer as optimizer_module  # the TensorFlow update step
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


# ---------------------------------------------------------------- mechanism-check plants


def drop_layer_share(monkeypatch, rule):
    """One layer rule's per-example norm loses its layer's share (the rule's ``analyse``
    returns zeros for the squared norms and keeps its gradient function): that layer's
    gradients are then never clipped. ``rule``: a TensorFlow ``Rule`` class, or the kind (a
    string) of a family whose kernel is written once (``engine_forms.KernelRule``). Patched on the
    rule class, from outside."""
    from keras_noisecurve.backend.tensorflow.engine_forms import KernelRule

    rule_class = KernelRule if isinstance(rule, str) else rule
    original = rule_class.analyse

    def analyse(self, layer, *args, **kwargs):
        sq, grads = original(self, layer, *args, **kwargs)
        if isinstance(rule, str) and self.kind != rule:
            return sq, grads
        return tf.zeros_like(sq), grads

    monkeypatch.setattr(rule_class, "analyse", analyse)


def overlapping_fixed_epochs(monkeypatch):
    """A fixed-epochs sampler whose batch t starts at t·B/2 of the order instead of t·B:
    consecutive batches overlap by half, so examples take part twice as often as planned."""
    import numpy as np

    from keras_noisecurve.privacy.sampler import BatchSampler

    original = BatchSampler.batch

    def batch(self, t):
        if self.sampling != "fixed_epochs":
            return original(self, t)
        order = np.concatenate(self.partitions)
        start = (int(t) * max(1, self.batch_size // 2)) % order.size
        members = np.take(order, np.arange(start, start + self.batch_size), mode="wrap")
        indices = np.zeros(self.padded_size, np.int64)
        mask = np.zeros(self.padded_size, np.float32)
        indices[: members.size], mask[: members.size] = members, 1.0
        return indices, mask, 0

    monkeypatch.setattr(BatchSampler, "batch", batch)


def poisson_from_every_partition(monkeypatch):
    """A cyclic-Poisson sampler that draws every step from ALL examples (at rate q/b) instead of
    from partition t mod b: the expected batch is the same, but examples appear in steps of
    other partitions."""
    import numpy as np

    from keras_noisecurve.privacy.sampler import BatchSampler

    def batch(self, t):
        rng = np.random.default_rng([int(t), 99])
        chosen = np.flatnonzero(rng.random(self.num_examples) < self.sampling_probability / self.bands)
        chosen = chosen[: self.padded_size]
        indices = np.zeros(self.padded_size, np.int64)
        mask = np.zeros(self.padded_size, np.float32)
        indices[: chosen.size], mask[: chosen.size] = chosen, 1.0
        return indices, mask, 0

    monkeypatch.setattr(BatchSampler, "batch", batch)


class FrozenClipNoiseOptimizer(knc.NoiseCurveOptimizer):
    """An adaptive clip whose noise stays at ζ_0·σ while the clip ζ_t moves: the noise of the
    sum S_t/ζ_t is then σ·ζ_0/ζ_t, not the σ the run's ε assumes."""

    def _dp_noise_std(self, dtype):
        return self.l2_norm_clip * self.noise_multiplier
