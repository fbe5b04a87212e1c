"""Keras 3 optimizers for private training: ``NoiseCurveOptimizer`` (the noise of a
mixing matrix C: DP-SGD for C = I, DP-BandMF, NoiseCurve) and its base ``DPOptimizer``
(C = I without a step plan). docs/training.md, "DP-SGD", says which to use.

Update rule (docs/design.md#update-rule, paper App. C), at step
t = ``optimizer.iterations``::

    ĝ_t = (Σ_i clip(g_i, ζ) + ζ·σ·z̃_t) / B          B = expected batch size
    w   ← w − η·ĝ_t                                   plain SGD, no momentum

The optimizer receives the CLIPPED SUM Σ_i clip(g_i, ζ) (from ``DPModel`` or a
clipping engine) through :meth:`DPOptimizer.apply_clipped_sum`; the ordinary
``apply``/``apply_gradients`` entry points refuse to run, so a plain
``keras.Model`` can never train through it without per-example clipping.

Momentum, weight decay, gradient clipping of the noisy sum, EMA, loss scaling and
gradient accumulation are refused: the mixing-matrix objective (paper eq. 1)
assumes exactly w ← w − η·ĝ_t, and clipping after the sum would not bound any
example's contribution.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_noisecurve._validation import check_float, check_int
from keras_noisecurve.mixing.matrix import load_mixing
from keras_noisecurve.training.noise import BandedNoise, key_from_seed, normal_from_seed, step_seed, variable_seed

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
        "regularizer (data-independent, so it is not clipped) to the loss instead",
    ),
}
# accepted with their defaults only (they appear in the base class config)
_IGNORED_DEFAULTS = {"ema_momentum": 0.99, "ema_overwrite_frequency": None}


def _check_backend():
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


@keras.saving.register_keras_serializable(package=_PACKAGE)
class DPOptimizer(keras.optimizers.Optimizer):
    """DP-SGD for Keras 3: clipped sum in, independent Gaussian noise, mean over B.

    ``w ← w − η·(Σ_i clip(g_i, ζ) + ζ·σ·z_t) / B`` with z_t ~ N(0, I), i.e. C = I, at
    every step, with no step plan. The base class of ``NoiseCurveOptimizer``, which
    holds the whole update; ``DPOptimizer(...)`` is ``NoiseCurveOptimizer(mixing="dpsgd", ...)``
    (same noise, draw for draw).

    Args:
      learning_rate: η > 0 (float) or a ``keras.optimizers.schedules.LearningRateSchedule``.
      l2_norm_clip: ζ > 0, the per-example L2 clipping norm (used by ``DPModel``).
      noise_multiplier: σ ≥ 0; the noise standard deviation is ζ·σ on the sum.
      expected_batch_size: B ≥ 1, the EXPECTED batch size of the (Poisson) sampler.
        The sum is divided by B, never by the actual batch size (which would leak it).
      seed: ``None`` (default): a secret key from OS entropy. An integer makes the
        noise reproducible, for tests only: knowing it voids the privacy guarantee.
      name: optimizer name.

    Plain SGD only: no momentum, weight decay, EMA, clipnorm/clipvalue/global_clipnorm,
    loss scaling or gradient accumulation (each raises ``ValueError``). There is no
    step limit: the way to ask for DP-SGD is
    ``NoiseCurveOptimizer(mixing=MixingMatrix.identity(T))``, which refuses steps
    beyond the privacy plan of T steps like every other C (docs/training.md, "DP-SGD").
    """

    def __init__(
        self,
        learning_rate=0.01,
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        expected_batch_size=None,
        seed=None,
        name="dp_optimizer",
        **kwargs,
    ):
        _check_backend()
        kwargs = _check_kwargs(dict(kwargs))
        l2_norm_clip = check_float("l2_norm_clip", l2_norm_clip, positive=True)
        noise_multiplier = check_float("noise_multiplier", noise_multiplier, nonnegative=True)
        if expected_batch_size is None:
            raise ValueError(
                "expected_batch_size is required: the noisy sum is divided by the EXPECTED batch "
                "size B of the sampler (e.g. banded_poisson_dataset's batch_size), got None."
            )
        expected_batch_size = check_int("expected_batch_size", expected_batch_size, minimum=1)
        if seed is not None:
            seed = check_int("seed", seed, minimum=0, maximum=2**63 - 1)
        if not isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule) and not callable(
            learning_rate
        ):
            learning_rate = check_float("learning_rate", learning_rate, positive=True)
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self.l2_norm_clip = l2_norm_clip
        self.noise_multiplier = noise_multiplier
        self.expected_batch_size = expected_batch_size
        self.seed = seed
        self._mixing = "dpsgd"  # C = I without a step plan; NoiseCurveOptimizer sets its C
        self._noise = _noise_of(self._mixing)
        self._initial_key = key_from_seed(seed)
        self._private_apply = False
        self._step_noise = None  # _StepNoise while one step's updates are built

    # ------------------------------------------------------------- noise source
    @property
    def mixing(self):
        """The mixing matrix: a ``MixingMatrix``, or ``"dpsgd"`` (C = I, no step plan)."""
        return self._mixing

    @property
    def noise(self) -> BandedNoise:
        """The online noise generator (``BandedNoise``)."""
        return self._noise

    def noise_state_bytes(self) -> int:
        """Bytes of the ring buffers (0 for DP-SGD); the optimizer must be built."""
        if not self.built:
            return 0
        return int(sum(np.prod(r.shape) * np.dtype(r.dtype).itemsize for r in self._rings if r is not None))

    # -------------------------------------------------------------------- build
    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        key = self._initial_key
        self._noise_key = self.add_variable(
            shape=(2,),
            dtype="int64",
            initializer=lambda shape, dtype=None: tf.constant(key, dtype=tf.int64),
            name="noise_key",
        )
        self._rings = []
        for var in variables:
            shape = self._noise.ring_shape(var.shape)
            if shape is None:
                self._rings.append(None)
                continue
            colocate = var.value if isinstance(var, keras.Variable) else var
            with self._distribution_strategy.extended.colocate_vars_with(colocate):
                ring = self.add_variable(
                    shape=shape,
                    dtype=var.dtype,
                    name=f"{getattr(var, 'path', var.name).replace('/', '_')}_noise_ring",
                )
            self._rings.append(ring)

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

        The update is ``w ← w − η·(sum + ζ·σ·z̃_t)/B`` for every variable.
        """
        self._private_apply = True
        try:
            return super().apply(grads, trainable_variables)
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
        return super().apply(grads, trainable_variables)

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
        """``variable ← variable − (η/B)·(gradient + ζσ·z̃_t)`` (gradient = clipped sum).

        z̃_t = z_t / C[t, t] for b = 1 (the scale ζσ/C[t, t] is folded into the draw);
        for b ≥ 2 the ring buffer gives z̃_t and slot t mod (b − 1) is overwritten.
        """
        index = self._get_variable_index(variable)
        noise = self._step_noise or _StepNoise(self)
        dtype = variable.dtype
        std = self.l2_norm_clip * self.noise_multiplier
        seed = variable_seed(noise.seed, index)
        row = noise.row(dtype)
        ring = self._rings[index]
        if ring is None:  # b = 1: no buffer, z̃_t = z_t / C[t, t]
            scale = std if row is None else std / row[0]
            noise_term = normal_from_seed(seed, variable.shape, dtype, scale=scale)
        else:
            z = normal_from_seed(seed, variable.shape, dtype)
            z_tilde = self._noise.combine(z, noise.step, ring.value, row=row)
            # write only slot t mod (b − 1), in place
            slot = tf.reshape(self._noise.slot(noise.step), [1])
            self.assign(ring, tf.IndexedSlices(z_tilde[None], slot, tf.shape(ring.value)))
            noise_term = tf.cast(std, dtype) * z_tilde
        rate = tf.cast(learning_rate, dtype) / tf.cast(self.expected_batch_size, dtype)
        self.assign_sub(variable, rate * (tf.cast(gradient, dtype) + noise_term))

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
        return config


