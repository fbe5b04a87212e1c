"""Per-example clipping: the vectorized engine, the engine registry and shared checks.

The engine contract and ``ClippedSum`` are in :mod:`keras_noisecurve.backend.tensorflow.clipped_sum`
(re-exported here); the ghost-norm engine is :mod:`keras_noisecurve.backend.tensorflow.ghost`.

- :func:`vectorized_clipped_sum`: the reference, a per-example loop (``tf.while_loop``
  of plain gradients, no ``tf.vectorized_map``; the name is historical).
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
from keras_noisecurve._losses import per_example_loss_fn  # noqa: F401 - callers import it from here
from keras_noisecurve._validation import check_choice, check_float, check_int
from keras_noisecurve.backend.common import units
from keras_noisecurve.backend.common.clip import clip_factors
from keras_noisecurve.backend.tensorflow import ghost
from keras_noisecurve.backend.tensorflow.clipped_sum import ClippedSum, chunked_clipped_sum
from keras_noisecurve.backend.common.model_checks import ENGINES, check_model_is_clippable  # noqa: F401 - ditto

#: what this module defines, and ClippedSum (clipped_sum's), the engines' result; the neutral
#: helpers imported here (ENGINES, check_model_is_clippable, per_example_loss_fn) are their modules'
__all__ = ["ClippedSum", "add_regularization", "get_engine", "vectorized_clipped_sum"]

def _trainable(model):
    variables = list(model.trainable_variables)
    if not variables:
        raise ValueError("the model has no trainable variables.")
    # the tf.Variable behind each keras.Variable (what GradientTape differentiates)
    return [v.value if isinstance(v, keras.Variable) else v for v in variables]


def _validate(l2_norm_clip, microbatch_size):
    if not tf.is_tensor(l2_norm_clip):  # a tensor: an adaptive clip's ζ_t
        l2_norm_clip = check_float("l2_norm_clip", l2_norm_clip, positive=True)
    if microbatch_size is not None:
        microbatch_size = check_int("microbatch_size", microbatch_size, minimum=1)
    return l2_norm_clip, microbatch_size


def check_unit_rows(weights, unit_rows):
    """Refuse a batch whose rows are not whole units of ``unit_rows`` (a ``ValueError`` from the static
    shape, else a run-time assertion)."""
    if unit_rows == 1:
        return
    rows = weights.shape[0]
    if rows is not None:
        units.check_rows(int(rows), unit_rows)
    else:
        tf.debugging.assert_equal(tf.shape(weights)[0] % unit_rows, 0, message=(
            f"a user-level batch has examples_per_user={unit_rows} rows per user: its rows must be a multiple"))


# ------------------------------------------------------------- vectorized engine
def _chunk_stats(model, loss_fn, variables, x, y, w, training, l2_norm_clip, unit_rows=1):
    """Per-example grads of a chunk, one example at a time, clipped and summed; an example
    with a non-finite loss or gradient norm is dropped (it contributes 0 and is marked).

    An honest per-example loop: example 0, then a ``tf.while_loop`` over examples
    1 … P − 1, each a plain ``GradientTape`` on a batch of one (no ``tf.vectorized_map``
    / pfor, whose batched kernels differ from the per-example ones and which crashes
    on some layers). The clipped gradients are accumulated in the loop, so memory is
    O(parameters) plus the per-example norms, losses and predictions. With ``unit_rows`` k > 1
    (user-level) the loop runs over units of k consecutive rows, each one batch of k whose loss is
    ``Σ_j w_j·loss_j``, clipped as one; norms and drops are per row (a unit's on each of its rows).
    """
    k = int(unit_rows)
    wide = tf.float64 if any(v.dtype == tf.float64 for v in variables) else tf.float32
    clip = tf.cast(l2_norm_clip, wide)

    def single(i):
        if k == 1:
            xi, yi = tf.nest.map_structure(lambda t: t[i : i + 1], (x, y))
        else:
            xi, yi = tf.nest.map_structure(lambda t: t[i * k : (i + 1) * k], (x, y))
        with tf.GradientTape() as tape:
            pred = model(xi, training=training)
            if k == 1:
                loss = loss_fn(yi, pred)[0]
                weighted = loss * tf.cast(w[i], loss.dtype)
            else:  # the unit's rows: their losses (k,), the unit's weighted sum
                losses = tf.reshape(loss_fn(yi, pred), [k])
                weighted = tf.reduce_sum(losses * tf.cast(w[i * k : (i + 1) * k], losses.dtype))
                loss = tf.reduce_sum(losses)  # finite iff every row's is
        grads = tape.gradient(weighted, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        # IndexedSlices (embeddings) to dense, with the variable's static shape: TensorFlow's
        # gradient of a kernel with a dimension of 1 (Dense(1) → Dense on sequences, Gemma3n's
        # rank-1 LAuReL block) loses it at a dynamic row (None, …), which the loop refuses
        grads = [tf.ensure_shape(tf.convert_to_tensor(g), v.shape) for g, v in zip(grads, variables)]
        # variables may differ in dtype (LoRA factors are float32 in a float64 model): add in the widest
        norm = tf.sqrt(tf.add_n([tf.cast(tf.reduce_sum(tf.square(g)), wide) for g in grads]))
        # min(1, ζ/‖g‖); a non-finite loss or gradient norm drops the example: its contribution is
        # replaced by zeros (tf.where: 0·inf would be nan)
        factor, keep = clip_factors(norm, tf.cast(loss, norm.dtype), clip)
        dropped = tf.logical_not(keep)
        clipped = [tf.where(dropped, tf.zeros_like(g), tf.cast(factor, g.dtype) * g) for g in grads]
        if k > 1:
            return clipped, norm, losses, pred, dropped
        return clipped, norm, loss, tf.nest.map_structure(lambda t: t[0], pred), dropped

    n = tf.shape(w)[0] // k
    sums, norm0, loss0, pred0, dropped0 = single(0)
    leaves0 = tf.nest.flatten(pred0)

    def array(first):
        return tf.TensorArray(first.dtype, size=n, element_shape=first.shape).write(0, first)

    arrays = (array(norm0), array(loss0), [array(t) for t in leaves0], array(dropped0))

    def body(i, sums, arrays):
        clipped, norm, loss, pred, dropped = single(i)
        norms, losses, preds, drops = arrays
        preds = [a.write(i, t) for a, t in zip(preds, tf.nest.flatten(pred))]
        arrays = (norms.write(i, norm), losses.write(i, loss), preds, drops.write(i, dropped))
        return i + 1, [s + c for s, c in zip(sums, clipped)], arrays

    _, sums, (norms, losses, preds, drops) = tf.while_loop(lambda i, *_: i < n, body, (tf.constant(1), sums, arrays))
    preds = tf.nest.pack_sequence_as(pred0, [a.stack() for a in preds])
    if k > 1:  # (U, k, ...) -> (P, ...); a unit's norm and drop on each of its rows
        rows = lambda t: tf.reshape(t, tf.concat([[-1], tf.shape(t)[2:]], 0))  # noqa: E731
        return (sums, units.per_row(norms.stack(), k), rows(losses.stack()), tf.nest.map_structure(rows, preds),
                units.per_row(drops.stack(), k))
    return sums, norms.stack(), losses.stack(), preds, drops.stack()


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
    unit_rows=1,
) -> ClippedSum:
    """Σ_i clip(w_i·∇loss_i, ζ) by a per-example loop: the reference engine.

    Each example's gradient is taken alone (a ``GradientTape`` on a batch of one inside
    a ``tf.while_loop``, no ``tf.vectorized_map``), so it computes exactly what a Python
    loop over examples computes, on every kernel path (oneDNN on or off) and layer. The
    name is historical: it used ``tf.vectorized_map``, whose batched kernels drifted
    (2.0e-3 relative on the GroupNorm CNN with oneDNN on) and which crashed on
    ``MultiHeadAttention``.

    Args:
      model: a Keras model (TF backend).
      loss_fn: ``(y_true, y_pred) -> (P,)`` per-example unreduced loss.
      x, y: a batch of P examples (nested structures allowed for x).
      sample_weight: (P,) weights multiplying each loss before clipping, or None (all 1).
      l2_norm_clip: ζ > 0.
      microbatch_size: process the batch in chunks of this many examples (the loop
        runs per chunk; memory is O(parameters) per chunk either way); None: the whole
        batch in one loop.
      training: passed to ``model(..., training=training)``.
      unit_rows: k, the rows of one privacy unit (a user-level run's examples per user; 1: every
        row is a unit): units of k consecutive rows are clipped as one
        (:mod:`keras_noisecurve.backend.common.units`); a ``microbatch_size`` is rounded down to whole units.

    Returns:
      :class:`ClippedSum`; an example whose loss or gradient norm is not finite contributes
      0 and is marked in ``nonfinite``. Memory O(parameters) beyond the model's own; time: P
      gradients one after the other (slow: a reference, docs/training.md, "Performance").
      Regularisation losses are NOT included (see :func:`add_regularization`).
    """
    l2_norm_clip, microbatch_size = _validate(l2_norm_clip, microbatch_size)
    variables = _trainable(model)
    n = tf.shape(tf.nest.flatten(x)[0])[0]
    if sample_weight is None:
        w = tf.ones([n], dtype=tf.float32)
    else:
        w = tf.reshape(tf.cast(sample_weight, tf.float32), [-1])

    unit_rows = check_int("unit_rows", unit_rows, minimum=1)
    check_unit_rows(w, unit_rows)
    if microbatch_size is None:
        return ClippedSum(*_chunk_stats(model, loss_fn, variables, x, y, w, training, l2_norm_clip, unit_rows))

    def step(x_chunk, y_chunk, w_chunk):
        return ClippedSum(*_chunk_stats(model, loss_fn, variables, x_chunk, y_chunk, w_chunk, training, l2_norm_clip,
                                        unit_rows))

    return chunked_clipped_sum(step, x, y, w, max(1, microbatch_size // unit_rows) * unit_rows)


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
        (``keras_noisecurve.backend.tensorflow.ghost``): ghost norms for every layer with a rule,
        a per-layer vector–Jacobian product of its own call for any other layer with
        trainable weights; it never differentiates the whole model per example.
        ``"vectorized"``: the reference, per-example gradients of the whole model one
        example at a time (a ``tf.while_loop`` of plain ``GradientTape`` gradients, no
        pfor: exact on every kernel path and layer, P times a batch-of-one gradient,
        slow); ``"auto"`` never chooses it.
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
