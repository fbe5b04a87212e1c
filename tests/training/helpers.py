"""Small shared builders for the training tests (tiny models: the suite runs on 2 cores)."""

import keras
import numpy as np

from keras_noisecurve.mixing import MixingMatrix


def random_banded_c(steps, bands, *, rng, diag_scale=1.0, metadata=None):
    """A random valid C: lower triangular, b-banded, positive diagonal, unit columns.

    Independent of the solver: entries ~ N(0, 1) in the band, |diag| + diag_scale on
    the diagonal, then every column divided by its norm.
    """
    dense = np.zeros((steps, steps))
    for t in range(steps):
        for j in range(min(bands, t + 1)):
            dense[t, t - j] = rng.normal()
        dense[t, t] = abs(dense[t, t]) + diag_scale
    dense /= np.linalg.norm(dense, axis=0, keepdims=True)
    return MixingMatrix.from_dense(dense, bands=bands, metadata=metadata or {"objective": "test"})


def bandmf_like_c(steps, bands):
    """A BandMF-like C: the banded Cholesky-type factor of the prefix-sum workload's
    X = CᵀC, built as the exchange-flipped Cholesky of a banded Toeplitz matrix with
    decaying coefficients, then column-normalised (independent of the solver)."""
    coeffs = np.array([1.0 / (1 + j) ** 0.5 for j in range(bands)])
    x = np.zeros((steps, steps))
    for t in range(steps):
        for j in range(bands):
            if t + j < steps:
                x[t, t + j] = x[t + j, t] = coeffs[j] * (0.6 if j else 1.0)
    x += 0.5 * np.eye(steps)  # keep it positive definite
    flip = np.eye(steps)[::-1]
    c = flip @ np.linalg.cholesky(flip @ x @ flip).T @ flip  # X = CᵀC, C lower triangular
    c[np.abs(np.subtract.outer(np.arange(steps), np.arange(steps))) >= bands] = 0.0
    c = np.tril(c)
    c /= np.linalg.norm(c, axis=0, keepdims=True)
    return MixingMatrix.from_dense(c, bands=bands, metadata={"objective": "bandmf-like"})



class CrashAt(keras.callbacks.Callback):
    """Raises ``RuntimeError("simulated crash")`` after the ``at_step``-th training batch
    (counted across epochs): an interrupted ``fit``."""

    def __init__(self, at_step):
        super().__init__()
        self.at_step, self.seen = at_step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at_step:
            raise RuntimeError("simulated crash")


# ------------------------------------------------------------ per-example clipping references


def set_precision(dtype):
    """Keras's float type for new layers. Keras caches its global dtype policy the first
    time it is read, after which floatx alone no longer changes the layers' dtype: set both."""
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)


def float64_layers():
    """Generator for an autouse fixture: new layers are float64 and the seed is fixed, for
    comparisons that measure the method rather than round-off; the old precision after."""
    old = keras.config.floatx()
    set_precision("float64")
    keras.utils.set_random_seed(0)
    yield
    set_precision(old)


def mse(y, p):
    """Per-example mean squared error over every non-example axis: (P,)."""
    import tensorflow as tf

    d = tf.cast(y, p.dtype) - p
    return tf.reduce_mean(tf.square(d), axis=list(range(1, d.shape.rank)))


def loop_reference(model, loss_fn, x, y, w, clip):
    """Per-example gradients one example at a time with ``tf.GradientTape`` (the
    independent reference of the clipping engines).

    Returns ``(norms (P,), clipped sum)``: ``norms[i] = ‖w_i·∇loss_i‖`` and
    ``Σ_i min(1, clip/norms[i])·w_i·∇loss_i`` per trainable variable (numpy arrays).
    ``x`` may be any structure of arrays with the examples first.
    """
    import tensorflow as tf

    variables = model.trainable_variables
    total = [np.zeros(v.shape) for v in variables]
    norms = []
    for i in range(len(w)):
        xi = tf.nest.map_structure(lambda t: t[i : i + 1], x)
        with tf.GradientTape() as tape:
            loss = w[i] * loss_fn(y[i : i + 1], model(xi, training=False))[0]
        grads = [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, variables, unconnected_gradients="zero")]
        norm = np.sqrt(sum(np.sum(g**2) for g in grads))
        norms.append(norm)
        factor = 1.0 if norm == 0 else min(1.0, clip / norm)
        for k, g in enumerate(grads):
            total[k] += factor * g
    return np.array(norms), total


def noiseless(optimizer):
    """``optimizer`` with σ = 0 (no noise, no privacy) for exact comparisons in tests.

    The optimizer refuses ``noise_multiplier=0`` (σ = 0 is no privacy); tests that compare a
    private step with a noise-free reference set it after construction, before the first step."""
    optimizer.noise_multiplier = 0.0
    return optimizer
