"""The correlated noise of a mixing strategy as a TensorFlow Privacy ``DPQuery``
(TensorFlow only: TensorFlow Privacy is a TensorFlow library).

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

The query's arithmetic in TensorFlow (clip, sum, add the noise, its state) is the TensorFlow
backend's (``backend.module("tf_privacy").query_class()``); this module gives it the noise
generator, the key and the privacy events. On JAX importing this module raises an
``ImportError``: the optimizer draws the same noise there (``NoiseCurveOptimizer``).
"""

from __future__ import annotations

import numpy as np

from keras_noisecurve import backend as _backend
from keras_noisecurve._validation import check_float
from keras_noisecurve.mixing.strategies import load_mixing
from keras_noisecurve.training.noise import StreamNoise, key_from_seed

#: the backend's DPQuery class (TensorFlow Privacy's); on JAX an ImportError, saying why
_Query = _backend.module("tf_privacy").query_class()

import dp_accounting  # noqa: E402  (after the tf-privacy import workaround)

__all__ = ["BandedMatrixFactorizationQuery"]


class BandedMatrixFactorizationQuery(_Query):
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

    def __init__(self, l2_norm_clip, noise_multiplier, mixing, template, seed=None):
        l2_norm_clip = check_float("l2_norm_clip", l2_norm_clip, positive=True)
        noise_multiplier = check_float("noise_multiplier", noise_multiplier, nonnegative=True)
        self._mixing = load_mixing(mixing)
        super().__init__(l2_norm_clip, noise_multiplier, StreamNoise.from_mixing(self._mixing), template)
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

    def _event_at(self, step) -> dp_accounting.DpEvent:
        """The event of step ``step`` (an int, known eagerly; ``None`` in a graph, where it is known
        only if every step's is equal)."""
        if self._run_spec is None:
            return dp_accounting.GaussianDpEvent(self._noise_multiplier)
        if step is not None:
            return self.step_event(step)
        if self._run_spec.separation == 1 and self._run_spec.participation_sensitivities is None:
            return self.step_event(0)  # every step adds the same event
        return dp_accounting.UnsupportedDpEvent()

    @property
    def _run_steps(self):
        """The run's T, past which a step fails (``None`` for a query made without a run)."""
        return None if self._run_spec is None else self._run_spec.steps

    @property
    def noise(self) -> StreamNoise:
        """The shared online noise generator."""
        return self._noise

