"""The TensorFlow half of ``PrivateModel`` (``dp_model.py``): the private ``train_step``
(a clipping engine of ``clipping.py``/``ghost.py``, the regularisation gradient, the
step checks as tensors, ``optimizer.apply_clipped_sum``), and what ``fit`` needs around
it on TensorFlow (``tf.distribute``, XLA's refused steps reported on the host).

``PrivateModel`` inherits from :class:`TrainStepBackend` of the backend in use (this
module under ``KERAS_BACKEND=tensorflow``, ``keras_noisecurve.backend.jax.dp_model``
under JAX), picked once when ``keras_noisecurve.training.dp_model`` is imported. It lives
in ``training`` because it runs the clipping engines of this package.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_noisecurve import _compat
from keras_noisecurve._losses import float32_outputs, split_sample_weight, weigh_positions
from keras_noisecurve.backend.common import messages
from keras_noisecurve.backend.common.clip import unit_weights
from keras_noisecurve.backend.common.run_batch import split_step as _split_step
from keras_noisecurve.backend.tensorflow import features
from keras_noisecurve.backend.tensorflow.clipping import add_regularization, get_engine
from keras_noisecurve.backend.tensorflow.features import add_weight_penalty, class_weights, weight_penalty

__all__ = ["TrainStepBackend"]


def _num_replicas() -> int:
    ctx = tf.distribute.get_replica_context()
    if ctx is None:  # cross-replica context
        return tf.distribute.get_strategy().num_replicas_in_sync
    return ctx.num_replicas_in_sync


def _check_step(step, iterations):
    """Fail the step unless every row of the batch belongs to step ``iterations``.

    Returns the assertion op (``None`` when eager: it has raised already). The caller
    makes every update of the step depend on it (``tf.control_dependencies``): in a
    ``tf.function`` an assertion runs, but is not ordered before the variable updates,
    which it shares no data with, so without the dependency the optimizer could advance
    (and apply the step's noise) before the assertion stops the step."""
    expected = tf.cast(iterations, tf.int64)
    step = tf.cast(step, tf.int64)
    return tf.debugging.assert_equal(
        step,
        tf.fill(tf.shape(step), expected),
        message=(
            "PrivateRun: this batch belongs to another step than the optimizer's (x: the batch's "
            "step, y: the optimizer's). The dataset and the optimizer are out of step, "
            "e.g. a dataset restarted at batch 0 after the model was restored, or reordered "
            "(skip/shuffle/repeat) after run.dataset(): each step of the plan must use its own batch, "
            "or the privacy accounting no longer holds. Pass run.dataset(...) to fit unchanged (it "
            "starts at the optimizer's step), or in a custom loop iterate run.dataset(x, y).batches(optimizer)"
        ),
        summarize=2,
    )


# Why train_step refused a batch (bits of model._dp_refused[1]).
_OUT_OF_STEP, _PAST_PLAN, _NON_FINITE, _ALL_DROPPED = 1, 2, 4, 8


def _refusal_state():
    """int64 (4,): [refused steps so far, reason bits, batch step, optimizer step] of the
    last refused step. Not a model weight: never saved, never trained."""
    return tf.Variable(
        tf.zeros([4], tf.int64), trainable=False, name="refused_steps",
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    )


def _refusal_message(state, loss_scale):
    count, reasons, batch_step, iteration = (int(v) for v in state)
    what = []
    if reasons & _OUT_OF_STEP:
        what.append(
            f"its batch belongs to step {batch_step}, not to the optimizer's step {iteration}: the dataset "
            "and the optimizer are out of step, e.g. a dataset restarted at batch 0 after the model was "
            "restored, or reordered (skip/shuffle/repeat) after run.dataset(). Pass run.dataset(...) to "
            "fit unchanged (it starts at the optimizer's step), or in a custom loop iterate "
            "run.dataset(x, y).batches(optimizer)"
        )
    if reasons & _PAST_PLAN:
        what.append(messages.past_plan(iteration))
    if reasons & _NON_FINITE:
        what.append(
            f"its clipped sum or an example's gradient was not finite under mixed_float16 with the static loss "
            f"scale {loss_scale:g} (a float16 overflow in the backward pass): compile with a smaller "
            "loss_scale= (a power of two, 1 turns scaling off) or use mixed_bfloat16"
        )
    if reasons & _ALL_DROPPED:
        what.append(
            "every real example of its batch had a non-finite loss or gradient (an inf/nan feature or label, "
            "or a layer whose output overflows), so no example could contribute"
        )
    return (
        f"private training refused step {iteration} ({count} refused step(s) so far): " + "; ".join(what)
        + ". The refused batch had no influence on the weights (the step applied its noise only, which "
        "leaks nothing); stop here and fix the input before training on."
    )


class _RefuseBadSteps(keras.callbacks.Callback):
    """Raises on the host right after a step that ``train_step`` refused (a batch out of
    step, a step past the plan, a non-finite float16 sum, a batch of non-finite examples
    only): under XLA, where assertions are dropped, this is how such a step is reported.
    The step itself used no data."""

    def __init__(self, model):
        super().__init__()
        self._state = model._dp_refused
        self._loss_scale = model._dp_loss_scale
        self._seen = 0

    def on_train_begin(self, logs=None):
        self._seen = int(self._state[0].numpy())

    def on_train_batch_end(self, batch, logs=None):
        state = self._state.numpy()
        if int(state[0]) > self._seen:
            self._seen = int(state[0])
            raise RuntimeError(_refusal_message(state, self._loss_scale))


class TrainStepBackend:
    """TensorFlow implementation of ``PrivateModel``'s backend hooks and ``train_step``."""

    _dp_counts_steps_on_host = False  # fit's callbacks read optimizer.iterations

    def _dp_refusal_state(self):
        return _refusal_state()

    def _dp_nonfinite_state(self):
        return features.state()

    def _dp_check_engine(self, model):
        if self._dp_clipping != "vectorized":  # the per-layer engine's refusals, before compile
            get_engine(self._dp_clipping, model)

    def reset_metrics(self):
        """Keras's ``reset_metrics`` (every epoch of ``fit``), and the epoch's
        ``nonfinite_examples`` count."""
        super().reset_metrics()
        features.reset_epoch(self._dp_nonfinite)

    def _dp_compile_defaults(self, kwargs):
        kwargs.setdefault("jit_compile", False)
        if kwargs["jit_compile"] is True:
            _check_xla(self)

    def _dp_check_loss_scale(self, scale):
        return scale

    def _dp_batches(self, data, optimizer):
        if tf.distribute.has_strategy():
            return data.batches(optimizer)
        with self.distribute_strategy.scope():  # P rounded up to the replicas of the model's strategy
            return data.batches(optimizer)

    def _dp_step_callbacks(self):
        callbacks = [features.WarnNonFinite(self._dp_nonfinite)]
        if self.jit_compile or self._dp_loss_scale != 1.0:
            # a refused step (out of step, past the plan, non-finite) raises on the host right
            # after it (without XLA the step's own assertions fail it first)
            callbacks.append(_RefuseBadSteps(self))
        return callbacks

    def _dp_fit(self, x, y, kwargs):
        self._dp_build_optimizer_before_tracing()
        if not self.jit_compile:
            return super().fit(x, y, **kwargs)
        try:
            return super().fit(x, y, **kwargs)
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError, tf.errors.InternalError) as error:
            raise RuntimeError(
                "the private train step failed under XLA (jit_compile=True), most likely because a layer's "
                f"clipping path cannot be compiled by XLA: {error.message.splitlines()[0]} "
                "Compile with jit_compile=False (the default of private models)."
            ) from error

    def _dp_build_optimizer_before_tracing(self):
        """Build the optimizer (its noise key, noise state and the inner optimizer's slots)
        before ``fit`` traces the train step, where every layer is built already.

        Without a distribution strategy Keras builds the optimizer inside the first trace
        of the step; a ``tf.function`` whose first trace creates variables is traced a
        second time, so every ``fit`` would trace the private step twice. Under a strategy
        Keras builds it beforehand itself; an unbuilt model is built by the first trace,
        and the optimizer with it (``train_step``)."""
        optimizer = self.optimizer
        if optimizer is None or optimizer.built or _compat.explicit_distribution_strategy(self) is not None:
            return
        if not all(layer.built for layer in _compat.flatten_layers(self)):
            return
        self._dp_build_optimizer(optimizer)

    def _dp_build_optimizer(self, optimizer):
        with keras.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(self.trainable_variables)
        optimizer.built = True

    def _symbolic_build(self, iterator=None, data_batch=None):
        # Keras builds a model under a tf.distribute strategy from one batch, unpacked
        # as (x, y, sample_weight): leave out a PrivateRun batch's step index.
        if data_batch is not None:
            data_batch = _split_step(data_batch)[0]
        return super()._symbolic_build(iterator=iterator, data_batch=data_batch)

    @tf.autograph.experimental.do_not_convert
    def _engine(self):
        """The clipping engine, resolved once (a Python-side choice, never traced)."""
        if self._dp_engine is None:
            self._dp_engine = get_engine(self._dp_clipping, self)
        return self._dp_engine

    def _dp_engine_run(self, loss_fn, x, y, w, *, l2_norm_clip, plan=True, unit_rows=1):
        """The clipping engine (``get_engine(self.clipping, self)``) on one batch, eagerly, inside
        ``ghost.observe_layer_norms``, as numbers for the audit's clipping check
        (:mod:`keras_noisecurve.audit.mechanism_clipping`).

        ``unit_rows`` k: the rows of one privacy unit (a user-level run's ``examples_per_user``),
        clipped as one by the engine (rows ``[u·k, (u+1)·k)`` are unit u; 1: every row a unit).

        Returns ``(groups, norms, sums, layer_sq)``: ``groups`` ``[(layer, rule kind, [index of
        each of its variables in self.trainable_variables])]`` (``None`` unless ``plan``; with
        k > 1 the rules of the user-level plan, a layer whose rule cannot merge a unit's rows
        showing the fallback's), ``norms`` (U,) the per-unit norms before clipping (U = P/k:
        the per-example norms when k = 1), ``sums`` the clipped sum (one array per trainable
        variable), ``layer_sq`` ``{id(layer): (U,)}`` the per-unit squared norms of each layer's
        weights as its rule computed them; float64 numpy throughout."""
        import numpy as np

        from keras_noisecurve.backend.tensorflow import ghost

        unit_rows = int(unit_rows)
        engine = get_engine(self._dp_clipping, self)
        groups = None
        if plan:
            index = {id(v): k for k, v in enumerate(self.trainable_variables)}
            groups = [(layer, rule.kind, [index[id(v)] for v in own if id(v) in index])
                      for layer, rule, own in ghost._per_unit(ghost.plan(self), unit_rows)]
        with ghost.observe_layer_norms() as seen:
            out = engine(self, loss_fn, x, y, w, l2_norm_clip=l2_norm_clip, training=False, unit_rows=unit_rows)
        layer_sq = {}
        for layer, _, _, sq in seen:  # per unit already when unit_rows > 1
            layer_sq[id(layer)] = layer_sq.get(id(layer), 0.0) + np.asarray(sq.numpy(), np.float64)
        norms = np.asarray(out.norms.numpy(), np.float64)[::unit_rows]  # a unit's norm is on each of its rows
        return (groups, norms, [np.asarray(g.numpy(), np.float64) for g in out.grads], layer_sq)

    def train_step(self, data):
        data, step = _split_step(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        optimizer = self.optimizer
        self._dp_check_optimizer(optimizer)  # e.g. optimizer swapped after compile
        self._dp_warn_unprobed()  # at trace time (Python): the batch probe ran before, or a warning
        iteration = tf.cast(tf.identity(optimizer.iterations), tf.int64)  # before this step's update
        checks = []  # assertions every update of the step depends on (graph mode; eager: raised already)
        if step is not None:
            checks.append(_check_step(step, optimizer.iterations))  # eager/graph; XLA drops it: see _refuse below
        elif getattr(optimizer, "run", None) is not None:  # e.g. train_on_batch(x, y): not the plan's batch
            raise ValueError(self._dp_not_the_plan(optimizer.run) + " Got a batch without the run's step index.")
        sample_weight, loss_fn, y_loss, positions = _split_weights(self._dp_loss_fn, y, sample_weight)
        if self._dp_class_weight is not None:  # fit(class_weight=...): w_i·cw[y_i], before clipping
            weights_of_class = class_weights(self._dp_class_weight, y)
            sample_weight = weights_of_class if sample_weight is None else sample_weight * weights_of_class
        if not self.trainable_variables:  # an unbuilt subclassed model: create its weights
            self(x, training=False)
        scale = self._dp_loss_scale
        loss_fn = _train_loss(loss_fn, scale)
        if optimizer.adaptive_clip is not None and not optimizer.built:  # ζ_t is its variable, read below
            self._dp_build_optimizer(optimizer)
        clip = optimizer.current_clip()  # ζ_t (a fixed float, or the adaptive clip's value before this step)
        if optimizer.adaptive_clip is not None:
            clip = tf.identity(clip)
        unit_rows = self._dp_unit_rows(optimizer)  # user-level: k rows per user, clipped as one
        if unit_rows > 1 and _num_replicas() > 1:
            raise ValueError(
                f"a user-level run (examples_per_user={unit_rows}) trains on one replica on TensorFlow: "
                f"tf.distribute splits a batch's rows over its {_num_replicas()} replicas, which would split "
                "users. Train without a distribution strategy, or on the JAX backend.")
        clipped = self._engine()(
            self,
            loss_fn,
            x,
            y_loss,
            sample_weight,
            l2_norm_clip=clip * scale,  # Σ clip(S·g_i, S·ζ) = S·Σ clip(g_i, ζ)
            microbatch_size=self._dp_microbatch_size,
            training=True,
            unit_rows=unit_rows,
        )
        if scale != 1.0:  # undo the loss scale (exact: S is a power of two), in float32
            clipped = clipped._replace(
                grads=[g / tf.cast(scale, g.dtype) for g in clipped.grads],
                norms=clipped.norms / tf.cast(scale, clipped.norms.dtype),
                per_example_loss=clipped.per_example_loss / tf.cast(scale, clipped.per_example_loss.dtype),
            )
        dropped, real = features.count_dropped(clipped.nonfinite, sample_weight, clipped.per_example_loss)
        if scale == 1.0:  # a float16 overflow is refused in _refuse instead (the loss scale's fault)
            checks.append(features.assert_some_finite(dropped, real, iteration))
        clipped = add_regularization(
            self, clipped, expected_batch_size=optimizer.expected_batch_size, num_replicas=_num_replicas()
        )
        chunked = self._dp_microbatch_size is not None or self._dp_clipping == "vectorized"
        penalty = weight_penalty(self, (x, y, sample_weight), chunked=chunked)  # add_loss: weights only, else refused
        if penalty is not None:
            clipped = add_weight_penalty(
                self, clipped, penalty, expected_batch_size=optimizer.expected_batch_size,
                num_replicas=_num_replicas(),
            )
        if not optimizer.built:  # as Keras's apply would, but outside the checks' control dependencies
            self._dp_build_optimizer(optimizer)
        with tf.control_dependencies([c for c in checks if c is not None]):  # no update before the check
            grads = self._refuse(clipped.grads, step, iteration, optimizer, dropped, real)
            optimizer.apply_clipped_sum(grads, self.trainable_variables, norms=clipped.norms,
                                        sample_weight=unit_weights(sample_weight, positions), unit_rows=unit_rows,
                                        keep_clip=_refused_whatever_the_data(step, iteration, optimizer))
        epoch_dropped = features.record(self._dp_nonfinite, dropped, iteration)

        losses = tf.cast(clipped.per_example_loss, tf.float32)
        weights = tf.ones_like(losses) if sample_weight is None else sample_weight
        y_pred = clipped.y_pred
        keep = None if sample_weight is None else sample_weight > 0
        if clipped.nonfinite is not None:  # dropped examples are left out of the loss and the metrics
            losses = tf.where(clipped.nonfinite, tf.zeros_like(losses), losses)
            weights = tf.where(clipped.nonfinite, tf.zeros_like(weights), weights)
            finite = tf.logical_not(clipped.nonfinite)
            keep = finite if keep is None else tf.logical_and(keep, finite)
        _compat.loss_tracker(self).update_state(losses, sample_weight=weights)
        metric_weight = _times_rows(positions, sample_weight)
        if keep is not None:
            # Padding rows of the batch sampler (weight 0) are blanked examples:
            # leave them out of every metric, also the unweighted `metrics=[...]`.
            y, y_pred = _compat.map_keeping_masks(lambda t: tf.boolean_mask(t, keep), (y, y_pred))
            if metric_weight is not None:
                metric_weight = tf.boolean_mask(metric_weight, keep)
        logs = dict(self.compute_metrics(x, y, y_pred, sample_weight=metric_weight))
        logs[features.METRIC] = epoch_dropped
        if optimizer.adaptive_clip is not None:
            logs["l2_norm_clip"] = clip  # ζ_t of this step
        return logs

    def test_step(self, data):
        """``evaluate``: the loss ``fit`` logs (the compiled per-example loss, weighted mean
        Σ_i w_i·loss_i / Σ_i w_i, without regularisation) and the compiled metrics, for
        every model ``fit`` accepts (dict or list outputs included)."""
        data, _ = _split_step(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        rows, loss_fn, y_loss, positions = _split_weights(self._dp_loss_fn, y, sample_weight)
        y_pred = self(x, training=False)
        losses = tf.cast(_train_loss(loss_fn, 1.0)(y_loss, y_pred), tf.float32)
        weights = tf.ones_like(losses) if rows is None else rows
        _compat.loss_tracker(self).update_state(losses, sample_weight=weights)
        return self.compute_metrics(x, y, y_pred, sample_weight=_times_rows(positions, rows))

    def _refuse(self, grads, step, iteration, optimizer, dropped, real):
        """The clipped sum, or zeros when this step must not use its batch.

        Checks, as tensors (XLA keeps them, unlike assertions): every row's step equals
        the optimizer's step t (a ``PrivateRun`` batch), t < T (a mixing matrix with a
        plan), not every real example was dropped as non-finite (``dropped``/``real``, the
        counts of ``features.count_dropped``; without XLA ``features.assert_some_finite``
        stopped such a step first), and, under float16 loss scaling, the sum is finite and
        no example was dropped (a float16 overflow is the loss scale's doing, not the
        data's). A failed check zeroes the sum (``tf.where``, so a NaN cannot leak
        through), the step applies its noise only (data-independent: it leaks nothing),
        and ``_dp_refused`` records it for the host (``_RefuseBadSteps`` raises after the
        step)."""
        checks = []  # (ok: bool scalar, reason bit)
        if step is not None:
            checks.append((tf.reduce_all(tf.equal(tf.cast(step, tf.int64), iteration)), _OUT_OF_STEP))
        plan = optimizer.noise.steps
        if plan is not None:
            checks.append((iteration < plan, _PAST_PLAN))
        if self._dp_loss_scale != 1.0:
            finite = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in grads]))
            checks.append((tf.logical_and(finite, tf.equal(dropped, 0)), _NON_FINITE))
        else:
            checks.append((tf.logical_not(features.all_dropped(dropped, real)), _ALL_DROPPED))
        ok = tf.reduce_all(tf.stack([c for c, _ in checks]))
        reasons = tf.add_n([tf.where(c, tf.constant(0, tf.int64), tf.constant(bit, tf.int64)) for c, bit in checks])
        batch_step = iteration if step is None else tf.reduce_min(tf.cast(step, tf.int64))
        state = self._dp_refused
        refused = tf.stack([state[0] + 1, reasons, batch_step, iteration])
        state.assign(tf.where(ok, tf.identity(state), refused))
        return [tf.where(ok, g, tf.zeros_like(g)) for g in grads]


