"""Per-example clipping: the vectorized engine, the engine registry and shared checks.

The engine contract and ``ClippedSum`` are in :mod:`keras_noisecurve.training.clipped_sum`
(re-exported here); the ghost-norm engine is :mod:`keras_noisecurve.training.ghost`.

- :func:`vectorized_clipped_sum`: per-example gradients with ``tf.vectorized_map``.
- :func:`get_engine`: ``"auto"``/``"ghost"`` (per-layer) or ``"vectorized"`` (reference).
- :func:`per_example_loss_fn`: the unreduced ``(y_true, y_pred) -> (P,)`` loss an
  engine needs (:mod:`keras_noisecurve._losses`).
- Regularisation losses (kernel regularizers) are data-independent: their gradient
  ∇reg is computed once, outside clipping, and ``B·∇reg`` is added to the clipped
  sum (``B`` = ``expected_batch_size`` argument of :func:`add_regularization`) so
  that after the optimizer's division by B it is exactly ∇reg.
"""

from __future__ import annotations

from typing import Callable

import keras
import tensorflow as tf

from keras_noisecurve import _compat
from keras_noisecurve._losses import per_example_loss_fn
from keras_noisecurve._validation import check_choice, check_float, check_int
from keras_noisecurve.training import ghost
from keras_noisecurve.training.clipped_sum import ClippedSum, chunked_clipped_sum
from keras_noisecurve.training.model_checks import ENGINES, check_model_is_clippable

__all__ = [
    "ClippedSum",
    "vectorized_clipped_sum",
    "per_example_loss_fn",
    "add_regularization",
    "check_model_is_clippable",
    "get_engine",
    "ENGINES",
]

def _trainable(model):
    variables = list(model.trainable_variables)
    if not variables:
        raise ValueError("the model has no trainable variables.")
    # the tf.Variable behind each keras.Variable (what GradientTape differentiates)
    return [v.value if isinstance(v, keras.Variable) else v for v in variables]


def _validate(l2_norm_clip, microbatch_size):
    l2_norm_clip = check_float("l2_norm_clip", l2_norm_clip, positive=True)
    if microbatch_size is not None:
        microbatch_size = check_int("microbatch_size", microbatch_size, minimum=1)
    return l2_norm_clip, microbatch_size


# ------------------------------------------------------------- vectorized engine
def _expand(tree):
    return tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), tree)


def _squeeze(tree):
    return tf.nest.map_structure(lambda t: tf.squeeze(t, 0), tree)


