"""``make_private``: wrap any Keras model in a ``PrivateModel``, whose ``train_step``
clips per example.

One training step (docs/design.md#update-rule):

1. the clipping engine computes Σ_i clip(w_i·∇loss_i, ζ) (w_i = sample weight or
   the sampler's padding mask, applied before clipping);
2. the gradient of the data-independent regularisation losses is added as B·∇reg;
3. the optimizer (a ``NoiseCurveOptimizer``) adds ζσ·z̃_t, divides by the expected batch
   size B and takes the SGD step, through ``apply_clipped_sum``.

``class_weight`` multiplies each example's weight before clipping, a layer's
``add_loss`` penalty on the weights only is added like a regulariser and one that
depends on the data is refused (:mod:`keras_noisecurve.training.keras_features`).
``test_step`` reports the same loss as training (the compiled per-example loss, weighted
mean over the batch); ``predict_step`` is Keras's own.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_noisecurve import _compat
from keras_noisecurve._validation import check_choice, check_float, check_int
from keras_noisecurve.training.clipping import (
    ENGINES,
    add_regularization,
    check_model_is_clippable,
    get_engine,
    per_example_loss_fn,
)
from keras_noisecurve.training import nonfinite
from keras_noisecurve.training.keras_features import (
    add_weight_penalty,
    check_class_weight,
    class_weights,
    weight_penalty,
)
from keras_noisecurve.training.optimizer import NoiseCurveOptimizer

__all__ = ["PrivateModel", "make_private"]

_PACKAGE = "keras_noisecurve"


def _num_replicas() -> int:
    ctx = tf.distribute.get_replica_context()
    if ctx is None:  # cross-replica context
        return tf.distribute.get_strategy().num_replicas_in_sync
    return ctx.num_replicas_in_sync


def _split_step(data):
    """``(x, y, sample_weight), step`` of a ``PrivateRun`` batch ``(x, y, mask, step)``;
    ``data, None`` for any other batch."""
    if isinstance(data, (tuple, list)) and len(data) == 4:
        return tuple(data[:3]), data[3]
    return data, None


def _check_step(step, iterations):
    """Fail the step unless every row of the batch belongs to step ``iterations``."""
    expected = tf.cast(iterations, tf.int64)
    step = tf.cast(step, tf.int64)
    tf.debugging.assert_equal(
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


def _not_the_plan(planned):
    """The message for data that is not ``planned``'s own pipeline (a ``PrivateRun``)."""
    return (
        f"this model's optimizer belongs to a PrivateRun ({planned!r}): every step must take the run's own "
        "batch (cyclic Poisson sampling, step index checked), or the run's epsilon does not describe the "
        "training. Pass the run's pipeline unchanged: fit(run.dataset(x, y)) (no y, batch_size, shuffle, "
        "re-batching or other dataset)."
    )


def _check_run_data(planned, run, x):
    """Refuse, before any step, data that is not ``planned``'s pipeline (``ValueError``).

    ``planned``: the optimizer's ``PrivateRun`` (``None``: nothing to check); ``run``: the
    run of ``x`` when ``x`` is a ``RunData`` (``run.dataset(...)``), ``None`` for arrays,
    any ``tf.data.Dataset`` (also one of ``run.dataset(...).batches(...)``, which is for
    custom loops) or anything else.
    """
    if planned is None:
        return
    if run is None:
        hint = ""
        if isinstance(x, tf.data.Dataset):
            hint = (" (the batches of run.dataset(x, y).batches(optimizer) are for custom loops: give fit "
                    "run.dataset(x, y) itself)")
        raise ValueError(_not_the_plan(planned) + f" Got {type(x).__name__}{hint}.")
    if not planned.same_plan(run):
        raise ValueError(
            f"the dataset belongs to another plan ({run!r}) than this model's optimizer ({planned!r}): "
            "the batches and the noise would not belong to one run. Use the optimizer's run.dataset(x, y)."
        )


