"""Derivatives of a Keras model's loss on the TensorFlow backend, for the spectrum.

The framework part of :class:`keras_noisecurve.spectrum.HessianOperator`,
``clipping_scale`` and the random-label pre-training: Hessian-vector products of a
batch's loss by double back-propagation (nested ``tf.GradientTape``), optionally split
over the replicas of a ``tf.distribute.Strategy``; per-example gradient norms
(``tf.vectorized_map``); one plain SGD step. The JAX module of the same name
(``keras_noisecurve.backend.jax.hvp``) has the same functions. Everything here takes
and returns numpy arrays at its edges: (p,)-shaped vectors are split per variable by
the caller (``keras_noisecurve.spectrum.hvp``), which also owns validation, batching
arithmetic and the exact-moments context.
"""

from __future__ import annotations

import numpy as np

__all__ = ["EXACT_MOMENTS", "HVPEngine", "per_example_gradient_norms", "sgd_step_fn"]

#: whether Hessian-vector products through ``keras.ops.moments`` are exact: no, Keras's
#: ``moments`` is ``tf.nn.moments``, whose variance stops the mean's gradient (second
#: derivatives miss the mean's path; ``spectrum.moments.exact_moments`` patches it)
EXACT_MOMENTS = False


class HVPEngine:
    """Products with the Hessian of Σ_{i∈batch} ℓ_i / n, one batch at a time.

    Args:
      model: a built Keras model; run in inference mode (``training=False``).
      loss_fn: ``(y_true, y_pred) -> (batch,)`` per-example losses.
      inv_n: 1/n, the weight of one example in the mean loss over the whole dataset.
      strategy: optional ``tf.distribute.Strategy``: each batch is split over its replicas
        and the per-replica results are summed.

    The functions are traced on first use: call them inside the exact-moments context
    (``keras_noisecurve.spectrum.moments.exact_moments``) when products through
    normalisation layers must be exact.
    """

    def __init__(self, *, model, loss_fn, inv_n: float, strategy=None):
        self.model = model
        self.variables = list(model.trainable_variables)
        self.loss_fn = loss_fn
        self.inv_n = float(inv_n)
        self.strategy = strategy
        self._fns = None

    def batch(self, x, y):
        """One batch as framework tensors (x, y: numpy slices or tensors)."""
        import tensorflow as tf

        return tf.convert_to_tensor(x), tf.convert_to_tensor(y)

    def _batch_loss(self, xb, yb):
        import tensorflow as tf

        pred = self.model(xb, training=False)
        values = self.loss_fn(yb, pred)
        dtype = self.variables[0].dtype
        # tf.constant with an explicit dtype: tf.cast(python_float) would round 1/n to float32.
        return tf.reduce_sum(tf.cast(values, dtype)) * tf.constant(self.inv_n, dtype=dtype)

    def _build(self):
        import tensorflow as tf

        variables = self.variables
        zero = tf.UnconnectedGradients.ZERO

        def hvp_replica(xb, yb, tangents):
            with tf.GradientTape() as outer:
                with tf.GradientTape() as inner:
                    value = self._batch_loss(xb, yb)
                grads = inner.gradient(value, variables, unconnected_gradients=zero)
                dot = tf.add_n([tf.reduce_sum(g * t) for g, t in zip(grads, tangents)])
            return outer.gradient(dot, variables, unconnected_gradients=zero)

        def hmm_replica(xb, yb, tangents):
            with tf.GradientTape() as outer:
                with tf.GradientTape() as inner:
                    value = self._batch_loss(xb, yb)
                grads = inner.gradient(value, variables, unconnected_gradients=zero)
                dots = tf.add_n(
                    [tf.reduce_sum(tf.reshape(g, (1, -1)) * tf.reshape(t, (tf.shape(t)[0], -1)), axis=1) for g, t in zip(grads, tangents)]
                )
            return outer.jacobian(dots, variables, unconnected_gradients=zero, experimental_use_pfor=True)

        def grad_replica(xb, yb):
            with tf.GradientTape() as tape:
                value = self._batch_loss(xb, yb)
            return tape.gradient(value, variables, unconnected_gradients=zero), value

        strategy = self.strategy
        if strategy is None:
            self._fns = {name: tf.function(fn, reduce_retracing=True)
                         for name, fn in (("hvp", hvp_replica), ("hmm", hmm_replica), ("grad", grad_replica))}
            return

        def distributed(fn):
            @tf.function(reduce_retracing=True)
            def run(dist_x, dist_y, *rest):
                per_replica = strategy.run(fn, args=(dist_x, dist_y) + rest)
                return tf.nest.map_structure(lambda t: strategy.reduce(tf.distribute.ReduceOp.SUM, t, axis=None), per_replica)

            return run

        self._fns = {"hvp": distributed(hvp_replica), "hmm": distributed(hmm_replica), "grad": distributed(grad_replica)}

    def _shards(self, xb, yb):
        """Per-replica values of a batch (strategy only)."""
        k = self.strategy.num_replicas_in_sync
        n = int(xb.shape[0])
        bounds = [round(i * n / k) for i in range(k + 1)]
        xs = [xb[bounds[i] : bounds[i + 1]] for i in range(k)]
        ys = [yb[bounds[i] : bounds[i + 1]] for i in range(k)]
        dist_x = self.strategy.experimental_distribute_values_from_function(lambda ctx: xs[ctx.replica_id_in_sync_group])
        dist_y = self.strategy.experimental_distribute_values_from_function(lambda ctx: ys[ctx.replica_id_in_sync_group])
        return dist_x, dist_y

    def _call(self, name, xb, yb, *extra):
        import tensorflow as tf

        if self._fns is None:
            self._build()
        if self.strategy is not None:
            xb, yb = self._shards(xb, yb)
        out = self._fns[name](xb, yb, *extra)
        return [np.asarray(t.numpy(), dtype=np.float64) for t in tf.nest.flatten(out)]

    def _tangents(self, parts):
        import tensorflow as tf

        return [tf.constant(p, dtype=v.dtype) for p, v in zip(parts, self.variables)]

    def hvp(self, xb, yb, tangents):
        """H_batch·v per variable: ``tangents`` one numpy array per variable (its shape);
        returns a list of float64 numpy arrays of the same shapes."""
        return self._call("hvp", xb, yb, self._tangents(tangents))

    def hmm(self, xb, yb, tangents):
        """H_batch·V for c vectors at once (``pfor``): tangents (c, *shape) per variable;
        returns float64 arrays (c, *shape)."""
        return self._call("hmm", xb, yb, self._tangents(tangents))

    def grad(self, xb, yb):
        """(∇ of the batch's share of the mean loss per variable, that share) as numpy float64."""
        out = self._call("grad", xb, yb)
        return out[:-1], float(out[-1])


