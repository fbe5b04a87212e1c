"""What a private step keeps of Keras's training features, written in Keras for a backend whose
step is one traced function with Keras's metric state (JAX's; TensorFlow's step has its own,
``keras_noisecurve.backend.tensorflow.features``):

* **Non-finite examples.** An example whose loss or per-example gradient norm is not
  finite is dropped by the clipping engine (clip factor 0: it contributes exactly 0,
  within the clip bound ζ, so the privacy analysis is unchanged). :func:`count_dropped`
  counts the real ones (sample weight > 0) inside the traced step, the
  :class:`NonFiniteExamples` metric carries the counts through Keras's metric state (no
  host synchronisation per step) and logs this epoch's count as ``nonfinite_examples``;
  :class:`ReportNonFinite` warns once per ``fit`` naming the steps. A step whose every
  real example was dropped applies its noise only (the clipped sum is zeroed in the step)
  and ``fit`` raises at the end of that epoch (``train_on_batch`` right after the step):
  the host sees the step's state only when Keras copies it back. A step whose batch
  belongs to another step of the plan (a ``PrivateRun`` batch whose step index is not the
  optimizer's, e.g. one JAX process feeding another step's rows) is refused the same way,
  with its own message.
* **``fit(class_weight=...)``**: :func:`class_weights` gives each example the weight of
  its class, multiplied into ``w_i`` before clipping.

(A layer's ``add_loss`` penalty needs the framework to tell a penalty on the weights from one on the
batch: the backend's ``dp_model`` has that check.)
"""

from __future__ import annotations

import warnings

import keras
import numpy as np

from keras_noisecurve.backend.common import messages

__all__ = [
    "METRIC", "NonFiniteExamples", "ReportNonFinite", "all_dropped_message", "class_weights", "count_dropped",
    "ALL_DROPPED", "OUT_OF_STEP", "dropped_message", "nonfinite_mask", "out_of_step_message", "raise_if_refused",
    "refusal_message", "refused_steps",
]

#: the name of the count in ``fit``'s logs (as on TensorFlow)
METRIC = "nonfinite_examples"

# the entries of NonFiniteExamples.counts: this epoch's dropped examples, this fit's
# dropped examples, this fit's steps with a dropped example, the first and last such step,
# this fit's refused steps, the last refused step, why it was refused (a sum of the bits
# below) and the smallest step index of its batch
_EPOCH, _FIT_COUNT, _FIT_STEPS, _FIRST, _LAST, _REFUSED, _REFUSED_STEP, _REFUSED_WHY, _REFUSED_BATCH = range(9)
_SIZE = 9
#: reasons a step is refused (bits of the ``_REFUSED_WHY`` entry)
ALL_DROPPED, OUT_OF_STEP = 1, 2


def nonfinite_mask(losses, norms):
    """(P,) bool: example i's loss or gradient norm is not finite (``losses``, ``norms``:
    (P,) float)."""
    ops = keras.ops
    return ops.logical_not(ops.logical_and(ops.isfinite(losses), ops.isfinite(norms)))


def count_dropped(nonfinite, weights):
    """``(dropped, real)`` int32 scalars: the real examples (``weights`` (P,) > 0) that
    ``nonfinite`` (P,) bool marks, and the real examples. Padding rows (weight 0) are not
    counted: a non-finite padding row is dropped too, but it was never in the batch."""
    ops = keras.ops
    real = ops.greater(weights, 0)
    dropped, real = ops.sum(ops.cast(ops.logical_and(nonfinite, real), "int32")), ops.sum(ops.cast(real, "int32"))
    return ops.cast(dropped, "int32"), ops.cast(real, "int32")  # JAX sums integers to int64 under x64


#: what ``reset_state`` keeps of the counts: all but this epoch's count
_KEEP_FIT = np.array([0] + [1] * (_SIZE - 1), np.int32)


class NonFiniteExamples(keras.metrics.Metric):
    """The ``nonfinite_examples`` log: this epoch's count of dropped examples.

    Its int32 (9,) variable also keeps this ``fit``'s count, its steps with a dropped
    example (first, last) and its refused steps (the last one, why, its batch's step); ``reset_state`` (Keras's per-epoch and
    ``evaluate`` reset) clears only the epoch's count, ``reset_fit`` everything."""

    def __init__(self, name=METRIC, **kwargs):
        super().__init__(name=name, dtype="int32", **kwargs)
        self.counts = self.add_variable(shape=(_SIZE,), initializer="zeros", dtype="int32", name="counts")
        self._keep_fit = keras.ops.convert_to_tensor(_KEEP_FIT)  # made once: reset_state runs every train_on_batch

    def update_state(self, dropped, iteration, why, batch_step=None):
        """Add one step: ``dropped`` int32 examples at optimizer step ``iteration``;
        ``why`` int32, 0 or the bits of the reasons the step was refused
        (:data:`ALL_DROPPED`: it had real examples and all were dropped;
        :data:`OUT_OF_STEP`: its batch belongs to another step); ``batch_step``: the
        smallest step index of the batch (``iteration`` when ``None``)."""
        ops, old = keras.ops, self.counts.value
        dropped, iteration, why = (ops.cast(v, "int32") for v in (dropped, iteration, why))
        batch_step = iteration if batch_step is None else ops.cast(batch_step, "int32")
        refused = ops.not_equal(why, 0)
        had = ops.greater(dropped, 0)
        first = ops.where(ops.logical_and(had, ops.equal(old[_FIT_STEPS], 0)), iteration, old[_FIRST])
        self.counts.assign(ops.stack([
            old[_EPOCH] + dropped,
            old[_FIT_COUNT] + dropped,
            old[_FIT_STEPS] + ops.cast(had, "int32"),
            first,
            ops.where(had, iteration, old[_LAST]),
            old[_REFUSED] + ops.cast(refused, "int32"),
            ops.where(refused, iteration, old[_REFUSED_STEP]),
            ops.where(refused, why, old[_REFUSED_WHY]),
            ops.where(refused, batch_step, old[_REFUSED_BATCH]),
        ]))

    def result(self):
        return self.counts.value[_EPOCH]

    def reset_state(self):  # every train_on_batch call: one product, not an eager scatter
        self.counts.assign(keras.ops.multiply(self.counts.value, self._keep_fit))

    def reset_fit(self):
        self.counts.assign(keras.ops.zeros((_SIZE,), "int32"))

    def values(self) -> np.ndarray:
        """The counts on the host (int (9,))."""
        return np.asarray(keras.ops.convert_to_numpy(self.counts.value))


