"""The clipping factor of every engine on both backends, written once with ``keras.ops`` (so it
runs on the backend's own arrays, inside a ``tf.function`` or a ``jax.jit``).

An example whose loss or gradient norm is not finite is dropped: its factor is exactly 0, and
the engines replace its rows by zeros before summing (``0·inf`` would be ``nan``). A zero
contribution is within the clip bound ζ, so the privacy analysis is unchanged.

The count query of an adaptive clip (``keras_noisecurve.AdaptiveClip``) is counted here too
(:func:`clip_count` over the rows :func:`unit_weights` marks as examples).
"""

from __future__ import annotations

__all__ = ["clip_count", "clip_factors", "unit_weights"]


def clip_factors(norms, losses, l2_norm_clip):
    """``(factors, keep)``: ``factors = min(1, ζ/‖g_i‖)`` per example where ``keep``, else 0;
    ``keep`` is ``isfinite(‖g_i‖) ∧ isfinite(loss_i)``.

    Args:
      norms: the per-example gradient norms ``‖w_i·∇loss_i‖``, (P,) (or a scalar), float.
      losses: the per-example losses, the shape of ``norms``.
      l2_norm_clip: ζ > 0 (a Python float or a scalar of the backend), taken in ``norms``' dtype.
    """
    from keras import ops

    clip = ops.cast(l2_norm_clip, norms.dtype)
    keep = ops.logical_and(ops.isfinite(norms), ops.isfinite(losses))
    factors = clip / ops.maximum(norms, clip)  # ζ/‖g‖ above ζ, exactly 1 at or below it
    return ops.where(keep, factors, ops.zeros_like(factors)), keep


def clip_count(norms, sample_weight, clip):
    """``(below, real)``, float32 scalars of the backend: the batch's examples with norm ≤ ζ_t,
    and the batch's examples (rows of weight > 0: the sampler's padding rows are not
    examples). ``norms`` (P,) per-example norms; ``sample_weight`` (P,) or ``None`` (every
    row an example); ``clip`` ζ_t. An example whose norm is not finite counts as clipped."""
    from keras import ops

    norms = ops.cast(ops.reshape(norms, (-1,)), "float32")
    if sample_weight is None:
        real = ops.ones_like(norms)
    else:
        real = ops.cast(ops.reshape(ops.convert_to_tensor(sample_weight), (-1,)) > 0, "float32")
    below = ops.cast(ops.less_equal(norms, ops.cast(clip, "float32")), "float32") * real
    return ops.sum(below), ops.sum(real)


def unit_weights(rows, positions):
    """(P,) float32, > 0 for the batch's examples, for :func:`clip_count`: ``rows`` > 0 (the
    sampler's padding rows have weight 0), and with per-position weights ``positions``
    (P, L, ...) a row whose positions all weigh 0 is not counted either (padding, or an
    example that contributes nothing: leaving it out moves the count by 0 ≤ ½). ``None``
    for neither (every row an example)."""
    from keras import ops

    weights = None if rows is None else ops.cast(ops.reshape(rows, (-1,)) > 0, "float32")
    if positions is not None:
        flat = ops.reshape(ops.convert_to_tensor(positions), (ops.shape(positions)[0], -1))
        some = ops.cast(ops.any(flat > 0, axis=1), "float32")
        weights = some if weights is None else weights * some
    return weights
