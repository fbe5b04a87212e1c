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
depends on the data is refused (:mod:`keras_noisecurve.backend.tensorflow.features` on
TensorFlow, :mod:`keras_noisecurve.backend.common.step_features` on JAX). ``test_step`` reports the same loss as training (the compiled per-example
loss, weighted mean over the batch); ``predict_step`` is Keras's own.
"""

from __future__ import annotations

import sys

import keras
import numpy as np

from keras_noisecurve import _compat
from keras_noisecurve import backend as _backend
from keras_noisecurve._losses import per_example_loss_fn
from keras_noisecurve._validation import check_choice, check_float, check_int
from keras_noisecurve.backend.common import batch_probe
from keras_noisecurve.training import log_guard, lora_state, plan_guard
from keras_noisecurve.backend.common.class_weight import check_class_weight
from keras_noisecurve.backend.common.model_checks import ENGINES, check_model_is_clippable
from keras_noisecurve.training.optimizer import NoiseCurveOptimizer

__all__ = ["PrivateModel", "make_private"]

_PACKAGE = "keras_noisecurve"

#: the backend's ``dp_model``, whose ``TrainStepBackend`` is the private ``train_step`` and what
#: ``fit`` needs around it
_impl = _backend.module("dp_model")


def _not_the_plan(planned):
    """The message for data that is not ``planned``'s own pipeline (a ``PrivateRun``)."""
    return (
        f"this model's optimizer belongs to a PrivateRun ({planned!r}): every step must take the run's own "
        "batch (cyclic Poisson sampling, step index checked), or the run's epsilon does not describe the "
        "training. Pass the run's pipeline unchanged: fit(run.dataset(x, y)) (no y, batch_size, shuffle, "
        "re-batching or other dataset)."
    )


def _paths(tree, prefix=""):
    """The ``a/b/c`` paths of the leaves of a nested dict (a Keras state tree's, e.g.
    ``{"adam": {"iteration": ...}}`` → ``["adam/iteration"]``)."""
    if not isinstance(tree, dict):
        return [prefix]
    return [p for key, value in tree.items() for p in _paths(value, f"{prefix}/{key}" if prefix else str(key))]


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
        tf = sys.modules.get("tensorflow")
        if tf is not None and isinstance(x, tf.data.Dataset):
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
    return int(value.numpy()) if hasattr(value, "numpy") else int(np.asarray(value))


class _StopAtPlanEnd(keras.callbacks.Callback):
    """Stops ``fit`` after the plan's last step (instead of running out of data).

    On JAX the steps are counted on the host from the optimizer's step at the start of
    ``fit`` (one step per batch): there the variables are only synchronised at the end of
    an epoch, and reading them after every batch would force a copy each step."""

    def __init__(self, steps):
        super().__init__()
        self._steps = steps
        self._done = 0

    def on_train_begin(self, logs=None):
        self._done = _iterations(self.model.optimizer)
        if self._done >= self._steps:
            raise RuntimeError(
                f"the plan of {self._steps} steps is complete (the optimizer has taken {self._done} steps): "
                "no further private step is possible with this run."
            )

    def on_train_batch_end(self, batch, logs=None):
        self._done += 1
        if not self.model._dp_counts_steps_on_host:
            self._done = _iterations(self.model.optimizer)
        if self._done >= self._steps:
            self.model.stop_training = True


class _LowLevelStart(keras.callbacks.Callback):
    """Refuses, after any restore (it runs after the user's callbacks) and before the first
    step, a ``banded_poisson_dataset`` plan that cannot continue at the optimizer's step."""

    def __init__(self, plan):
        super().__init__()
        self._plan = plan

    def on_train_begin(self, logs=None):
        done, steps = self._plan.begin(self.model.optimizer), self._plan.steps
        if done >= steps:
            raise RuntimeError(f"the plan of {steps} steps is complete (the optimizer has taken {done} steps): "
                               "no further private step is possible with this banded_poisson_dataset.")