def _iterations(optimizer) -> int:
    """The optimizer's step count, through ``.numpy()`` (numpy's conversion of a
    ``keras.Variable`` warns with a DeprecationWarning under numpy 2)."""
    iterations = optimizer.iterations
    value = getattr(iterations, "value", iterations)
    return int(value.numpy()) if hasattr(value, "numpy") else int(value)


class _StopAtPlanEnd(keras.callbacks.Callback):
    """Stops ``fit`` after the plan's last step (instead of running out of data)."""

    def __init__(self, steps):
        super().__init__()
        self._steps = steps

    def on_train_begin(self, logs=None):
        done = _iterations(self.model.optimizer)
        if done >= self._steps:
            raise RuntimeError(
                f"the plan of {self._steps} steps is complete (the optimizer has taken {done} steps): "
                "no further private step is possible with this run."
            )

    def on_train_batch_end(self, batch, logs=None):
        if _iterations(self.model.optimizer) >= self._steps:
            self.model.stop_training = True


class _LowLevelStart(keras.callbacks.Callback):
    """Refuses, after any restore (it runs after the user's callbacks) and before the first
    step, a ``banded_poisson_dataset`` plan that cannot continue at the optimizer's step."""

    def __init__(self, plan):
        super().__init__()
        self._plan = plan

    def on_train_begin(self, logs=None):
        done, steps = self._plan.position(self.model.optimizer), self._plan.steps
        if done >= steps:
            raise RuntimeError(f"the plan of {steps} steps is complete (the optimizer has taken {done} steps): "
                               "no further private step is possible with this banded_poisson_dataset.")


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
        what.append(
            f"the optimizer's step {iteration} is past the mixing matrix's plan (the privacy plan is spent); "
            "solve a mixing matrix with more steps"
        )
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


