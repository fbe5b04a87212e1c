"""Clipping-aware curvature scale s (TensorFlow or JAX backend).

With per-example clipping at norm ζ, DP training steps along the mean of clipped
gradients, (1/n) Σ_i min(1, ζ/‖g_i‖)·g_i. When ζ is below the typical per-example
gradient norm, that is ≈ s·∇L with

    s = (1/n) Σ_i min(1, ζ / ‖g_i‖),

so gradient descent effectively sees the curvature s·H instead of H. ``clipping_scale``
measures s on public data at the current weights; ``Spectrum.scaled(s)`` rescales a
spectrum accordingly (see docs/spectrum.md for when to use it).
"""

from __future__ import annotations

import numpy as np

from keras_noisecurve import backend
from keras_noisecurve._validation import check_float, check_int


def per_example_gradient_norms(model, x, y, *, loss_fn, batch_size: int = 128) -> np.ndarray:
    """‖∇_w ℓ(y_i, f(x_i; w))‖₂ over all trainable variables, for every example.

    Args:
      model: a built Keras model, run in inference mode (``training=False``).
      x, y: (n, ...) inputs and labels.
      loss_fn: ``(y_true, y_pred) -> (batch,)`` per-example loss.
      batch_size: examples per vectorised call (``tf.vectorized_map`` on TensorFlow,
        ``jax.vmap`` on JAX).

    Returns:
      (n,) float64 gradient norms, in the units of the loss per unit weight.
    """
    batch_size = check_int("batch_size", batch_size, minimum=1)
    return backend.module("hvp").per_example_gradient_norms(model, x, y, loss_fn=loss_fn, batch_size=batch_size)


def clipping_scale(
    model,
    x,
    y=None,
    *,
    l2_norm_clip: float,
    loss=None,
    batch_size: int = 128,
    seed=None,
) -> float:
    """s = mean_i min(1, ζ / ‖g_i‖) over public examples at the current weights.

    Args:
      model: Keras model (not modified).
      x: (n, ...) public inputs.
      y: labels, or ``None`` for random labels uniform over the output classes (as in
        random-label pre-training).
      l2_norm_clip: ζ > 0, the per-example clipping norm used in DP training.
      loss: as in ``estimate_spectrum``.
      batch_size: examples per vectorised batch.
      seed: seed of the random labels.

    Returns:
      s in (0, 1]; multiply curvature by s (``Spectrum.scaled(s)``) to model clipped GD.
      Examples with a zero gradient count as 1.
    """
    from keras_noisecurve.spectrum.losses import output_width, random_labels, resolve_loss

    zeta = check_float("l2_norm_clip", l2_norm_clip, positive=True)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    x = np.asarray(x)
    if x.shape[0] < 1:
        raise ValueError("x must contain at least one example.")
    if not model.built:
        model(x[:1], training=False)
    k = output_width(model, x)
    resolved = resolve_loss(model, loss, num_outputs=k)
    if y is None:
        y = random_labels(x.shape[0], num_outputs=k, label_kind=resolved.label_kind, seed=seed)
    norms = per_example_gradient_norms(model, x, y, loss_fn=resolved.fn, batch_size=batch_size)
    factors = np.where(norms > 0, np.minimum(1.0, zeta / np.maximum(norms, 1e-300)), 1.0)
    return float(factors.mean())
