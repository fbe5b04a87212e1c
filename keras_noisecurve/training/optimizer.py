"""Keras 3 optimizers for private training: ``NoiseCurveOptimizer`` (the noise of a
mixing matrix C: DP-SGD for C = I, DP-BandMF, NoiseCurve) and its base ``DPOptimizer``
(C = I without a step plan). docs/training.md, "DP-SGD", says which to use.

Update rule (docs/design.md#update-rule, paper App. C), at step
t = ``optimizer.iterations``::

    ĝ_t = (Σ_i clip(g_i, ζ) + ζ·σ·z̃_t) / B          B = expected batch size
    w   ← w − η·ĝ_t                                   inner=None: plain SGD
    inner.update_step(ĝ_t, w, η_t)                    inner=<a Keras optimizer>

The optimizer receives the CLIPPED SUM Σ_i clip(g_i, ζ) (from ``DPModel`` or a
clipping engine) through :meth:`DPOptimizer.apply_clipped_sum`; the ordinary
``apply``/``apply_gradients`` entry points refuse to run, so a plain
``keras.Model`` can never train through it without per-example clipping.

Privatization ends at ĝ_t: with ``inner=`` (momentum SGD, Adam, AdamW, …) the inner
optimizer post-processes ĝ_t exactly as Keras would a gradient (its slots, its
learning rate or schedule at its ``iterations``, which advance with ours, and its
weight decay), which costs no privacy. The update rule C was optimised for is
recorded in ``mixing.metadata["update_rule"]`` (absent: plain SGD, constant rate);
construction warns once when the optimizer runs another one. docs/training.md,
"Any Keras optimizer (`inner=`)", has the details.

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
from keras_noisecurve._validation import check_float, check_int
from keras_noisecurve.mixing.strategies import load_mixing
from keras_noisecurve.mixing.update_rule import UpdateRule
from keras_noisecurve.training.noise import StreamNoise, key_from_seed, normal_from_seed, step_seed, variable_seed

__all__ = ["DPOptimizer", "NoiseCurveOptimizer"]

_PACKAGE = "keras_noisecurve"

# kwarg -> (value that means "off", reason)
_REFUSED = {
    "clipnorm": (None, "it would clip the NOISY sum; per-example clipping is l2_norm_clip"),
    "clipvalue": (None, "it would clip the NOISY sum; per-example clipping is l2_norm_clip"),
    "global_clipnorm": (None, "it would clip the NOISY sum; per-example clipping is l2_norm_clip"),
    "use_ema": (False, "the mixing-matrix objective assumes the plain iterate w ← w − η·ĝ"),
    "loss_scale_factor": (None, "the optimizer receives clipped sums, not scaled losses"),
    "gradient_accumulation_steps": (
        None,
        "one optimizer step must be one noisy step of the privacy plan; use a larger "
        "expected_batch_size (and microbatch_size in make_private to bound memory) instead",
    ),
    "weight_decay": (
        None,
        "it changes the dynamics the mixing matrix was optimised for; add a kernel "
        "regularizer (data-independent, so it is not clipped) to the loss instead, or give "
        "the decay to an inner optimizer (inner=keras.optimizers.AdamW(...) or "
        "keras.optimizers.SGD(weight_decay=...))",
    ),
}
# accepted with their defaults only (they appear in the base class config)
_IGNORED_DEFAULTS = {"ema_momentum": 0.99, "ema_overwrite_frequency": None}

_NOISY_CLIP = (
    "it would clip the NOISY mean ĝ_t, not each example's gradient: harmless for privacy "
    "(post-processing) but misleading, since it bounds no example's contribution (that is "
    "l2_norm_clip), and it changes the update the mixing matrix was optimised for"
)
# attribute of an inner optimizer -> why a value other than None/False is refused
_INNER_REFUSED = {
    "clipnorm": _NOISY_CLIP,
    "clipvalue": _NOISY_CLIP,
    "global_clipnorm": _NOISY_CLIP,
    "use_ema": "the private optimizer never updates or finalizes an inner optimizer's weight average",
    "gradient_accumulation_steps": "one optimizer step must be one noisy step of the privacy plan; use "
    "a larger expected_batch_size (and microbatch_size in make_private to bound memory) instead",
    "loss_scale_factor": "the private optimizer receives clipped sums, not scaled losses",
}


def _check_backend():
    from keras_noisecurve._quiet import probe_devices_quietly

    probe_devices_quietly()  # no "failed call to cuInit" from our first variable on a CPU machine
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise RuntimeError(
            f"keras_noisecurve optimizers need the TensorFlow Keras backend, but KERAS_BACKEND is "
            f"{backend!r}. Set the environment variable KERAS_BACKEND=tensorflow before importing keras."
        )


def _check_kwargs(kwargs):
    for name, (off, reason) in _REFUSED.items():
        if name in kwargs:
            value = kwargs.pop(name)
            if value is not None and value is not off and not (off is None and value is False):
                raise ValueError(
                    f"{name}={value!r} is not supported by private optimizers: {reason}."
                )
    for name, default in _IGNORED_DEFAULTS.items():
        if name in kwargs:
            value = kwargs.pop(name)
            if value != default:
                raise ValueError(f"{name}={value!r} is not supported by private optimizers (EMA is refused).")
    return kwargs


def _check_inner(inner):
    """Refuse an ``inner`` optimizer that cannot post-process ĝ_t faithfully (ValueError)."""
    if isinstance(inner, DPOptimizer):
        raise ValueError(
            f"inner={type(inner).__name__}(name={inner.name!r}) is itself a private optimizer: the noise "
            "would be added twice and no privacy accounting describes that. Pass a plain Keras optimizer "
            "as inner, e.g. inner=keras.optimizers.Adam(1e-3)."
        )
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "inner=keras.optimizers.LossScaleOptimizer is not supported: the private optimizer receives "
            "clipped sums of per-example gradients, not scaled losses, and a skipped step would break the "
            "privacy plan (one step per noise draw). Pass the wrapped optimizer itself "
            "(inner=loss_scale_optimizer.inner_optimizer)."
        )
    if not isinstance(inner, keras.optimizers.Optimizer):
        raise TypeError(
            f"inner must be a keras.optimizers.Optimizer (e.g. keras.optimizers.SGD(0.1, momentum=0.9)) "
            f"or None; got {inner!r} ({type(inner).__name__})."
        )
    for name, reason in _INNER_REFUSED.items():
        value = getattr(inner, name, None)
        if value is not None and value is not False:
            raise ValueError(
                f"the inner optimizer {type(inner).__name__} has {name}={value!r}, which is not supported: "
                f"{reason}. Create it without {name}."
            )


class _InnerLearningRate(keras.optimizers.schedules.LearningRateSchedule):
    """Stands in for the outer learning rate when there is an inner optimizer (creates no
    variable): the inner optimizer's current learning rate."""

    def __init__(self, inner):
        self._inner = inner

    def __call__(self, step):
        return self._inner.learning_rate

    def get_config(self):
        return {}