@keras.saving.register_keras_serializable(package=_PACKAGE)
class PrivateModel(_impl.TrainStepBackend, keras.Model):
    """A private model wrapping an existing model (what :func:`make_private` returns):
    ``fit`` clips per example and the ``NoiseCurveOptimizer`` adds the noise.

    Args:
      model: any Keras model (Sequential, functional or subclassed). Its weights
        are shared, not copied.
      clipping: the clipping engine: ``"auto"`` (ghost-norm clipping when
        ``keras_noisecurve.backend.tensorflow.ghost`` supports the model, else vectorized),
        ``"vectorized"`` or ``"ghost"``.
      microbatch_size: evaluate per-example gradients in chunks of this many
        examples to bound memory (``None``: the whole batch at once).

    ``compile`` requires a ``NoiseCurveOptimizer`` and a single loss; BatchNormalization
    layers and activity regularizers are refused. The logged ``loss`` is
    Σ_i w_i·loss_i / Σ_i w_i over the batch (mask-weighted, without the regularisation
    term, and without the examples the engine dropped).

    An example whose loss or gradient is not finite is dropped by the clipping engine
    (it contributes 0, within the clip bound); ``fit`` logs the epoch's count as
    ``nonfinite_examples`` and warns once per ``fit`` naming the steps; a step whose
    every real example is non-finite stops ``fit`` before the weights change
    (``keras_noisecurve.backend.tensorflow.features``; docs/training.md). On JAX that step applies
    its noise only and ``fit`` raises at the end of the epoch (docs/backends.md).
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
            self._dp_check_engine(model)  # refused now, not at the first step

    def call(self, inputs, training=None):
        return self.inner(inputs, training=training)

    def build(self, input_shape=None):
        if not self.inner.built and input_shape is not None:
            if type(self.inner).build is not keras.Model.build:
                self.inner.build(input_shape)
            else:  # a subclassed model without build(): create its weights by a call
                shape = [1 if d is None else d for d in input_shape]
                self.inner(keras.ops.zeros(shape))
        self.built = True

    def get_config(self):
        config = {
            "name": self.name,
            "model": keras.saving.serialize_keras_object(self.inner),
            "clipping": self._dp_clipping,
            "microbatch_size": self._dp_microbatch_size,
        }
        lora = lora_state.lora_config(self.inner)
        if lora is not None:  # which layers had LoRA and which were frozen (Keras's configs do not say)
            config["lora"] = lora
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        model = keras.saving.deserialize_keras_object(config.pop("model"), custom_objects=custom_objects)
        lora_state.restore_structure(model, config.pop("lora", None))
        return cls(model, **config)

    def save_own_variables(self, store):
        """Keras's, and the frozen kernel and factors of every LoRA layer (Keras saves a LoRA
        layer merged), see :mod:`keras_noisecurve.training.lora_state`."""
        super().save_own_variables(store)
        self._dp_apply_pending_lora()
        lora_state.save_values(self.inner, store)
        optimizer = getattr(self, "optimizer", None)
        if isinstance(optimizer, NoiseCurveOptimizer) and optimizer.built:
            # the private steps these weights carry, with the weights (plan_guard.check_plan)
            store["dp_private_steps"] = np.asarray(_iterations(optimizer), np.int64)

    def load_own_variables(self, store):
        # the wrapper owns no variables (Keras's own check would count the LoRA entries)
        # the layers load after this (merged kernel, zero factors): put the values back before training
        self._dp_pending_lora = lora_state.stash_values(self.inner, store)
        steps = int(np.asarray(store["dp_private_steps"])) if "dp_private_steps" in store.keys() else 0
        object.__setattr__(self, "_dp_loaded_steps", steps)

    def set_state_tree(self, state_tree):
        """Keras's (what ``load_weights`` and ``load_model`` of an Orbax checkpoint call),
        refusing an optimizer state that does not name every variable of this model's
        optimizer: Keras assigns by variable path and skips a path it does not find, so a
        ``NoiseCurveOptimizer`` would keep its fresh step counter, keys or noise state (zeros)
        — a resumed run whose batches or correlated noise are not the plan's, silently.
        ``ValueError`` names the missing paths; nothing is assigned."""
        saved = state_tree.get("optimizer_variables") if isinstance(state_tree, dict) else None
        optimizer = getattr(self, "optimizer", None)
        if saved is not None and isinstance(optimizer, NoiseCurveOptimizer):
            missing = sorted({v.path for v in optimizer.variables} - set(_paths(saved)))
            if missing:
                shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
                raise ValueError(
                    f"the checkpoint's optimizer state does not name {len(missing)} of this optimizer's "
                    f"{len(optimizer.variables)} variables ({shown}): Keras would skip them and the run would "
                    "resume with a fresh step counter, keys or noise state, not the plan's. Restore into a model "
                    "built as the saved one, with the same model and layer names (a fresh process gives Keras's "
                    "automatic names again; or name the model and its layers), and build the optimizer first "
                    "(optimizer.build(model.trainable_variables)).")
        return super().set_state_tree(state_tree)

    def _dp_apply_pending_lora(self):
        pending = getattr(self, "_dp_pending_lora", None)
        if pending is not None:
            self._dp_pending_lora = None
            lora_state.apply_values(self.inner, pending)

    def train_on_batch(self, *args, **kwargs):
        """Keras's ``train_on_batch`` (after a ``load_model``, the LoRA factors restored first;
        the first call after ``compile`` checks the optimizer's saved plan, model and loss,
        ``optimizer.check_plan``)."""
        self._dp_apply_pending_lora()
        if not getattr(self, "_dp_plan_checked", False):
            self._dp_check_plan()
            object.__setattr__(self, "_dp_plan_checked", True)
        x = args[0] if args else kwargs.get("x")
        y = args[1] if len(args) > 1 else kwargs.get("y")
        self._dp_probe(x, y)
        object.__setattr__(self, "_dp_weights_after", None)  # a private step: the next fit compares nothing
        return super().train_on_batch(*args, **kwargs)

    # ------------------------------------------------------------ the plan and the weights
    def _dp_check_plan(self, data=None):
        """``optimizer.check_plan`` with this model's words (``plan_guard.check_plan``)."""
        plan_guard.check_plan(self, data)

    def check_examples_apart(self, x, y=None):
        """Run the batch probe on the batch ``x, y`` now: refuse a model whose examples reach
        one another in training mode (MixUp, CutMix, batch statistics, a loss that mixes), or
        that writes non-trainable state from the data
        (:func:`keras_noisecurve.backend.common.batch_probe.check_examples_apart`; docs/training.md,
        "Examples apart, and no state from the data").

        ``fit``, ``train_on_batch`` and ``fit_distributed`` run it themselves once per
        ``compile``, before the first private step; a custom loop that calls ``train_step``
        itself calls this first (its step warns otherwise).

        Returns:
          the ``ProbeResult``. Raises ``ValueError`` with what it found.
        """
        result = batch_probe.check_examples_apart(self, x, y, loss_fn=self._dp_loss_fn)  # builds an unbuilt model
        object.__setattr__(self, "_dp_probed", result.rows >= 2)
        return result

    def _dp_probe(self, x, y=None):
        """:meth:`check_examples_apart` once per ``compile``."""
        if not getattr(self, "_dp_probed", False) and x is not None:
            self.check_examples_apart(x, y)

    def _dp_warn_unprobed(self):
        """Where the private step is traced (or run eagerly): warn when the batch probe has
        not run since ``compile`` (data it could not read: a Python generator, a custom loop,
        batches of one example)."""
        if not getattr(self, "_dp_probed", False):
            import warnings

            warnings.warn(
                "the batch probe did not run on this model before its private step (its data could not be read "
                "twice, e.g. a Python generator; a custom loop; or fewer than 2 different examples): nothing checked "
                "that no layer or loss mixes the examples of a batch and that no state is written from the data. "
                "Call private.check_examples_apart(x, y) on a batch first, or give fit arrays or run.dataset(x, y).",
                RuntimeWarning, stacklevel=2)

    def load_weights(self, filepath, *args, **kwargs):
        """Keras's, with the optimizer built first when the model is compiled and built: Keras
        would skip an unbuilt optimizer's saved state with a warning, and the run would restart
        its step count, keys and plan on weights that carry private steps."""
        optimizer = getattr(self, "optimizer", None)
        if isinstance(optimizer, NoiseCurveOptimizer) and not optimizer.built and self.built:
            optimizer.build(self.trainable_variables)
        object.__setattr__(self, "_dp_plan_checked", False)  # train_on_batch checks the restored plan
        return super().load_weights(filepath, *args, **kwargs)

    def _dp_setup(self, clipping, microbatch_size):
        self._dp_clipping = check_choice("clipping", clipping, ENGINES)
        if microbatch_size is not None:
            microbatch_size = check_int("microbatch_size", microbatch_size, minimum=1)
        self._dp_microbatch_size = microbatch_size
        self._dp_engine = None
        self._dp_loss_fn = None
        self._dp_loss_scale = 1.0
        self._dp_class_weight = None  # the class_weight table of the fit in progress
        self._dp_train_functions = {}  # the traced train function of each class-weight table (this compile)
        # untracked (object.__setattr__): not a weight, not in checkpoints or .keras files
        object.__setattr__(self, "_dp_refused", self._dp_refusal_state())
        object.__setattr__(self, "_dp_nonfinite", self._dp_nonfinite_state())

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

        On TensorFlow ``jit_compile`` defaults to ``False`` (on JAX, Keras's default: the step is
        jit-compiled): ``jit_compile=True`` works (the step checks
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
        if kwargs.get("loss_weights") is not None:
            raise ValueError("loss_weights are not supported by private models (single loss only).")
        self._dp_loss_fn = per_example_loss_fn(loss)
        self._dp_loss_scale = self._dp_check_loss_scale(_loss_scale(self, loss_scale, auto_scale_loss))
        check_model_is_clippable(self)
        self._dp_compile_defaults(kwargs)
        super().compile(optimizer=optimizer, loss=loss, **kwargs)
        self._dp_train_functions = {}  # traced for the previous compile
        object.__setattr__(self, "_dp_plan_checked", False)
        object.__setattr__(self, "_dp_probed", False)
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
        self._dp_apply_pending_lora()
        class_weight = kwargs.pop("class_weight", None)
        if class_weight is None and self._dp_class_weight is None:
            return self._dp_fit_plan(x, y, **kwargs)
        self._dp_use_class_weight(class_weight)
        try:
            return self._dp_fit_plan(x, y, **kwargs)
        finally:
            self._dp_use_class_weight(None)

    def _dp_fit_plan(self, x=None, y=None, **kwargs):
        from keras_noisecurve.privacy.run_data import RunData

        run = x.run if isinstance(x, RunData) else None
        _check_run_data(getattr(self.optimizer, "run", None), run, x)
        log_guard.check_callbacks(kwargs.get("callbacks"), validation_split=kwargs.get("validation_split", 0.0))
        log_guard.say_private_logs(self)
        if run is not None:
            if y is not None:
                raise ValueError("a PrivateRun dataset carries its labels: call fit(run.dataset(x, y)) without y.")
            optimizer = self.optimizer
            if not isinstance(optimizer, NoiseCurveOptimizer):
                raise ValueError(f"a private model needs a NoiseCurveOptimizer, got {type(optimizer).__name__}.")
            data = x
            x = self._dp_batches(x, optimizer)
            kwargs.setdefault("steps_per_epoch", run.steps_per_epoch)
            kwargs.setdefault("epochs", run.epochs)
            kwargs.setdefault("shuffle", False)  # the plan decides the order
            others, budgets = plan_guard.budgets_apart(kwargs.pop("callbacks", None))
            # after the user's restores, the plan check; then the budgets (they read the restored step)
            start = plan_guard.PlanStart(data.source.fingerprint(), plan_guard.probe_rows(source=data.source))
            kwargs["callbacks"] = others + [start] + budgets + [_StopAtPlanEnd(run.steps)]
        low = getattr(x, "_knc_low_level_plan", None)
        rows = plan_guard.probe_rows(source=low.source) if low is not None else plan_guard.probe_rows(x, y)
        if run is None and low is not None:  # banded_poisson_dataset: start at the optimizer's step
            x = low.dataset(self.optimizer, with_step=True)
            kwargs.setdefault("shuffle", False)  # the plan decides the order
            kwargs["callbacks"] = plan_guard.callback_list(kwargs.pop("callbacks", None)) + [_LowLevelStart(low)]
        elif run is None and isinstance(self.optimizer, NoiseCurveOptimizer):
            import warnings

            batch_size = kwargs.get("batch_size", 32 if plan_guard.is_arrays(x) else None)
            warnings.warn(plan_guard.low_level_warning(self.optimizer, batch_size), RuntimeWarning, stacklevel=3)
        if run is None:
            kwargs["callbacks"] = plan_guard.callback_list(kwargs.pop("callbacks", None)) + [
                plan_guard.PlanStart(None, rows)]
        extra = self._dp_step_callbacks()
        if extra:
            kwargs["callbacks"] = plan_guard.callback_list(kwargs.pop("callbacks", None)) + extra
        return self._dp_fit(x, y, kwargs)

    #: ``{class: weight}`` validated as a dense float32 table (``None`` stays ``None``)
    _dp_check_class_weight = staticmethod(check_class_weight)

    def _dp_use_class_weight(self, class_weight):
        """Set (or with ``None`` clear) the class-weight table of the ``fit`` or ``train_on_batch``
        in progress. The table is a constant of the traced step, so each table has its own
        train function, kept until the next ``compile`` (at most ``_MAX_TABLES`` tables): calls
        with a table seen before reuse its step instead of tracing it again."""
        table = self._dp_check_class_weight(class_weight)
        old, new = _table_key(self._dp_class_weight), _table_key(table)
        if old != new:
            if self.train_function is not None:
                self._dp_train_functions.pop(old, None)
                self._dp_train_functions[old] = self.train_function
                while len(self._dp_train_functions) > _MAX_TABLES:
                    self._dp_train_functions.pop(next(iter(self._dp_train_functions)))
            self.train_function = self._dp_train_functions.get(new)
        self._dp_class_weight = table

    def _dp_check_optimizer(self, optimizer):
        if not isinstance(optimizer, NoiseCurveOptimizer):
            raise ValueError(f"a private model needs a NoiseCurveOptimizer, got {type(optimizer).__name__}.")

    def _dp_loss_tracker(self):
        """The ``Mean`` metric behind the logged ``loss``."""
        return _compat.loss_tracker(self)

    @staticmethod
    def _dp_not_the_plan(planned):
        return _not_the_plan(planned)

    @staticmethod
    def _dp_unit_rows(optimizer) -> int:
        """k, the rows of one privacy unit that the engines clip as one: a user-level run's
        ``examples_per_user`` (its batches put each user's rows together), else 1."""
        run = getattr(optimizer, "run", None)
        return 1 if run is None else int(getattr(run, "examples_per_user", 1))


#: how many class-weight tables keep their traced train function (``_dp_use_class_weight``)
_MAX_TABLES = 8


def _table_key(table):
    """A hashable key of a class-weight table (``None``: no table)."""
    return None if table is None else np.asarray(table, np.float32).tobytes()


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
