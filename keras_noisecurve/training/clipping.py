"""Per-example clipping engines: the contract and the vectorized engine.

Contract (every engine implements it; ``ghost.ghost_clipped_sum`` too)::

    engine(model, loss_fn, x, y, sample_weight, *, l2_norm_clip,
           microbatch_size=None, training=True) -> ClippedSum

- ``loss_fn(y_true, y_pred) -> (P,)``: the per-example, UNREDUCED loss (see
  :func:`per_example_loss_fn`).
- ``sample_weight`` (P,) or ``None`` multiplies each example's loss BEFORE
  clipping: a batch sampler's 0/1 mask makes padding contribute nothing, and any
  weight keeps the sensitivity ≤ ζ because clipping comes after.
- ``ClippedSum.grads[k] = Σ_i clip(w_i·∇loss_i, ζ)`` for ``model.trainable_variables[k]``,
  where ``clip(g, ζ) = g·min(1, ζ/‖g‖₂)`` with the norm over ALL variables (global
  per-example norm). Not divided by the batch size.
- Regularisation losses (kernel regularizers) are data-independent: their gradient
  ∇reg is computed once, outside clipping, and ``B·∇reg`` is added to the clipped
  sum (``B`` = ``expected_batch_size`` argument of :func:`add_regularization`) so
  that after the optimizer's division by B it is exactly ∇reg.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable, NamedTuple

import keras
import tensorflow as tf

from keras_noisecurve._validation import check_choice, check_float, check_int

__all__ = [
    "ClippedSum",
    "vectorized_clipped_sum",
    "per_example_loss_fn",
    "add_regularization",
    "check_model_is_clippable",
    "get_engine",
    "ENGINES",
]

ENGINES = ("auto", "vectorized", "ghost")


class ClippedSum(NamedTuple):
    """Output of a clipping engine (shapes with P = number of examples in the batch).

    grads: list of tensors, Σ_i clip(w_i·∇loss_i, ζ), aligned with ``model.trainable_variables``.
    norms: (P,) per-example gradient norms before clipping, of w_i·∇loss_i.
    per_example_loss: (P,) unweighted loss_i.
    y_pred: the model outputs for the batch (for metrics).
    """

    grads: list
    norms: Any
    per_example_loss: Any
    y_pred: Any


# ---------------------------------------------------------------- loss functions
def per_example_loss_fn(loss) -> Callable:
    """A per-example loss ``(y_true, y_pred) -> (P,)`` from a compiled loss.

    Args:
      loss: a loss name (``"sparse_categorical_crossentropy"``), a ``keras.losses.Loss``
        object, or a function ``(y_true, y_pred) -> per-example values``. Multi-output
        losses (lists or dicts) are refused.

    The result is never reduced over the batch: a ``Loss`` object's ``call`` is used
    (its reduction is ignored); values with extra axes are averaged over them.
    """
    if isinstance(loss, (list, tuple, dict)):
        raise ValueError(
            "private training supports a single loss (one model output); got a "
            f"{type(loss).__name__} of losses. Combine the outputs into one loss function."
        )
    if loss is None:
        raise ValueError("the model must be compiled with a loss for private training.")
    if isinstance(loss, str):
        fn = keras.losses.get(loss)
        if isinstance(fn, keras.losses.Loss):
            fn = fn.call
    elif isinstance(loss, keras.losses.Loss):
        fn = loss.call
    elif callable(loss):
        fn = loss
    else:
        raise ValueError(f"loss must be a name, a keras.losses.Loss or a function; got {loss!r}.")

    def per_example(y_true, y_pred):
        values = fn(y_true, y_pred)
        values = tf.convert_to_tensor(values)
        if values.shape.rank is not None and values.shape.rank > 1:
            values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
        return values

    return per_example


# ----------------------------------------------------------------------- checks
def check_model_is_clippable(model) -> None:
    """Refuse layers that mix examples or add data-dependent losses inside ``call``.

    Raises:
      ValueError: for a trainable BatchNormalization (training mode mixes the examples of a
        batch, so per-example clipping would not bound one example's influence) and
        for activity regularizers (data-dependent losses outside the clipped loss).
    """
    for layer in model._flatten_layers(include_self=True):
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            raise ValueError(
                f"layer {layer.name!r} is a BatchNormalization layer: in training mode it mixes "
                "the examples of a batch, so per-example clipping cannot bound one example's "
                "influence (no DP guarantee). Use GroupNormalization or LayerNormalization, or "
                "freeze it (layer.trainable = False runs it in inference mode)."
            )
        if getattr(layer, "activity_regularizer", None) is not None and layer is not model:
            raise ValueError(
                f"layer {layer.name!r} has an activity_regularizer: a data-dependent loss that would "
                "escape per-example clipping. Remove it or add the penalty inside the loss."
            )


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
    sq = tf.add_n([tf.reduce_sum(tf.reshape(tf.square(g), [tf.shape(g)[0], -1]), axis=1) for g in grads])
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
      :class:`ClippedSum`. Memory O(P × parameters) (or per chunk); time ≈ 2× a plain
      step on the small CNN. Regularisation losses are NOT included (see
      :func:`add_regularization`).
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

    m = microbatch_size
    chunks = (n + m - 1) // m

    def take(tree, i):
        return tf.nest.map_structure(lambda t: t[i * m : tf.minimum((i + 1) * m, n)], tree)

    # Output signature from a symbolic trace on the first chunk.
    first = _chunk_stats(model, loss_fn, variables, take(x, 0), take(y, 0), take(w, 0), training, l2_norm_clip)
    norms_ta = tf.TensorArray(first[1].dtype, size=chunks, infer_shape=False)
    loss_ta = tf.TensorArray(first[2].dtype, size=chunks, infer_shape=False)
    pred_flat = tf.nest.flatten(first[3])
    pred_tas = [tf.TensorArray(p.dtype, size=chunks, infer_shape=False) for p in pred_flat]
    norms_ta = norms_ta.write(0, first[1])
    loss_ta = loss_ta.write(0, first[2])
    pred_tas = [ta.write(0, p) for ta, p in zip(pred_tas, pred_flat)]

    def body(i, sums, norms_ta, loss_ta, pred_tas):
        s, nr, ls, pr = _chunk_stats(model, loss_fn, variables, take(x, i), take(y, i), take(w, i), training, l2_norm_clip)
        sums = [a + b for a, b in zip(sums, s)]
        pred_tas = [ta.write(i, p) for ta, p in zip(pred_tas, tf.nest.flatten(pr))]
        return i + 1, sums, norms_ta.write(i, nr), loss_ta.write(i, ls), pred_tas

    _, sums, norms_ta, loss_ta, pred_tas = tf.while_loop(
        lambda i, *_: i < chunks, body, (tf.constant(1), list(first[0]), norms_ta, loss_ta, pred_tas)
    )
    def concat(ta, like):
        out = ta.concat()
        out.set_shape(tf.TensorShape([None]).concatenate(like.shape[1:]))
        return out

    preds = tf.nest.pack_sequence_as(first[3], [concat(ta, p) for ta, p in zip(pred_tas, pred_flat)])
    return ClippedSum(list(sums), concat(norms_ta, first[1]), concat(loss_ta, first[2]), preds)


def add_regularization(model, clipped: ClippedSum, *, expected_batch_size: int, num_replicas: int = 1) -> ClippedSum:
    """Add ``B·∇reg / R`` to the clipped sum, reg = Σ model weight-regularisation losses.

    The regulariser does not depend on data (activity regularizers are refused), so
    its gradient is added unclipped: after the optimizer divides by B (and the R
    replicas' sums are added) it contributes exactly ∇reg to ĝ_t.
    """
    variables = _trainable(model)
    with tf.GradientTape() as tape:
        reg_losses = model._get_regularization_losses()
        if not reg_losses:
            return clipped
        reg = tf.add_n([tf.cast(r, tf.float32) for r in reg_losses])
    reg_grads = tape.gradient(reg, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    scale = float(expected_batch_size) / float(num_replicas)
    grads = [g + tf.cast(scale, g.dtype) * tf.cast(r, g.dtype) for g, r in zip(clipped.grads, reg_grads)]
    return clipped._replace(grads=grads)


# ---------------------------------------------------------------------- registry
def _ghost_module():
    try:
        return importlib.import_module("keras_noisecurve.training.ghost")
    except ModuleNotFoundError as exc:
        if exc.name == "keras_noisecurve.training.ghost":
            return None
        raise


def get_engine(name: str = "auto", model=None) -> Callable:
    """The clipping engine called ``name``.

    Args:
      name: ``"vectorized"`` (per-example gradients by ``tf.vectorized_map``),
        ``"ghost"`` (ghost-norm clipping, ``keras_noisecurve.training.ghost``) or
        ``"auto"``: ghost when ``ghost.supports(model)`` is true, else vectorized.
      model: needed for ``"auto"`` and to check ``"ghost"`` supports the model.

    Returns:
      a function with the engine signature (module docstring).
    """
    check_choice("clipping", name, ENGINES)
    if name == "vectorized":
        return vectorized_clipped_sum
    ghost = _ghost_module()
    if name == "ghost":
        if ghost is None:
            raise ValueError("clipping='ghost' is not available in this installation; use 'vectorized'.")
        if model is not None:
            ok, reason = ghost.supports(model)
            if not ok:
                raise ValueError(f"clipping='ghost' does not support this model: {reason}. Use 'vectorized'.")
        return ghost.ghost_clipped_sum
    # auto
    if ghost is not None and model is not None:
        ok, reason = ghost.supports(model)
        if ok:
            return ghost.ghost_clipped_sum
        warnings.warn(
            f"clipping='auto' uses the vectorized engine for this model: the ghost engine does not "
            f"support it ({reason}). Per-example gradients cost more memory and time.",
            stacklevel=2,
        )
    return vectorized_clipped_sum
