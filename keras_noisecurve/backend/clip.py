"""The clipping factor of every engine on both backends, written once with ``keras.ops`` (so it
runs on the backend's own arrays, inside a ``tf.function`` or a ``jax.jit``).

An example whose loss or gradient norm is not finite is dropped: its factor is exactly 0, and
the engines replace its rows by zeros before summing (``0·inf`` would be ``nan``). A zero
contribution is within the clip bound ζ, so the privacy analysis is unchanged.
"""

from __future__ import annotations

__all__ = ["clip_factors"]


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
