"""The private update of one variable, written once in ``keras.ops`` for every backend's
``NoiseCurveOptimizer`` (``backend/<name>/optimizer.py`` draws the noise term, this applies it).

With S the clipped sum of the batch's per-example gradients (the ``gradient`` Keras hands the
optimizer), ζσ·z̃_t the step's correlated noise of the variable and B the expected batch size::

    ĝ = (S + ζσ·z̃_t) / B,    w ← w − η·ĝ      (computed as (η/B)·(S + ζσ·z̃_t))

or, with an inner Keras optimizer, ``inner.update_step(ĝ, w, η_t)``.
"""

from __future__ import annotations

import keras

__all__ = ["apply_update"]


def apply_update(optimizer, gradient, variable, learning_rate, noise_term) -> None:
    """Apply one private step to ``variable``.

    Args:
      optimizer: the ``NoiseCurveOptimizer`` (its ``expected_batch_size`` B, its ``inner``
        optimizer or ``None``, its ``assign_sub``).
      gradient: S, the clipped sum, shaped as ``variable``.
      variable: the Keras variable w.
      learning_rate: η (η_t of the inner optimizer when there is one), a scalar.
      noise_term: ζσ·z̃_t, shaped as ``variable``, in its dtype.

    Without an inner optimizer ``w ← w − (η/B)·(S + ζσ·z̃_t)``, in the variable's dtype; with
    one, ``inner.update_step((S + ζσ·z̃_t)/B, w, η_t)``.
    """
    ops, dtype = keras.ops, variable.dtype
    total = ops.add(ops.cast(gradient, dtype), noise_term)
    batch = ops.cast(optimizer.expected_batch_size, dtype)
    if optimizer.inner is None:
        optimizer.assign_sub(variable, ops.multiply(ops.divide(ops.cast(learning_rate, dtype), batch), total))
    else:
        optimizer.inner.update_step(ops.divide(total, batch), variable, learning_rate)