def _refused_whatever_the_data(step, iteration, optimizer):
    """True when the step is refused for a reason that does not depend on its batch (rows of
    another step, past the plan): an adaptive clip then keeps ζ (without XLA the assertions
    stopped such a step already); ``None`` for a fixed clip or nothing to check."""
    if optimizer.adaptive_clip is None:
        return None
    refused = []
    if step is not None:
        refused.append(tf.logical_not(tf.reduce_all(tf.equal(tf.cast(step, tf.int64), iteration))))
    if optimizer.noise.steps is not None:
        refused.append(iteration >= optimizer.noise.steps)
    return tf.reduce_any(tf.stack(refused)) if refused else None


def _check_xla(model):
    """Refuse ``jit_compile=True`` for layers whose clipping path XLA cannot compile."""
    for layer in _compat.flatten_layers(model, include_self=False):
        if isinstance(layer, keras.layers.RNN):
            raise ValueError(
                f"layer {layer.name!r} ({type(layer).__name__}) is recurrent: its per-example clipping loops "
                "over time steps with TensorArrays that XLA cannot compile. Compile with jit_compile=False "
                "(the default of private models)."
            )


def _train_loss(loss_fn, scale):
    """The per-example loss the engine differentiates: ``S·loss_fn`` on float32 outputs.

    Predictions of a mixed-precision model (float16/bfloat16) are cast to float32
    first, as Keras's ``Loss.__call__`` does, so the losses, the norms and the clipping
    factors are float32; their gradient flows back through the cast in the layers'
    dtype. ``scale`` is the static float16 loss scale S (1.0: none)."""

    def loss(y_true, y_pred):
        values = loss_fn(y_true, float32_outputs(y_pred))  # each output keeps its Keras mask
        return values if scale == 1.0 else values * tf.cast(scale, values.dtype)

    return loss


def _split_weights(loss_fn, y, sample_weight):
    """``(row weights (P,) float32 or None, loss_fn, y for the loss, position weights or None)``:
    a (P,) sample weight weighs examples before clipping; one with more entries per example
    (e.g. (P, L) per token) weighs positions inside the per-example loss, the labels then
    travel with them as ``(y, positions)`` (``keras_noisecurve._losses.split_sample_weight``)."""
    if isinstance(sample_weight, (list, tuple, dict)):
        raise ValueError(
            "a private model takes one sample weight per example, shape (P,), or per position, e.g. (P, L), "
            f"the same for every output; got a {type(sample_weight).__name__} of sample weights.")
    if sample_weight is not None:
        sample_weight = tf.cast(sample_weight, tf.float32)
    rows, positions = split_sample_weight(sample_weight)
    if positions is None:
        return rows, loss_fn, y, None
    return rows, weigh_positions(loss_fn), (y, positions), positions


def _times_rows(positions, rows):
    """The metrics' sample weight: ``rows`` (P,) or None, or the per-position weights (P, ...)
    times ``rows`` on their first axis."""
    if positions is None or rows is None:
        return rows if positions is None else positions
    return positions * tf.reshape(rows, [-1] + [1] * (positions.shape.rank - 1))
