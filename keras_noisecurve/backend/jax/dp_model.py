"""The JAX half of ``PrivateModel`` (``keras_noisecurve.training.dp_model``): the private
``train_step(state, data)``, functional as Keras's JAX trainer wants it, and what ``fit``
needs around it on JAX.

One step, all under ``jax.jit`` (Keras's JAX trainer compiles ``train_step``)::

    g_i  = ∇_w (w_i·loss_i)(w)                      per example: jax.vmap of jax.grad of
                                                      the model's stateless_call
    S    = Σ_i g_i·min(1, ζ/‖g_i‖₂)                  ‖·‖ over ALL trainable variables;
                                                      0 for an example whose loss or norm
                                                      is not finite (dropped, counted)
    S   += B·∇(reg + penalty)                         weight regularisers and add_loss
                                                      penalties on the weights, unclipped
    (w, optimizer state) ← optimizer.stateless_apply_clipped_sum(S)

with w_i the batch's mask (padding 0) times any sample weight times the class weight of
``fit(class_weight=...)``, applied before clipping (``backend.common.step_features`` has the
non-finite count and the class weights, :func:`weight_penalty` below the add_loss check, as the
TensorFlow step does them).
That is the ``clipping="vectorized"`` engine (:func:`~keras_noisecurve.backend.jax.clipping.clipped_sum`): the per-example
gradients are exact for every layer (``vmap`` of the whole model's gradient);
``microbatch_size=m`` evaluates them m examples at a time (``jax.lax.map`` over chunks;
the batch is padded with weight-0 rows to a multiple of m). ``clipping="auto"`` and
``"ghost"`` compute the same ``S`` and norms by per-layer ghost norms instead
(:mod:`keras_noisecurve.backend.jax.ghost`; ``"auto"`` hands a model it cannot attribute
to examples, or a microbatched one, to the vectorized engine).

Refusals: a batch whose step is not the optimizer's, or a step t ≥ T of a plan, has its
clipped sum replaced by zeros inside the step (the noise is still applied: it leaks
nothing) and fit refuses on the host BEFORE a step past the plan (callback). Keras's
JAX trainer only copies the state back to the variables at the end of an epoch, so
the host side counts steps itself.
"""

from __future__ import annotations

import functools

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import keras
import numpy as np

from keras_noisecurve import _compat
from keras_noisecurve._losses import float32_outputs, split_sample_weight, weigh_positions
from keras_noisecurve.backend.common import messages
from keras_noisecurve.backend.common import step_features as features
from keras_noisecurve.backend.common.clip import unit_weights
from keras_noisecurve.backend.common.units import per_row
from keras_noisecurve.backend.common.run_batch import split_step as _split_step
from keras_noisecurve.backend.jax.clipping import clipped_sum
from keras_noisecurve.backend.jax.ghost import ghost_clipped_sum
from keras_noisecurve.backend.jax.pipeline import RunBatches

__all__ = ["TrainStepBackend"]


def _past_plan_message(step, steps):
    return messages.past_plan(step, steps) + "."


class _RefusePastPlan(keras.callbacks.Callback):
    """Raises before a step t ≥ T of the optimizer's plan (counted on the host)."""

    def __init__(self, steps):
        super().__init__()
        self._steps = steps
        self._done = 0

    def on_train_begin(self, logs=None):
        self._done = int(np.asarray(self.model.optimizer.iterations.value))

    def on_train_batch_begin(self, batch, logs=None):
        if self._done >= self._steps:
            raise RuntimeError(_past_plan_message(self._done, self._steps))

    def on_train_batch_end(self, batch, logs=None):
        self._done += 1