def per_example_gradient_norms(model, x, y, *, loss_fn, batch_size: int) -> np.ndarray:
    """‖∇_w ℓ(y_i, f(x_i; w))‖₂ over all trainable variables, for every example, (n,) float64
    (``tf.vectorized_map`` over each batch of ``batch_size`` examples; inference mode)."""
    import tensorflow as tf

    variables = model.trainable_variables

    @tf.function(reduce_retracing=True)
    def norms(xb, yb):
        def one(args):
            xi, yi = args
            with tf.GradientTape() as tape:
                pred = model(xi[None], training=False)
                value = tf.reduce_sum(tf.cast(loss_fn(yi[None], pred), variables[0].dtype))
            grads = tape.gradient(value, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads]))

        return tf.vectorized_map(one, (xb, yb))

    x = np.asarray(x)
    y = np.asarray(y)
    out = []
    for start in range(0, x.shape[0], batch_size):
        out.append(norms(tf.convert_to_tensor(x[start : start + batch_size]), tf.convert_to_tensor(y[start : start + batch_size])).numpy())
    return np.concatenate(out).astype(np.float64)


def sgd_step_fn(model, *, loss_fn, learning_rate: float):
    """``step(xb, yb) -> float`` (numpy batches): one plain SGD step w ← w − η·∇ mean_i ℓ_i
    in training mode, in place on the model's variables; returns the batch's mean loss."""
    import keras
    import tensorflow as tf

    optimizer = keras.optimizers.SGD(learning_rate=learning_rate)
    variables = model.trainable_variables

    @tf.function(reduce_retracing=True)
    def step(xb, yb):
        with tf.GradientTape() as tape:
            pred = model(xb, training=True)
            value = tf.reduce_mean(tf.cast(loss_fn(yb, pred), variables[0].dtype))
        grads = tape.gradient(value, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        optimizer.apply(grads, variables)
        return value

    return lambda xb, yb: float(step(tf.convert_to_tensor(xb), tf.convert_to_tensor(yb)))
