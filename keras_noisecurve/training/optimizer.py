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
import tensorflow as tf

from keras_noisecurve import _compat
from keras_noisecurve.mixing.strategies import load_mixing
from keras_noisecurve.training.noise import StreamNoise, key_from_seed, normal_from_seed, step_seed, variable_seed
from keras_noisecurve.training.optimizer_args import (
    IGNORED_DEFAULTS,
    REFUSED,
    check_backend,
    check_inner,
    check_kwargs,
    check_learning_rate,
    check_noise_arguments,
    from_run,
)
from keras_noisecurve.training.update_rule_check import update_rule_warning

__all__ = ["NoiseCurveOptimizer"]

_PACKAGE = "keras_noisecurve"


@keras.saving.register_keras_serializable(package=_PACKAGE)
class NoiseCurveOptimizer(keras.optimizers.Optimizer):
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
      l2_norm_clip: ζ > 0, the per-example L2 clipping norm (used by the private model).
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
        l2_norm_clip=1.0,
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
        if inner is not None and _compat.distribution_strategy(inner) is not _compat.distribution_strategy(self):
            raise ValueError(
                f"the inner optimizer {type(inner).__name__} was created under another tf.distribute "
                f"strategy ({type(_compat.distribution_strategy(inner)).__name__}) than this optimizer "
                f"({type(_compat.distribution_strategy(self)).__name__}): its slot variables would not be "
                "mirrored like the model's. Create both inside the same `with strategy.scope():`."
            )
        self._inner = inner
        self.l2_norm_clip = l2_norm_clip
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
        return int(self.iterations.value.numpy()), np.asarray(self._sampling_key.value.numpy(), dtype=np.int64)

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
        key = self._initial_key
        self._noise_key = self.add_variable(
            shape=(2,),
            dtype="int64",
            initializer=lambda shape, dtype=None: tf.constant(key, dtype=tf.int64),
            name="noise_key",
        )
        if self.run is not None:
            # The run's secret sampling key, saved and restored with the optimizer (and,
            # under MultiWorkerMirroredStrategy, initialised from the chief's value).
            sampling_key = self.run.initial_key()
            self._sampling_key = self.add_variable(
                shape=(2,),
                dtype="int64",
                initializer=lambda shape, dtype=None: tf.constant(sampling_key, dtype=tf.int64),
                name="sampling_key",
            )
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
            colocate = var.value if isinstance(var, keras.Variable) else var
            with _compat.distribution_strategy(self).extended.colocate_vars_with(colocate):
                state = self.add_variable(
                    shape=shape,
                    dtype=var.dtype,
                    name=f"{getattr(var, 'path', var.name).replace('/', '_')}_{suffix}",
                )
            self._rings.append(state)
        if inner is not None and not inner.built:
            inner.build(variables)

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
        if tf.executing_eagerly() and int(inner.iterations.numpy()) != int(self.iterations.numpy()):
            raise ValueError(
                f"the inner optimizer {type(inner).__name__} has already taken {int(inner.iterations.numpy())} "
                f"steps of its own (this optimizer: {int(self.iterations.numpy())}): its schedule and slots "
                "would not follow the private steps. Pass a fresh (unbuilt) optimizer as inner."
            )

    # ------------------------------------------------------------ entry points
    def apply_clipped_sum(self, grads, trainable_variables=None):
        """Apply one noisy step from a CLIPPED SUM of per-example gradients.

        Args:
          grads: list of tensors Σ_i clip(w_i·∇loss_i, ζ), aligned with
            ``trainable_variables`` (un-normalised: NOT divided by the batch size).
            Under ``tf.distribute`` each replica passes its own partial sum; the
            sums are added across replicas before the noise is added once.
          trainable_variables: the model's trainable variables (needed on the first
            call to build the optimizer).

        Every variable gets ``ĝ_t = (sum + ζ·σ·z̃_t)/B``: ``w ← w − η·ĝ_t`` without an
        inner optimizer, else the inner optimizer's ``update_step(ĝ_t, w, η_t)``.
        """
        self._private_apply = True
        try:
            return self.apply(grads, trainable_variables)
        finally:
            self._private_apply = False

    def apply(self, grads, trainable_variables=None):
        if not self._private_apply:
            raise RuntimeError(
                f"{type(self).__name__} only accepts per-example CLIPPED gradient sums, through "
                "apply_clipped_sum(). A plain keras.Model compiled with it would feed it the "
                "unclipped mean gradient and break differential privacy: wrap the model with "
                "keras_noisecurve.make_private(model) before "
                "compile(), or call a clipping engine and optimizer.apply_clipped_sum() yourself."
            )
        inner = self.inner
        if inner is None or len(grads) == 0:
            return super().apply(grads, trainable_variables)
        result = super().apply(grads, trainable_variables)
        # the inner optimizer's step counter (its schedule, Adam's bias correction)
        # advances with ours, as Keras's own apply() advances it
        _compat.iterations_variable(inner).assign_add(1)
        return result

    def apply_gradients(self, grads_and_vars):
        grads, variables = zip(*grads_and_vars)
        return self.apply(list(grads), list(variables))

    # Keras's TensorFlow optimizer calls this PRIVATE hook once per step, in cross-replica
    # context, around the per-variable update_step calls (_backend_update_step ->
    # maybe_merge_call). No public hook runs there: apply() runs once per replica, in
    # replica context, and update_step once per variable and replica copy. The work all
    # variables of a step share (privacy-plan check, step seed, row t of C) is built here
    # once per step instead of once per variable. Without the hook, update_step builds it
    # itself (same noise, slower); tests/training/test_keras_hook.py fails if a Keras
    # release removes the hook, changes its signature or stops calling it.
    def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
        """Build the per-step noise work (plan check, step seed, row of C) once, then
        the per-variable updates."""
        self._step_noise = _StepNoise(self)
        try:
            return super()._distributed_tf_update_step(distribution, grads_and_vars, learning_rate)
        finally:
            self._step_noise = None

    def update_step(self, gradient, variable, learning_rate):
        """``ĝ = (gradient + ζσ·z̃_t)/B`` (gradient = clipped sum), then
        ``variable ← variable − η·ĝ`` or, with an inner optimizer,
        ``inner.update_step(ĝ, variable, learning_rate)`` (``learning_rate`` is then the
        inner optimizer's η_t).

        Without noise state (b = 1, p = 1, DP-SGD) z̃_t is z_t times a scalar, folded into
        the draw with ζσ. Otherwise the state gives z̃_t (``StreamNoise.advance_in_place``:
        one XLA-compiled pass over the state): a ring (banded, toeplitz, fir) has only its
        slot t mod (b − 1) overwritten, in place; the BLT accumulators are rewritten in
        place. Under ``tf.distribute`` the unfused ``StreamNoise.advance`` and a scatter.
        """
        index = _compat.variable_index(self, variable)
        noise = self._step_noise or _StepNoise(self)
        dtype = variable.dtype
        std = self.l2_norm_clip * self.noise_multiplier
        seed = variable_seed(noise.seed, index)
        coefficients = noise.coefficients(dtype)
        state = self._rings[index]
        if state is None:  # no state: z̃_t = z_t / C[t, t] (or f_0 z_t), scale folded in
            scale = self._noise.folded_scale(std, coefficients)
            noise_term = normal_from_seed(seed, variable.shape, dtype, scale=scale)
        else:
            z = normal_from_seed(seed, variable.shape, dtype)
            if self._noise.fuses(state.value):  # one XLA pass over the state, written in place
                noise_term = self._noise.advance_in_place(z, noise.step, state.value, coefficients, scale=std)
            else:  # tf.distribute or a redefined advance(): the unfused reference, a scatter
                z_tilde, write = self._noise.advance(z, noise.step, state.value, coefficients)
                if write.slot is not None:  # a ring: write only slot t mod (b − 1), in place
                    slot = tf.reshape(write.slot, [1])
                    dense_shape = tf.constant(list(state.shape), tf.int32)  # static: no read of the state
                    self.assign(state, tf.IndexedSlices(write.value[None], slot, dense_shape))
                else:
                    self.assign(state, write.value)
                noise_term = tf.cast(std, dtype) * z_tilde
        inner = self.inner
        if inner is None:
            rate = tf.cast(learning_rate, dtype) / tf.cast(self.expected_batch_size, dtype)
            self.assign_sub(variable, rate * (tf.cast(gradient, dtype) + noise_term))
        else:
            privatized = (tf.cast(gradient, dtype) + noise_term) / tf.cast(self.expected_batch_size, dtype)
            inner.update_step(privatized, variable, learning_rate)

    # ------------------------------------------------------------------- config
    def get_config(self):
        config = super().get_config()
        for name in list(REFUSED) + list(IGNORED_DEFAULTS):
            config.pop(name, None)
        config.update(
            {
                "l2_norm_clip": self.l2_norm_clip,
                "noise_multiplier": self.noise_multiplier,
                "expected_batch_size": self.expected_batch_size,
                "seed": self.seed,
            }
        )
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


class _StepNoise:
    """What all variables of one step share: the step t, its seed ``step_seed(key, t)``
    (computed after the privacy-plan check, so no update runs past step T) and the
    step's coefficients (``StreamNoise.step_coefficients``) per dtype."""

    def __init__(self, optimizer):
        self._noise = optimizer.noise
        self.step = optimizer.iterations
        self._checks = [op for op in [self._noise.assert_in_plan(self.step)] if op is not None]
        with tf.control_dependencies(self._checks):
            self.seed = step_seed(optimizer._noise_key, self.step)
        self._rows = {}

    def coefficients(self, dtype):
        """The step's ``StepCoefficients`` in ``dtype``, or ``None`` for C = I without a
        plan; read after the plan check (row T of a banded C does not exist)."""
        dtype = tf.as_dtype(dtype)
        if dtype not in self._rows:
            with tf.control_dependencies(self._checks):
                self._rows[dtype] = self._noise.step_coefficients(self.step, dtype)
        return self._rows[dtype]
