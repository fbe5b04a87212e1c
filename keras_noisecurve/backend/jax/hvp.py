"""Derivatives of a Keras model's loss on the JAX backend, for the spectrum.

The JAX implementation of ``keras_noisecurve.backend.tensorflow.hvp`` (same functions,
same numpy edges). The loss is a pure function of the trainable values through
``model.stateless_call``; the Hessian-vector product is forward-over-reverse,

    H·v = d/dε ∇L(w + εv) |_{ε=0} = jax.jvp(jax.grad(L), (w,), (v,))[1],

about the cost of two gradients, jitted (one trace per batch shape). c products at
once are ``jax.vmap`` of that over the tangents. Weights are read from the model's
variables at every call, so assigning new weights needs no retrace. Keras's JAX
``moments`` computes the variance with ``jnp.var`` (no stop-gradient on the mean), so
second derivatives through GroupNormalization/LayerNormalization are exact here without
the patch the TensorFlow backend needs. Imports no TensorFlow.
"""

from __future__ import annotations

import numpy as np

from keras_noisecurve.backend.common.calls import training_kwargs

__all__ = ["EXACT_MOMENTS", "HVPEngine", "per_example_gradient_norms", "sgd_step_fn"]

#: whether Hessian-vector products through ``keras.ops.moments`` are exact: yes, Keras's
#: ``moments`` computes the variance with ``jnp.var``, whose derivatives follow the mean
EXACT_MOMENTS = True


def _values(variables):
    return [v.value for v in variables]


def _loss_of(model, loss_fn, *, training: bool, reduce: str, inv_n: float = 1.0):
    """f(trainable, non_trainable, xb, yb) -> (loss, new non_trainable): the batch's summed
    loss times ``inv_n`` (reduce="sum") or its mean (reduce="mean")."""
    import jax.numpy as jnp

    def f(trainable, non_trainable, xb, yb):
        kwargs = training_kwargs(model, training)
        pred, non_trainable = model.stateless_call(trainable, non_trainable, xb, **kwargs)
        dtype = trainable[0].dtype
        values = jnp.asarray(loss_fn(yb, pred)).astype(dtype)
        if reduce == "mean":
            return jnp.mean(values), non_trainable
        return jnp.sum(values) * jnp.asarray(inv_n, dtype=dtype), non_trainable

    return f


class HVPEngine:
    """Products with the Hessian of Σ_{i∈batch} ℓ_i / n, one batch at a time (JAX).

    Args:
      model: a built Keras model; run in inference mode (``training=False``).
      loss_fn: ``(y_true, y_pred) -> (batch,)`` per-example losses.
      inv_n: 1/n, the weight of one example in the mean loss over the whole dataset.
      strategy: must be ``None`` (a ``tf.distribute.Strategy`` has no meaning on JAX).
    """

    def __init__(self, *, model, loss_fn, inv_n: float, strategy=None):
        if strategy is not None:
            raise ValueError(
                f"strategy={type(strategy).__name__} is a tf.distribute.Strategy, which the JAX backend does not use; "
                "pass strategy=None (on JAX the products run on jax.devices()[0]), or set KERAS_BACKEND=tensorflow."
            )
        import jax

        self.model = model
        self.variables = list(model.trainable_variables)
        self.inv_n = float(inv_n)
        loss = _loss_of(model, loss_fn, training=False, reduce="sum", inv_n=inv_n)

        def value(trainable, non_trainable, xb, yb):
            return loss(trainable, non_trainable, xb, yb)[0]

        grad = jax.grad(value)

        def hvp(trainable, non_trainable, xb, yb, tangents):
            return jax.jvp(lambda w: grad(w, non_trainable, xb, yb), (trainable,), (tangents,))[1]

        self._hvp = jax.jit(hvp)
        self._hmm = jax.jit(jax.vmap(hvp, in_axes=(None, None, None, None, 0)))
        self._grad = jax.jit(jax.value_and_grad(value))

    def batch(self, x, y):
        """One batch as JAX arrays (x, y: numpy slices)."""
        import jax.numpy as jnp

        return jnp.asarray(np.asarray(x)), jnp.asarray(np.asarray(y))

    def _state(self):
        return _values(self.variables), _values(self.model.non_trainable_variables)

    def _tangents(self, parts):
        import jax.numpy as jnp

        return [jnp.asarray(p, dtype=v.dtype) for p, v in zip(parts, self.variables)]

    def hvp(self, xb, yb, tangents):
        """H_batch·v per variable: ``tangents`` one numpy array per variable (its shape);
        returns a list of float64 numpy arrays of the same shapes."""
        out = self._hvp(*self._state(), xb, yb, self._tangents(tangents))
        return [np.asarray(t, dtype=np.float64) for t in out]

    def hmm(self, xb, yb, tangents):
        """H_batch·V for c vectors at once (``vmap``): tangents (c, *shape) per variable;
        returns float64 arrays (c, *shape)."""
        out = self._hmm(*self._state(), xb, yb, self._tangents(tangents))
        return [np.asarray(t, dtype=np.float64) for t in out]

    def grad(self, xb, yb):
        """(∇ of the batch's share of the mean loss per variable, that share) as numpy float64."""
        value, grads = self._grad(*self._state(), xb, yb)
        return [np.asarray(g, dtype=np.float64) for g in grads], float(value)


