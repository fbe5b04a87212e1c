"""Every use of a private name of Keras, TensorFlow or dp-accounting, in one place.

The library reads a few attributes and calls a few methods that Keras, TensorFlow and
dp-accounting do not document, where no public API gives the same thing; and it
overrides four private Keras methods (:data:`PRIVATE_OVERRIDES`). Each access is one
function here, named for what it returns, and each is pinned by ``tests/test_compat.py``
against the installed versions (so an upgrade that renames or changes one fails there,
with the name, instead of deep inside a training step). No other module of
``keras_noisecurve`` names a private third-party attribute or imports ``keras.src`` /
``tensorflow.python``, but ``keras_noisecurve.backend.tensorflow.compat``, which holds the
TensorFlow internals (imported only by the TensorFlow backend).

Nothing is imported at module level: TensorFlow and the Keras backend modules are
imported inside the functions that need them, so numpy-only callers (the privacy
ledger) import this module without starting TensorFlow.
"""

from __future__ import annotations

__all__ = [
    "PRIVATE_OVERRIDES",
    "check_private_override",
    "added_losses",
    "causal_padding",
    "compile_metrics",
    "copy_keras_mask",
    "keras_mask",
    "map_keeping_masks",
    "current_learning_rate",
    "dense_pmf_fields",
    "distribution_strategy",
    "flatten_layers",
    "float64_promotion",
    "iterations_variable",
    "keras_tf_nn_module",
    "learning_rate_value",
    "is_backend_variable",
    "loss_tracker",
    "optimizer_variables",
    "own_trainable_variables",
    "pld_pmfs",
    "regularization_losses",
    "replica_value_specs",
    "rnn",
    "swap_compute_moments",
    "symbolic_build",
    "without_compiled_loss",
    "unautocast_variable",
    "unmerged_kernel",
    "trainable_variable_keys",
    "trainable_variables",
    "update_compile_metrics",
    "variable_index",
    "variable_key",
]

#: Private methods of Keras that classes of this package override, as
#: ``(our class, the Keras class that defines the method, method, its parameters)``.
#: Keras calls them itself (no public hook runs at that point); tests/test_compat.py
#: checks that Keras still defines each with these parameters and that our class still
#: overrides it.
PRIVATE_OVERRIDES = (
    # (our class, the Keras class, the method, its parameters, the backend it is overridden on
    # (None: every backend))
    # weight decay is delegated to the inner optimizer (Keras applies it before update_step)
    ("keras_noisecurve.training.optimizer.NoiseCurveOptimizer", "keras.optimizers.Optimizer",
     "_apply_weight_decay", ("self", "variables"), None),
    # once per step in cross-replica context, around the per-variable update_step calls
    ("keras_noisecurve.training.optimizer.NoiseCurveOptimizer", "keras.optimizers.Optimizer",
     "_distributed_tf_update_step", ("self", "distribution", "grads_and_vars", "learning_rate"), None),
    # the model is built from one batch under a tf.distribute strategy (a run's step index left out)
    ("keras_noisecurve.training.dp_model.PrivateModel", "keras.Model",
     "_symbolic_build", ("self", "iterator", "data_batch"), None),
    # JAX: the loop over the variables' update_step, with the noise of all of them drawn in one pass
    # (keras_noisecurve.backend.jax.optimizer)
    ("keras_noisecurve.training.optimizer.NoiseCurveOptimizer", "keras.optimizers.Optimizer",
     "_backend_update_step", ("self", "grads", "trainable_variables", "learning_rate"), "jax"),
)


def check_private_override(ours, base, method, parameters):
    """Why ``ours.method`` no longer overrides Keras's ``base.method`` with ``parameters`` as
    :data:`PRIVATE_OVERRIDES` records it (a Keras upgrade renamed or changed it), else ``None``.
    ``ours`` and ``base`` are dotted class paths."""
    import importlib
    import inspect

    import keras

    module_name, _, base_name = base.rpartition(".")
    keras_class = getattr(importlib.import_module(module_name), base_name)
    keras_method = getattr(keras_class, method, None)
    if keras_method is None:
        return f"keras {keras.__version__} has no {base}.{method}: our override is dead"
    if tuple(inspect.signature(keras_method).parameters) != parameters:
        return f"keras {keras.__version__} changed {base}.{method}{inspect.signature(keras_method)}"
    module_name, _, class_name = ours.rpartition(".")
    our_class = getattr(importlib.import_module(module_name), class_name)
    if not issubclass(our_class, keras_class):
        return f"{ours} is not a {base}"
    if getattr(our_class, method) is keras_method:
        return f"{ours} no longer overrides {method}"
    if tuple(inspect.signature(getattr(our_class, method)).parameters) != parameters:
        return f"{ours}.{method} takes {inspect.signature(getattr(our_class, method))}, Keras {parameters}"
    return None


