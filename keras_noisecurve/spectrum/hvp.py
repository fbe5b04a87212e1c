"""Hessian-vector products of a Keras model's mean loss over a dataset (TensorFlow).

``HessianOperator`` exposes the Hessian H = ∇²L(w) of

    L(w) = (1/n) Σ_{i=1}^{n} ℓ(y_i, f(x_i; w))

over all trainable variables as a flat float64 linear operator: ``matvec(v)`` takes and
returns (p,) float64 numpy vectors (variables in ``model.trainable_variables`` order,
each flattened row-major). Products are computed by double back-propagation with nested
``tf.GradientTape`` (a few gradients' cost; docs/spectrum.md, "Cost"), batch by batch,
each batch contributing
Σ_{i∈batch} ℓ_i / n, so unequal batches are weighted by their example counts exactly.

The model runs in inference mode (``training=False``): dropout is off and batch
normalisation uses its moving statistics, so H is the Hessian of the deterministic
inference-mode loss. Normalisation layers that compute moments (GroupNormalization,
LayerNormalization) get exact second derivatives through ``moments.exact_moments``
(``exact_moments=True``, the default; see that module for the Keras pitfall).

Precision: vectors are cast to the variables' dtype, so a float32 model gives float32-
accurate products (≈1e-7 relative); use a float64 model for tight comparisons.
"""

from __future__ import annotations

import numpy as np

from keras_noisecurve._validation import check_int
from keras_noisecurve.spectrum.losses import output_width, resolve_loss
from keras_noisecurve.spectrum.moments import exact_moments, moment_layers


def flat_weights(variables) -> np.ndarray:
    """Concatenate variables (row-major) into a (p,) float64 vector."""
    return np.concatenate([np.asarray(v.numpy(), dtype=np.float64).reshape(-1) for v in variables])


def assign_flat_weights(variables, flat) -> None:
    """Assign a (p,) vector back into ``variables`` (inverse of ``flat_weights``)."""
    flat = np.asarray(flat, dtype=np.float64).reshape(-1)
    offset = 0
    for v in variables:
        size = int(np.prod(v.shape))
        v.assign(flat[offset : offset + size].reshape(tuple(int(d) for d in v.shape)).astype(np.dtype(str(v.dtype).split(".")[-1]).name))
        offset += size
    if offset != flat.size:
        raise ValueError(f"flat vector has {flat.size} entries, the variables {offset}.")


