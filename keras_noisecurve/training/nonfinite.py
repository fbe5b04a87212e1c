"""Examples with a non-finite loss or gradient: counted, reported, and an empty step refused.

The clipping engines drop such an example (it contributes exactly 0 to the clipped sum,
``ClippedSum.nonfinite`` marks it; :mod:`keras_noisecurve.training.clipped_sum`). A zero
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
import tensorflow as tf

from keras_noisecurve.backend import messages

__all__ = [
    "METRIC", "WarnNonFinite", "all_dropped", "assert_some_finite", "count_dropped", "epoch_count", "message", "record",
    "reset_epoch", "state",
]

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
