"""Shared pieces of the JAX tests: small models and an INDEPENDENT per-example reference
(a Python loop of ``jax.grad`` over ``stateless_call``, float64 numpy for the clipping)."""

import jax
import jax.numpy as jnp
import keras
import numpy as np


def mlp(seed=0, inputs=6, outputs=3, regularizer=None):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((inputs,)),
        keras.layers.Dense(8, activation="tanh", kernel_regularizer=regularizer),
        keras.layers.LayerNormalization(),
        keras.layers.Dense(outputs),
    ])


def mse_per_example(y_true, y_pred):
    """Hand-written mean squared error per example, (P,)."""
    return jnp.mean((y_pred - y_true) ** 2, axis=-1)


def reference_clipped_sum(model, x, y, weights, clip, loss=mse_per_example):
    """``(Σ_i clip(w_i ∇loss_i, ζ), norms)`` by a loop over examples (inputs may be lists or
    dicts): one ``jax.grad`` of the model's ``stateless_call`` per example, norms and
    clipping in float64 numpy."""
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    sums = [np.zeros(v.shape, np.float64) for v in trainable]
    norms = []

    def loss_one(tv, xi, yi, wi):  # ONE example, batch of 1: no vmap anywhere
        pred, _ = model.stateless_call(tv, non_trainable, xi, training=True)
        return wi * loss(yi, pred)[0]

    grad_one = jax.jit(jax.grad(loss_one))
    for i in range(len(y)):
        xi = jax.tree_util.tree_map(lambda a: a[i:i + 1], x)
        grads = [np.asarray(g, np.float64) for g in grad_one(trainable, xi, y[i:i + 1], weights[i])]
        norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
        norms.append(norm)
        factor = min(1.0, clip / norm) if norm > 0 else 1.0
        for s, g in zip(sums, grads):
            s += factor * g
    return sums, np.array(norms)


def weights_of(model):
    return [np.array(keras.ops.convert_to_numpy(v.value)) for v in model.trainable_variables]


def spy_fallback(monkeypatch, record):
    """Make the JAX ghost engine call ``record(layer)`` for every layer (or caller clipped
    whole) it sends to its per-layer fallback, at trace time, before the fallback itself runs
    unchanged (``ghost._fallback`` wrapped through ``monkeypatch``, undone after the test)."""
    from keras_noisecurve.backend.jax import ghost

    original = ghost._fallback

    def spying(model, layer, *args, **kwargs):
        record(layer)
        return original(model, layer, *args, **kwargs)

    monkeypatch.setattr(ghost, "_fallback", spying)
