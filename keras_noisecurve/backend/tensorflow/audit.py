"""What the audits need from TensorFlow (:mod:`keras_noisecurve.audit.mechanism_clipping`,
:mod:`keras_noisecurve.audit.input_canaries`): the independent references, one
``tf.GradientTape`` per example and the canaries' tape jacobian, and the scope in which a
float64 clone is built (anywhere). (The engine's side is the private model's
``_dp_engine_run``, in :mod:`keras_noisecurve.backend.tensorflow.dp_model`.)"""

from __future__ import annotations

import contextlib

import numpy as np
import tensorflow as tf

__all__ = ["float64_scope", "loss_jacobian", "reference_grads"]


def float64_scope():
    """Where a float64 clone is built and differentiated: anywhere on TensorFlow."""
    return contextlib.nullcontext()


def reference_grads(model, loss_fn, x, y, w, *, float64):
    """(P, per-variable) float64 numpy gradients of each example's weighted loss w_i·loss_i,
    one ``GradientTape`` each, in float64 (``float64``: a float64 clone) or float32."""
    dtype = tf.float64 if float64 else tf.float32
    variables = model.trainable_variables

    @tf.function(reduce_retracing=True)
    def one(xi, yi, wi):
        with tf.GradientTape() as tape:
            loss = loss_fn(yi, model(xi, training=False))
            loss = tf.reduce_sum(tf.cast(loss, dtype)) * tf.cast(wi, dtype)
        grads = tape.gradient(loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return [tf.convert_to_tensor(g) for g in grads]  # embedding rows come as IndexedSlices

    def cast(t):
        t = tf.convert_to_tensor(t)
        return tf.cast(t, dtype) if t.dtype.is_floating else t

    out = []
    for i in range(len(w)):
        xi, yi = (tf.nest.map_structure(lambda a: cast(np.asarray(a)[i:i + 1]), t) for t in (x, y))
        grads = one(xi, yi, tf.constant(w[i]))
        out.append([np.asarray(g.numpy(), np.float64) for g in grads])
    return out


def loss_jacobian(model):
    """A ``tf.function`` (x, y) → numpy per-example jacobians of (f(x)[:, 0] − y[:, 0])² over
    ``model``'s trainable variables (one (m, *shape) array per variable), the input-canary
    audit's reference gradients."""

    @tf.function(reduce_retracing=True)
    def jacobian(x, y):
        with tf.GradientTape() as tape:
            loss = tf.square(model(x, training=False)[:, 0] - y[:, 0])
        return tape.jacobian(loss, model.trainable_variables)

    return lambda x, y: [np.asarray(j.numpy()) for j in jacobian(x, y)]
