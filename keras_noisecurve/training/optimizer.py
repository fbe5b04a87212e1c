"""``NoiseCurveOptimizer``: the Keras 3 optimizer of private training, one class for
every mixing strategy C: C = I (DP-SGD, the default), DP-BandMF, NoiseCurve, BLT, BISR.
docs/training.md, "DP-SGD", says how to ask for each.

Update rule (docs/design.md#update-rule, paper App. C), at step
t = ``optimizer.iterations``::

    ĝ_t = (Σ_i clip(g_i, ζ) + ζ·σ·z̃_t) / B          B = expected batch size
    w   ← w − η·ĝ_t                                   inner=None: plain SGD
    inner.update_step(ĝ_t, w, η_t)                    inner=<a Keras optimizer>

with z̃_t = (C⁻¹Z)_t computed online (``keras_noisecurve.training.noise.StreamNoise``).
The optimizer receives the CLIPPED SUM Σ_i clip(g_i, ζ) (from a private model or a
clipping engine) through :meth:`NoiseCurveOptimizer.apply_clipped_sum`; the ordinary
``apply``/``apply_gradients`` entry points refuse to run, so a plain ``keras.Model``
can never train through it without per-example clipping.

Privatization ends at ĝ_t: with ``inner=`` (momentum SGD, Adam, AdamW, …) the inner
optimizer post-processes ĝ_t exactly as Keras would a gradient (its slots, its
learning rate or schedule at its ``iterations``, which advance with ours, and its
weight decay), which costs no privacy. Construction warns once when the optimizer
runs another update than the one C was optimised for (``update_rule_check.py``).

As Keras's own optimizers: ``__init__`` validates the arguments (``optimizer_args.py``),
``build()`` creates the slot variables (noise key, the run's sampling key, one noise
state per model variable), ``update_step()`` is the per-variable update and
``get_config``/``from_config`` round-trip the configuration.

Refused: clipping of the noisy sum or mean (``clipnorm``/``clipvalue``/``global_clipnorm``,
here or on the inner: per-example clipping is ``l2_norm_clip``), EMA, loss scaling and
gradient accumulation (one optimizer step must be one noisy step of the privacy
plan), and ``weight_decay`` on this optimizer (give it to the inner optimizer, e.g.
``keras.optimizers.AdamW``).
"""

from __future__ import annotations

import warnings

import keras
import numpy as np

from keras_noisecurve import _compat
from keras_noisecurve import backend as _backend
from keras_noisecurve.mixing.strategies import load_mixing
from keras_noisecurve.privacy import plan_state
from keras_noisecurve.privacy.secrets import fixed_seed_warning, warn_keys_written
from keras_noisecurve.training.clip_norm import ClipNorm
from keras_noisecurve.training.noise import StreamNoise, key_from_seed
from keras_noisecurve.training.optimizer_args import (
    IGNORED_DEFAULTS,
    REFUSED,
    check_backend,
    check_inner,
    check_kwargs,
    check_learning_rate,
    check_noise_arguments,
    resolve_clip,
    from_run,
)
from keras_noisecurve.training.update_rule_check import update_rule_warning

__all__ = ["NoiseCurveOptimizer"]

_PACKAGE = "keras_noisecurve"

# the backend's half of the optimizer (slot variables, per-step noise, per-variable
# update): keras_noisecurve.backend.<backend>.optimizer.OptimizerBackend, picked once
_impl = _backend.module("optimizer")


def _key_as(value, shape):
    """A saved key (int64 (2,) or int32 (4,), the same bits) in the layout ``shape`` of this
    backend's key variable; unchanged when it already has it, refused when it has neither."""
    value = np.ascontiguousarray(value)
    if value.shape == shape:
        return value
    if shape == (4,) and value.shape == (2,):
        return value.astype(np.int64).view(np.int32)
    if shape == (2,) and value.shape == (4,):
        return value.astype(np.int32).view(np.int64)
    raise ValueError(f"a saved noise or sampling key has shape {value.shape}; this optimizer's key variable has "
                     f"shape {shape} (an int64 (2,) key or its int32 (4,) words are allowed).")


class _Overlay:
    """A Keras variable store with some entries replaced (read-only, as loading reads it)."""

    def __init__(self, store, replaced):
        self._store, self._replaced = store, replaced

    def keys(self):
        return self._store.keys()

    def __getitem__(self, key):
        return self._replaced[key] if key in self._replaced else self._store[key]

    def __len__(self):
        return len(self._store.keys())