# ------------------------------------------------------------------ Keras layers/models
def flatten_layers(model, *, include_self: bool = True, recursive: bool = True):
    """The layers of ``model`` (a Keras layer or model), depth first, as Keras tracks them
    (``Layer._flatten_layers``: also layers held in attributes, lists and dicts)."""
    return model._flatten_layers(include_self=include_self, recursive=recursive)


def loss_kwargs(loss) -> dict:
    """The keyword arguments a Keras loss object passes its function (``from_logits``, ...):
    ``LossFunctionWrapper._fn_kwargs``; empty for other losses."""
    return dict(getattr(loss, "_fn_kwargs", None) or {})


def seed_generators(layer) -> list:
    """The ``keras.random.SeedGenerator`` objects ``layer`` itself tracks (Keras's
    ``Layer._seed_generators``; empty where a release has none)."""
    return list(getattr(layer, "_seed_generators", None) or [])


def global_seed_generator():
    """Keras's global ``SeedGenerator`` (what unseeded ``keras.random`` calls draw from), or
    ``None`` when none was made yet (``keras.src.backend.common.global_state``)."""
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute("global_seed_generator")


def own_trainable_variables(layer) -> list:
    """The trainable variables ``layer`` itself created (not its sublayers'): Keras's
    ``Layer._trainable_variables`` (empty when the layer has none)."""
    return getattr(layer, "_trainable_variables", [])


def unautocast_variable(variable):
    """The backend variable behind a Keras ``variable`` (a ``tf.Variable`` on TensorFlow),
    read WITHOUT Keras's autocast: inside a layer's call under a mixed-precision policy
    ``variable.value`` is a fresh cast of it, which a ``tf.autodiff.ForwardAccumulator``
    cannot watch (Keras's ``Variable._value``). Anything else is returned unchanged."""
    return getattr(variable, "_value", None) if is_backend_variable(getattr(variable, "_value", None)) else variable


def unmerged_kernel(layer):
    """The kernel variable of a LoRA-enabled ``Dense``/``EinsumDense`` without its LoRA factors
    (``layer.kernel`` is ``K + s·A·B``; Keras's ``_kernel`` is ``K``)."""
    return layer._kernel


def copy_keras_mask(source, target):
    """``target`` with the Keras mask of ``source`` attached (``keras_mask`` is Keras's
    private tensor attribute, read and set through ``keras.src.backend``'s masking helpers);
    ``target`` unchanged when ``source`` has none."""
    from keras.src.backend.common.masking import get_keras_mask, set_keras_mask

    mask = get_keras_mask(source)
    if mask is not None:
        set_keras_mask(target, mask)
    return target


def keras_mask(tensor):
    """The Keras mask attached to ``tensor`` (``keras_mask``, Keras's private tensor attribute:
    e.g. the (P, L) mask an ``Embedding(mask_zero=True)`` passes down to the model's output, or
    the mask a loss's ``call`` attaches to its values for ``ignore_class``), or None."""
    from keras.src.backend.common.masking import get_keras_mask

    return get_keras_mask(tensor)


def map_keeping_masks(fn, structure):
    """``fn`` applied to every tensor of ``structure``, each result carrying ``fn`` of the
    input's Keras mask (e.g. the rows of a batch selected or zeroed, mask and all)."""
    import keras
    from keras.src.backend.common.masking import get_keras_mask, set_keras_mask

    def one(t):
        out = fn(t)
        mask = get_keras_mask(t)
        if mask is not None:
            set_keras_mask(out, fn(mask))
        return out

    return keras.tree.map_structure(one, structure)


def causal_padding(layer):
    """The ``keras.ops.pad`` widths that make a ``Conv1D(padding="causal")`` a "valid"
    convolution: ``[[0, 0], [(kernel_size − 1)·dilation_rate, 0], [0, 0]]`` for channels last."""
    return layer._compute_causal_padding()


def rnn(step_function, inputs, initial_states, **kwargs):
    """Keras's own loop of its recurrent layers on the backend in use (``keras.src.backend.rnn``:
    ``(last_output, outputs, new_states)``, with its masking, ``go_backwards`` and ``unroll``), which
    ``keras.layers.RNN.inner_loop`` runs; ``keras.ops`` has no public equivalent."""
    from keras.src import backend

    return backend.rnn(step_function, inputs, initial_states, **kwargs)