@keras.saving.register_keras_serializable(package=_PACKAGE)
class DPOptimizer(keras.optimizers.Optimizer):
    """DP-SGD for Keras 3: clipped sum in, independent Gaussian noise, mean over B.

    ``ĝ_t = (Σ_i clip(g_i, ζ) + ζ·σ·z_t) / B`` with z_t ~ N(0, I), i.e. C = I, at every
    step, with no step plan; then ``w ← w − η·ĝ_t`` (``inner=None``) or the update of
    the ``inner`` Keras optimizer. The base class of ``NoiseCurveOptimizer``, which
    holds the whole update; ``DPOptimizer(...)`` is ``NoiseCurveOptimizer(mixing="dpsgd", ...)``
    (same noise, draw for draw).

    Args:
      learning_rate: η > 0 (float) or a ``keras.optimizers.schedules.LearningRateSchedule``;
        required without ``inner`` (no default: ``None`` raises ``ValueError``). Must be
        left out with ``inner`` (the inner optimizer's is used).
      l2_norm_clip: ζ > 0, the per-example L2 clipping norm (used by ``DPModel``).
      noise_multiplier: σ ≥ 0, required (no default; ``NoiseCurveOptimizer(run=...)`` takes
        the run's); the noise standard deviation is ζ·σ on the sum.
      expected_batch_size: B ≥ 1, the EXPECTED batch size of the (Poisson) sampler.
        The sum is divided by B, never by the actual batch size (which would leak it).
      seed: ``None`` (default): a secret key from OS entropy. An integer makes the
        noise reproducible, for tests only: knowing it voids the privacy guarantee.
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

    No clipnorm/clipvalue/global_clipnorm, EMA, loss scaling, gradient accumulation or
    ``weight_decay`` on this optimizer (each raises ``ValueError``; weight decay belongs
    to the inner optimizer). There is no step limit: the way to ask for DP-SGD is
    ``NoiseCurveOptimizer(mixing=MixingMatrix.identity(T))``, which refuses steps
    beyond the privacy plan of T steps like every other C (docs/training.md, "DP-SGD").
    """

    def __init__(
        self,
        learning_rate=None,
        l2_norm_clip=1.0,
        noise_multiplier=None,
        expected_batch_size=None,
        seed=None,
        name="dp_optimizer",
        inner=None,
        **kwargs,
    ):
        _check_backend()
        kwargs = _check_kwargs(dict(kwargs))
        l2_norm_clip = check_float("l2_norm_clip", l2_norm_clip, positive=True)
        if noise_multiplier is None:
            raise ValueError(
                "noise_multiplier (sigma) is required, got None: there is no safe default. Give the run "
                "(NoiseCurveOptimizer(run=PrivateRun(..., epsilon=...)), which calibrates it) or the sigma your "
                "accounting used."
            )
        noise_multiplier = check_float("noise_multiplier", noise_multiplier, nonnegative=True)
        if expected_batch_size is None:
            raise ValueError(
                "expected_batch_size is required: the noisy sum is divided by the EXPECTED batch "
                "size B of the sampler (e.g. banded_poisson_dataset's batch_size), got None."
            )
        expected_batch_size = check_int("expected_batch_size", expected_batch_size, minimum=1)
        if seed is not None:
            seed = check_int("seed", seed, minimum=0, maximum=2**63 - 1)
        if inner is not None:
            _check_inner(inner)
            if learning_rate is not None:
                raise ValueError(
                    f"learning_rate={learning_rate!r} is given together with inner={type(inner).__name__}: "
                    "the inner optimizer's learning rate (or schedule) is the one used. Leave learning_rate "
                    f"out and give it to the inner optimizer, e.g. keras.optimizers.{type(inner).__name__}"
                    "(learning_rate=...)."
                )
            learning_rate = _InnerLearningRate(inner)  # creates no variable of its own
        else:
            if learning_rate is None:
                raise ValueError(
                    "learning_rate is required, got None (e.g. C.metadata['learning_rate'], which only curvature "
                    "objectives record, is None for a bandmf or dpsgd C): give the rate you train with, e.g. "
                    "learning_rate=0.5, or inner=keras.optimizers.SGD(...)."
                )
            if not isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule) and not callable(
                learning_rate
            ):
                learning_rate = check_float("learning_rate", learning_rate, positive=True)
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
        self._mixing = load_mixing("dpsgd")  # C = I without a step plan; NoiseCurveOptimizer sets its C
        self._noise = _noise_of(self._mixing)
        self._initial_key = key_from_seed(seed)
        self._run = None  # a PrivateRun: NoiseCurveOptimizer(run=...)
        self._sampling_key = None
        self._private_apply = False
        self._step_noise = None  # _StepNoise while one step's updates are built

    # ------------------------------------------------------------- noise source
    @property
    def mixing(self):
        """The mixing strategy: a ``MixingMatrix`` (banded), ``ToeplitzMixing``, ``BLTMixing``,
        ``BISRMixing`` or ``IdentityMixing`` (``"dpsgd"``: C = I, no step plan)."""
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
                "keras_noisecurve.make_private(model) (or build a keras_noisecurve.DPModel) before "
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
        for name in list(_REFUSED) + list(_IGNORED_DEFAULTS):
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

    # ------------------------------------------------------------ update rule
    def _update_rule_run(self, steps):
        """What this optimizer runs over ``steps`` steps: ``(kind, momentum, nesterov,
        learning_rates)``; kind is ``"sgd"`` or the inner optimizer's class name, and
        learning_rates (shape (steps,)) is ``None`` when it cannot be evaluated."""
        inner = self.inner
        if inner is None:
            return "sgd", 0.0, False, _learning_rates(_compat.learning_rate_value(self), steps)
        if isinstance(inner, keras.optimizers.SGD):
            return "sgd", float(inner.momentum), bool(inner.nesterov), _learning_rates(_compat.learning_rate_value(inner), steps)
        return type(inner).__name__, None, None, None


