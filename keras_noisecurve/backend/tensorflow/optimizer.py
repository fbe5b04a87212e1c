"""The TensorFlow half of ``NoiseCurveOptimizer`` (``keras_noisecurve.training.optimizer``): the slot variables'
creation, the per-step noise work and the per-variable update in TensorFlow ops.

``NoiseCurveOptimizer`` inherits from :class:`OptimizerBackend` of the backend in use
(this module under ``KERAS_BACKEND=tensorflow``, ``keras_noisecurve.backend.jax.optimizer``
under JAX), picked once when ``keras_noisecurve.training.optimizer`` is imported
(``backend.module("optimizer")``). Its hooks: ``_dp_check_inner_strategy``,
``_dp_key_variable``, ``_dp_state_variable``, ``_dp_check_inner_steps``,
``_dp_read_position`` and ``update_step`` (whose update, ĝ = (S + ζσz̃)/B, is ``backend.common.update``, every
backend's); what they need of the optimizer (the noise
stream, the variable index, the inner optimizer) they reach through ``self``.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_noisecurve import _compat
from keras_noisecurve.backend.common import update
from keras_noisecurve.backend.tensorflow.noise import normal_from_seed, step_seed, variable_seed

__all__ = ["STEP_DTYPE", "OptimizerBackend", "executing_eagerly"]

#: the dtype of the optimizer's step counter (``iterations``), given to a learning-rate schedule
STEP_DTYPE = "int64"


def executing_eagerly() -> bool:
    """Whether values can be read now: ``tf.executing_eagerly()`` (False inside a ``tf.function``)."""
    return bool(tf.executing_eagerly())


class OptimizerBackend:
    """TensorFlow implementation of the backend hooks of ``NoiseCurveOptimizer``."""

    def _dp_check_inner_strategy(self, inner):
        if _compat.distribution_strategy(inner) is not _compat.distribution_strategy(self):
            raise ValueError(
                f"the inner optimizer {type(inner).__name__} was created under another tf.distribute "
                f"strategy ({type(_compat.distribution_strategy(inner)).__name__}) than this optimizer "
                f"({type(_compat.distribution_strategy(self)).__name__}): its slot variables would not be "
                "mirrored like the model's. Create both inside the same `with strategy.scope():`."
            )

    def _dp_key_variable(self, key, name):
        """An int64 (2,) variable holding ``key``."""
        return self.add_variable(
            shape=(2,),
            dtype="int64",
            initializer=lambda shape, dtype=None: tf.constant(key, dtype=tf.int64),
            name=name,
        )

    def _dp_state_variable(self, var, shape, name):
        """The noise-state variable of model variable ``var``, colocated with it."""
        colocate = var.value if hasattr(var, "value") else var
        with _compat.distribution_strategy(self).extended.colocate_vars_with(colocate):
            return self.add_variable(shape=shape, dtype=var.dtype, name=name)

    def _dp_check_inner_steps(self, inner):
        if tf.executing_eagerly() and int(inner.iterations.numpy()) != int(self.iterations.numpy()):
            raise ValueError(
                f"the inner optimizer {type(inner).__name__} has already taken {int(inner.iterations.numpy())} "
                f"steps of its own (this optimizer: {int(self.iterations.numpy())}): its schedule and slots "
                "would not follow the private steps. Pass a fresh (unbuilt) optimizer as inner."
            )

    def _dp_read_position(self):
        """``(step, sampling key int64 (2,))`` read from the variables."""
        return int(self.iterations.value.numpy()), np.asarray(self._sampling_key.value.numpy(), dtype=np.int64)

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
        index = self._dp_variable_index(variable)
        noise = self._step_noise or _StepNoise(self)
        dtype = variable.dtype
        std = self._dp_noise_std(dtype)
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
        update.apply_update(self, gradient, variable, learning_rate, noise_term)


    def _dp_count_normal(self, stream):
        """The N(0, 1) draw of step t's count query (an adaptive clip's), float32 scalar:
        ``normal_from_seed(variable_seed(step_seed(key, t), stream))``, as on JAX."""
        seed = variable_seed(step_seed(self._noise_key, self.iterations), stream)
        return normal_from_seed(seed, [1], tf.float32)[0]

    def _dp_check_adaptive_replicas(self):
        """An adaptive clip under ``tf.distribute`` with several replicas is refused: each
        replica would count only its own examples."""
        replicas = _compat.distribution_strategy(self).num_replicas_in_sync
        if replicas > 1:
            raise ValueError(
                f"an adaptive clip (AdaptiveClip) is not supported under tf.distribute with {replicas} replicas: the "
                "count query would see one replica's examples. Train on one replica, use a fixed l2_norm_clip, or "
                "use the JAX backend (keras.distribution), where the count covers the global batch.")


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