@keras.saving.register_keras_serializable(package=_PACKAGE)
class NoiseCurveOptimizer(ClipNorm, _impl.OptimizerBackend, keras.optimizers.Optimizer):
    """Private SGD with the noise z̃_t = (C⁻¹Z)_t of a mixing strategy C (C = I: DP-SGD).

    ``ĝ_t = (Σ_i clip(g_i, ζ) + ζ·σ·z̃_t) / B`` (docs/design.md#update-rule; paper
    App. C), with z̃ computed online from ``mixing.buffers`` state arrays per variable
    (``keras_noisecurve.training.noise.StreamNoise``: the ring of b − 1 past values of a
    banded or Toeplitz C, the p − 1 past draws of BISR, the d accumulators of BLT; no
    state for C = I), then ``w ← w − η·ĝ_t`` or the update of the ``inner`` Keras
    optimizer.

    Two ways to make one:

    - ``NoiseCurveOptimizer(run=run, learning_rate=...)`` (the documented way): C, σ
      and B are the ``keras_noisecurve.PrivateRun``'s (given ones must agree), the
      run's secret sampling key becomes the optimizer variable ``sampling_key`` (saved
      and restored with ``iterations`` and the noise state), and ``run.dataset(x, y)``
      trains at this optimizer's step. A model compiled with it trains only on
      ``run.dataset(...)``: ``fit`` refuses arrays and any other dataset before the
      first step. The run never refers back to the optimizer.
    - ``NoiseCurveOptimizer(mixing=..., noise_multiplier=σ, expected_batch_size=B, ...)``:
      the LOW-LEVEL piece for custom loops that do their own sampling and accounting:
      nothing checks that the batches follow the sampling the accounting assumed, and
      nothing restores a sampler's position on resume.

    Args:
      learning_rate: η > 0 (float) or a ``keras.optimizers.schedules.LearningRateSchedule``;
        required without ``inner`` (no default: ``None`` raises ``ValueError``). Must be
        left out with ``inner`` (the inner optimizer's is used).
      mixing: the strategy C, anything ``keras_noisecurve.mixing.load_mixing`` reads: a
        ``MixingMatrix`` (T steps, b bands; ``MixingMatrix.identity(T)`` is DP-SGD with a
        plan of T steps), a ``ToeplitzMixing``, ``BLTMixing`` or ``BISRMixing``, the path
        of a ``.npz`` file of any of them, the config dict ``get_config`` writes, or
        ``"dpsgd"``/``None`` (default): C = I without a step plan (independent noise,
        no step limit). Training refuses step t ≥ T of a C with a plan.
      l2_norm_clip: ζ > 0, the per-example L2 clipping norm (used by the private model), or
        a ``keras_noisecurve.AdaptiveClip``: step t clips at ζ_t and adds ζ_t·σ·z̃_t, and
        ζ follows a private quantile of the norms (``apply_clipped_sum`` then needs the
        norms). ``None`` (default): the run's adaptive clip if it has one, else 1.0. An
        adaptive clip with ``run=`` must be the run's (its ε includes the count queries).
      noise_multiplier: σ > 0 (σ = 0 would be no privacy: refused), required (no default; with ``run=`` the run's); the noise
        standard deviation is ζ·σ on the sum.
      expected_batch_size: B ≥ 1, the EXPECTED batch size of the (Poisson) sampler.
        The sum is divided by B, never by the actual batch size (which would leak it).
      seed: ``None`` (default): a secret noise key from OS entropy. An integer makes
        the noise reproducible, for tests only: knowing it voids the privacy guarantee.
      name: optimizer name.
      inner: ``None`` (default: plain SGD, ``w ← w − η·ĝ_t``) or a fresh Keras optimizer
        (``keras.optimizers.SGD(η, momentum=β)``, ``Adam``, ``AdamW``, …) created in the
        same ``tf.distribute`` scope. Each step hands it the privatized mean ĝ_t through
        its ``update_step(ĝ_t, w, η_t)``; its ``iterations`` advance with this optimizer's,
        its learning rate (or schedule) and weight decay apply, and
        ``optimizer.learning_rate`` reads and sets its learning rate. Refused
        (``ValueError``): a private optimizer, a ``LossScaleOptimizer``, an inner
        optimizer with clipnorm/clipvalue/global_clipnorm, use_ema,
        gradient_accumulation_steps or loss_scale_factor, one from another
        distribution strategy, or one already built on other variables.
      run: a ``keras_noisecurve.PrivateRun``, or ``None`` (see above).

    No clipnorm/clipvalue/global_clipnorm, EMA, loss scaling, gradient accumulation or
    ``weight_decay`` on this optimizer (each raises ``ValueError``; weight decay belongs
    to the inner optimizer).

    Construction warns once (``UserWarning``) when the update the optimizer runs differs
    from the one C was optimised for, ``mixing.metadata["update_rule"]`` (absent: plain
    SGD with a constant learning rate; ``keras_noisecurve.UpdateRule``): the momentum
    and Nesterov flag of an inner ``keras.optimizers.SGD`` (0 without inner), its
    learning rates at steps 0 … T−1 (schedule shape, and the base rate against
    ``mixing.metadata["learning_rate"]`` where the objective recorded one), or an inner
    optimizer that is not SGD at all. C = I never warns.
    """

    def __init__(
        self,
        learning_rate=None,
        mixing=None,
        l2_norm_clip=None,
        noise_multiplier=None,
        expected_batch_size=None,
        seed=None,
        name="noisecurve_optimizer",
        inner=None,
        run=None,
        **kwargs,
    ):
        if run is not None:
            mixing, noise_multiplier, expected_batch_size = from_run(run, mixing, noise_multiplier,
                                                                     expected_batch_size)
        mixing = load_mixing("dpsgd" if mixing is None else mixing)
        l2_norm_clip, adaptive_clip = resolve_clip(l2_norm_clip, run)
        check_backend()
        kwargs = check_kwargs(dict(kwargs))
        l2_norm_clip, noise_multiplier, expected_batch_size, seed = check_noise_arguments(
            l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size, seed=seed,
        )
        if inner is not None:
            check_inner(inner, NoiseCurveOptimizer)
        learning_rate = check_learning_rate(learning_rate, inner)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        if inner is not None:
            self._dp_check_inner_strategy(inner)
        self._inner = inner
        self.l2_norm_clip = l2_norm_clip  # ζ, or ζ_0 of an adaptive clip
        self.adaptive_clip = adaptive_clip
        self._clip = None  # ζ_t (float32 scalar variable) of an adaptive clip, made by build()
        self.noise_multiplier = noise_multiplier
        self.expected_batch_size = expected_batch_size
        self.seed = seed
        self._mixing = mixing
        self._noise = StreamNoise.from_mixing(mixing)
        self._initial_key = key_from_seed(seed)
        self._run = run
        self._sampling_key = None
        self._private_apply = False
        self._step_noise = None  # _StepNoise while one step's updates are built
        self._plan = None  # the plan words variable (plan_state), made by build()
        self._pending_plan = {}  # {field: word} bound before build (data, model)
        if seed is not None:
            fixed_seed_warning("NoiseCurveOptimizer", "noise")
        # the variables of an unbuilt optimizer (step counter, learning rate; the inner's too)
        self._dp_unbuilt_count = len(self.variables)
        message = update_rule_warning(mixing, inner, _compat.learning_rate_value(self))
        if message is not None:
            warnings.warn(message, UserWarning, stacklevel=2)

    # ------------------------------------------------------------- noise source
    @property
    def mixing(self):
        """The mixing strategy: a ``MixingMatrix`` (banded), ``ToeplitzMixing``, ``BLTMixing``,
        ``BISRMixing`` or ``IdentityMixing`` (C = I, the default; ``"dpsgd"`` loads it)."""
        return self._mixing

    @property
    def run(self):
        """The ``PrivateRun`` this optimizer was made for, or ``None``."""
        return getattr(self, "_run", None)

    @property
    def sampling_key(self):
        """The run's secret sampling key (int64 (2,) variable, saved with the optimizer),
        or ``None`` without a run or before ``build``."""
        return self._sampling_key

    def sampling_position(self):
        """``(step, key)``: where the run's batches continue, the next step
        ``iterations`` and the sampling key (int64 (2,), secret); ``(0, run's key)``
        before ``build`` (the key ``build`` will store). Read by the dataset of
        ``run.dataset(x, y).batches(optimizer)`` each time it is iterated."""
        if self.run is None:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} was not created for a PrivateRun: it has no sampling "
                "position. Create it with NoiseCurveOptimizer(run=run, ...)."
            )
        if not self.built or self._sampling_key is None:
            return 0, self.run.initial_key()
        return self._dp_read_position()

    @property
    def noise(self) -> StreamNoise:
        """The online noise generator (``keras_noisecurve.training.noise.StreamNoise``)."""
        return self._noise

    def noise_state_bytes(self) -> int:
        """Bytes of the noise state, ``mixing.buffers`` × parameters × dtype size (0 for
        DP-SGD); the optimizer must be built."""
        if not self.built:
            return 0
        return int(sum(np.prod(r.shape) * np.dtype(r.dtype).itemsize for r in self._rings if r is not None))

    # ------------------------------------------------------------------ the plan
    def _dp_expected_plan(self) -> np.ndarray:
        """The plan words (``plan_state.words``) of this optimizer: the run's plan and ζ, or
        for an optimizer without a run its C, σ, B and ζ; ``data``/``model`` as bound."""
        run = self.run
        clip = float(self.l2_norm_clip) if self.adaptive_clip is None else self.adaptive_clip.to_config()
        facts = {"mixing": self._mixing.digest(), "noise_multiplier": float(self.noise_multiplier),
                 "batch_size": int(self.expected_batch_size), "l2_norm_clip": clip}
        if run is not None:
            facts.update(num_examples=run.num_examples, steps=run.steps, delta=run.delta, sampling=run.sampling,
                         accountant=run.accountant, padded_batch_size=run.padded_batch_size)
        expected = plan_state.words(facts)
        for name, value in self._pending_plan.items():
            expected[plan_state.FIELDS.index(name)] = value
        return expected

    def saved_plan(self) -> np.ndarray:
        """The plan words in the optimizer's state (int32 (fields,); restored with its step),
        or the expected ones before ``build``."""
        if self._plan is None:
            return self._dp_expected_plan()
        return np.asarray(keras.ops.convert_to_numpy(self._plan.value), dtype=np.int32)

    def check_plan(self, *, data=None, model=None) -> None:
        """Refuse (``ValueError``) to continue a state saved under another plan: the saved
        plan words (restored with the step by any route) against this optimizer's, and,
        where given, the words of the training examples (``data``, in order) and of the
        model and loss (``model``), which the first private fit binds. Host-side, once per
        ``fit`` or custom loop: no cost per step."""
        bind = {name: int(w) for name, w in (("data", data), ("model", model)) if w}
        expected = self._dp_expected_plan()
        for name, value in bind.items():
            expected[plan_state.FIELDS.index(name)] = value
        if self._plan is None:  # not built: build() starts from these words
            self._pending_plan.update(bind)
            return
        saved = self.saved_plan()
        step = int(keras.ops.convert_to_numpy(self.iterations.value))
        differ = plan_state.differences(saved, expected)
        if differ:
            raise ValueError(plan_state.refusal(differ, step=step, plan=repr(self.run or self)))
        unbound = [plan_state.FIELDS.index(name) for name in bind if not saved[plan_state.FIELDS.index(name)]]
        if self.seed is None and step == 0:
            current = np.asarray(keras.ops.convert_to_numpy(self._noise_key.value))
            fresh = getattr(self, "_dp_fresh_noise_key", None)
            if fresh is not None and not np.array_equal(current, fresh):
                raise ValueError(
                    "this optimizer's noise key was restored from a file saved before its first private step: "
                    "every run started from that file draws the same noise, so two of them (e.g. on the data "
                    "before and after a deletion) release their difference without noise. Start a run from a "
                    "fresh optimizer (load only the model's weights: private.inner.load_weights(...)).")
        if unbound:
            saved[unbound] = expected[unbound]
            self._plan.assign(saved)

    # ------------------------------------------------------------ inner optimizer
    @property
    def inner(self):
        """The Keras optimizer that receives the privatized gradient ĝ_t, or ``None`` (plain SGD)."""
        return getattr(self, "_inner", None)

    @property
    def learning_rate(self):
        """The current learning rate: the inner optimizer's when there is one."""
        inner = self.inner
        if inner is not None:
            return inner.learning_rate
        return _compat.current_learning_rate(self)

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        inner = self.inner
        if inner is not None:
            inner.learning_rate = learning_rate
        else:
            keras.optimizers.Optimizer.learning_rate.fset(self, learning_rate)

    @property
    def variables(self):
        """This optimizer's variables, then the inner optimizer's (as ``LossScaleOptimizer``)."""
        inner = self.inner
        return _compat.optimizer_variables(self)[:] + (inner.variables if inner is not None else [])

    def save_own_variables(self, store):
        """Keras's, and a ``UserWarning`` naming the file: the optimizer's variables hold the
        run's secret noise key and sampling key (``.keras``, ``.weights.h5``,
        ``ModelCheckpoint``, ``BackupAndRestore``); once per file and process."""
        super().save_own_variables(store)
        if self.built:  # an unbuilt optimizer writes no variable, so no key
            warn_keys_written(store, sampling=self._sampling_key is not None)

    def load_own_variables(self, store):
        """Keras's loading of a ``.keras`` file's optimizer variables, across backends: the keys
        are int64 (2,) on TensorFlow and the same bits as int32 (4,) words on JAX (little-endian
        halves), so a file written on one backend resumes on the other with the same noise key
        and sampling key (every other variable has the same shape on both)."""
        keys = [k for k in (getattr(self, "_noise_key", None), getattr(self, "_sampling_key", None)) if k is not None]
        if len(store.keys()) == getattr(self, "_dp_unbuilt_count", -1):
            # saved before it was built (its step counter and learning rate only): no private
            # step, no key, nothing to restore; the rate is the config's
            return None
        if len(store.keys()) != len(self.variables):
            # Keras would warn and skip: the weights would load while the step count, the keys
            # and the plan words restart, and epsilon would forget the steps the weights carry
            raise ValueError(
                f"the file's state of optimizer {self.name!r} has {len(store.keys())} variables, this optimizer "
                f"{len(self.variables)}{' (not built yet)' if not self.variables else ''}: it was written for "
                "another model or optimizer, or by another version of keras_noisecurve. Restoring the weights "
                "without the step count, keys and plan would report an epsilon that ignores the private steps "
                "the weights carry. Build the model and call optimizer.build(model.trainable_variables) before "
                "loading, with the model and run the file was written with, or start a new run from fresh weights.")
        if not keys:
            return super().load_own_variables(store)
        converted = {}
        for i, variable in enumerate(self.variables):
            if any(variable is k for k in keys):
                converted[str(i)] = _key_as(np.asarray(store[str(i)]), tuple(variable.shape))
        return super().load_own_variables(_Overlay(store, converted))

    def _apply_weight_decay(self, variables):
        # Weight decay is the inner optimizer's (this optimizer refuses weight_decay):
        # w ← w − η_t·λ·w before its update, as Keras applies it; data-independent, so
        # post-processing of the private output.
        inner = self.inner
        if inner is not None:
            return inner._apply_weight_decay(variables)
        return super()._apply_weight_decay(variables)

    # -------------------------------------------------------------------- build
    def build(self, variables):
        if self.built:
            return
        inner = self.inner
        if inner is not None and inner.built:
            self._check_built_inner(inner, variables)
        super().build(variables)
        # the keys: int64 (2,) on TensorFlow, their four 32-bit words (int32 (4,)) on JAX
        self._noise_key = self._dp_key_variable(self._initial_key, "noise_key")
        # the key drawn in this process: a restore that replaces it before the first step is seen
        # (a build traced inside the first step is never restored before that step)
        self._dp_fresh_noise_key = None
        if _impl.executing_eagerly():
            self._dp_fresh_noise_key = np.asarray(keras.ops.convert_to_numpy(self._noise_key.value)).copy()
        # the plan words (plan_state): what epsilon depends on, saved and restored with the step
        self._plan = self.add_variable(
            shape=(len(plan_state.FIELDS),), dtype="int32",
            initializer=lambda shape, dtype=None: keras.ops.convert_to_tensor(self._dp_expected_plan(), "int32"),
            name="plan")
        self._dp_build_clip()  # an adaptive clip's ζ_t, saved and restored with the step
        if self.run is not None:
            # The run's secret sampling key, saved and restored with the optimizer (and,
            # under MultiWorkerMirroredStrategy, initialised from the chief's value).
            self._sampling_key = self._dp_key_variable(self.run.initial_key(), "sampling_key")
        # One noise-state variable (buffers, *shape) per model variable, None without
        # state: the banded ring keeps its historical name (checkpoints load), the other
        # kinds are "<path>_noise_state".
        self._rings = []
        suffix = self._noise.state_name
        for var in variables:
            shape = self._noise.state_shape(var.shape)
            if shape is None:
                self._rings.append(None)
                continue
            name = f"{getattr(var, 'path', var.name).replace('/', '_')}_{suffix}"
            self._rings.append(self._dp_state_variable(var, shape, name))
        if inner is not None and not inner.built:
            inner.build(variables)

    def _dp_variable_index(self, variable) -> int:
        """The position of ``variable`` among the variables this optimizer was built on."""
        return _compat.variable_index(self, variable)

    def _check_built_inner(self, inner, variables):
        """An inner optimizer built before this one must be built on exactly ``variables``
        and not have stepped on its own."""
        ours = {_compat.variable_key(self, v) for v in variables}
        if set(_compat.trainable_variable_keys(inner)) != ours:
            raise ValueError(
                f"the inner optimizer {type(inner).__name__} is already built on other variables "
                f"({len(_compat.trainable_variables(inner))} variables, not the {len(variables)} this optimizer "
                "trains): its slots belong to another model. Pass a fresh (unbuilt) optimizer as inner."
            )
        self._dp_check_inner_steps(inner)

    def _dp_check_unit_rows(self, unit_rows):
        """Refuse a clipped sum whose privacy unit is not the run's (see ``apply_clipped_sum``)."""
        run = self.run
        expected = 1 if run is None else int(getattr(run, "examples_per_user", 1))
        if isinstance(unit_rows, bool) or not isinstance(unit_rows, int) or unit_rows != expected:
            unit = "each example" if expected == 1 else f"each user's {expected} rows as one (examples_per_user)"
            raise ValueError(
                f"apply_clipped_sum(unit_rows={unit_rows!r}): this optimizer's run clips {unit}, so its epsilon "
                f"assumes sums clipped with unit_rows={expected}. Clip with the engine's unit_rows={expected} "
                f"(a private model does) and pass apply_clipped_sum(..., unit_rows={expected}).")

    # ------------------------------------------------------------ entry points
    def apply_clipped_sum(self, grads, trainable_variables=None, *, norms=None, sample_weight=None, keep_clip=None,
                          unit_rows=1):
        """Apply one noisy step from a CLIPPED SUM of per-example gradients.

        Args:
          grads: list of tensors Σ_i clip(w_i·∇loss_i, ζ), aligned with
            ``trainable_variables`` (un-normalised: NOT divided by the batch size).
            Under ``tf.distribute`` each replica passes its own partial sum; the
            sums are added across replicas before the noise is added once.
          trainable_variables: the model's trainable variables (needed on the first
            call to build the optimizer).
          norms: with an adaptive clip (required there), the per-example norms (P,) the sum
            was clipped with, for the step's count query; ignored otherwise.
          sample_weight: the rows' weights (P,); rows of weight 0 (the sampler's padding)
            are not examples and are left out of the count. ``None``: every row is one.
          keep_clip: a boolean scalar; where true an adaptive clip keeps ζ (the private
            models pass it for a step refused whatever its data: out of step, past the plan).
          unit_rows: the rows of one privacy unit the sum was clipped by: 1 (each example), or a
            user-level run's ``examples_per_user`` k (each user's k rows clipped as one, e.g.
            ``engine(..., unit_rows=k)``). ``norms`` and ``sample_weight`` stay PER ROW, as the
            engine returns them (a user's norm on each of its rows): the count takes one norm per
            user, and a user is real where one of its rows weighs more than 0. It must be the run's
            k: a sum clipped per example in a user-level run would have k times the sensitivity
            its ε assumes (``ValueError``).

        Every variable gets ``ĝ_t = (sum + ζ·σ·z̃_t)/B``: ``w ← w − η·ĝ_t`` without an
        inner optimizer, else the inner optimizer's ``update_step(ĝ_t, w, η_t)``.
        """
        self._dp_check_unit_rows(unit_rows)
        self._private_apply = True
        self._dp_counted = (*_per_unit(norms, sample_weight, unit_rows), keep_clip)
        try:
            return self.apply(grads, trainable_variables)
        finally:
            self._private_apply = False
            self._dp_counted = (None, None, None)

    def stateless_apply_clipped_sum(self, optimizer_variables, grads, trainable_variables, *, norms=None,
                                    sample_weight=None, keep_clip=None, unit_rows=1):
        """:meth:`apply_clipped_sum` as a pure function, for a functional train step (the
        JAX backend's): ``optimizer_variables`` and ``trainable_variables`` are the current
        values (aligned with ``self.variables`` and the variables this optimizer was built
        on), ``grads`` the clipped sums. Returns ``(trainable_variables,
        optimizer_variables)``, the values after the step (Keras's ``stateless_apply``).
        ``norms``/``sample_weight``/``keep_clip``/``unit_rows``: as :meth:`apply_clipped_sum`'s."""
        self._dp_check_unit_rows(unit_rows)
        self._private_apply = True
        self._dp_counted = (*_per_unit(norms, sample_weight, unit_rows), keep_clip)
        try:
            return self.stateless_apply(optimizer_variables, grads, trainable_variables)
        finally:
            self._private_apply = False
            self._dp_counted = (None, None, None)

    def apply(self, grads, trainable_variables=None):
        if not self._private_apply:
            raise RuntimeError(
                f"{type(self).__name__} only accepts per-example CLIPPED gradient sums, through "
                "apply_clipped_sum(). A plain keras.Model compiled with it would feed it the "
                "unclipped mean gradient and break differential privacy: wrap the model with "
                "keras_noisecurve.make_private(model) before "
                "compile(), or call a clipping engine and optimizer.apply_clipped_sum() yourself."
            )
        if not self.built and trainable_variables is not None:  # ζ_t below reads the clip's variable
            self.build(trainable_variables)
        next_clip = self._dp_clip_update(*getattr(self, "_dp_counted", (None, None, None)))  # before the step counts
        inner = self.inner
        result = super().apply(grads, trainable_variables)
        if inner is not None and len(grads) > 0:
            # the inner optimizer's step counter (its schedule, Adam's bias correction)
            # advances with ours, as Keras's own apply() advances it
            _compat.iterations_variable(inner).assign_add(1)
        if next_clip is not None:
            self._clip.assign(next_clip)
        return result

    def apply_gradients(self, grads_and_vars):
        grads, variables = zip(*grads_and_vars)
        return self.apply(list(grads), list(variables))

    # ------------------------------------------------------------------- config
    def get_config(self):
        config = super().get_config()
        for name in list(REFUSED) + list(IGNORED_DEFAULTS):
            config.pop(name, None)
        config.update(
            {
                "l2_norm_clip": self.l2_norm_clip if self.adaptive_clip is None else self.adaptive_clip.to_config(),
                "noise_multiplier": self.noise_multiplier,
                "expected_batch_size": self.expected_batch_size,
            }
        )  # never the seed: a fixed one would print the noise key in config.json (the key is a variable)
        if self.inner is not None:
            config.pop("learning_rate", None)  # the inner optimizer's, stored with it
            config["inner"] = keras.saving.serialize_keras_object(self.inner)
        if self.run is not None:  # C, sigma and B are the run's
            for name in ("noise_multiplier", "expected_batch_size"):
                config.pop(name, None)
            config["run"] = self.run.get_config()
            return config
        # banded: {"band_values", "metadata"}; other kinds: {"kind", "steps", <parameters>,
        # "metadata"}; load_mixing reads both back
        config["mixing"] = self._mixing.to_config()
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        if isinstance(config.get("run"), dict):
            from keras_noisecurve.privacy.run import PrivateRun

            config["run"] = PrivateRun.from_config(config["run"])
        if isinstance(config.get("inner"), dict):
            config["inner"] = keras.saving.deserialize_keras_object(config["inner"], custom_objects=custom_objects)
        return super().from_config(config, custom_objects=custom_objects)


def _per_unit(norms, sample_weight, unit_rows):
    """The count's ``(norms, weights)`` of the step's units from per-row ones (``units.unit_view``:
    one norm per user, a user real where a row weighs > 0); as they are for ``unit_rows`` 1."""
    if norms is None or unit_rows == 1:
        return norms, sample_weight
    from keras_noisecurve.backend.common.units import unit_view

    weights = None if sample_weight is None else keras.ops.cast(keras.ops.convert_to_tensor(sample_weight) > 0,
                                                                "float32")
    return unit_view(norms, weights, unit_rows)