def all_dropped_message(step, refused) -> str:
    """The error for a step whose every real example was dropped."""
    return (
        f"private training refused step {step} ({refused} refused step(s) so far): every real example of its "
        "batch had a non-finite loss or gradient (an inf/nan feature or label, or a layer whose output "
        "overflows), so no example could contribute. The refused batch had no influence on the weights (the "
        "step applied its noise only, which leaks nothing); stop here and fix the input before training on, "
        "e.g. numpy.isfinite(x).all()."
    )


def out_of_step_message(step, batch_step, refused) -> str:
    """The error for a step whose batch belongs to another step of the plan."""
    return (
        f"private training refused step {step} ({refused} refused step(s) so far): its batch holds rows of step "
        f"{batch_step} of the plan, not of the optimizer's step {step}. The dataset and the optimizer are out of "
        "step (under several processes, as JAX runs them: a process fed the rows of another step; every "
        "process must start fit(run.dataset(...)) from the same optimizer state). The refused batch had no "
        "influence on the weights (the step applied its noise only, which leaks nothing); stop here and restart "
        "every process from one checkpoint."
    )


def refusal_message(values) -> str:
    """The error for the last refused step in the counts ``values``."""
    step, refused = int(values[_REFUSED_STEP]), int(values[_REFUSED])
    if int(values[_REFUSED_WHY]) & OUT_OF_STEP:
        return out_of_step_message(step, int(values[_REFUSED_BATCH]), refused)
    return all_dropped_message(step, refused)


def dropped_message(values) -> str:
    """The warning after a ``fit`` that dropped examples (``values``: the metric's counts)."""
    return messages.dropped_examples(*(int(values[i]) for i in (_FIT_COUNT, _FIT_STEPS, _FIRST, _LAST)))


def refused_steps(values) -> int:
    """The number of refused steps in the counts ``values`` (the metric's ``values()``)."""
    return int(values[_REFUSED])


def raise_if_refused(values, seen) -> int:
    """Raise ``RuntimeError`` when the counts ``values`` hold more refused steps than ``seen``;
    returns the number of refused steps."""
    refused = int(values[_REFUSED])
    if refused > seen:
        raise RuntimeError(refusal_message(values))
    return refused


class ReportNonFinite(keras.callbacks.Callback):
    """Clears the counts when ``fit`` begins; at the end of each epoch (when Keras's
    trainer has copied the state back) raises if a step was refused; when ``fit`` ends,
    warns once (``RuntimeWarning``) if any example was dropped, naming the steps."""

    def __init__(self, metric):
        super().__init__()
        self._metric = metric

    def on_train_begin(self, logs=None):
        self._metric.reset_fit()

    def on_epoch_end(self, epoch, logs=None):
        raise_if_refused(self._metric.values(), 0)

    def on_train_end(self, logs=None):
        values = self._metric.values()
        if int(values[_FIT_COUNT]) > 0:
            warnings.warn(dropped_message(values), RuntimeWarning, stacklevel=2)


# ------------------------------------------------------------------ class_weight
def class_weights(table, y):
    """(P,) float32 weight of each example's class, ``table[y_i]`` (``table``: the dense
    float32 table of ``check_class_weight``); ``y`` integer labels (P,) or (P, 1), or
    one-hot / probability rows (P, C) (the class is the argmax, as in Keras); a class
    outside the table weighs 1.

    Raises:
      ValueError: ``y`` is a structure (several outputs: Keras refuses ``class_weight`` there too).
    """
    if isinstance(y, (list, tuple, dict)):
        raise ValueError("class_weight needs a model with one output (Keras's rule too); use sample weights instead.")
    ops = keras.ops
    y = ops.convert_to_tensor(y)
    if len(y.shape) == 2 and y.shape[1] > 1:
        labels = ops.cast(ops.argmax(y, axis=-1), "int32")
    else:
        labels = ops.reshape(ops.cast(ops.round(ops.cast(y, "float32")), "int32"), (-1,))
    inside = ops.logical_and(ops.greater_equal(labels, 0), ops.less(labels, len(table)))
    picked = ops.take(ops.convert_to_tensor(np.asarray(table, np.float32)), ops.where(inside, labels, 0))
    return ops.where(inside, picked, ops.ones_like(picked))
