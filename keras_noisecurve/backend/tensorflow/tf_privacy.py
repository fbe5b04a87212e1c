"""The correlated noise of a mixing strategy as a TensorFlow Privacy ``DPQuery``
(``keras_noisecurve.integrations.tf_privacy``, TensorFlow only: TensorFlow Privacy is).

``BandedMatrixFactorizationQuery`` is a ``SumAggregationDPQuery``: each record (a
nested structure of tensors, e.g. one example's gradients) is clipped to global L2
norm ζ, records are summed, and ``get_noised_result`` adds ζσ·z̃_t, where
z̃ = C⁻¹Z is produced online by the SAME code as ``NoiseCurveOptimizer``
(``keras_noisecurve.training.noise``). With the same seed and C, step t of the
query adds exactly the noise the optimizer adds at step t (the flattened position
of a tensor in the record structure plays the role of the optimizer's variable index).

Every strategy kind works (``MixingMatrix``, ``ToeplitzMixing``, ``BLTMixing``,
``BISRMixing``: ``keras_noisecurve.training.noise.StreamNoise``, the optimizer's
generator). The global state holds the step counter, the int64 noise key and one
noise-state array per tensor (``mixing.buffers`` × the tensor's shape: the ring of
b − 1 past z̃ of a banded or Toeplitz C, the p − 1 past draws of BISR, the d
accumulators of BLT; an empty tensor without state); it is a plain nest of tensors,
so it can be checkpointed and carried through ``tf.function``.

Privacy accounting, two kinds of query:

- **made from a run** (:meth:`BandedMatrixFactorizationQuery.from_run`): the query stops at
  the run's T steps (``run.steps``; a step past it fails with ``InvalidArgumentError``, in
  a ``tf.function`` too, and nothing of that step is released; under XLA, which drops
  assertions, its result is NaN) and its events are the run's own: step t returns the
  part of the run's dominating event (:func:`keras_noisecurve.privacy.events.event_of`)
  that step t adds, so the events of steps 0 … t−1 compose to the run's event after t
  steps and their ε is ``run.epsilon(t)``. Cyclic Poisson: ``PoissonSampledDpEvent(q, GaussianDpEvent(σ/s))``
  at the first step of each participation (t mod b = 0), ``NoOpDpEvent()`` at the others.
  Fixed epochs: ``GaussianDpEvent(σ / √(Δ_k² − Δ_{k−1}²))`` at the first step of epoch k
  (Δ_k the sensitivity of k participations, s·√k for a banded C; Gaussians compose by
  adding 1/σ², so these compose to ``GaussianDpEvent(σ/Δ_k)``), ``NoOpDpEvent()`` at the
  others. The events include the run's sampling: do not wrap them in another
  ``PoissonSampledDpEvent``. Inside a ``tf.function`` the step is a symbolic tensor when
  the Python code runs, so where the event depends on the step (b > 1, or more than one
  step per epoch) it cannot be chosen there: the event is then ``UnsupportedDpEvent()``
  (an accountant refuses to compose it, as TF Privacy's own tree-aggregation queries do):
  account with :meth:`~BandedMatrixFactorizationQuery.step_event` or ``run.epsilon(t)``.
- **made without a run** (the constructor, from a ``MixingMatrix`` or another strategy):
  each call returns ``GaussianDpEvent(σ)``, and the query runs to C's T steps.
  Composing that event once per step is a valid (conservative) account only when every
  example participates at most once in any b consecutive steps, b the band width of C,
  with no amplification by sampling claimed: row t of C has entries of magnitude ≤ 1
  (unit columns) and then touches at most one participation, so it moves row t of CG
  by at most ζ. BLT and BISR C's are full lower-triangular (b = T): for them the
  condition is one participation in the whole run. The tight account (cyclic Poisson
  with b partitions, or several epochs with the sensitivity of all participations) is
  ``PrivateRun``'s: make the query with ``from_run``.

Needs TensorFlow Privacy, an optional extra (Python <= 3.11 only):
``pip install "keras-noisecurve[tf-privacy]"``. Without it, importing this module
raises an ``ImportError`` that says so.
"""

from __future__ import annotations

import collections

import numpy as np
import tensorflow as tf

from keras_noisecurve._validation import check_float
from keras_noisecurve.backend.tensorflow.tf_privacy_import import import_tf_privacy
from keras_noisecurve.mixing.strategies import load_mixing
from keras_noisecurve.training.noise import StreamNoise, key_from_seed

_dp_query = import_tf_privacy("privacy.dp_query.dp_query")

import dp_accounting  # noqa: E402  (after the tf-privacy import workaround)

__all__ = ["BandedMatrixFactorizationQuery"]


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