def added_losses(model) -> list:
    """The losses that ``model``'s layers added with ``self.add_loss(...)`` in their last
    call (not the weight regularizers): ``Layer._get_own_losses`` of every layer."""
    return [loss for layer in flatten_layers(model) for loss in layer._get_own_losses()]


def regularization_losses(model) -> list:
    """The weight-regularization losses of ``model`` (kernel/bias regularizers), without
    activity regularization: ``Layer._get_regularization_losses``."""
    return model._get_regularization_losses()


def compile_metrics(model):
    """The ``CompileMetrics`` that ``compile(metrics=...)`` created (None before compile)."""
    return model._compile_metrics


def update_compile_metrics(model, y, y_pred, *, sample_weight, row_weight) -> None:
    """``CompileMetrics.update_state`` of ``compile(metrics=..., weighted_metrics=...)``, with
    the unweighted ``metrics`` given ``row_weight`` as their sample weight (Keras gives them
    none): a (P,) 0/1 weight leaves rows out of every metric under static shapes (JAX).
    The weighted metrics get ``sample_weight`` (P,), repeated for each output as Keras does.
    A metric whose ``update_state`` takes no ``sample_weight`` is called without it.
    Reads ``CompileMetrics.built/build/_flatten_y/_flat_metrics/_flat_weighted_metrics``."""
    import inspect

    metrics = model._compile_metrics
    if metrics is None:
        return
    if not metrics.built:
        metrics.build(y, y_pred)
    y_true, y_pred = metrics._flatten_y(y), metrics._flatten_y(y_pred)

    def update(metric, y_t, y_p, weight):
        weight = _per_position(weight, y_p)
        parameters = inspect.signature(metric.update_state).parameters
        if "sample_weight" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            metric.update_state(y_t, y_p, sample_weight=weight)
        else:
            metric.update_state(y_t, y_p)

    for metric, y_t, y_p in zip(metrics._flat_metrics, y_true, y_pred):
        if metric:
            update(metric, y_t, y_p, row_weight)
    for metric, y_t, y_p in zip(metrics._flat_weighted_metrics, y_true, y_pred):
        if metric:
            update(metric, y_t, y_p, sample_weight)


def _per_position(weight, y_pred):
    """A (P,) metric weight broadcast to the shape of ``y_pred``'s Keras mask (P, L, ...) when it
    has one: Keras's metrics multiply the weight by the mask without aligning their ranks."""
    from keras import ops
    from keras.src.backend.common.masking import get_keras_mask

    mask = None if weight is None else get_keras_mask(y_pred)
    if mask is None or len(weight.shape) >= len(mask.shape):
        return weight
    weight = ops.reshape(weight, tuple(weight.shape) + (1,) * (len(mask.shape) - len(weight.shape)))
    return ops.broadcast_to(ops.cast(weight, "float32"), ops.shape(mask))


def is_backend_variable(value) -> bool:
    """Whether ``value`` is a variable of the backend's own framework (a ``tf.Variable``
    on TensorFlow; JAX has none): imports TensorFlow only when it is already loaded."""
    import sys

    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(value, tf.Variable)


def loss_tracker(model):
    """The ``Mean`` metric behind the ``loss`` that ``fit`` reports (Trainer._loss_tracker)."""
    return model._loss_tracker


def explicit_distribution_strategy(model):
    """The ``tf.distribute`` strategy ``model`` was compiled under, or ``None`` with the
    default one; ``fit`` builds the optimizer before tracing only under an explicit one
    (Trainer._distribute_strategy, the test of its ``_maybe_symbolic_build``)."""
    return model._distribute_strategy


def symbolic_build(model, *, data_batch) -> None:
    """Create ``model``'s, its metrics' and its optimizer's variables from the spec of one
    batch, as ``fit`` does under a ``tf.distribute`` strategy (Trainer._symbolic_build)."""
    model._symbolic_build(data_batch=data_batch)


def without_compiled_loss(model):
    """A context in which ``model`` has no compiled loss (``Trainer._compile_loss`` set to None,
    restored on exit): Keras's JAX ``fit`` then builds the model and the compiled metrics from
    one batch without building the ``CompileLoss`` (which the private step never calls, whose
    per-output loss trackers would log 0)."""
    import contextlib

    @contextlib.contextmanager
    def scope():
        saved = model._compile_loss
        model._compile_loss = None
        try:
            yield
        finally:
            model._compile_loss = saved

    return scope()