def _learning_rates(learning_rate, steps):
    """η_t for t = 0 … steps − 1 (float64), from a float, a variable or a
    ``LearningRateSchedule``; ``None`` for a zero-argument callable (unknown)."""
    if isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule):
        try:  # most schedules are elementwise: one call for all steps
            rates = np.asarray(_numpy(learning_rate(tf.range(steps, dtype=tf.int64))), dtype=np.float64)
        except Exception:  # noqa: BLE001 - e.g. a schedule with a tf.cond on the step
            rates = None
        if rates is None or rates.shape != (steps,):
            rates = np.array([float(_numpy(learning_rate(tf.constant(t, tf.int64)))) for t in range(steps)])
        return rates
    if isinstance(learning_rate, (keras.Variable, tf.Variable)):
        return np.full(steps, float(_numpy(learning_rate)))
    if callable(learning_rate):
        return None
    return np.full(steps, float(learning_rate))


def _numpy(value):
    """A tensor or variable as numpy, through ``.numpy()``: ``np.asarray`` on a Keras
    variable warns under numpy 2 (its ``__array__`` takes no ``copy`` argument)."""
    value = value.value if isinstance(value, keras.Variable) else value
    return value.numpy() if hasattr(value, "numpy") else np.asarray(value)


def _float32_rates(rates, rule, steps):
    """Keras evaluates schedules in float32, so small multipliers (a cosine near step T)
    carry relative errors far above ``UpdateRule``'s comparison tolerance. Rates that
    equal η·s_t to float32 precision (|η_t − η·s_t| ≤ 8 float32 ulps of η) are replaced
    by η·s_t, so only real differences are reported."""
    planned = rule.multipliers(steps)
    eta = rates[0] / planned[0]
    if eta > 0 and np.all(np.abs(rates - eta * planned) <= 8 * np.finfo(np.float32).eps * eta):
        return eta * planned
    return rates


