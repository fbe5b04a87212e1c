"""What every per-example clipping engine returns, and the chunked loop they share.

Engine contract (``clipping.vectorized_clipped_sum`` and ``ghost.ghost_clipped_sum``
implement it; ``clipping.get_engine`` picks one)::

    engine(model, loss_fn, x, y, sample_weight, *, l2_norm_clip,
           microbatch_size=None, training=True) -> ClippedSum

- ``loss_fn(y_true, y_pred) -> (P,)``: the per-example, UNREDUCED loss (see
  :func:`keras_noisecurve.backend.tensorflow.clipping.per_example_loss_fn`).
- ``sample_weight`` (P,) or ``None`` multiplies each example's loss BEFORE
  clipping: a batch sampler's 0/1 mask makes padding contribute nothing, and any
  weight keeps the sensitivity ≤ ζ because clipping comes after.
- ``ClippedSum.grads[k] = Σ_i clip(w_i·∇loss_i, ζ)`` for ``model.trainable_variables[k]``,
  where ``clip(g, ζ) = g·min(1, ζ/‖g‖₂)`` with the norm over ALL variables (global
  per-example norm). Not divided by the batch size.
- An example whose loss or gradient (norm) is not finite — an ``inf``/``nan`` feature or
  label, a layer that overflows — is DROPPED: it contributes exactly 0 to ``grads``
  (its rows are replaced by zeros with ``tf.where`` before any sum over the batch, so
  0·inf = nan cannot reach the other examples), and ``ClippedSum.nonfinite`` marks it.
  A zero contribution is within the clip bound ζ, so the sensitivity is unchanged.
- ``microbatch_size=m`` runs the engine on consecutive chunks of m examples
  (:func:`chunked_clipped_sum`) to bound peak memory; clipping is per example, so
  the result does not depend on m.

This module imports only TensorFlow: both engines import it, and it imports neither.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import tensorflow as tf

__all__ = ["ClippedSum", "chunked_clipped_sum"]


class ClippedSum(NamedTuple):
    """Output of a clipping engine (shapes with P = number of examples in the batch).

    grads: list of tensors, Σ_i clip(w_i·∇loss_i, ζ), aligned with ``model.trainable_variables``.
    norms: (P,) per-example gradient norms before clipping, of w_i·∇loss_i.
    per_example_loss: (P,) unweighted loss_i (as computed: not finite for a dropped example).
    y_pred: the model outputs for the batch (for metrics).
    nonfinite: (P,) bool, True for an example whose loss_i or gradient norm is not
      finite: it contributed exactly 0 to ``grads``. ``None`` from an engine that does
      not report it.
    """

    grads: list
    norms: Any
    per_example_loss: Any
    y_pred: Any
    nonfinite: Any = None


def chunked_clipped_sum(step: Callable, x, y, sample_weight, microbatch_size: int) -> ClippedSum:
    """Run ``step`` on consecutive chunks of ``microbatch_size`` examples and combine.

    Args:
      step: ``step(x_chunk, y_chunk, weight_chunk) -> ClippedSum`` on one chunk
        (``weight_chunk`` is ``None`` when ``sample_weight`` is ``None``).
      x, y: a batch of P examples (nested structures allowed); P may be dynamic.
      sample_weight: (P,) weights or ``None``.
      microbatch_size: m ≥ 1 examples per chunk; the last chunk may be shorter.

    Returns:
      ``ClippedSum`` of the whole batch: ``grads`` summed over the ⌈P/m⌉ chunks
      (a ``tf.while_loop``, so the graph holds one chunk at a time), ``norms``,
      ``per_example_loss``, ``y_pred`` and ``nonfinite`` concatenated in example order
      (a chunk's dropped examples are already 0 in its ``grads``).
    """
    m = microbatch_size
    x, y = (tf.nest.map_structure(tf.convert_to_tensor, t) for t in (x, y))
    if sample_weight is not None:
        sample_weight = tf.convert_to_tensor(sample_weight)
    n = tf.shape(tf.nest.flatten(x)[0])[0]
    chunks = (n + m - 1) // m

    def take(tree, i):
        if tree is None:
            return None
        return tf.nest.map_structure(lambda t: t[i * m : tf.minimum((i + 1) * m, n)], tree)

    def run(i):
        return step(take(x, i), take(y, i), take(sample_weight, i))

    # The first chunk, outside the loop, fixes the output structure and dtypes.
    first = run(0)
    pred_flat = tf.nest.flatten(first.y_pred)
    norms_ta = tf.TensorArray(first.norms.dtype, size=chunks, infer_shape=False).write(0, first.norms)
    loss_ta = tf.TensorArray(first.per_example_loss.dtype, size=chunks, infer_shape=False).write(
        0, first.per_example_loss
    )
    pred_tas = [tf.TensorArray(p.dtype, size=chunks, infer_shape=False).write(0, p) for p in pred_flat]
    # per-example tensors carried through the loop besides the predictions: the nonfinite mask
    reported = first.nonfinite is not None
    extra_tas = [tf.TensorArray(tf.bool, size=chunks, infer_shape=False).write(0, first.nonfinite)] if reported else []

    def body(i, sums, norms_ta, loss_ta, pred_tas, extra_tas):
        part = run(i)
        sums = [a + b for a, b in zip(sums, part.grads)]
        pred_tas = [ta.write(i, p) for ta, p in zip(pred_tas, tf.nest.flatten(part.y_pred))]
        extra_tas = [ta.write(i, part.nonfinite) for ta in extra_tas]
        return (i + 1, sums, norms_ta.write(i, part.norms), loss_ta.write(i, part.per_example_loss), pred_tas,
                extra_tas)

    _, sums, norms_ta, loss_ta, pred_tas, extra_tas = tf.while_loop(
        lambda i, *_: i < chunks, body, (tf.constant(1), list(first.grads), norms_ta, loss_ta, pred_tas, extra_tas)
    )

    def concat(ta, like):
        out = ta.concat()
        out.set_shape(tf.TensorShape([None]).concatenate(like.shape[1:]))
        return out

    return ClippedSum(
        grads=list(sums),
        norms=concat(norms_ta, first.norms),
        per_example_loss=concat(loss_ta, first.per_example_loss),
        y_pred=tf.nest.pack_sequence_as(first.y_pred, [concat(ta, p) for ta, p in zip(pred_tas, pred_flat)]),
        nonfinite=concat(extra_tas[0], first.nonfinite) if reported else None,
    )
