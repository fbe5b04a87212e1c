"""The JAX half of ``NoiseCurveOptimizer`` (``keras_noisecurve.training.optimizer``):
slot variables, the per-variable noisy update, in ``jax.numpy``.

The optimizer inherits from :class:`OptimizerBackend` under ``KERAS_BACKEND=jax``. On
JAX, Keras runs an optimizer step through ``stateless_apply`` (variable assignments
recorded in a ``StatelessScope`` under ``jax.jit``): ``update_step`` reads and assigns
Keras variables as on TensorFlow, and Keras turns it into a pure function.

The keys are stored as 32-bit words: JAX has no int64 without ``jax_enable_x64``
(never enabled here), so the noise key (int64 (2,) on TensorFlow) is the int32 (4,)
variable of its four uint32 words (``noise.key_words``), and the sampling key the int32
(4,) view of its two int64 words (read back exactly by :meth:`_dp_read_position`).

The noise of step t for variable k is ``normal_from_seed(variable_seed(step_seed(words,
t), k))`` of ``keras_noisecurve.backend.jax.noise``: the same z_t as TensorFlow's for the
same key, drawn for all variables of a step in one pass (``variable_normals``). The update, as on TensorFlow::

    ĝ = (S + ζσ·z̃_t) / B,   w ← w − η·ĝ   (or inner.update_step(ĝ, w, η_t))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from keras_noisecurve.backend.common import messages, update
from keras_noisecurve.backend.jax import noise as jax_noise
from keras_noisecurve.backend.jax import pipeline as jax_pipeline
from keras_noisecurve.backend.jax import sharding as jax_sharding

__all__ = ["STEP_DTYPE", "OptimizerBackend", "executing_eagerly", "int64_words", "words_int64"]

#: the dtype of the optimizer's step counter, given to a learning-rate schedule: JAX without
#: x64 has no int64 (Keras's counters are int32)
STEP_DTYPE = "int32"


def executing_eagerly() -> bool:
    """Whether values can be read now: always, outside a trace (Keras builds the optimizer
    outside ``jit``)."""
    return True


def int64_words(key) -> np.ndarray:
    """An int64 (2,) key as its int32 (4,) words (little-endian halves): exact."""
    return np.ascontiguousarray(np.asarray(key, dtype=np.int64)).view(np.int32).copy()


def words_int64(words) -> np.ndarray:
    """The inverse of :func:`int64_words`: int32 (4,) words back to the int64 (2,) key."""
    return np.ascontiguousarray(np.asarray(words, dtype=np.int32)).view(np.int64).copy()


def _is_concrete(value) -> bool:
    return not isinstance(value, jax.core.Tracer)


class OptimizerBackend:
    """JAX implementation of the backend hooks of ``NoiseCurveOptimizer``."""

    def _dp_check_inner_strategy(self, inner):
        return None  # no tf.distribute on JAX: keras.distribution places the variables

    def _dp_key_variable(self, key, name):
        """The key as an int32 (4,) variable: the noise key's uint32 words
        (``noise.key_words``), the sampling key's int64 halves. Under several JAX processes
        the key is process 0's in every process (``pipeline.shared_key``): a secret key
        drawn from OS entropy differs between processes, and the noise and the batches
        must be one."""
        key = jax_pipeline.shared_key(key)
        if name == "noise_key":
            words = np.asarray(jax_noise.key_words(np.asarray(key, np.int64))).astype(np.uint32).view(np.int32)
        else:
            words = int64_words(key)
        return self.add_variable(
            shape=(4,),
            dtype="int32",
            initializer=lambda shape, dtype=None: jnp.asarray(words, dtype=jnp.int32),
            name=name,
        )

    def _dp_state_variable(self, var, shape, name):
        """The noise state ``(buffers, *var.shape)`` of ``var``, zeros, laid out as ``var``
        (``keras.distribution.ModelParallel``): the buffer axis whole, the other axes split
        as the variable's (``sharding.state_layout``), so a device holds the state of its
        own slice of ``var`` only. The layout is given explicitly: a ``LayoutMap`` pattern
        never applies to the state (one such as ``".*kernel.*"`` would match its path and
        give it the variable's rank)."""
        layout = jax_sharding.state_layout(jax_sharding.variable_layout(var), len(var.shape))
        return self.add_variable(shape=shape, dtype=var.dtype, name=name, layout=layout)

    @staticmethod
    def _dp_draw(seed, variable, dtype, scale=None):
        """z_t of ``variable`` (times ``scale``): ``noise.normal_from_seed``, or, for a
        variable sharded over a device mesh, the same values drawn shard by shard
        (``sharding.sharded_normal``: no device draws another device's slice)."""
        layout = jax_sharding.variable_layout(variable)
        if jax_sharding.is_sharded(layout):
            return jax_sharding.sharded_normal(seed, tuple(variable.shape), dtype, jax_sharding.jax_sharding(layout),
                                               scale=scale)
        return jax_noise.normal_from_seed(seed, tuple(variable.shape), dtype, scale=scale)

    def _dp_check_inner_steps(self, inner):
        done, ours = int(np.asarray(inner.iterations.value)), int(np.asarray(self.iterations.value))
        if done != ours:
            raise ValueError(
                f"the inner optimizer {type(inner).__name__} has already taken {done} steps of its own "
                f"(this optimizer: {ours}): its schedule and slots would not follow the private steps. "
                "Pass a fresh (unbuilt) optimizer as inner."
            )

    def _dp_read_position(self):
        """``(step, sampling key int64 (2,))`` read from the variables (host values)."""
        step = int(np.asarray(self.iterations.value))
        return step, words_int64(np.asarray(self._sampling_key.value))

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        """Keras's loop over the variables (``update_step`` for each), with the noise of all
        of them drawn in one pass (``noise.variable_normals``): a traced step holds a fixed
        number of Philox blocks whatever the number of variables."""
        variables = list(trainable_variables)
        for gradient, variable, term in zip(grads, variables, self._dp_noise_terms(variables)):
            self._dp_apply_update(gradient, variable, learning_rate, term)

    def update_step(self, gradient, variable, learning_rate):
        """``ĝ = (gradient + ζσ·z̃_t)/B`` (gradient = the clipped sum), then
        ``variable ← variable − η·ĝ`` or ``inner.update_step(ĝ, variable, η_t)``; one
        variable (a step of the whole model goes through :meth:`_backend_update_step`)."""
        self._dp_apply_update(gradient, variable, learning_rate, self._dp_noise_terms([variable])[0])

    def _dp_noise_terms(self, variables):
        """ζσ·z̃_t of each variable of this step, its noise state advanced (assigned).

        Without noise state z̃_t is z_t times a scalar (``StreamNoise.folded_scale``),
        folded into the draw; with state, ``StreamNoise.advance`` gives z̃_t and the
        state's write, applied functionally (``apply_write``) and assigned. The draws of
        all ``variables`` are one ``noise.variable_normals`` call (variable k's z_t is
        ``normal_from_seed(variable_seed(step_seed(key, t), k))``, as one at a time). Past
        the plan (t ≥ T) a concrete step raises here; under ``jit`` the private model
        refuses the step on the host before it runs."""
        noise = self._noise
        step = self.iterations.value
        if noise.steps is not None and _is_concrete(step) and int(np.asarray(step)) >= noise.steps:
            raise RuntimeError(messages.plan_spent(noise.steps))
        if not variables:
            return []
        words = jax.lax.bitcast_convert_type(self._noise_key.value, jnp.uint32)
        seed = jax_noise.step_seed(words, step)
        indices = [self._dp_variable_index(variable) for variable in variables]
        dtypes = [variable.dtype for variable in variables]
        coefficients = {dtype: noise.step_coefficients(step, dtype) for dtype in dict.fromkeys(dtypes)}
        stds = {dtype: self._dp_noise_std(dtype) for dtype in coefficients}
        states = [self._rings[index] for index in indices]
        scales = [noise.folded_scale(stds[dtype], coefficients[dtype]) if state is None else None
                  for dtype, state in zip(dtypes, states)]
        # the unsharded variables in one pass; a variable sharded over a mesh shard by shard
        # (the same values: variable k's z_t depends on (key, t, k) only)
        sharded = [jax_sharding.is_sharded(jax_sharding.variable_layout(v)) for v in variables]
        plain = [k for k, split in enumerate(sharded) if not split]
        draws = [None] * len(variables)
        if plain:
            joint = jax_noise.variable_normals(seed, [tuple(variables[k].shape) for k in plain],
                                               [dtypes[k] for k in plain], [scales[k] for k in plain],
                                               [indices[k] for k in plain])
            for k, z in zip(plain, joint):
                draws[k] = z
        for k, split in enumerate(sharded):
            if split:
                draws[k] = self._dp_draw(jax_noise.variable_seed(seed, indices[k]), variables[k], dtypes[k],
                                         scale=scales[k])
        terms = []
        for z, dtype, state in zip(draws, dtypes, states):
            if state is None:  # no state: z̃_t = z_t / C[t, t] (or f_0 z_t), scale folded in
                terms.append(z)
                continue
            z_tilde, write = noise.advance(z, step, state.value, coefficients[dtype])
            self.assign(state, noise.apply_write(state.value, write))
            terms.append(jnp.asarray(stds[dtype], dtype) * z_tilde)
        return terms

    def _dp_count_normal(self, stream):
        """The N(0, 1) draw of step t's count query (an adaptive clip's), float32 scalar:
        ``normal_from_seed(variable_seed(step_seed(key, t), stream))``, as on TensorFlow."""
        words = jax.lax.bitcast_convert_type(self._noise_key.value, jnp.uint32)
        seed = jax_noise.variable_seed(jax_noise.step_seed(words, self.iterations.value), stream)
        return jax_noise.normal_from_seed(seed, (1,), jnp.float32)[0]

    def _dp_check_adaptive_replicas(self):
        return None  # one program over all devices: the count is summed over the global batch

    def _dp_apply_update(self, gradient, variable, learning_rate, noise_term):
        """``ĝ = (gradient + noise_term)/B``, then ``variable ← variable − η·ĝ`` or
        ``inner.update_step(ĝ, variable, η_t)`` (``update.apply_update``, every backend's)."""
        update.apply_update(self, gradient, variable, learning_rate, noise_term)