class HessianOperator:
    """H = ∇²(mean loss over (x, y)) of a Keras model as a flat float64 operator.

    Args:
      model: a built Keras model (TensorFlow backend).
      x: (n, ...) inputs (numpy array or tensor).
      y: (n, ...) labels matching ``loss``.
      loss: ``None`` (compiled loss, else inferred from the last activation), a loss
        name, a ``keras.losses.Loss`` or a function (y_true, y_pred) → per-example losses.
      batch_size: examples per HVP batch (memory vs speed; results do not depend on it).
      strategy: optional ``tf.distribute.Strategy``; each batch is split over replicas
        and the products are summed (the model's variables may live outside its scope).
      exact_moments: trace HVPs with exact moments (see ``keras_noisecurve.spectrum.moments``).

    Attributes:
      dimension: p, number of trainable parameters.
      num_hvps: Hessian-vector products computed so far (a matmat of c columns counts c).
      variables: the model's trainable variables, in flat-vector order.
      moment_layers: normalisation layers found in the model.
    """

    def __init__(self, model, x, y, *, loss=None, batch_size: int = 256, strategy=None, exact_moments: bool = True):
        import tensorflow as tf

        x = np.asarray(x) if not tf.is_tensor(x) else x
        y = np.asarray(y) if not tf.is_tensor(y) else y
        n = int(x.shape[0])
        if n == 0:
            raise ValueError("x must contain at least one example.")
        if int(y.shape[0]) != n:
            raise ValueError(f"x and y must have the same number of examples, got {n} and {int(y.shape[0])}.")
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        self.model = model
        if not model.built:
            model(x[:1], training=False)
        self.variables = list(model.trainable_variables)
        if not self.variables:
            raise ValueError("the model has no trainable variables.")
        self.shapes = [tuple(int(d) for d in v.shape) for v in self.variables]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.dimension = int(sum(self.sizes))
        self.num_examples = n
        self.resolved_loss = resolve_loss(model, loss, num_outputs=output_width(model, x))
        self.loss_fn = self.resolved_loss.fn
        self.strategy = strategy
        self.exact_moments = bool(exact_moments)
        self.moment_layers = moment_layers(model)
        self.num_hvps = 0
        self.num_gradients = 0
        self._batches = []
        for start in range(0, n, self.batch_size):
            xb = tf.convert_to_tensor(x[start : start + self.batch_size])
            yb = tf.convert_to_tensor(y[start : start + self.batch_size])
            self._batches.append((xb, yb))
        self._inv_n = 1.0 / n
        self._hvp_fn = None
        self._hmm_fn = None
        self._grad_fn = None

    # ------------------------------------------------------------------ helpers
    def _split(self, flat):
        import tensorflow as tf

        parts = []
        offset = 0
        for v, shape, size in zip(self.variables, self.shapes, self.sizes):
            parts.append(tf.constant(flat[offset : offset + size].reshape(shape), dtype=v.dtype))
            offset += size
        return parts

    def _split_columns(self, mat):
        import tensorflow as tf

        c = mat.shape[1]
        parts = []
        offset = 0
        for v, shape, size in zip(self.variables, self.shapes, self.sizes):
            block = mat[offset : offset + size].T.reshape((c,) + shape)
            parts.append(tf.constant(block, dtype=v.dtype))
            offset += size
        return parts

    def _batch_loss(self, xb, yb):
        import tensorflow as tf

        pred = self.model(xb, training=False)
        values = self.loss_fn(yb, pred)
        dtype = self.variables[0].dtype
        # tf.constant with an explicit dtype: tf.cast(python_float) would round 1/n to float32.
        return tf.reduce_sum(tf.cast(values, dtype)) * tf.constant(self._inv_n, dtype=dtype)

    def _context(self):
        import contextlib

        return exact_moments() if self.exact_moments else contextlib.nullcontext()

    def _build(self):
        import tensorflow as tf

        variables = self.variables

        def hvp_replica(xb, yb, tangents):
            with tf.GradientTape() as outer:
                with tf.GradientTape() as inner:
                    value = self._batch_loss(xb, yb)
                grads = inner.gradient(value, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
                dot = tf.add_n([tf.reduce_sum(g * t) for g, t in zip(grads, tangents)])
            return outer.gradient(dot, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)

        def hmm_replica(xb, yb, tangents):
            with tf.GradientTape() as outer:
                with tf.GradientTape() as inner:
                    value = self._batch_loss(xb, yb)
                grads = inner.gradient(value, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
                dots = tf.add_n(
                    [tf.reduce_sum(tf.reshape(g, (1, -1)) * tf.reshape(t, (tf.shape(t)[0], -1)), axis=1) for g, t in zip(grads, tangents)]
                )
            return outer.jacobian(dots, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO, experimental_use_pfor=True)

        def grad_replica(xb, yb):
            with tf.GradientTape() as tape:
                value = self._batch_loss(xb, yb)
            return tape.gradient(value, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO), value

        strategy = self.strategy
        if strategy is None:
            self._hvp_fn = tf.function(hvp_replica, reduce_retracing=True)
            self._hmm_fn = tf.function(hmm_replica, reduce_retracing=True)
            self._grad_fn = tf.function(grad_replica, reduce_retracing=True)
            return

        def distributed(fn):
            @tf.function(reduce_retracing=True)
            def run(dist_x, dist_y, *rest):
                per_replica = strategy.run(fn, args=(dist_x, dist_y) + rest)
                return tf.nest.map_structure(
                    lambda t: strategy.reduce(tf.distribute.ReduceOp.SUM, t, axis=None), per_replica
                )

            return run

        self._hvp_fn = distributed(hvp_replica)
        self._hmm_fn = distributed(hmm_replica)
        self._grad_fn = distributed(grad_replica)

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

    def _run_batches(self, fn, *extra):
        total = None
        with self._context():
            if self._hvp_fn is None:
                self._build()
            for xb, yb in self._batches:
                if self.strategy is None:
                    out = fn(xb, yb, *extra)
                else:
                    dist_x, dist_y = self._shards(xb, yb)
                    out = fn(dist_x, dist_y, *extra)
                import tensorflow as tf

                out = [np.asarray(t.numpy(), dtype=np.float64) for t in tf.nest.flatten(out)]
                total = out if total is None else [a + b for a, b in zip(total, out)]
        return total

    # ------------------------------------------------------------------ public
    def matvec(self, v) -> np.ndarray:
        """H·v for a (p,) vector; returns (p,) float64."""
        v = np.asarray(v, dtype=np.float64).reshape(-1)
        if v.size != self.dimension:
            raise ValueError(f"v must have {self.dimension} entries (the number of parameters), got {v.size}.")
        tangents = self._split(v)
        parts = self._run_batches(lambda xb, yb: self._hvp_fn(xb, yb, tangents))
        self.num_hvps += 1
        return np.concatenate([p.reshape(-1) for p in parts])

    __call__ = matvec

    def matmat(self, V) -> np.ndarray:
        """H·V for a (p, c) matrix (c products vectorised with ``pfor``); returns (p, c) float64."""
        V = np.asarray(V, dtype=np.float64)
        if V.ndim != 2 or V.shape[0] != self.dimension:
            raise ValueError(f"V must have shape ({self.dimension}, c), got {V.shape}.")
        c = V.shape[1]
        tangents = self._split_columns(V)
        parts = self._run_batches(lambda xb, yb: self._hmm_fn(xb, yb, tangents))
        self.num_hvps += c
        return np.concatenate([p.reshape(c, -1) for p in parts], axis=1).T

    def gradient(self) -> np.ndarray:
        """∇L(w) at the current weights, (p,) float64 (first derivatives need no patch)."""
        parts = self._run_batches(lambda xb, yb: self._grad_fn(xb, yb))
        self.num_gradients += 1
        return np.concatenate([p.reshape(-1) for p in parts[:-1]])

    def loss(self) -> float:
        """L(w), the mean loss over the dataset at the current weights."""
        parts = self._run_batches(lambda xb, yb: self._grad_fn(xb, yb))
        return float(parts[-1])

    def flat_weights(self) -> np.ndarray:
        """Current weights as a (p,) float64 vector (same order as ``matvec``)."""
        return flat_weights(self.variables)

    def assign(self, flat) -> None:
        """Set the model's weights from a (p,) vector."""
        assign_flat_weights(self.variables, flat)