def _chunk_stats(model, loss_fn, variables, x, y, w, training, l2_norm_clip):
    """Per-example grads of a chunk via tf.vectorized_map, clipped and summed."""

    def single(args):
        xi, yi, wi = args
        with tf.GradientTape() as tape:
            pred = model(_expand(xi), training=training)
            loss = loss_fn(_expand(yi), pred)[0]
            weighted = loss * tf.cast(wi, loss.dtype)
        grads = tape.gradient(weighted, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return grads, loss, _squeeze(pred)

    grads, losses, preds = tf.vectorized_map(single, (x, y, w))
    # variables may differ in dtype (LoRA factors are float32 in a float64 model): add in the widest
    wide = tf.float64 if any(g.dtype == tf.float64 for g in grads) else tf.float32
    sq = tf.add_n([tf.cast(tf.reduce_sum(tf.reshape(tf.square(g), [tf.shape(g)[0], -1]), axis=1), wide) for g in grads])
    norms = tf.sqrt(sq)
    clip = tf.cast(l2_norm_clip, norms.dtype)
    factor = clip / tf.maximum(norms, clip)  # min(1, ζ/‖g‖)
    sums = [tf.tensordot(tf.cast(factor, g.dtype), g, axes=1) for g in grads]
    return sums, norms, losses, preds


def vectorized_clipped_sum(
    model,
    loss_fn,
    x,
    y,
    sample_weight=None,
    *,
    l2_norm_clip,
    microbatch_size=None,
    training=True,
) -> ClippedSum:
    """Σ_i clip(w_i·∇loss_i, ζ) by per-example gradients with ``tf.vectorized_map``.

    Args:
      model: a Keras model (TF backend).
      loss_fn: ``(y_true, y_pred) -> (P,)`` per-example unreduced loss.
      x, y: a batch of P examples (nested structures allowed for x).
      sample_weight: (P,) weights multiplying each loss before clipping, or None (all 1).
      l2_norm_clip: ζ > 0.
      microbatch_size: process the batch in chunks of this many examples
        (``tf.while_loop``) to bound memory at O(microbatch_size × parameters); None:
        the whole batch at once.
      training: passed to ``model(..., training=training)``.

    Returns:
      :class:`ClippedSum`. Memory O(P × parameters) (or O(m × parameters) per chunk);
      time: P gradients, vectorised (docs/training.md, "Performance", has timings).
      Regularisation losses are NOT included (see :func:`add_regularization`).
    """
    l2_norm_clip, microbatch_size = _validate(l2_norm_clip, microbatch_size)
    variables = _trainable(model)
    n = tf.shape(tf.nest.flatten(x)[0])[0]
    if sample_weight is None:
        w = tf.ones([n], dtype=tf.float32)
    else:
        w = tf.reshape(tf.cast(sample_weight, tf.float32), [-1])

    if microbatch_size is None:
        sums, norms, losses, preds = _chunk_stats(model, loss_fn, variables, x, y, w, training, l2_norm_clip)
        return ClippedSum(sums, norms, losses, preds)

    def step(x_chunk, y_chunk, w_chunk):
        return ClippedSum(*_chunk_stats(model, loss_fn, variables, x_chunk, y_chunk, w_chunk, training, l2_norm_clip))

    return chunked_clipped_sum(step, x, y, w, microbatch_size)


def add_regularization(model, clipped: ClippedSum, *, expected_batch_size: int, num_replicas: int = 1) -> ClippedSum:
    """Add ``B·∇reg / R`` to the clipped sum, reg = Σ model weight-regularisation losses.

    The regulariser does not depend on data (activity regularizers are refused), so
    its gradient is added unclipped: after the optimizer divides by B (and the R
    replicas' sums are added) it contributes exactly ∇reg to ĝ_t.
    """
    variables = _trainable(model)
    with tf.GradientTape() as tape:
        reg_losses = _compat.regularization_losses(model)
        if not reg_losses:
            return clipped
        reg = tf.add_n([tf.cast(r, tf.float32) for r in reg_losses])
    reg_grads = tape.gradient(reg, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    scale = float(expected_batch_size) / float(num_replicas)
    grads = [g + tf.cast(scale, g.dtype) * tf.cast(r, g.dtype) for g, r in zip(clipped.grads, reg_grads)]
    return clipped._replace(grads=grads)


# ---------------------------------------------------------------------- registry
def get_engine(name: str = "auto", model=None) -> Callable:
    """The clipping engine called ``name``.

    Args:
      name: ``"auto"`` or ``"ghost"``: the per-layer engine
        (``keras_noisecurve.training.ghost``): ghost norms for every layer with a rule,
        a per-layer vector–Jacobian product of its own call for any other layer with
        trainable weights; it never differentiates the whole model per example.
        ``"vectorized"``: per-example gradients of the whole model by
        ``tf.vectorized_map``, kept as a reference (slower, O(P × parameters) memory,
        and TensorFlow's pfor can fail on some layers — e.g. a segmentation fault on
        ``MultiHeadAttention`` with TF 2.21, a ``variant`` TypeError on LSTMs); ``"auto"``
        never chooses it.
      model: checks that the model can be clipped (``"auto"``/``"ghost"``).

    Raises:
      ValueError: the model cannot be clipped per example (a trainable
        BatchNormalization), with the layer named.
    """
    check_choice("clipping", name, ENGINES)
    if name == "vectorized":
        return vectorized_clipped_sum
    if model is not None:
        ok, reason = ghost.supports(model)
        if not ok:
            raise ValueError(f"clipping={name!r} cannot clip this model per example: {reason}.")
    return ghost.ghost_clipped_sum