class TrainStepBackend:
    """JAX implementation of ``PrivateModel``'s backend hooks and ``train_step``."""

    _dp_counts_steps_on_host = True  # the variables are synchronised once per epoch

    def _dp_refusal_state(self):
        return None

    def save(self, filepath, *args, **kwargs):
        """Keras's ``save``, refused (before any file is written) when a weight or an optimizer
        variable is split across JAX processes: ``save`` gathers every value to this host,
        which JAX cannot do for an array with shards in another process."""
        self._dp_check_gatherable("save")
        return super().save(filepath, *args, **kwargs)

    def save_weights(self, filepath, *args, **kwargs):
        """Keras's ``save_weights``, refused like :meth:`save` for values split across processes."""
        self._dp_check_gatherable("save_weights")
        return super().save_weights(filepath, *args, **kwargs)

    def _dp_check_gatherable(self, what):
        optimizer = getattr(self, "optimizer", None)
        variables = list(self.variables) + (list(optimizer.variables) if optimizer is not None else [])
        variables = list({id(v): v for v in variables}.values())  # a model's and its optimizer's lists overlap
        split = [v.path for v in variables
                 if isinstance(v.value, jax.Array) and not v.value.is_fully_addressable
                 and not v.value.is_fully_replicated]  # a replicated value is read on any process
        if split:
            raise ValueError(
                f"model.{what}() gathers every value to this process, but {len(split)} of them are split across "
                f"JAX processes (e.g. {split[0]!r}; ModelParallel over several processes). Save a checkpoint of "
                "the shards instead, written by every process: keras.callbacks.OrbaxCheckpoint(directory, "
                "save_freq=...) in fit, restored with model.load_weights(directory) (pip install "
                "orbax-checkpoint).")

    def _dp_nonfinite_state(self):
        metric = features.NonFiniteExamples()
        self._dp_nonfinite_metric = metric  # tracked: a model metric, its counts in Keras's JAX state
        return metric

    def _dp_check_engine(self, model):
        return None  # the ghost engine's refusals come when the step is traced (keras_noisecurve.backend.jax.ghost)

    def _dp_clipped_sum(self):
        """The clipping engine: ``clipped_sum`` (whole-model vmap) for ``clipping="vectorized"``, else
        ``ghost_clipped_sum`` (per-layer ghost norms; ``"auto"`` hands what it cannot attribute to examples to
        ``clipped_sum``). Both return ``(sums, norms, losses, y_pred, non_trainable)``."""
        if self._dp_clipping == "vectorized":
            return clipped_sum
        return functools.partial(ghost_clipped_sum, clipping=self._dp_clipping, vectorized=clipped_sum)

    def _dp_engine_run(self, loss_fn, x, y, w, *, l2_norm_clip, plan=True, unit_rows=1):
        """This model's clipping engine (:meth:`_dp_clipped_sum`) on one batch, outside ``jax.jit``,
        inside ``norm_observer.observe_layer_norms``, as numbers for the audit's clipping check
        (:mod:`keras_noisecurve.audit.mechanism_clipping`).

        ``unit_rows`` k: the rows of one privacy unit (a user-level run's ``examples_per_user``),
        clipped as one by the engine (rows ``[u·k, (u+1)·k)`` are unit u; 1: every row a unit).

        Returns ``(groups, norms, sums, layer_sq)``: ``groups`` ``[(layer, rule name, [index of
        each of its variables in self.trainable_variables])]`` in the order of those indices
        (``None`` unless ``plan``; the vectorized engine reports no layer: every layer that owns
        weights with the rule name ``"vectorized"``), ``norms`` (U,) the per-unit norms before
        clipping (U = P/k: the per-example norms when k = 1), ``sums`` the clipped sum (one array
        per trainable variable), ``layer_sq`` ``{id(layer): (U,)}`` the per-unit squared norms of
        each layer's weights as its rule computed them; float64 numpy throughout."""
        from keras_noisecurve.backend.common import norm_observer
        from keras_noisecurve.backend.jax import ghost

        unit_rows = int(unit_rows)
        trainable = [v.value for v in self.trainable_variables]
        non_trainable = [v.value for v in self.non_trainable_variables]
        with norm_observer.observe_layer_norms() as seen:
            sums, norms, _, _, _ = self._dp_clipped_sum()(
                self, loss_fn, trainable, non_trainable, x, y, jnp.asarray(w, jnp.float32),
                l2_norm_clip=l2_norm_clip, microbatch_size=self._dp_microbatch_size, training=False,
                unit_rows=unit_rows)
        index = {id(v): k for k, v in enumerate(self.trainable_variables)}
        layer_sq, groups = {}, []
        for layer, rule, owned, sq in seen:  # per unit already when unit_rows > 1
            layer_sq[id(layer)] = layer_sq.get(id(layer), 0.0) + np.asarray(sq, np.float64)
            if all(g[0] is not layer for g in groups):
                groups.append((layer, rule, [index[id(v)] for v in owned if id(v) in index]))
        if not seen:  # the vectorized engine
            groups = [(layer, "vectorized", [index[id(v)] for v in owned if id(v) in index])
                      for layer, owned in ghost.targets(self)]
        groups.sort(key=lambda group: min(group[2], default=len(index)))
        return (groups if plan else None, np.asarray(norms, np.float64)[::unit_rows],  # a unit's norm on its rows
                [np.asarray(s, np.float64) for s in sums], layer_sq)

    def _dp_compile_defaults(self, kwargs):
        if kwargs.get("steps_per_execution", 1) != 1:
            raise ValueError(
                "a private model on the JAX backend runs one step per execution (steps_per_execution=1): "
                f"got steps_per_execution={kwargs['steps_per_execution']!r}."
            )

    def _dp_check_loss_scale(self, scale):
        if scale != 1.0:
            raise ValueError(
                "float16 loss scaling of private models is implemented on the TensorFlow backend only; on JAX "
                "use mixed_bfloat16 or float32 (got a loss scale of "
                f"{scale:g})."
            )
        return scale

    def _dp_batches(self, data, optimizer):
        batches = data.batches(optimizer)
        if len(batches) == 0:  # nothing to build the model from: refuse as _StopAtPlanEnd does
            raise RuntimeError(
                f"the plan of {data.run.steps} steps is complete (the optimizer has taken {batches.start} steps): "
                "no further private step is possible with this run."
            )
        return batches

    def _dp_step_callbacks(self):
        steps = self.optimizer.noise.steps
        report = [features.ReportNonFinite(self._dp_nonfinite)]
        return report if steps is None else report + [_RefusePastPlan(steps)]

    def _dp_fit(self, x, y, kwargs):
        if isinstance(x, RunBatches):  # start at the optimizer's step after any on_train_begin restore
            kwargs["callbacks"] = list(kwargs.pop("callbacks", None) or []) + [x.restart_callback()]
        active = keras.distribution.distribution()
        if not (isinstance(x, RunBatches) and getattr(active, "auto_shard_dataset", False)):
            return super().fit(x, y, **kwargs)
        # a run's batches are this process's block of each step already (pipeline.serve):
        # Keras's multi-process check asks for a tf.data dataset it can shard itself
        active.auto_shard_dataset = False
        try:
            return super().fit(x, y, **kwargs)
        finally:
            active.auto_shard_dataset = True

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        """Keras's ``train_on_batch``, refused on the host past the optimizer's plan."""
        optimizer = self.optimizer
        self._dp_check_optimizer(optimizer)
        if getattr(optimizer, "run", None) is not None:
            raise ValueError(self._dp_not_the_plan(optimizer.run) + " Got a batch without the run's step index.")
        steps = optimizer.noise.steps
        if steps is not None and optimizer.built:
            done = int(np.asarray(optimizer.iterations.value))
            if done >= steps:
                raise RuntimeError(_past_plan_message(done, steps))
        seen = features.refused_steps(self._dp_nonfinite.values())
        self._dp_use_class_weight(class_weight)
        try:
            logs = super().train_on_batch(x, y, sample_weight=sample_weight, return_dict=return_dict)
        finally:
            self._dp_use_class_weight(None)
        features.raise_if_refused(self._dp_nonfinite.values(), seen)
        return logs

    def _symbolic_build(self, iterator=None, data_batch=None):
        # build from one batch unpacked as (x, y, sample_weight): leave out a run batch's step
        if data_batch is None and iterator is not None:
            for _, _, data_or_iterator in iterator:
                if isinstance(data_or_iterator, (list, tuple)):
                    data_batch = data_or_iterator[0]
                else:
                    data_batch = next(data_or_iterator)
                break
        if data_batch is not None:
            # build from (x, y): the sample weights (P,) would be broadcast against a loss with one
            # value per token or pixel by Keras's compiled loss (never built, never called here)
            x, y, _ = keras.utils.unpack_x_y_sample_weight(_split_step(data_batch)[0])
            data_batch = (x,) if y is None else (x, y)
        with _compat.without_compiled_loss(self):  # as on TensorFlow: the compiled loss is never built
            return super()._symbolic_build(data_batch=data_batch)

    def make_train_function(self, force=False):
        """Keras's, jitting a function made for this ``fit``/``train_on_batch``'s class-weight
        table (``None`` included) instead of the bound ``train_step``: ``jax.jit`` reuses a
        trace for an EQUAL function (bound methods of one model are equal), so a kept train
        function of another table (``PrivateModel._dp_use_class_weight``) would be reused
        with that table's weights baked in."""
        if self.train_function is not None and not force:
            return None
        table = self._dp_class_weight

        def train_step(state, data):  # a new function object: its own jit trace cache
            return self._dp_train_step(state, data, table)

        self.train_step = train_step  # read by Keras's make_train_function; the method is restored below
        try:
            return super().make_train_function(force=force)
        finally:
            del self.train_step

    def train_step(self, state, data):
        """One private step (see the module docstring); Keras's JAX ``train_step`` contract:
        ``state`` = (trainable, non-trainable, optimizer, metrics variables' values),
        returns ``(logs, new state)``."""
        return self._dp_train_step(state, data, self._dp_class_weight)

    def _dp_train_step(self, state, data, class_weight):
        """:meth:`train_step` with the class-weight table ``class_weight`` (float32 (C,) or None)."""
        trainable, non_trainable, optimizer_values, metrics_values = state
        data, step = _split_step(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        optimizer = self.optimizer
        self._dp_check_optimizer(optimizer)
        self._dp_warn_unprobed()  # at trace time (Python): the batch probe ran before, or a warning
        if step is None and getattr(optimizer, "run", None) is not None:
            raise ValueError(self._dp_not_the_plan(optimizer.run) + " Got a batch without the run's step index.")
        position = [id(v) for v in optimizer.variables].index(id(optimizer.iterations))
        iteration = optimizer_values[position]
        clip = optimizer.clip_value(optimizer_values)  # ζ_t: fixed, or the adaptive clip's before this step
        weights, loss_fn, y_loss, positions = self._dp_weights(x, y, sample_weight)
        if class_weight is not None:  # fit(class_weight=...): w_i·cw[y_i], before clipping
            weights = weights * features.class_weights(class_weight, y)
        penalty = weight_penalty(self, trainable, non_trainable, x)  # add_loss: weights only, else refused
        unit_rows = self._dp_unit_rows(optimizer)  # user-level: k rows per user, clipped as one
        sums, norms, losses, y_pred, non_trainable = self._dp_clipped_sum()(
            self, loss_fn, trainable, non_trainable, x, y_loss, weights,
            l2_norm_clip=clip, microbatch_size=self._dp_microbatch_size, training=True, unit_rows=unit_rows,
        )
        nonfinite = features.nonfinite_mask(losses, norms)  # dropped by the engine (contributed 0)
        if unit_rows > 1:  # the engine dropped the whole user: every row of it
            nonfinite = per_row(jnp.any(jnp.reshape(nonfinite, (-1, unit_rows)), axis=1), unit_rows)
        dropped, real = features.count_dropped(nonfinite, weights)
        all_dropped = (real > 0) & (dropped == real)
        sums = self._dp_add_regularization(trainable, non_trainable, sums, optimizer.expected_batch_size,
                                           penalty=penalty)
        why = jnp.where(all_dropped, features.ALL_DROPPED, 0)
        batch_step = None
        if step is not None:  # a PrivateRun batch: every row of the optimizer's step (all processes' rows)
            step = jnp.asarray(step, jnp.int32)
            out_of_step = jnp.logical_not(jnp.all(step == iteration.astype(jnp.int32)))
            why = why + jnp.where(out_of_step, features.OUT_OF_STEP, 0)
            batch_step = jnp.where(jnp.min(step) != iteration.astype(jnp.int32), jnp.min(step), jnp.max(step))
        ok = why == 0
        if optimizer.noise.steps is not None:
            ok = ok & (iteration < optimizer.noise.steps)
        sums = [jnp.where(ok, s, jnp.zeros_like(s)) for s in sums]
        # a step refused whatever its data (out of step, past the plan) leaves an adaptive clip as it was
        keep_clip = jnp.logical_not(ok | (why == features.ALL_DROPPED))
        trainable, optimizer_values = optimizer.stateless_apply_clipped_sum(
            optimizer_values, sums, trainable, norms=norms, sample_weight=unit_weights(weights, positions),
            keep_clip=keep_clip, unit_rows=unit_rows)

        # padding rows (weight 0) and dropped examples count in no metric: weight 0 for the
        # loss and the weighted metrics, 0/1 row weight for the unweighted ones (static shapes)
        keep = (weights > 0) & jnp.logical_not(nonfinite)
        rows = keep.astype(jnp.float32)

        def kept(t):  # a dropped example's values replaced by zeros (0·nan is nan in a metric)
            return jnp.where(jnp.reshape(keep, (-1,) + (1,) * (jnp.ndim(t) - 1)), t, jnp.zeros_like(t))

        y_kept, y_pred_kept = _compat.map_keeping_masks(kept, (y, y_pred))
        mapping = list(zip(self.metrics_variables, metrics_values))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            self._dp_loss_tracker().update_state(kept(losses.astype(jnp.float32)), sample_weight=weights * rows)
            self._dp_nonfinite.update_state(dropped, iteration, why, batch_step)
            _compat.update_compile_metrics(self, y_kept, y_pred_kept,
                                           sample_weight=_times_rows(positions, weights * rows), row_weight=rows)
            logs = self.get_metrics_result()
        if optimizer.adaptive_clip is not None:
            logs["l2_norm_clip"] = clip  # ζ_t of this step
        metrics_values = [
            scope.get_current_value(v) if scope.get_current_value(v) is not None else v.value
            for v in self.metrics_variables
        ]
        return logs, (trainable, non_trainable, optimizer_values, metrics_values)

    def _dp_weights(self, x, y, sample_weight):
        """``(weights (P,), loss_fn, y for the loss, position weights or None)`` of a batch: a
        (P,) sample weight (the run's padding mask) weighs examples before clipping; one with
        more entries per example (e.g. (P, L) per token) weighs positions inside the
        per-example loss (``keras_noisecurve._losses.split_sample_weight``), the labels then
        travel with them as ``(y, positions)``."""
        rows, positions = split_sample_weight(
            None if sample_weight is None else jax.tree_util.tree_map(lambda w: jnp.asarray(w, jnp.float32),
                                                                      sample_weight))
        if isinstance(rows, (list, tuple, dict)):
            raise ValueError(
                "a private model takes one sample weight per example, shape (P,), or per position, e.g. (P, L), "
                f"the same for every output; got a {type(rows).__name__} of sample weights.")
        size = int(jax.tree_util.tree_leaves(x)[0].shape[0])
        weights = jnp.ones((size,), jnp.float32) if rows is None else rows
        if positions is None:
            return weights, self._dp_loss_fn, y, None
        return weights, weigh_positions(self._dp_loss_fn), (y, positions), positions

    def test_step(self, state, data):
        """``evaluate``: the loss ``fit`` logs (the compiled per-example loss, weighted mean
        Σ_i w_i·loss_i / Σ_i w_i, without regularisation) and the compiled metrics, as on
        TensorFlow; Keras's JAX ``test_step`` contract (``state`` = trainable, non-trainable,
        metrics variables' values; returns ``(logs, new state)``)."""
        trainable, non_trainable, metrics_values = state
        data, _ = _split_step(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        weights, loss_fn, y_loss, positions = self._dp_weights(x, y, sample_weight)
        y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=False)
        losses = jnp.reshape(loss_fn(y_loss, float32_outputs(y_pred)), (-1,)).astype(jnp.float32)
        mapping = list(zip(self.metrics_variables, metrics_values))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            self._dp_loss_tracker().update_state(losses, sample_weight=weights)
            _compat.update_compile_metrics(self, y, y_pred, sample_weight=_times_rows(positions, weights),
                                           row_weight=None)
            logs = self.get_metrics_result()
        metrics_values = [
            scope.get_current_value(v) if scope.get_current_value(v) is not None else v.value
            for v in self.metrics_variables
        ]
        return logs, (trainable, non_trainable, metrics_values)

    def _dp_add_regularization(self, trainable, non_trainable, sums, expected_batch_size, penalty=None):
        """``S + B·∇(reg + penalty)`` for the weight regularisers and an ``add_loss`` penalty
        on the weights only (``penalty(trainable)``, :func:`weight_penalty`):
        data-independent, unclipped."""
        regularized = [v for v in self.trainable_variables if getattr(v, "regularizer", None) is not None]
        if not regularized and penalty is None:
            return sums
        ids = {id(v) for v in regularized}

        def reg(tv):
            total = jnp.asarray(0.0, jnp.float32) if penalty is None else penalty(list(tv))
            for variable, value in zip(self.trainable_variables, tv):
                if id(variable) in ids:
                    total = total + jnp.asarray(variable.regularizer(value), jnp.float32)
            return total

        grads = jax.grad(reg)(list(trainable))
        scale = float(expected_batch_size)
        return [s + jnp.asarray(scale, s.dtype) * g.astype(s.dtype) for s, g in zip(sums, grads)]


def _times_rows(positions, rows):
    """The metrics' sample weight: ``rows`` (P,), or the per-position weights (P, ...) times
    ``rows`` on their first axis."""
    if positions is None:
        return rows
    return positions * jnp.reshape(rows, (-1,) + (1,) * (positions.ndim - 1)).astype(positions.dtype)


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
