"""Hessian-vector products of a Keras model's mean loss over a dataset (any backend).

``HessianOperator`` exposes the Hessian H = ∇²L(w) of

    L(w) = (1/n) Σ_{i=1}^{n} ℓ(y_i, f(x_i; w))

over all trainable variables as a flat float64 linear operator: ``matvec(v)`` takes and
returns (p,) float64 numpy vectors (variables in ``model.trainable_variables`` order,
each flattened row-major). Products are computed batch by batch, each batch
contributing Σ_{i∈batch} ℓ_i / n, so unequal batches are weighted by their example
counts exactly. The derivatives come from the backend (``keras_noisecurve.backend``,
module ``hvp``): on TensorFlow by double back-propagation with nested
``tf.GradientTape``, on JAX forward-over-reverse (``jax.jvp`` of ``jax.grad`` through
``model.stateless_call``, jitted); a few gradients' cost either way (docs/spectrum.md,
"Cost"). This module is the same on both: validation, batching, flattening.

The model runs in inference mode (``training=False``): dropout is off and batch
normalisation uses its moving statistics, so H is the Hessian of the deterministic
inference-mode loss. Normalisation layers that compute moments (GroupNormalization,
LayerNormalization) get exact second derivatives through ``moments.exact_moments``
(``exact_moments=True``, the default; see that module for the Keras pitfall, which
only the TensorFlow backend has).

Precision: vectors are cast to the variables' dtype, so a float32 model gives float32-
accurate products (≈1e-7 relative); use a float64 model for tight comparisons (on JAX
that needs ``JAX_ENABLE_X64=1``).
"""

from __future__ import annotations

import contextlib

import numpy as np

from keras_noisecurve import backend
from keras_noisecurve._validation import check_int
from keras_noisecurve.spectrum.losses import output_width, resolve_loss
from keras_noisecurve.spectrum.moments import exact_moments, moment_layers


def _numpy(variable) -> np.ndarray:
    import keras

    return np.asarray(keras.ops.convert_to_numpy(variable.value))


def flat_weights(variables) -> np.ndarray:
    """Concatenate variables (row-major) into a (p,) float64 vector."""
    return np.concatenate([np.asarray(_numpy(v), dtype=np.float64).reshape(-1) for v in variables])


def assign_flat_weights(variables, flat) -> None:
    """Assign a (p,) vector back into ``variables`` (inverse of ``flat_weights``)."""
    flat = np.asarray(flat, dtype=np.float64).reshape(-1)
    offset = 0
    for v in variables:
        size = int(np.prod(v.shape))
        v.assign(flat[offset : offset + size].reshape(tuple(int(d) for d in v.shape)).astype(_numpy(v).dtype))
        offset += size
    if offset != flat.size:
        raise ValueError(f"flat vector has {flat.size} entries, the variables {offset}.")


class HessianOperator:
    """H = ∇²(mean loss over (x, y)) of a Keras model as a flat float64 operator.

    Args:
      model: a built Keras model (TensorFlow or JAX backend).
      x: (n, ...) inputs (numpy array or tensor).
      y: (n, ...) labels matching ``loss``.
      loss: ``None`` (compiled loss, else inferred from the last activation), a loss
        name, a ``keras.losses.Loss`` or a function (y_true, y_pred) → per-example losses.
      batch_size: examples per HVP batch (memory vs speed; results do not depend on it).
      strategy: optional ``tf.distribute.Strategy`` (TensorFlow backend only; refused on
        JAX); each batch is split over replicas and the products are summed (the model's
        variables may live outside its scope).
      exact_moments: trace HVPs with exact moments (see ``keras_noisecurve.spectrum.moments``).

    Attributes:
      dimension: p, number of trainable parameters.
      num_hvps: Hessian-vector products computed so far (a matmat of c columns counts c).
      variables: the model's trainable variables, in flat-vector order.
      moment_layers: normalisation layers found in the model.
    """

    def __init__(self, model, x, y, *, loss=None, batch_size: int = 256, strategy=None, exact_moments: bool = True):
        engines = backend.module("hvp")
        if not hasattr(x, "shape"):
            x = np.asarray(x)
        if not hasattr(y, "shape"):
            y = np.asarray(y)
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
        self._engine = engines.HVPEngine(model=model, loss_fn=self.loss_fn, inv_n=1.0 / n, strategy=strategy)
        self._batches = [
            self._engine.batch(x[start : start + self.batch_size], y[start : start + self.batch_size])
            for start in range(0, n, self.batch_size)
        ]

    # ------------------------------------------------------------------ helpers
    def _split(self, flat):
        parts = []
        offset = 0
        for shape, size in zip(self.shapes, self.sizes):
            parts.append(flat[offset : offset + size].reshape(shape))
            offset += size
        return parts

    def _split_columns(self, mat):
        c = mat.shape[1]
        parts = []
        offset = 0
        for shape, size in zip(self.shapes, self.sizes):
            parts.append(mat[offset : offset + size].T.reshape((c,) + shape))
            offset += size
        return parts

    def _context(self):
        return exact_moments() if self.exact_moments else contextlib.nullcontext()

    def _run_batches(self, fn):
        """Σ over batches of fn(xb, yb), a list of numpy arrays."""
        total = None
        with self._context():
            for xb, yb in self._batches:
                out = fn(xb, yb)
                total = out if total is None else [a + b for a, b in zip(total, out)]
        return total

    # ------------------------------------------------------------------ public
    def matvec(self, v) -> np.ndarray:
        """H·v for a (p,) vector; returns (p,) float64."""
        v = np.asarray(v, dtype=np.float64).reshape(-1)
        if v.size != self.dimension:
            raise ValueError(f"v must have {self.dimension} entries (the number of parameters), got {v.size}.")
        tangents = self._split(v)
        parts = self._run_batches(lambda xb, yb: self._engine.hvp(xb, yb, tangents))
        self.num_hvps += 1
        return np.concatenate([p.reshape(-1) for p in parts])

    __call__ = matvec

    def matmat(self, V) -> np.ndarray:
        """H·V for a (p, c) matrix (c products vectorised: ``pfor`` on TensorFlow, ``vmap`` on
        JAX); returns (p, c) float64."""
        V = np.asarray(V, dtype=np.float64)
        if V.ndim != 2 or V.shape[0] != self.dimension:
            raise ValueError(f"V must have shape ({self.dimension}, c), got {V.shape}.")
        c = V.shape[1]
        tangents = self._split_columns(V)
        parts = self._run_batches(lambda xb, yb: self._engine.hmm(xb, yb, tangents))
        self.num_hvps += c
        return np.concatenate([p.reshape(c, -1) for p in parts], axis=1).T

    def _gradient_and_loss(self):
        def one(xb, yb):
            grads, value = self._engine.grad(xb, yb)
            return list(grads) + [np.float64(value)]

        return self._run_batches(one)

    def gradient(self) -> np.ndarray:
        """∇L(w) at the current weights, (p,) float64 (first derivatives need no patch)."""
        parts = self._gradient_and_loss()
        self.num_gradients += 1
        return np.concatenate([p.reshape(-1) for p in parts[:-1]])

    def loss(self) -> float:
        """L(w), the mean loss over the dataset at the current weights."""
        return float(self._gradient_and_loss()[-1])

    def flat_weights(self) -> np.ndarray:
        """Current weights as a (p,) float64 vector (same order as ``matvec``)."""
        return flat_weights(self.variables)

    def assign(self, flat) -> None:
        """Set the model's weights from a (p,) vector."""
        assign_flat_weights(self.variables, flat)
