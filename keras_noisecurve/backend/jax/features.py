"""What the JAX private step keeps of Keras's training features, as the TensorFlow step
does (``keras_noisecurve.backend.tensorflow.features``):

* **Non-finite examples.** An example whose loss or per-example gradient norm is not
  finite is dropped by the clipping engine (clip factor 0: it contributes exactly 0,
  within the clip bound ζ, so the privacy analysis is unchanged). :func:`count_dropped`
  counts the real ones (sample weight > 0) inside the jitted step, the
  :class:`NonFiniteExamples` metric carries the counts through Keras's JAX state (no
  host synchronisation per step) and logs this epoch's count as ``nonfinite_examples``;
  :class:`ReportNonFinite` warns once per ``fit`` naming the steps. A step whose every
  real example was dropped applies its noise only (the clipped sum is zeroed in the step)
  and ``fit`` raises at the end of that epoch (``train_on_batch`` right after the step):
  under ``jit`` the host sees the step's state only when Keras copies it back. A step
  whose batch belongs to another step of the plan (a ``PrivateRun`` batch whose step
  index is not the optimizer's, e.g. one JAX process feeding another step's rows) is
  refused the same way, with its own message.
* **``fit(class_weight=...)``**: :func:`class_weights` gives each example the weight of
  its class, multiplied into ``w_i`` before clipping.
* **``add_loss``**: :func:`weight_penalty` returns the penalty of the layers'
  ``self.add_loss(...)`` as a function of the trainable values when it depends on the
  weights only (checked on the jaxpr: no path from the batch to the penalty), added like
  a weight regulariser (``B·∇penalty`` joins the clipped sum); one computed from the
  batch is refused with a ``ValueError`` (never dropped silently).
"""

from __future__ import annotations

import warnings

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import keras
import numpy as np

from keras_noisecurve.backend.common import messages

