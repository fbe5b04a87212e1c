"""Keras training features a private model keeps: ``class_weight`` and ``add_loss``.

* ``fit(..., class_weight={class: weight})`` multiplies each example's loss weight
  ``w_i`` by the weight of its class, BEFORE clipping (Keras folds ``class_weight`` into
  ``sample_weight`` the same way): the clipped sum is ``Σ_i clip(w_i·cw[y_i]·∇loss_i, ζ)``.
* A layer's ``self.add_loss(penalty)``: a penalty that depends on the weights only (no
  example enters it) is added like a weight regulariser, unclipped: ``B·∇penalty / R``
  joins the clipped sum, so after the optimizer's division by the expected batch size B
  it contributes exactly ``∇penalty``. A penalty that depends on the batch (an
  activity penalty, an MoE load-balancing loss) is refused: it is not a sum of
  per-example terms that clipping could bound. A penalty that is a constant 0 times
  anything (Mixtral with ``router_aux_loss_coef=0``) adds nothing and is ignored.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_noisecurve import _compat
from keras_noisecurve.training.class_weight import check_class_weight

__all__ = ["add_weight_penalty", "check_class_weight", "class_weights", "weight_penalty"]


# ------------------------------------------------------------------ class_weight
def class_weights(table, y):
    """(P,) weight of each example's class: ``table[y_i]``; ``y`` integer labels of shape
    (P,) or (P, 1), or one-hot / probability rows (P, C) (the class is the argmax, as in
    Keras); a class outside the table weighs 1.

    Raises:
      ValueError: ``y`` is a structure (several outputs: Keras refuses ``class_weight`` there too).
    """
    if isinstance(y, (list, tuple, dict)):
        raise ValueError("class_weight needs a model with one output (Keras's rule too); use sample weights instead.")
    y = tf.convert_to_tensor(y)
    if y.shape.rank == 2 and y.shape[1] is not None and y.shape[1] > 1:
        labels = tf.argmax(y, axis=-1)
    else:
        labels = tf.reshape(tf.cast(tf.round(tf.cast(y, tf.float64)), tf.int64), [-1])
    n = tf.constant(len(table), tf.int64)
    inside = tf.logical_and(labels >= 0, labels < n)
    picked = tf.gather(tf.constant(table), tf.where(inside, labels, tf.zeros_like(labels)))
    return tf.where(inside, picked, tf.ones_like(picked))


# ---------------------------------------------------------------------- add_loss
def _is_zero(t) -> bool:
    """``t`` is a constant 0, or a product with a constant-0 factor."""
    value = tf.get_static_value(t)
    if value is not None:
        return bool(np.all(np.asarray(value) == 0))
    if getattr(t, "op", None) is not None and t.op.type in ("Mul", "MulNoNan"):
        return any(_is_zero(i) for i in t.op.inputs)
    return False


def _depends_on(t, sources) -> bool:
    """Whether graph tensor ``t`` is computed from any tensor in ``sources`` (names)."""
    seen, todo = set(), [t.op]
    while todo:
        op = todo.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if any(out.name in sources for out in op.outputs):
            return True
        todo.extend(i.op for i in op.inputs)
    return False


def weight_penalty(model, data, *, chunked=False):
    """The sum of ``model``'s ``add_loss`` penalties of the forward pass just traced, or
    ``None`` when there is none (constant-zero penalties are dropped).

    Args:
      model: the model whose forward pass (inside the clipping engine) added the losses.
      data: the step's ``(x, y, sample_weight)`` tensors.
      chunked: the engine ran the forward pass in a loop (microbatches, the vectorized
        engine), where losses cannot be checked.

    Raises:
      ValueError: a penalty computed from the batch (naming what to do), or one that
        cannot be checked (eager execution, or made inside a microbatch loop).
    """
    losses = [t for t in _compat.added_losses(model) if not _is_zero(t)]
    if not losses:
        return None
    if tf.executing_eagerly():
        raise ValueError(
            "a layer adds a loss with self.add_loss(...): private training checks that it depends on the "
            "weights only when the step is traced, not under run_eagerly=True. Compile with run_eagerly=False."
        )
    if chunked:
        raise ValueError(
            "a layer adds a loss with self.add_loss(...), which cannot be checked inside the microbatch "
            "loop (microbatch_size=...) or the vectorized engine: use microbatch_size=None and "
            "clipping='auto'."
        )
    graph = tf.compat.v1.get_default_graph()
    sources = {t.name for t in tf.nest.flatten(data) if isinstance(t, tf.Tensor) and t.graph is graph}
    # the forward pass's own losses; those of the per-layer fallback's re-runs (made in its
    # loop over examples) repeat them and are left out
    losses = [t for t in losses if getattr(t, "graph", None) is graph]
    for t in losses:
        if _depends_on(t, sources):
            raise ValueError(
                f"a layer adds a loss that depends on the batch with self.add_loss(...) ({t.name}): it is "
                "not a sum of per-example terms, so per-example clipping cannot bound one example's "
                "influence on it (no DP guarantee), and private training does not drop it silently. "
                "Remove it (e.g. router_aux_loss_coef=0 for a Mixtral/MoE router), or put a per-example "
                "version of it into the loss. A penalty on the weights only is supported."
            )
    return tf.add_n([tf.cast(t, tf.float32) for t in losses]) if losses else None


def add_weight_penalty(model, clipped, penalty, *, expected_batch_size, num_replicas=1):
    """``clipped`` with ``B·∇penalty / R`` added to its sum (as weight regularisers are).

    ``penalty`` is a scalar of the traced forward pass that depends on the weights only
    (:func:`weight_penalty`); its gradient is taken symbolically in that graph.
    """
    variables = model.trainable_variables
    handles = [getattr(v, "value", v) for v in variables]
    grads = tf.gradients(penalty, handles, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    scale = float(expected_batch_size) / float(num_replicas)
    summed = [g + tf.cast(scale, g.dtype) * tf.cast(tf.convert_to_tensor(r), g.dtype)
              for g, r in zip(clipped.grads, grads)]
    return clipped._replace(grads=summed)
