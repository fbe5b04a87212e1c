"""TensorFlow Privacy's ``DPQuery`` for the correlated noise of a mixing strategy: the
TensorFlow half of ``keras_noisecurve.integrations.tf_privacy.BandedMatrixFactorizationQuery``,
whose docstring says what the query releases and how it is accounted.

:class:`NoiseQuery` is a ``SumAggregationDPQuery``: each record (a nested structure of tensors,
e.g. one example's gradients) is clipped to global L2 norm ζ, records are summed, and
``get_noised_result`` adds ζσ·z̃_t from the online noise generator it is given (the
optimizer's, ``StreamNoise``, made on the neutral side with the strategy and the key). The
global state holds the step counter, the int64 noise key and one noise-state array per tensor
(the generator's ``state_shape`` of the tensor's shape; an empty tensor without state); it is
a plain nest of tensors, so it can be checkpointed and carried through ``tf.function``. What
the query reports (its steps, its privacy events) is the neutral subclass's.

Needs TensorFlow Privacy, an optional extra (Python <= 3.11 only):
``pip install "keras-noisecurve[tf-privacy]"``. Without it, importing this module
raises an ``ImportError`` that says so.
"""

from __future__ import annotations

import collections

import numpy as np
import tensorflow as tf

from keras_noisecurve.backend.tensorflow.tf_privacy_import import import_tf_privacy

_dp_query = import_tf_privacy("privacy.dp_query.dp_query")

__all__ = ["query_class"]


def _is_shape(t) -> bool:
    return isinstance(t, (tuple, list, tf.TensorShape)) and all(isinstance(d, (int, np.integer)) for d in t)


def _template_specs(template):
    """(structure, TensorSpecs) of a template: a list of shapes, or a nest of tensors/specs/arrays."""
    if isinstance(template, (tuple, list)) and template and all(_is_shape(t) for t in template):
        specs = [tf.TensorSpec(tf.TensorShape(t), tf.float32) for t in template]
        return specs, specs
    flat = tf.nest.flatten(template)
    if not flat:
        raise ValueError(f"template must hold at least one tensor, shape or TensorSpec; got {template!r}.")
    specs = []
    for i, t in enumerate(flat):
        if not isinstance(t, tf.TensorSpec):
            t = tf.convert_to_tensor(t)
            t = tf.TensorSpec(t.shape, t.dtype)
        if not t.shape.is_fully_defined():
            raise ValueError(f"template entry {i} must have a fully defined shape, got {t.shape}.")
        specs.append(t)
    return tf.nest.pack_sequence_as(template, specs), specs


def query_class() -> type:
    """The TensorFlow Privacy ``DPQuery`` class the public query subclasses: :class:`NoiseQuery`."""
    return NoiseQuery


class NoiseQuery(_dp_query.SumAggregationDPQuery):
    """TF Privacy ``DPQuery``: clip records to ζ, sum, add ζσ·z̃_t.

    Args:
      l2_norm_clip: ζ (checked by the caller).
      noise_multiplier: σ (checked by the caller).
      noise: the online noise generator (``keras_noisecurve.training.noise.StreamNoise``):
        tensor k of ``tf.nest.flatten(template)`` gets the noise of variable index k.
      template: the record structure: a nest of tensors/``tf.TensorSpec``s, or a
        list of shapes (float32).

    The subclass sets ``_key`` (the int64 (2,) noise key) and gives ``steps`` (the steps the
    query releases, ``None``: unlimited), ``_run_steps`` (a run's T, past which a step fails,
    or ``None``) and ``_event_at(step)``, the ``DpEvent`` of step ``step`` (an int, or ``None``
    for a step not known when the graph is traced).
    """

    _GlobalState = collections.namedtuple("_GlobalState", ["step", "key", "rings", "l2_norm_clip", "stddev"])

    def __init__(self, l2_norm_clip, noise_multiplier, noise, template):
        self._l2_norm_clip = l2_norm_clip
        self._noise_multiplier = noise_multiplier
        self._noise = noise
        self._structure, self._specs = _template_specs(template)

    def _event(self, step):
        """The event of ``step`` (a tensor): its value where it is known (eagerly)."""
        value = tf.get_static_value(step)
        return self._event_at(None if value is None else int(value))

    def initial_global_state(self):
        rings = []
        for s in self._specs:
            shape = self._noise.state_shape(s.shape)
            rings.append(tf.zeros([0], s.dtype) if shape is None else tf.zeros(shape, s.dtype))
        return self._GlobalState(
            step=tf.constant(0, tf.int64),
            key=tf.constant(self._key, tf.int64),
            rings=tuple(rings),
            l2_norm_clip=tf.constant(self._l2_norm_clip, tf.float32),
            stddev=tf.constant(self._l2_norm_clip * self._noise_multiplier, tf.float32),
        )

    def derive_sample_params(self, global_state):
        return global_state.l2_norm_clip

    def initial_sample_state(self, template=None):
        """Zeros shaped like ``template`` (default: the template given at construction)."""
        if template is None:
            return tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), self._structure)
        return super().initial_sample_state(template)

    def preprocess_record(self, params, record):
        """Clip the record's global L2 norm to ζ (``tf.clip_by_global_norm``)."""
        flat = tf.nest.flatten(record)
        clipped, _ = tf.clip_by_global_norm(flat, params)
        return tf.nest.pack_sequence_as(record, clipped)

    def get_noised_result(self, sample_state, global_state):
        """Sum + ζσ·z̃_t for every tensor; advances the step and the noise state."""
        flat = tf.nest.flatten(sample_state)
        if len(flat) != len(self._specs):
            raise ValueError(f"sample_state has {len(flat)} tensors, the template {len(self._specs)}.")
        step = global_state.step
        checks = [self._assert_in_run(step), self._noise.assert_in_plan(step)]
        checks = [op for op in checks if op is not None]
        results, rings = [], []
        with tf.control_dependencies(checks):
            for k, (value, ring) in enumerate(zip(flat, global_state.rings)):
                has_state = self._noise.buffers > 0
                z_tilde, new_state = self._noise.sample(
                    global_state.key, step, k, value.shape, dtype=value.dtype, state=ring if has_state else None
                )
                results.append(value + tf.cast(global_state.stddev, value.dtype) * z_tilde)
                rings.append(new_state if has_state else ring)
            next_step = step + 1
            if self.steps is not None:  # XLA drops assertions: past the plan the result is NaN, not the sum
                in_plan = step < tf.constant(self.steps, step.dtype)
                results = [tf.where(in_plan, r, tf.constant(float("nan"), r.dtype)) if r.dtype.is_floating else r
                           for r in results]
        new_state = global_state._replace(step=next_step, rings=tuple(rings))
        return tf.nest.pack_sequence_as(sample_state, results), new_state, self._event(step)

    def _assert_in_run(self, step):
        """An op that fails when ``step >= run.steps`` (query made from a run; ``None`` otherwise)."""
        steps = self._run_steps
        if steps is None:
            return None
        return tf.debugging.assert_less(
            step, tf.constant(steps, step.dtype),
            message=(f"the PrivateRun of this query plans T = {steps} steps and its epsilon covers {steps} noisy sums: "
                     "refusing to release a sum past the plan (the step counter of the global state is at T). "
                     "Make a PrivateRun with more steps (and a mixing matrix of at least as many) for a longer run."))

    def derive_metrics(self, global_state):
        return collections.OrderedDict(
            step=global_state.step,
            l2_norm_clip=global_state.l2_norm_clip,
            noise_stddev=global_state.stddev,
        )
