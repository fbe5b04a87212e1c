"""Keras training features a private model keeps on TensorFlow: ``class_weight``, ``add_loss``, and
the count and report of the examples it drops (the JAX step's are ``backend/common/step_features.py``, in Keras).

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

Examples with a non-finite loss or gradient are counted, reported, and an empty step is refused.
The clipping engines drop such an example (it contributes exactly 0 to the clipped sum,
``ClippedSum.nonfinite`` marks it; :mod:`keras_noisecurve.backend.tensorflow.clipped_sum`). A zero
contribution is within the clip bound ζ, so the privacy analysis is unchanged. What a
``PrivateModel`` does with the mask lives here:

- :func:`count_dropped`: the number of real examples (sample weight > 0) dropped in a
  step and the number of real examples, summed over the replicas of a step;
- :func:`record`: adds them to the model's counters (:func:`state`); the epoch's count is
  the ``nonfinite_examples`` entry of ``fit``'s logs (progress bar and ``History``);
- :class:`WarnNonFinite`: one ``RuntimeWarning`` per ``fit`` naming the steps;
- :func:`assert_some_finite`: a step whose every real example was dropped is an error
  raised before the weights change (:func:`all_dropped` is the same test as a tensor,
  for the refusal of ``PrivateModel._refuse`` under XLA, which drops assertions).
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_noisecurve import _compat
from keras_noisecurve.backend.common import messages
from keras_noisecurve.backend.common.class_weight import check_class_weight

__all__ = [
    "METRIC",
    "WarnNonFinite",
    "add_weight_penalty",
    "all_dropped",
    "assert_some_finite",
    "check_class_weight",
    "class_weights",
    "count_dropped",
    "epoch_count",
    "message",
    "record",
    "reset_epoch",
    "state",
    "weight_penalty",
]


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


# ------------------------------------------------------------------ non-finite examples
#: the name of the count in ``fit``'s logs
METRIC = "nonfinite_examples"

# the entries of state(): this fit's dropped examples, this fit's steps with a dropped
# example, the first and last such step (optimizer steps), this epoch's dropped examples
_FIT_COUNT, _FIT_STEPS, _FIRST, _LAST, _EPOCH_COUNT = range(5)


def state() -> tf.Variable:
    """int64 (5,): [dropped examples in this fit, steps with a dropped example in this fit,
    first such step, last such step, dropped examples in this epoch]. Not a model weight:
    never saved, never trained (the model holds it untracked)."""
    return tf.Variable(
        tf.zeros([5], tf.int64), trainable=False, name="nonfinite_examples",
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    )


def count_dropped(nonfinite, sample_weight, per_example_loss):
    """``(dropped, real)`` int64 scalars of one step, summed over the replicas.

    ``nonfinite`` (P,) bool from the engine (``None``: the engine reports nothing, counted
    as none dropped), ``sample_weight`` (P,) or ``None`` (every row real),
    ``per_example_loss`` (P,) (gives P). Padding rows (weight 0) are not counted: a
    padding row that is not finite is dropped too, but it was never part of the batch.
    """
    if sample_weight is None:
        real = tf.ones(tf.shape(per_example_loss), tf.bool)
    else:
        real = tf.reshape(sample_weight, [-1]) > 0
    dropped = tf.zeros_like(real) if nonfinite is None else tf.logical_and(nonfinite, real)
    counts = tf.stack([tf.reduce_sum(tf.cast(dropped, tf.int64)), tf.reduce_sum(tf.cast(real, tf.int64))])
    context = tf.distribute.get_replica_context()
    if context is not None and context.num_replicas_in_sync > 1:
        counts = context.all_reduce("sum", counts)
    return counts[0], counts[1]


def all_dropped(dropped, real):
    """bool scalar: the step had real examples and every one of them was dropped (an empty
    Poisson batch, ``real == 0``, is a valid step: its sum is 0 by design)."""
    return tf.logical_and(real > 0, tf.equal(dropped, real))


def assert_some_finite(dropped, real, iteration):
    """Fail the step (``InvalidArgumentError``) when every real example of the batch has a
    non-finite loss or gradient. Returns the assertion op (``None`` when eager: it has
    raised already); the caller makes every update of the step depend on it
    (``tf.control_dependencies``), since an assertion is not ordered before the variable
    updates of a ``tf.function`` otherwise. XLA drops assertions: under
    ``jit_compile=True`` the model refuses the step instead (noise only, no data) and
    raises after it."""
    message = (
        "private training stopped: every real example of the batch of this step has a non-finite loss or "
        "gradient (an inf/nan feature or label, or a layer whose output overflows), so no example can contribute "
        "and the weights were not changed. Examples with a non-finite loss or gradient are otherwise dropped one "
        "by one (the nonfinite_examples log of fit): check the inputs, e.g. numpy.isfinite(x).all()"
    )
    return tf.debugging.Assert(tf.logical_not(all_dropped(dropped, real)), [message, "step:", iteration])


def record(variable, dropped, iteration):
    """Add one step's ``dropped`` count (int64) at optimizer step ``iteration`` to ``variable``
    (:func:`state`); returns this epoch's count so far (the ``nonfinite_examples`` log)."""
    had = dropped > 0
    old = tf.identity(variable)
    iteration = tf.cast(iteration, tf.int64)
    first = tf.where(tf.logical_and(had, tf.equal(old[_FIT_STEPS], 0)), iteration, old[_FIRST])
    new = tf.stack([
        old[_FIT_COUNT] + dropped,
        old[_FIT_STEPS] + tf.cast(had, tf.int64),
        first,
        tf.where(had, iteration, old[_LAST]),
        old[_EPOCH_COUNT] + dropped,
    ])
    variable.assign(new)
    return new[_EPOCH_COUNT]


def epoch_count(variable) -> int:
    """This epoch's dropped examples so far, read on the host from :func:`state`'s ``variable``."""
    return int(variable.numpy()[_EPOCH_COUNT])


def reset_epoch(variable) -> None:
    """Start a new epoch's count (host side, from ``reset_metrics``)."""
    variable.assign(tf.tensor_scatter_nd_update(variable, [[_EPOCH_COUNT]], tf.zeros([1], tf.int64)))


def message(values) -> str:
    """The warning for :func:`state`'s ``values`` (numpy) after a fit that dropped examples."""
    return messages.dropped_examples(*(int(v) for v in values[:4]))


class WarnNonFinite(keras.callbacks.Callback):
    """Resets the model's counters when ``fit`` begins and, when it ends, warns once
    (``RuntimeWarning``) if any example was dropped, naming the steps."""

    def __init__(self, variable):
        super().__init__()
        self._state = variable

    def on_train_begin(self, logs=None):
        self._state.assign(tf.zeros([5], tf.int64))

    def on_train_end(self, logs=None):
        values = self._state.numpy()
        if int(values[_FIT_COUNT]) > 0:
            warnings.warn(message(values), RuntimeWarning, stacklevel=2)