__all__ = [
    "METRIC", "NonFiniteExamples", "ReportNonFinite", "all_dropped_message", "class_weights", "count_dropped",
    "ALL_DROPPED", "OUT_OF_STEP", "dropped_message", "nonfinite_mask", "out_of_step_message", "raise_if_refused",
    "refusal_message", "refused_steps", "weight_penalty",
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
    return jnp.logical_not(jnp.isfinite(losses) & jnp.isfinite(norms))


def count_dropped(nonfinite, weights):
    """``(dropped, real)`` int32 scalars: the real examples (``weights`` (P,) > 0) that
    ``nonfinite`` (P,) bool marks, and the real examples. Padding rows (weight 0) are not
    counted: a non-finite padding row is dropped too, but it was never in the batch."""
    real = weights > 0
    return jnp.sum(nonfinite & real, dtype=jnp.int32), jnp.sum(real, dtype=jnp.int32)


@jax.jit
def _zero_epoch(counts):
    return counts.at[_EPOCH].set(0)


class NonFiniteExamples(keras.metrics.Metric):
    """The ``nonfinite_examples`` log: this epoch's count of dropped examples.

    Its int32 (9,) variable also keeps this ``fit``'s count, its steps with a dropped
    example (first, last) and its refused steps (the last one, why, its batch's step); ``reset_state`` (Keras's per-epoch and
    ``evaluate`` reset) clears only the epoch's count, ``reset_fit`` everything."""

    def __init__(self, name=METRIC, **kwargs):
        super().__init__(name=name, dtype="int32", **kwargs)
        self.counts = self.add_variable(shape=(_SIZE,), initializer="zeros", dtype="int32", name="counts")

    def update_state(self, dropped, iteration, why, batch_step=None):
        """Add one step: ``dropped`` int32 examples at optimizer step ``iteration``;
        ``why`` int32, 0 or the bits of the reasons the step was refused
        (:data:`ALL_DROPPED`: it had real examples and all were dropped;
        :data:`OUT_OF_STEP`: its batch belongs to another step); ``batch_step``: the
        smallest step index of the batch (``iteration`` when ``None``)."""
        old = self.counts.value
        dropped = jnp.asarray(dropped, jnp.int32)
        iteration = jnp.asarray(iteration, jnp.int32)
        why = jnp.asarray(why, jnp.int32)
        batch_step = iteration if batch_step is None else jnp.asarray(batch_step, jnp.int32)
        refused = why != 0
        had = dropped > 0
        first = jnp.where(had & (old[_FIT_STEPS] == 0), iteration, old[_FIRST])
        self.counts.assign(jnp.stack([
            old[_EPOCH] + dropped,
            old[_FIT_COUNT] + dropped,
            old[_FIT_STEPS] + had.astype(jnp.int32),
            first,
            jnp.where(had, iteration, old[_LAST]),
            old[_REFUSED] + refused.astype(jnp.int32),
            jnp.where(refused, iteration, old[_REFUSED_STEP]),
            jnp.where(refused, why, old[_REFUSED_WHY]),
            jnp.where(refused, batch_step, old[_REFUSED_BATCH]),
        ]))

    def result(self):
        return self.counts.value[_EPOCH]

    def reset_state(self):  # every train_on_batch call: one jitted dispatch, not an eager scatter
        self.counts.assign(_zero_epoch(jnp.asarray(self.counts.value)))

    def reset_fit(self):
        self.counts.assign(jnp.zeros((_SIZE,), jnp.int32))

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
        "step (under several JAX processes: a process fed the rows of another step; every process must start "
        "fit(run.dataset(...)) from the same optimizer state). The refused batch had no influence on the weights "
        "(the step applied its noise only, which leaks nothing); stop here and restart every process from one "
        "checkpoint."
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
    """Clears the counts when ``fit`` begins; at the end of each epoch (when Keras's JAX
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
    y = jnp.asarray(y)
    if y.ndim == 2 and y.shape[1] > 1:
        labels = jnp.argmax(y, axis=-1).astype(jnp.int32)
    else:
        labels = jnp.reshape(jnp.round(y.astype(jnp.float32)).astype(jnp.int32), (-1,))
    inside = (labels >= 0) & (labels < len(table))
    picked = jnp.asarray(table, jnp.float32)[jnp.where(inside, labels, 0)]
    return jnp.where(inside, picked, jnp.ones_like(picked))


# ---------------------------------------------------------------------- add_loss
def _is_zero_literal(var) -> bool:
    return isinstance(var, jax_core.Literal) and bool(np.all(np.asarray(var.val) == 0))


def _depends_on(jaxpr, sources) -> list:
    """For each output of ``jaxpr``: whether it is computed from a variable in ``sources``
    (forward walk; an equation depends on its inputs as a whole, except a product with a
    literal 0 factor, which depends on nothing)."""
    dependent = set(sources)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "mul" and any(_is_zero_literal(v) for v in eqn.invars):
            continue
        if any(not isinstance(v, jax_core.Literal) and v in dependent for v in eqn.invars):
            dependent.update(eqn.outvars)
    return [not isinstance(v, jax_core.Literal) and v in dependent for v in jaxpr.outvars]


def weight_penalty(model, trainable, non_trainable, x):
    """The layers' ``add_loss`` penalty as a function ``penalty(trainable) -> float32
    scalar``, or ``None`` when the model adds none.

    ``trainable``/``non_trainable``: the values of ``model``'s variables; ``x``: the
    batch. The forward pass is traced once (``jax.make_jaxpr`` of a ``StatelessScope``
    collecting the losses); each penalty must not depend on ``x``.

    Raises:
      ValueError: a penalty computed from the batch (an activity penalty, an MoE
        load-balancing loss): not a sum of per-example terms, so clipping cannot bound it.
    """
    variables, others = model.trainable_variables, model.non_trainable_variables

    def penalties(values, inputs):
        mapping = list(zip(variables, values)) + list(zip(others, non_trainable))
        with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
            model(inputs, training=True)
        return [jnp.asarray(loss, jnp.float32) for loss in scope.losses]

    closed = jax.make_jaxpr(penalties)(list(trainable), x)
    if not closed.jaxpr.outvars:
        return None
    data = closed.jaxpr.invars[len(jax.tree_util.tree_leaves(list(trainable))):]
    for i, dependent in enumerate(_depends_on(closed.jaxpr, data)):
        if dependent:
            raise ValueError(
                f"a layer adds a loss that depends on the batch with self.add_loss(...) (penalty {i} of the "
                "model's forward pass): it is not a sum of per-example terms, so per-example clipping cannot "
                "bound one example's influence on it (no DP guarantee), and private training does not drop it "
                "silently. Remove it (e.g. router_aux_loss_coef=0 for a Mixtral/MoE router), or put a "
                "per-example version of it into the loss. A penalty on the weights only is supported."
            )

    def penalty(values):
        return sum(penalties(values, x), jnp.asarray(0.0, jnp.float32))

    return penalty
