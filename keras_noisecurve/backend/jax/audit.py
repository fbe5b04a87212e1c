"""What the audits need from JAX (:mod:`keras_noisecurve.audit.mechanism_clipping`,
:mod:`keras_noisecurve.audit.input_canaries`): the independent references, one ``jax.grad`` of
the model's ``stateless_call`` per example and the canaries' ``jax.jacrev``, and the scope in
which a float64 clone computes in float64. (The engine's side is the private model's
``_dp_engine_run``, in :mod:`keras_noisecurve.backend.jax.dp_model`.)"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["float64_scope", "loss_jacobian", "reference_grads"]


def float64_scope():
    """Where a float64 clone is built and differentiated: JAX computes in float64 only with
    ``jax_enable_x64`` on (``jax.enable_x64(True)``; on older JAX
    ``jax.experimental.enable_x64()``), and Keras's dtype promotion on JAX maps float64 to
    float32 whatever that flag says, so that a ``GroupNormalization`` or ``LayerNormalization``
    of the clone would normalise in float32 (a reference no more exact than the float32 model
    it checks): the scope also keeps Keras's float64 (``_compat.float64_promotion``)."""
    from keras_noisecurve import _compat

    enable = getattr(jax, "enable_x64", None)
    if enable is not None:
        x64 = enable(True)
    else:
        from jax.experimental import enable_x64  # JAX < 0.6

        x64 = enable_x64()

    @contextlib.contextmanager
    def scope():
        with x64, _compat.float64_promotion():
            yield

    return scope()


def _values(model):
    return ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables])


def reference_grads(model, loss_fn, x, y, w, *, float64):
    """(P, per-variable) float64 numpy gradients of each example's weighted loss w_i·loss_i:
    one ``jax.grad`` of ``model.stateless_call`` per example (no ``vmap``, no code shared with
    any engine), in float64 (``float64``: a clone built in :func:`float64_scope`, and called
    inside it) or float32."""
    dtype = jnp.float64 if float64 else jnp.float32
    trainable, non_trainable = _values(model)

    def cast(a):
        a = jnp.asarray(a)
        return a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a

    @jax.jit
    def one(tv, xi, yi, wi):
        def loss(tv):
            y_pred, _ = model.stateless_call(tv, non_trainable, xi, training=False)
            return jnp.sum(jnp.asarray(loss_fn(yi, y_pred)).astype(dtype)) * wi.astype(dtype)

        return jax.grad(loss)(tv)

    out = []
    for i in range(len(w)):
        xi, yi = (jax.tree_util.tree_map(lambda a: cast(np.asarray(a)[i:i + 1]), t) for t in (x, y))
        grads = one(trainable, xi, yi, jnp.asarray(w[i]))
        out.append([np.asarray(g, np.float64) for g in grads])
    return out


def loss_jacobian(model):
    """A function (x, y) → numpy per-example jacobians of (f(x)[:, 0] − y[:, 0])² over
    ``model``'s trainable variables at their current values (one (m, *shape) array per
    variable): ``jax.jacrev`` of ``model.stateless_call``, the input-canary audit's reference
    gradients."""

    @jax.jit
    def jacobian(trainable, non_trainable, x, y):
        def losses(tv):
            y_pred, _ = model.stateless_call(tv, non_trainable, x, training=False)
            return jnp.square(y_pred[:, 0] - y[:, 0])

        return jax.jacrev(losses)(trainable)

    def call(x, y):
        trainable, non_trainable = _values(model)
        return [np.asarray(j) for j in jacobian(trainable, non_trainable, x, y)]

    return call