class BandedMatrixFactorizationQuery(_dp_query.SumAggregationDPQuery):
    """TF Privacy ``DPQuery``: clip records to ζ, sum, add ζσ·(C⁻¹Z)_t.

    Args:
      l2_norm_clip: ζ > 0, global L2 clipping norm of one record.
      noise_multiplier: σ ≥ 0 (noise std ζσ on the sum).
      mixing: anything ``keras_noisecurve.mixing.load_mixing`` reads: a ``MixingMatrix``,
        ``ToeplitzMixing``, ``BLTMixing`` or ``BISRMixing``, a path to a ``.npz`` file of
        one, its ``to_config()`` dict, or ``"dpsgd"``.
      template: the record structure: a nest of tensors/``tf.TensorSpec``s, or a
        list of shapes (float32). Tensor k of ``tf.nest.flatten(template)`` gets the
        noise of variable index k.
      seed: ``None`` (secret key from OS entropy, the default) or an int (tests and
        reproducibility only; weakens DP if known).

    ``get_noised_result`` fails once the T steps of the mixing matrix are used. A query
    made this way reports ``GaussianDpEvent(σ)`` at every step, which assumes what the
    module docstring says (at most one participation in any b consecutive steps, no
    amplification); :meth:`from_run` makes the query of a ``PrivateRun``, with its events.
    """

    _GlobalState = collections.namedtuple("_GlobalState", ["step", "key", "rings", "l2_norm_clip", "stddev"])

    def __init__(self, l2_norm_clip, noise_multiplier, mixing, template, seed=None):
        self._l2_norm_clip = check_float("l2_norm_clip", l2_norm_clip, positive=True)
        self._noise_multiplier = check_float("noise_multiplier", noise_multiplier, nonnegative=True)
        self._mixing = load_mixing(mixing)
        self._noise = StreamNoise.from_mixing(self._mixing)
        self._structure, self._specs = _template_specs(template)
        self._key = key_from_seed(seed)
        self._run_spec = None  # set by from_run: the plan's T and participation pattern

    @classmethod
    def from_run(cls, run, *, l2_norm_clip, template, seed=None) -> "BandedMatrixFactorizationQuery":
        """The query of a ``keras_noisecurve.PrivateRun``: its C and σ, its T steps and its events.

        Step t < ``run.steps`` adds the noise of step t; step ``run.steps`` (the first past the
        plan, whose ε covers ``run.steps`` noisy sums) fails with ``InvalidArgumentError``
        before anything is released, eagerly and in a ``tf.function`` (under XLA, which drops
        assertions, its result is NaN instead of the noisy sum). The event of step t
        is :meth:`step_event` (t): the events of steps 0 … t−1 compose to the run's event
        after t steps, whose ε is ``run.epsilon(t)`` (module docstring). Feed it the batches
        of ``run.dataset(...)``: the events describe that sampling, nothing else.

        Args:
          run: the ``PrivateRun``.
          l2_norm_clip, template, seed: as the constructor.
        """
        from keras_noisecurve.privacy.run import PrivateRun

        if not isinstance(run, PrivateRun):
            raise ValueError(f"run must be a keras_noisecurve.PrivateRun, got {type(run).__name__}.")
        if run.adaptive_clip is not None:
            raise ValueError(
                f"the run has an adaptive clip ({run.adaptive_clip!r}); this query clips at a fixed l2_norm_clip and "
                "has no count query, so its epsilon would not be the run's. Train it with NoiseCurveOptimizer(run=run) "
                "and a private model (keras_noisecurve.make_private), or give the run no adaptive_clip.")
        if getattr(run, "privacy_unit", "example") != "example":
            raise ValueError(
                f"the run's privacy unit is the {run.privacy_unit} (examples_per_user={run.examples_per_user}); this "
                "query clips each record TF Privacy's optimizers give it, one example or microbatch, so its epsilon "
                "would be per example, not per user. Train a user-level run with NoiseCurveOptimizer(run=run) and a "
                "private model (keras_noisecurve.make_private), which clip each user's rows as one.")
        query = cls(l2_norm_clip, run.noise_multiplier, run.mixing, template, seed=seed)
        query._run_spec = run.spec
        return query

    @property
    def steps(self):
        """The number of steps the query releases: the run's T (:meth:`from_run`), else C's
        (``None`` for an unlimited C = I, ``"dpsgd"``)."""
        return self._noise.steps if self._run_spec is None else self._run_spec.steps

    def step_event(self, step: int) -> dp_accounting.DpEvent:
        """The ``DpEvent`` step ``step`` (0-based) reports: for a query made from a run, the
        part of the run's event that the step adds (the events of steps 0 … t−1 compose to
        the run's event after t steps, ε = ``run.epsilon(t)``); otherwise ``GaussianDpEvent(σ)``.

        Raises ``ValueError`` for a step outside 0 … :attr:`steps` − 1.
        """
        limit = self.steps
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0 or (
                limit is not None and step >= limit):
            allowed = "an int >= 0" if limit is None else f"an int in 0 ... {limit - 1} (the plan has {limit} steps)"
            raise ValueError(f"step must be {allowed}; got {step!r}.")
        spec = self._run_spec
        if spec is None:
            return dp_accounting.GaussianDpEvent(self._noise_multiplier)
        if int(step) % spec.separation:
            return dp_accounting.NoOpDpEvent()  # no example's participation count grows
        if spec.sampling == "cyclic_poisson":
            return dp_accounting.PoissonSampledDpEvent(
                spec.sampling_probability, dp_accounting.GaussianDpEvent(self._noise_multiplier / spec.sensitivity))
        k = int(step) // spec.separation + 1  # the k-th participation of the fixed order's examples
        previous = spec.fixed_epoch_sensitivity(k - 1) if k > 1 else 0.0
        added = spec.fixed_epoch_sensitivity(k) ** 2 - previous**2
        if added <= 0.0:
            return dp_accounting.NoOpDpEvent()
        return dp_accounting.GaussianDpEvent(self._noise_multiplier / np.sqrt(added))

    def _event(self, step) -> dp_accounting.DpEvent:
        """The event of ``step`` (a tensor): known eagerly; in a graph only if every step's is equal."""
        if self._run_spec is None:
            return dp_accounting.GaussianDpEvent(self._noise_multiplier)
        value = tf.get_static_value(step)
        if value is not None:
            return self.step_event(int(value))
        if self._run_spec.separation == 1 and self._run_spec.participation_sensitivities is None:
            return self.step_event(0)  # every step adds the same event
        return dp_accounting.UnsupportedDpEvent()

    @property
    def noise(self) -> StreamNoise:
        """The shared online noise generator."""
        return self._noise

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
        if self._run_spec is None:
            return None
        steps = self._run_spec.steps
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