def per_example_gradient_norms(model, x, y, *, loss_fn, batch_size: int) -> np.ndarray:
    """‖∇_w ℓ(y_i, f(x_i; w))‖₂ over all trainable variables, for every example, (n,) float64
    (``jax.vmap`` of one example's gradient over each batch, jitted; inference mode)."""
    import jax
    import jax.numpy as jnp

    loss = _loss_of(model, loss_fn, training=False, reduce="sum")

    def one(trainable, non_trainable, xi, yi):
        grads = jax.grad(lambda w: loss(w, non_trainable, xi[None], yi[None])[0])(trainable)
        return jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in grads))

    norms = jax.jit(jax.vmap(one, in_axes=(None, None, 0, 0)))
    trainable = _values(model.trainable_variables)
    non_trainable = _values(model.non_trainable_variables)
    x = np.asarray(x)
    y = np.asarray(y)
    out = [np.asarray(norms(trainable, non_trainable, jnp.asarray(x[s : s + batch_size]), jnp.asarray(y[s : s + batch_size])))
           for s in range(0, x.shape[0], batch_size)]
    return np.concatenate(out).astype(np.float64)


def sgd_step_fn(model, *, loss_fn, learning_rate: float):
    """``step(xb, yb) -> float`` (numpy batches): one plain SGD step w ← w − η·∇ mean_i ℓ_i
    in training mode (jitted, stateless), written back to the model's variables; returns
    the batch's mean loss. Non-trainable state (seed generators, moving statistics) is
    carried as Keras's own ``fit`` carries it."""
    import jax
    import jax.numpy as jnp

    loss = _loss_of(model, loss_fn, training=True, reduce="mean")
    lr = float(learning_rate)

    @jax.jit
    def step(trainable, non_trainable, xb, yb):
        (value, non_trainable), grads = jax.value_and_grad(loss, has_aux=True)(trainable, non_trainable, xb, yb)
        trainable = [w - jnp.asarray(lr, dtype=w.dtype) * g for w, g in zip(trainable, grads)]
        return trainable, non_trainable, value

    def run(xb, yb):
        trainable, non_trainable, value = step(
            _values(model.trainable_variables), _values(model.non_trainable_variables), jnp.asarray(xb), jnp.asarray(yb)
        )
        for variable, new in zip(model.trainable_variables, trainable):
            variable.assign(new)
        for variable, new in zip(model.non_trainable_variables, non_trainable):
            variable.assign(new)
        return float(value)

    return run