def _from_run(run, mixing, noise_multiplier, expected_batch_size):
    """(C, σ, B) of ``run``; any of them also given must agree with the run."""
    from keras_noisecurve.privacy.run import PrivateRun

    if not isinstance(run, PrivateRun):
        raise ValueError(f"run must be a keras_noisecurve.PrivateRun, got {type(run).__name__}.")
    given = {"mixing": mixing, "noise_multiplier": noise_multiplier, "expected_batch_size": expected_batch_size}
    planned = {"mixing": run.mixing, "noise_multiplier": run.noise_multiplier, "expected_batch_size": run.batch_size}
    for name, value in given.items():
        if value is None:
            continue
        same = load_mixing(value) == planned[name] if name == "mixing" else value == planned[name]
        if not same:
            raise ValueError(
                f"{name}={value!r} differs from the run's ({planned[name]!r}): with run=, leave {name} out "
                "(the run's is used)."
            )
    return planned["mixing"], planned["noise_multiplier"], planned["expected_batch_size"]


def _noise_of(mixing) -> StreamNoise:
    """The online noise generator of a resolved ``mixing`` (``"dpsgd"``: C = I, no plan)."""
    return StreamNoise.from_mixing(mixing)


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


@keras.saving.register_keras_serializable(package=_PACKAGE)
class NoiseCurveOptimizer(DPOptimizer):
    """DP-SGD with correlated noise z̃_t = (C⁻¹Z)_t of a mixing strategy C.

    ``ĝ_t = (Σ_i clip(g_i, ζ) + ζ·σ·z̃_t) / B`` (docs/design.md#update-rule; paper
    App. C), with z̃ computed online from ``mixing.buffers`` state arrays per variable
    (``keras_noisecurve.training.noise.StreamNoise``: the ring of b − 1 past values of a
    banded or Toeplitz C, the p − 1 past draws of BISR, the d accumulators of BLT), then
    ``w ← w − η·ĝ_t`` or the update of the ``inner`` Keras optimizer.

    Args:
      mixing: anything ``keras_noisecurve.mixing.load_mixing`` reads: a ``MixingMatrix``
        (T steps, b bands; ``MixingMatrix.identity(T)`` is DP-SGD), a ``ToeplitzMixing``,
        ``BLTMixing`` or ``BISRMixing``, the path of a ``.npz`` file of any of them, the
        config dict ``get_config`` writes (``mixing.to_config()``), or ``"dpsgd"`` (C = I
        without a step plan, what ``DPOptimizer`` does). Training refuses step t ≥ T
        (the privacy plan is spent): the step fails with an error.
      learning_rate, l2_norm_clip, noise_multiplier, expected_batch_size, seed, name, inner:
        as ``DPOptimizer``.
      run: a ``keras_noisecurve.PrivateRun`` (the one documented way to train
        privately): C, σ
        and B are then the run's (given ones must agree), the run's secret sampling key
        becomes the optimizer variable ``sampling_key`` (saved and restored with
        ``iterations`` and the noise state), and the run's dataset starts at this
        optimizer's step. A model compiled with it trains only on ``run.dataset(...)``:
        ``fit`` refuses arrays and any other dataset before the first step.

        Without ``run`` (``mixing``, ``noise_multiplier`` and ``expected_batch_size`` by
        hand) the optimizer is the LOW-LEVEL piece for custom loops that do their own
        sampling and accounting: nothing checks that the batches follow the sampling the
        accounting assumed, and nothing restores a sampler's position on resume.

    Construction warns once (``UserWarning``) when the update the optimizer runs differs
    from the one C was optimised for, ``mixing.metadata["update_rule"]`` (absent: plain
    SGD with a constant learning rate; ``keras_noisecurve.UpdateRule``): the momentum
    and Nesterov flag of an inner ``keras.optimizers.SGD`` (0 without inner), its
    learning rates at steps 0 … T−1 (schedule shape, and the base rate against
    ``mixing.metadata["learning_rate"]`` where the objective recorded one), or an inner
    optimizer that is not SGD at all. C = I (objective ``"dpsgd"``) never warns.
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
            mixing, noise_multiplier, expected_batch_size = _from_run(run, mixing, noise_multiplier,
                                                                      expected_batch_size)
        mixing = load_mixing("dpsgd" if mixing is None else mixing)
        super().__init__(
            learning_rate=learning_rate,
            l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            seed=seed,
            name=name,
            inner=inner,
            **kwargs,
        )
        self._mixing = mixing
        self._noise = _noise_of(mixing)
        if run is not None:
            self._run = run
            run.bind(self)
        message = self._update_rule_warning()
        if message is not None:
            warnings.warn(message, UserWarning, stacklevel=2)

    def _update_rule_warning(self):
        """The construction warning (a string), or ``None`` when the optimizer runs the
        update rule C was optimised for."""
        if not self._mixing.has_plan:  # C = I without a plan
            return None
        meta = self._mixing.metadata
        objective = meta.get("objective", "unknown")
        if objective == "dpsgd":  # C = I is optimal for no update rule in particular
            return None
        rule = UpdateRule.from_metadata(meta.get("update_rule"))
        planned = meta.get("learning_rate")
        steps = self._mixing.steps
        kind, momentum, nesterov, rates = self._update_rule_run(steps)
        if kind != "sgd":
            return (
                f"the mixing matrix ({objective}) was optimised for heavy-ball SGD ({rule.describe()}), but the "
                f"inner optimizer is {kind}: the privatized gradient it receives is as private as ever, but its "
                f"noise is no longer the one C was optimised for (no objective models {kind}'s update). Use "
                "inner=keras.optimizers.SGD(...) to follow C."
            )
        if rates is not None:
            rates = _float32_rates(rates, rule, steps)
        problems = rule.mismatches(momentum=momentum, nesterov=nesterov, learning_rates=rates,
                                   base_learning_rate=planned)
        if rates is not None and not rates[0] > 0:
            problems.insert(0, f"the optimizer's learning rate at step 0 is {rates[0]:g}")
        if not problems:
            return None
        target = f"update rule ({rule.describe()})"
        if planned is not None:
            target = f"learning rate {float(planned):g} and {target}"
        return (
            f"the update this optimizer runs differs from the {target} the mixing matrix ({objective}) was "
            "optimised for: " + "; ".join(problems) + ". Its noise is still private but no longer optimal. "
            "Solve C for the update you run (solve_mixing_matrix(..., update_rule=UpdateRule(momentum=..., "
            "schedule=...))), or run C's: inner=keras.optimizers.SGD(learning_rate_schedule(rule, "
            "learning_rate=η, steps=T), momentum=rule.momentum) with "
            "rule = UpdateRule.from_metadata(C.metadata.get('update_rule'))."
        )

    def get_config(self):
        config = super().get_config()
        if self.run is not None:  # C, sigma and B are the run's
            for name in ("noise_multiplier", "expected_batch_size"):
                config.pop(name, None)
            config["run"] = self.run.get_config()
            return config
        # banded: {"band_values", "metadata"}; other kinds: {"kind", "steps", <parameters>,
        # "metadata"}; load_mixing reads both back
        config["mixing"] = self._mixing.to_config()
        return config
