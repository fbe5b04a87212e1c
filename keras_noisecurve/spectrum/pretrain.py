"""Random-label pre-training on public data (paper §4.1-4.3; TensorFlow or JAX backend).

The Hessian upper bound Ĥ is the Hessian at the weights reached by training a copy of
the model on public inputs with labels drawn uniformly at random: the model is pushed
to maximum uncertainty, keeping its activations out of saturation (paper §4.2 shows
Ĥ ⪰ H(w) for every w for logistic regression). The user's model is never modified:
training runs on a ``keras.models.clone_model`` copy with the same weights.
"""

from __future__ import annotations

import numpy as np

from keras_noisecurve import backend
from keras_noisecurve._validation import check_float, check_int


def clone_with_weights(model):
    """A structural copy of ``model`` with the same weight values (user model untouched)."""
    import keras

    try:
        clone = keras.models.clone_model(model)
    except Exception as exc:  # noqa: BLE001 - clone_model raises many types
        raise ValueError(
            f"cannot clone the model ({type(exc).__name__}: {exc}); pass pretrain_epochs=0 and pre-train "
            "a copy yourself, or make the model serialisable (get_config/from_config)."
        ) from exc
    clone.set_weights(model.get_weights())
    return clone


def pretrain(
    model,
    x,
    y,
    *,
    loss_fn,
    epochs: int,
    learning_rate: float,
    batch_size: int,
    seed=None,
    verbose: bool = False,
):
    """Train ``model`` in place with plain SGD on the mean of ``loss_fn`` over (x, y).

    Args:
      model: the (cloned) Keras model to train.
      x, y: (n, ...) inputs and labels.
      loss_fn: (y_true, y_pred) → per-example losses.
      epochs: passes over the data (0 returns at once).
      learning_rate: SGD step size η (no momentum).
      batch_size: examples per step; examples are reshuffled every epoch with ``seed``.
      verbose: print the mean loss per epoch.

    Returns:
      list of per-epoch mean training losses.
    """
    epochs = check_int("pretrain_epochs", epochs, minimum=0)
    lr = check_float("pretrain_learning_rate", learning_rate, positive=True)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    if epochs == 0:
        return []
    x = np.asarray(x)
    y = np.asarray(y)
    n = x.shape[0]
    step = backend.module("hvp").sgd_step_fn(model, loss_fn=loss_fn, learning_rate=lr)
    rng = np.random.default_rng(seed)
    history = []
    for epoch in range(epochs):
        order = rng.permutation(n)
        total = 0.0
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            total += step(x[idx], y[idx]) * idx.size
        history.append(total / n)
        if verbose:
            print(f"random-label pre-training epoch {epoch + 1}/{epochs}: loss {history[-1]:.4f}")
    return history