def float64_promotion():
    """A context in which Keras's dtype promotion keeps float64: ``keras.backend.result_type``
    maps float64 to float32 on every backend but TensorFlow (``BIT64_TO_BIT32_DTYPE`` of
    ``keras.src.backend.common.dtypes``, "aligned with JAX's default"), even with JAX's
    ``jax_enable_x64`` on, and the layers that choose their compute dtype with it
    (``GroupNormalization``, ``LayerNormalization``: ``result_type(inputs.dtype, "float32")``)
    then compute a float64 model in float32. The entry is lifted on entry and restored on
    exit; on TensorFlow (no entry) the context changes nothing."""
    import contextlib

    from keras.src.backend.common import dtypes

    @contextlib.contextmanager
    def scope():
        table = dtypes.BIT64_TO_BIT32_DTYPE
        saved = table.pop("float64", None)
        try:
            yield
        finally:
            if saved is not None:
                table["float64"] = saved

    return scope()


# ------------------------------------------------------------------------ optimizers
def distribution_strategy(optimizer):
    """The ``tf.distribute.Strategy`` ``optimizer`` was created under."""
    return optimizer._distribution_strategy


def current_learning_rate(optimizer):
    """The learning rate of the current step: the schedule evaluated at ``iterations``, or
    the learning-rate variable."""
    return optimizer._get_current_learning_rate()


def learning_rate_value(optimizer):
    """What ``optimizer`` was given as learning rate, unevaluated: a ``LearningRateSchedule``,
    a callable, or the learning-rate variable."""
    return optimizer._learning_rate


def optimizer_variables(optimizer) -> list:
    """The optimizer's own variables (iterations, learning rate, slots), not an inner one's."""
    return optimizer._variables


def iterations_variable(optimizer):
    """The step counter variable (``optimizer.iterations`` reads it; this one can be assigned)."""
    return optimizer._iterations


def variable_key(optimizer, variable):
    """The key under which ``optimizer`` indexes ``variable`` (its slots, its index)."""
    return optimizer._var_key(variable)


def variable_index(optimizer, variable) -> int:
    """The position of ``variable`` among the variables ``optimizer`` was built on."""
    return optimizer._get_variable_index(variable)


def trainable_variable_keys(optimizer):
    """Keys (:func:`variable_key`) of the variables ``optimizer`` was built on."""
    return optimizer._trainable_variables_indices


def trainable_variables(optimizer) -> list:
    """The variables ``optimizer`` was built on (``build(variables)``), in order."""
    return optimizer._trainable_variables


def variable_layout(variable):
    """The layout a variable carries under ``keras.distribution`` (a ``TensorLayout`` or a
    backend sharding), ``None`` until it is initialised or without a distribution."""
    return getattr(variable, "_layout", None)


# ------------------------------------------------------------------- tf.distribute / XLA
def replica_value_specs(spec):
    """The per-replica specs of a ``PerReplicaSpec`` (None for any other spec)."""
    return getattr(spec, "_value_specs", None)


# ------------------------------------------------------------------ Keras moments patch
def keras_tf_nn_module():
    """Keras's TensorFlow-backend ``nn`` module when it computes ``keras.ops.moments``
    through a module-level ``_compute_moments`` (which can be swapped), else None."""
    try:
        from keras.src.backend.tensorflow import nn as tf_nn
    except ImportError:  # pragma: no cover - other Keras layouts
        return None
    if not hasattr(tf_nn, "_compute_moments"):
        return None
    return tf_nn


def swap_compute_moments(module, function):
    """Make ``keras.ops.moments`` compute with ``function(x, axes, keepdims, synchronized)``
    (module from :func:`keras_tf_nn_module`); returns the function it replaced."""
    previous = module._compute_moments
    module._compute_moments = function
    return previous


# ------------------------------------------------------------------------ dp-accounting
def pld_pmfs(pld) -> list:
    """The privacy-loss pmfs of a dp-accounting ``PrivacyLossDistribution``: ``[remove]``
    when it is symmetric, else ``[remove, add]`` (dp-accounting has no public accessor)."""
    return [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]


def dense_pmf_fields(pmf) -> tuple:
    """``(discretization Δ, lower_loss L0, probs, infinity_mass)`` of a dp-accounting
    ``DensePLDPmf``: ``probs[i]`` is the mass at privacy loss ``(L0 + i)·Δ``."""
    return pmf._discretization, pmf._lower_loss, pmf._probs, pmf._infinity_mass