@keras.saving.register_keras_serializable(package=_PACKAGE)
class PrivateModel(keras.Model):
    """A private model wrapping an existing model (what :func:`make_private` returns):
    ``fit`` clips per example and the ``NoiseCurveOptimizer`` adds the noise.

    Args:
      model: any Keras model (Sequential, functional or subclassed). Its weights
        are shared, not copied.
      clipping: the clipping engine: ``"auto"`` (ghost-norm clipping when
        ``keras_noisecurve.training.ghost`` supports the model, else vectorized),
        ``"vectorized"`` or ``"ghost"``.
      microbatch_size: evaluate per-example gradients in chunks of this many
        examples to bound memory (``None``: the whole batch at once).

    ``compile`` requires a ``NoiseCurveOptimizer`` and a single loss; BatchNormalization
    layers and activity regularizers are refused. The logged ``loss`` is
    Σ_i w_i·loss_i / Σ_i w_i over the batch (mask-weighted, without the regularisation
    term, and without the examples the engine dropped).

    An example whose loss or gradient is not finite is dropped by the clipping engine (it
    contributes 0, within the clip bound); ``fit`` logs the epoch's count as
    ``nonfinite_examples`` and warns once per ``fit`` naming the steps; a step whose
    every real example is non-finite stops ``fit`` before the weights change
    (``keras_noisecurve.training.nonfinite``; docs/training.md).
    """

    def __init__(self, model, clipping="auto", microbatch_size=None, **kwargs):
        super().__init__(**kwargs)
        self._dp_setup(clipping, microbatch_size)
        if not isinstance(model, keras.Model):
            raise ValueError(f"model must be a keras.Model, got {type(model).__name__}.")
        self.inner = model
        check_model_is_clippable(model)
        if model.built:  # nothing to create: the wrapper owns no weights of its own
            self.built = True
            if self._dp_clipping != "vectorized":  # refused now, not at the first step
                get_engine(self._dp_clipping, model)

    def call(self, inputs, training=None):
        return self.inner(inputs, training=training)

    def build(self, input_shape=None):
        if not self.inner.built and input_shape is not None:
            if type(self.inner).build is not keras.Model.build:
                self.inner.build(input_shape)
            else:  # a subclassed model without build(): create its weights by a call
                shape = [1 if d is None else d for d in input_shape]
                self.inner(tf.zeros(shape))
        self.built = True

    def get_config(self):
        return {
            "name": self.name,
            "model": keras.saving.serialize_keras_object(self.inner),
            "clipping": self._dp_clipping,
            "microbatch_size": self._dp_microbatch_size,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        model = keras.saving.deserialize_keras_object(config.pop("model"), custom_objects=custom_objects)
        return cls(model, **config)

    def _dp_setup(self, clipping, microbatch_size):
        self._dp_clipping = check_choice("clipping", clipping, ENGINES)
        if microbatch_size is not None:
            microbatch_size = check_int("microbatch_size", microbatch_size, minimum=1)
        self._dp_microbatch_size = microbatch_size
        self._dp_engine = None
        self._dp_loss_fn = None
        self._dp_loss_scale = 1.0
        self._dp_class_weight = None  # the class_weight table of the fit in progress
        # untracked (object.__setattr__): not a weight, not in checkpoints or .keras files
        object.__setattr__(self, "_dp_refused", _refusal_state())
        object.__setattr__(self, "_dp_nonfinite", nonfinite.state())

    def reset_metrics(self):
        """Keras's ``reset_metrics`` (every epoch of ``fit``), and the epoch's
        ``nonfinite_examples`` count."""
        super().reset_metrics()
        nonfinite.reset_epoch(self._dp_nonfinite)

    @property
    def clipping(self) -> str:
        """The clipping engine name given at construction."""
        return self._dp_clipping

    @property
    def microbatch_size(self):
        """Chunk size for per-example gradients (``None``: whole batch)."""
        return self._dp_microbatch_size

    def compile(self, optimizer=None, loss=None, **kwargs):
        """``keras.Model.compile`` that requires a ``NoiseCurveOptimizer`` and a single loss.

        ``jit_compile`` defaults to ``False``: ``jit_compile=True`` works (the step checks
        are tensors XLA keeps, see ``_refuse``) and is faster on the transformer block but
        slower on dense models on CPU, with a long first compilation (docs/training.md,
        "XLA"); recurrent layers are refused under it.

        Under a ``mixed_float16`` policy the per-example losses are multiplied by a
        STATIC loss scale S (``loss_scale=``, a power of two; default
        ``DEFAULT_FLOAT16_LOSS_SCALE``; ``auto_scale_loss=False`` or ``loss_scale=1``:
        none), the engine clips at S·ζ and the clipped sum is divided by S, so
        ``Σ_i clip(g_i, ζ)`` is unchanged. Keras's own ``LossScaleOptimizer`` is refused:
        its dynamic scale depends on the data and it skips steps.
        """
        loss_scale = kwargs.pop("loss_scale", None)
        auto_scale_loss = kwargs.pop("auto_scale_loss", True)
        kwargs["auto_scale_loss"] = False  # never wrap the private optimizer
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "a private model does its own static loss scaling under mixed_float16 (undone before "
                "clipping); keras.optimizers.LossScaleOptimizer is not supported (its dynamic scale depends "
                "on the data and it skips steps). Pass the NoiseCurveOptimizer itself, and loss_scale=S to compile."
            )
        if not isinstance(optimizer, NoiseCurveOptimizer):
            raise ValueError(
                "a private model must be compiled with a keras_noisecurve.NoiseCurveOptimizer "
                f"(clipped sums + calibrated noise); got optimizer={optimizer!r}. Training a private model "
                "without noise would not be private."
            )
        kwargs.setdefault("jit_compile", False)
        if kwargs.get("loss_weights") is not None:
            raise ValueError("loss_weights are not supported by private models (single loss only).")
        self._dp_loss_fn = per_example_loss_fn(loss)
        self._dp_loss_scale = _loss_scale(self, loss_scale, auto_scale_loss)
        check_model_is_clippable(self)
        if kwargs["jit_compile"] is True:
            _check_xla(self)
        super().compile(optimizer=optimizer, loss=loss, **kwargs)
        self._dp_engine = None  # resolved on first train_step (the model may not be built yet)

    def get_compile_config(self):
        return super().get_compile_config()

    def compile_from_config(self, config):
        """Re-compile on ``keras.models.load_model`` (the optimizer state is then loaded)."""
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def fit(self, x=None, y=None, **kwargs):
        """``keras.Model.fit``; with the examples of a ``PrivateRun`` (``run.dataset(x, y)``,
        a ``RunData``) it trains on the plan's batches for this model's optimizer
        (``x.batches(optimizer)``, refusing an optimizer made without the run or for
        another plan), defaults ``epochs``/``steps_per_epoch`` to the run's and stops
        after the plan's last step. The batches start at the optimizer's step, so a
        restored model (``BackupAndRestore``, ``load_model``) continues the plan. A
        ``banded_poisson_dataset`` (an optimizer without a run) also starts at the
        optimizer's step, its batches step-checked, or is refused where its plan
        cannot continue (drawn with ``seed=None`` in another process).

        ``class_weight={class: weight}`` multiplies each example's weight by its class's
        before clipping (arrays, datasets and ``PrivateRun`` datasets alike)."""
        table = check_class_weight(kwargs.pop("class_weight", None))
        if table is not None or self._dp_class_weight is not None:
            self.train_function = None  # retrace: the table is a constant of the step
        self._dp_class_weight = table
        try:
            return self._dp_fit(x, y, **kwargs)
        finally:
            if self._dp_class_weight is not None:
                self._dp_class_weight = None
                self.train_function = None

    def _dp_fit(self, x=None, y=None, **kwargs):
        from keras_noisecurve.privacy.run_data import RunData

        run = x.run if isinstance(x, RunData) else None
        _check_run_data(getattr(self.optimizer, "run", None), run, x)
        if run is not None:
            if y is not None:
                raise ValueError("a PrivateRun dataset carries its labels: call fit(run.dataset(x, y)) without y.")
            optimizer = self.optimizer
            if not isinstance(optimizer, NoiseCurveOptimizer):
                raise ValueError(f"a private model needs a NoiseCurveOptimizer, got {type(optimizer).__name__}.")
            if tf.distribute.has_strategy():
                x = x.batches(optimizer)
            else:  # P rounded up to the replicas of the model's strategy
                with self.distribute_strategy.scope():
                    x = x.batches(optimizer)
            kwargs.setdefault("steps_per_epoch", run.steps_per_epoch)
            kwargs.setdefault("epochs", run.epochs)
            kwargs.setdefault("shuffle", False)  # the plan decides the order
            callbacks = list(kwargs.pop("callbacks", None) or [])
            kwargs["callbacks"] = callbacks + [_StopAtPlanEnd(run.steps)]
        low = getattr(x, "_knc_low_level_plan", None)
        if run is None and low is not None:  # banded_poisson_dataset: start at the optimizer's step
            x = low.dataset(self.optimizer, with_step=True)
            kwargs.setdefault("shuffle", False)  # the plan decides the order
            kwargs["callbacks"] = list(kwargs.pop("callbacks", None) or []) + [_LowLevelStart(low)]
        kwargs["callbacks"] = list(kwargs.pop("callbacks", None) or []) + [nonfinite.WarnNonFinite(self._dp_nonfinite)]
        if self.jit_compile or self._dp_loss_scale != 1.0:
            # a refused step (out of step, past the plan, non-finite) raises on the host right
            # after it (without XLA the step's own assertions fail it first)
            kwargs["callbacks"] = list(kwargs.pop("callbacks", None) or []) + [_RefuseBadSteps(self)]
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

    def train_step(self, data):
        data, step = _split_step(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        optimizer = self.optimizer
        if not isinstance(optimizer, NoiseCurveOptimizer):  # e.g. optimizer swapped after compile
            raise ValueError(f"a private model needs a NoiseCurveOptimizer, got {type(optimizer).__name__}.")
        iteration = tf.cast(tf.identity(optimizer.iterations), tf.int64)  # before this step's update
        if step is not None:
            _check_step(step, optimizer.iterations)  # eager/graph; XLA drops it: see _refuse below
        elif getattr(optimizer, "run", None) is not None:  # e.g. train_on_batch(x, y): not the plan's batch
            raise ValueError(_not_the_plan(optimizer.run) + " Got a batch without the run's step index.")
        if sample_weight is not None:
            sample_weight = tf.reshape(tf.cast(sample_weight, tf.float32), [-1])
        if self._dp_class_weight is not None:  # fit(class_weight=...): w_i·cw[y_i], before clipping
            weights_of_class = class_weights(self._dp_class_weight, y)
            sample_weight = weights_of_class if sample_weight is None else sample_weight * weights_of_class
        if not self.trainable_variables:  # an unbuilt subclassed model: create its weights
            self(x, training=False)
        scale = self._dp_loss_scale
        loss_fn = _train_loss(self._dp_loss_fn, scale)
        clipped = self._engine()(
            self,
            loss_fn,
            x,
            y,
            sample_weight,
            l2_norm_clip=optimizer.l2_norm_clip * scale,  # Σ clip(S·g_i, S·ζ) = S·Σ clip(g_i, ζ)
            microbatch_size=self._dp_microbatch_size,
            training=True,
        )
        if scale != 1.0:  # undo the loss scale (exact: S is a power of two), in float32
            clipped = clipped._replace(
                grads=[g / tf.cast(scale, g.dtype) for g in clipped.grads],
                norms=clipped.norms / tf.cast(scale, clipped.norms.dtype),
                per_example_loss=clipped.per_example_loss / tf.cast(scale, clipped.per_example_loss.dtype),
            )
        dropped, real = nonfinite.count_dropped(clipped.nonfinite, sample_weight, clipped.per_example_loss)
        checks = []
        if scale == 1.0:  # a float16 overflow is refused in _refuse instead (the loss scale's fault)
            checks = [nonfinite.assert_some_finite(dropped, real, iteration)]
        clipped = add_regularization(
            self, clipped, expected_batch_size=optimizer.expected_batch_size, num_replicas=_num_replicas()
        )
        penalty = weight_penalty(self, (x, y, sample_weight), chunked=self._dp_microbatch_size is not None or self._dp_clipping == "vectorized")  # add_loss: weights only, else refused
        if penalty is not None:
            clipped = add_weight_penalty(
                self, clipped, penalty, expected_batch_size=optimizer.expected_batch_size,
                num_replicas=_num_replicas(),
            )
        if not optimizer.built:  # as Keras's apply would, but outside the checks' control dependencies
            with keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(self.trainable_variables)
            optimizer.built = True
        with tf.control_dependencies([c for c in checks if c is not None]):  # no update before the check
            grads = self._refuse(clipped.grads, step, iteration, optimizer, dropped, real)
            optimizer.apply_clipped_sum(grads, self.trainable_variables)
        epoch_dropped = nonfinite.record(self._dp_nonfinite, dropped, iteration)

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
        if keep is not None:
            # Padding rows of the batch sampler (weight 0) are copies of real examples:
            # leave them out of every metric, also the unweighted `metrics=[...]`.
            y, y_pred = tf.nest.map_structure(lambda t: tf.boolean_mask(t, keep), (y, y_pred))
            if sample_weight is not None:
                sample_weight = tf.boolean_mask(sample_weight, keep)
        logs = dict(self.compute_metrics(x, y, y_pred, sample_weight=sample_weight))
        logs[nonfinite.METRIC] = epoch_dropped
        return logs

    def test_step(self, data):
        """``evaluate``: the loss ``fit`` logs (the compiled per-example loss, weighted mean
        Σ_i w_i·loss_i / Σ_i w_i, without regularisation) and the compiled metrics, for
        every model ``fit`` accepts (dict or list outputs included)."""
        data, _ = _split_step(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        losses = tf.cast(_train_loss(self._dp_loss_fn, 1.0)(y, y_pred), tf.float32)
        weights = tf.ones_like(losses) if sample_weight is None else tf.reshape(tf.cast(sample_weight, tf.float32), [-1])
        _compat.loss_tracker(self).update_state(losses, sample_weight=weights)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _refuse(self, grads, step, iteration, optimizer, dropped, real):
        """The clipped sum, or zeros when this step must not use its batch.

        Checks, as tensors (XLA keeps them, unlike assertions): every row's step equals
        the optimizer's step t (a ``PrivateRun`` batch), t < T (a mixing matrix with a
        plan), not every real example was dropped as non-finite (``dropped``/``real``, the
        counts of ``nonfinite.count_dropped``; without XLA ``nonfinite.assert_some_finite``
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
            checks.append((tf.logical_not(nonfinite.all_dropped(dropped, real)), _ALL_DROPPED))
        ok = tf.reduce_all(tf.stack([c for c, _ in checks]))
        reasons = tf.add_n([tf.where(c, tf.constant(0, tf.int64), tf.constant(bit, tf.int64)) for c, bit in checks])
        batch_step = iteration if step is None else tf.reduce_min(tf.cast(step, tf.int64))
        state = self._dp_refused
        refused = tf.stack([state[0] + 1, reasons, batch_step, iteration])
        state.assign(tf.where(ok, tf.identity(state), refused))
        return [tf.where(ok, g, tf.zeros_like(g)) for g in grads]


def _check_xla(model):
    """Refuse ``jit_compile=True`` for layers whose clipping path XLA cannot compile."""
    for layer in _compat.flatten_layers(model, include_self=False):
        if isinstance(layer, keras.layers.RNN):
            raise ValueError(
                f"layer {layer.name!r} ({type(layer).__name__}) is recurrent: its per-example clipping loops "
                "over time steps with TensorArrays that XLA cannot compile. Compile with jit_compile=False "
                "(the default of private models)."
            )


#: the static loss scale of a mixed_float16 private model when compile gets no loss_scale
DEFAULT_FLOAT16_LOSS_SCALE = 128.0


def _loss_scale(model, loss_scale, auto_scale_loss):
    """The static loss scale S (a power of two; 1.0: none) of ``model``'s ``compile``."""
    float16 = any(
        getattr(layer, "compute_dtype", None) == "float16" for layer in _compat.flatten_layers(model)
    )
    if loss_scale is None:
        return DEFAULT_FLOAT16_LOSS_SCALE if (float16 and auto_scale_loss) else 1.0
    value = check_float("loss_scale", loss_scale, positive=True)
    if not np.log2(value).is_integer():
        raise ValueError(f"loss_scale must be a power of two (undone exactly), got {loss_scale!r}.")
    return value


_LOW_PRECISION = (tf.float16, tf.bfloat16)


def _train_loss(loss_fn, scale):
    """The per-example loss the engine differentiates: ``S·loss_fn`` on float32 outputs.

    Predictions of a mixed-precision model (float16/bfloat16) are cast to float32
    first, as Keras's ``Loss.__call__`` does, so the losses, the norms and the clipping
    factors are float32; their gradient flows back through the cast in the layers'
    dtype. ``scale`` is the static float16 loss scale S (1.0: none)."""

    def loss(y_true, y_pred):
        y_pred = tf.nest.map_structure(
            lambda t: tf.cast(t, tf.float32) if getattr(t, "dtype", None) in _LOW_PRECISION else t, y_pred
        )
        values = loss_fn(y_true, y_pred)
        return values if scale == 1.0 else values * tf.cast(scale, values.dtype)

    return loss


def make_private(model, *, clipping="auto", microbatch_size=None) -> PrivateModel:
    """Wrap ``model`` so that ``fit`` clips per example and adds calibrated noise.

    Args:
      model: a Keras model (Sequential, functional or subclassed), TF backend.
      clipping: ``"auto"``, ``"vectorized"`` or ``"ghost"`` (see ``PrivateModel``).
      microbatch_size: chunk size for per-example gradients, or ``None``.

    Returns:
      a :class:`PrivateModel` sharing ``model``'s layers and weights; compile it with
      a ``NoiseCurveOptimizer``.
    """
    return PrivateModel(model, clipping=clipping, microbatch_size=microbatch_size, name=f"private_{model.name}")