def _noise_of(mixing) -> BandedNoise:
    """The online noise generator of a resolved ``mixing`` (``"dpsgd"``: C = I, no plan)."""
    return BandedNoise(None if mixing == "dpsgd" else mixing.band_values)


class _StepNoise:
    """What all variables of one step share: the step t, its seed ``step_seed(key, t)``
    (computed after the privacy-plan check, so no update runs past step T) and the
    row t of C per dtype."""

    def __init__(self, optimizer):
        self._noise = optimizer.noise
        self.step = optimizer.iterations
        self._checks = [op for op in [self._noise.assert_in_plan(self.step)] if op is not None]
        with tf.control_dependencies(self._checks):
            self.seed = step_seed(optimizer._noise_key, self.step)
        self._rows = {}

    def row(self, dtype):
        """``(C[t, t], C[t, t − 1], …)`` in ``dtype`` (b,), or ``None`` for C = I; read
        after the plan check (row T does not exist)."""
        dtype = tf.as_dtype(dtype)
        if dtype not in self._rows:
            with tf.control_dependencies(self._checks):
                self._rows[dtype] = self._noise.row(self.step, dtype)
        return self._rows[dtype]


@keras.saving.register_keras_serializable(package=_PACKAGE)
class NoiseCurveOptimizer(DPOptimizer):
    """DP-SGD with banded correlated noise z̃_t = (C⁻¹Z)_t of a mixing matrix C.

    ``w ← w − η·(Σ_i clip(g_i, ζ) + ζ·σ·z̃_t) / B`` (docs/design.md#update-rule;
    paper App. C), with z̃ computed online from a ring buffer of b − 1 past values per
    variable.

    Args:
      mixing: anything ``keras_noisecurve.mixing.load_mixing`` reads: a ``MixingMatrix``
        (T steps, b bands; ``MixingMatrix.identity(T)`` is DP-SGD), the path of a
        ``.npz`` artifact, the config dict ``get_config`` writes, or ``"dpsgd"`` (C = I
        without a step plan, what ``DPOptimizer`` does). Training refuses step t ≥ T
        (the privacy plan is spent): the step fails with an error.
      learning_rate, l2_norm_clip, noise_multiplier, expected_batch_size, seed, name:
        as ``DPOptimizer``. A learning rate that differs from
        ``mixing.metadata["learning_rate"]`` warns (C was optimised for that η);
        a learning-rate schedule warns unless the objective is ``dpsgd``.
    """

    def __init__(
        self,
        learning_rate=0.01,
        mixing="dpsgd",
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        expected_batch_size=None,
        seed=None,
        name="noisecurve_optimizer",
        **kwargs,
    ):
        mixing = load_mixing(mixing)
        super().__init__(
            learning_rate=learning_rate,
            l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            seed=seed,
            name=name,
            **kwargs,
        )
        self._mixing = mixing
        self._noise = _noise_of(mixing)
        if self._mixing != "dpsgd":
            meta = self._mixing.metadata
            objective = meta.get("objective", "unknown")
            planned = meta.get("learning_rate")
            if isinstance(learning_rate, (int, float)) and planned is not None:
                if not np.isclose(float(learning_rate), float(planned), rtol=1e-6, atol=0.0):
                    warnings.warn(
                        f"learning_rate={learning_rate} differs from the learning rate {planned} the mixing "
                        f"matrix ({objective}) was optimised for; its noise is no longer optimal.",
                        stacklevel=2,
                    )
            if not isinstance(learning_rate, (int, float)) and objective != "dpsgd":
                warnings.warn(
                    f"a learning-rate schedule is used with a {objective!r} mixing matrix, whose objective "
                    "assumes a constant learning rate; the noise is still private but no longer optimal.",
                    stacklevel=2,
                )

    def get_config(self):
        config = super().get_config()
        if self._mixing == "dpsgd":
            config["mixing"] = "dpsgd"
        else:
            config["mixing"] = {
                "band_values": self._mixing.band_values.tolist(),
                "metadata": self._mixing.metadata,
            }
        return config
