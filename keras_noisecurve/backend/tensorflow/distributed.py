"""Multi-worker private training without ``model.fit``: the TensorFlow loop of
:func:`keras_noisecurve.training.fit_distributed` (which checks the model, the optimizer and
the run, then calls :func:`train` here).

Keras 3's ``model.fit`` fails under ``tf.distribute.MultiWorkerMirroredStrategy``
at the first step (``ValueError: Attempt to convert a value (PerReplica:{...}) with
an unsupported type``, keras-team/keras#20585, since TensorFlow 2.16), for any model
and dataset. :func:`fit_distributed` is a small training loop close to Keras's own
(one ``strategy.run(model.train_step, ...)`` per step inside a ``tf.function``, a
``keras.callbacks.CallbackList`` with one epoch) that works under every
``tf.distribute`` strategy, multi-worker included; it can be dropped once upstream
is fixed.

What every worker must agree on, and how it does:

- the weights, the noise key and the other optimizer variables: they are created
  under ``strategy.scope()``, where ``MultiWorkerMirroredStrategy`` broadcasts the
  CHIEF's initial value to every worker, so a secret key drawn from OS entropy
  (``seed=None``) is the same everywhere without ever being written down;
- the batches (``run=``): the run's secret sampling key is an optimizer variable,
  broadcast like the others; every worker computes the same global batch of each
  step from it and gathers only its own rows
  (``run.dataset(x, y).batches(optimizer, input_context=ctx)``);
- the noise: ``NoiseCurveOptimizer`` SUM-all-reduces the replicas' clipped sums, then adds
  the noise once, from (key, step, variable index); every replica computes the same
  update, so the replicas stay identical;
- the plan (the optimizer's public configuration, the variables' shapes, the start
  step, the number of steps, a run plan's fingerprint) and, with ``run=``, the examples
  in their order (``RunData.source.fingerprint()``: each worker gathers its rows of every
  global batch from its own copy, so a worker holding them in another order would put
  some examples in several batches of an epoch): :func:`fit_distributed` compares
  fingerprints of them across workers (as :func:`assert_same_on_all_workers` does)
  before the first step, and every worker raises the same ``ValueError`` when they
  differ (no worker is left waiting in a collective);
- ``model.stop_training``: OR-ed across workers after every execution, so a callback
  that stops one worker stops them all.

Two Keras internals are used, as ``fit`` uses them: ``Trainer._symbolic_build`` (to
create the variables before the loop, from the batch spec) and
``Trainer.get_metrics_result``; the traced step functions are kept in the model's
``__dict__`` (outside Keras's attribute tracking), as ``fit`` keeps ``train_function``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

import keras
import numpy as np
import tensorflow as tf

from keras_noisecurve import _compat
from keras_noisecurve._validation import check_int
from keras_noisecurve.backend.common import batch_probe
from keras_noisecurve.backend.tensorflow import features

__all__ = ["assert_same_on_all_workers", "check_supported", "is_chief", "train", "worker_checkpoint_dir"]


def check_supported() -> None:
    """Nothing to refuse: :func:`train` is the loop of ``tf.distribute`` strategies."""

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


# ----------------------------------------------------------------------- workers
def is_chief(strategy=None) -> bool:
    """Whether this process is the chief (worker 0, or the ``"chief"`` task) of
    ``strategy`` (default: the current strategy); always true in a single process.

    The chief is the one that prints the progress bar and writes the checkpoints
    that are kept (``strategy.extended.should_checkpoint``).
    """
    strategy = strategy or tf.distribute.get_strategy()
    return bool(getattr(strategy.extended, "should_checkpoint", True))


def worker_checkpoint_dir(directory, strategy=None) -> str:
    """The directory this worker writes its checkpoints to.

    Under ``MultiWorkerMirroredStrategy`` every worker must call ``save`` (saving
    reads synchronised variables through collectives), but only the chief's files
    are kept: the chief writes to ``directory``, worker ``i`` to
    ``directory/workertemp_<i>``, which it may delete after saving (TensorFlow's
    multi-worker pattern). In a single process: ``directory``.

    Args:
      directory: the checkpoint directory (a ``str`` or ``os.PathLike``).
      strategy: the strategy (default: the current one).

    Returns:
      the directory (``str``) to give ``tf.train.CheckpointManager`` or
      ``keras.callbacks.BackupAndRestore``.
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a str or os.PathLike, got {directory!r} ({type(directory).__name__}).")
    directory = os.fspath(directory)
    strategy = strategy or tf.distribute.get_strategy()
    if is_chief(strategy):
        return directory
    resolver = getattr(strategy, "cluster_resolver", None)
    task_id = getattr(resolver, "task_id", None)
    return os.path.join(directory, f"workertemp_{task_id if task_id is not None else 'x'}")


def _check_int64(name, value) -> int:
    return check_int(name, value, minimum=_INT64_MIN, maximum=_INT64_MAX)


def assert_same_on_all_workers(strategy, fingerprint: int, what: str) -> None:
    """Raise ``ValueError`` on EVERY worker unless all replicas pass the same ``fingerprint``.

    Every replica's fingerprint is all-gathered (``ReplicaContext.all_gather``:
    ``tf.distribute`` has no MIN/MAX all-reduce), so every worker sees the same
    (R,) int64 vector (R = ``num_replicas_in_sync``) and takes the same decision:
    min == max, or an error on all of them, naming ``what`` and the fingerprint of
    each replica. No worker is left waiting in a later collective.

    It is itself a collective: every worker must call it, in the same order as its
    other collectives (e.g. right after creating the strategy, before building the
    model: variables of different shapes already fail, or hang until the
    collective timeout, when they are created and broadcast).

    Args:
      strategy: a ``tf.distribute.Strategy`` (one replica: nothing to compare).
      fingerprint: an integer in [-2⁶³, 2⁶³), e.g. ``PrivateRun.fingerprint()``.
      what: what the fingerprint describes, for the message (e.g. ``"the run plan"``).
    """
    fingerprint = _check_int64("fingerprint", fingerprint)
    if not isinstance(what, str) or not what:
        raise TypeError(f"what must be a non-empty str naming what the fingerprint describes, got {what!r}.")
    if not isinstance(strategy, tf.distribute.Strategy):
        raise TypeError(f"strategy must be a tf.distribute.Strategy, got {strategy!r} ({type(strategy).__name__}).")
    _assert_same(strategy, {what: fingerprint})


#: the entry of the examples' fingerprint in the plan the workers compare (``run=``)
_DATA = "the examples, in order (fingerprint)"
#: what a worker whose examples differ must do, added to the message when _DATA differs
_DATA_ADVICE = (
    "The examples differ between the workers, or are in another order: each worker gathers its rows of every "
    "global batch from its own copy of them, so another order puts some examples in several batches of an "
    "epoch and breaks the sampling the privacy accounting assumes. Give every worker the same arrays in the "
    "same order: load them deterministically, and shuffle with a fixed seed or not at all (the run's sampling "
    "does the shuffling)."
)


def _assert_same(strategy, fingerprints: dict, advice=None) -> None:
    """All-gather the (k,) int64 vector of ``fingerprints`` (name -> int) of every
    replica and raise ``ValueError`` on every worker naming the entries that differ
    (:func:`_disagreement`; ``advice``: name -> what to do when that entry differs)."""
    if strategy.num_replicas_in_sync == 1:
        return
    names = list(fingerprints)
    local = tf.constant([[fingerprints[n] for n in names]], tf.int64)  # (1, k)

    def gather():
        return tf.distribute.get_replica_context().all_gather(local, axis=0)  # (R, k)

    gathered = strategy.experimental_local_results(tf.function(lambda: strategy.run(gather))())[0]
    message = _disagreement(names, np.asarray(gathered.numpy()), chief=is_chief(strategy), advice=advice)
    if message is not None:
        raise ValueError(message)


def _disagreement(names, table, *, chief, advice=None):
    """The message refusing the plan when a column of ``table`` (R, k) (the fingerprints
    named ``names``, one row per replica) differs between the replicas, else ``None``.
    Every worker holds the same gathered table, so all take the same decision.
    ``advice`` (name -> sentence) adds what to do for each entry that differs."""
    table = np.asarray(table)
    differ = [i for i in range(len(names)) if table[:, i].min() != table[:, i].max()]
    if not differ:
        return None
    details = "; ".join(f"{names[i]}: {table[:, i].tolist()}" for i in differ)
    verb = "differs" if len(differ) == 1 else "differ"
    worker = "the chief" if chief else "not the chief"
    hints = "".join(f" {(advice or {})[names[i]]}" for i in differ if names[i] in (advice or {}))
    return (
        f"the workers do not run the same plan: {', '.join(names[i] for i in differ)} {verb} between the "
        f"{table.shape[0]} replicas (fingerprint of each replica, in replica order — {details}). Every worker "
        f"must run the same program with the same plan and data; this worker ({worker}) stops before the first "
        f"step, and so do the others.{hints}"
    )


def _stable(obj):
    """``obj`` for JSON, the same in every process: numpy values as Python ones, any
    other object by its type name (a ``repr`` may hold a memory address)."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return type(obj).__name__


def _hash64(obj) -> int:
    """A signed 64-bit hash of a JSON-able object (the same in every process, unlike ``hash``)."""
    digest = hashlib.sha256(json.dumps(obj, sort_keys=True, default=_stable).encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def _without(config, keys):
    """``config`` (nested dicts/lists) without the entries named in ``keys``, at any depth."""
    if isinstance(config, dict):
        return {k: _without(v, keys) for k, v in config.items() if k not in keys}
    if isinstance(config, (list, tuple)):
        return [_without(v, keys) for v in config]
    return config


def _optimizer_fingerprint(optimizer) -> int:
    """The optimizer's public configuration (clip, σ, B, learning rate, C (its kind and
    parameters, by ``mixing.digest()``), inner optimizer, run plan (``run.fingerprint()``));
    never C's free-form metadata (the solver's timings differ between workers); not its
    seed (the key is the chief's) nor any name (Keras numbers the names of unnamed
    objects per process)."""
    config = _without(optimizer.get_config(), {"seed", "name"})
    config["mixing"] = optimizer.mixing.digest()
    if optimizer.run is not None:  # C by its values, never its metadata (solver timings)
        config["run"] = optimizer.run.fingerprint()
    return _hash64(config)


# --------------------------------------------------------------------- the loop
def _check_strategy(model, strategy):
    optimizer = model.optimizer
    if strategy is None:
        strategy = model.distribute_strategy
    if not isinstance(strategy, tf.distribute.Strategy):
        raise TypeError(
            f"strategy must be a tf.distribute.Strategy or None, got {strategy!r} ({type(strategy).__name__})."
        )
    if _compat.distribution_strategy(optimizer) is not strategy:
        raise ValueError(
            f"the optimizer was created under another strategy ({type(_compat.distribution_strategy(optimizer)).__name__}) "
            f"than the one given ({type(strategy).__name__}): create the model, the optimizer and compile() inside "
            "`with strategy.scope():` of the strategy you train with."
        )
    return strategy


def _replica_spec(spec):
    """The element spec of one replica's batch (``PerReplicaSpec`` -> its first value)."""

    def one(s):
        values = _compat.replica_value_specs(s)
        return values[0] if values else s

    return tf.nest.map_structure(one, spec)


def _needs_build(model) -> bool:
    metrics = _compat.compile_metrics(model)
    metrics_unbuilt = metrics is not None and not metrics.built
    layers_unbuilt = not all(layer.built for layer in _compat.flatten_layers(model))
    return layers_unbuilt or metrics_unbuilt or not model.optimizer.built


def _build(model, strategy, element_spec):
    """Create the model's, the metrics' and the optimizer's variables under the scope,
    outside the training function, from the spec of one replica's batch (what Keras's
    ``fit`` does, through the same ``Trainer._symbolic_build``)."""
    with strategy.scope():
        _compat.symbolic_build(model, data_batch=_replica_spec(element_spec))
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)


def _train_function(model, strategy, n):
    """The cached :func:`_make_train_function` of (model, strategy, optimizer, n): traced
    once, reused by later calls (as Keras keeps ``model.train_function``)."""
    cache = model.__dict__.setdefault("_fit_distributed_functions", {})  # bypasses Keras's attribute tracking
    key = (id(strategy), id(model.optimizer), n)
    if key not in cache:
        # the strategy and optimizer are kept with the function, so their ids stay theirs
        cache[key] = (strategy, model.optimizer, _make_train_function(model, strategy, n))
    return cache[key][2]


def _make_train_function(model, strategy, n):
    """A ``tf.function`` ``run(iterator)``: n steps ``strategy.run(model.train_step,
    (next(iterator),))``, then the model's metric results read in CROSS-replica
    context: synchronised (each metric's state SUM-reduced over all replicas), the
    same on every worker. The per-replica values ``train_step`` returns are only the
    local replica's (e.g. its own loss), so they are dropped."""

    def one_step(iterator):
        strategy.run(model.train_step, args=(next(iterator),))

    @tf.function
    def run(iterator):
        if n == 1:
            one_step(iterator)
        else:
            for _ in tf.range(n):
                one_step(iterator)
        return model.get_metrics_result()

    return run


def _any_worker(strategy):
    """``f(flag) -> bool``: the OR of a Python bool over all replicas (SUM all-reduce)."""

    @tf.function
    def reduce(flag):
        def fn():
            # tf.identity places the value on the replica's device (a captured tensor has
            # none, and the all-reduce would have no destination)
            return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, tf.identity(flag))

        return strategy.experimental_local_results(strategy.run(fn))[0]

    def any_worker(flag: bool) -> bool:
        return bool(reduce(tf.constant(1.0 if flag else 0.0)).numpy() > 0)

    return any_worker


def _floats(logs):
    """Metric results (tensors, maybe nested dicts) as a flat dict of Python floats."""
    out = {}
    for key, value in logs.items():
        if isinstance(value, dict):
            out.update(_floats(value))
        else:
            out[key] = float(np.asarray(value))
    return out


def _first_batch(dataset_fn):
    """``(x, y)`` of the first element of ``dataset_fn``'s pipeline 0 (``x``, ``(x, y)``,
    ``(x, y, mask)`` or ``(x, y, mask, step)``), or ``None`` when it is empty."""
    return batch_probe.first_of(next(iter(dataset_fn(tf.distribute.InputContext()).take(1)), None))


def train(model, dataset_fn, *, run_steps, plan_steps, steps, strategy, callbacks, verbose, skip_done_steps,
          fingerprint, data_fingerprint=None, probe_rows=None) -> keras.callbacks.History:
    """The loop of :func:`keras_noisecurve.training.fit_distributed`, whose docstring says what
    it does; the model and its ``NoiseCurveOptimizer`` are checked there. ``dataset_fn``:
    ``input_context -> tf.data.Dataset``; ``run_steps``: T of the run (``None`` without one);
    ``plan_steps``: the steps ``steps=None`` runs to; ``fingerprint``: an int64 or ``None``;
    ``data_fingerprint``: the run's examples in order (``RunData.source.fingerprint()``), or
    ``None`` (a ``dataset_fn``: nothing to fingerprint), compared as :data:`_DATA`;
    ``probe_rows``: ``() -> (x, y)``, the examples of the batch probe (``plan_guard.probe_rows``),
    run after the workers agreed on the plan and data (so all take the same decision); ``None``:
    the first batch of ``dataset_fn``'s pipeline 0."""
    strategy = _check_strategy(model, strategy)
    if run_steps is None:
        if not callable(dataset_fn):
            raise TypeError(
                "without run=, the second argument must be a callable dataset_fn(input_context) -> tf.data.Dataset "
                f"(as strategy.distribute_datasets_from_function expects), got {dataset_fn!r} "
                f"({type(dataset_fn).__name__}); to train on arrays, pass run=keras_noisecurve.PrivateRun(...)."
            )
        if fingerprint is not None:
            fingerprint = _check_int64("fingerprint", fingerprint)
    if verbose not in (0, 1, 2) or isinstance(verbose, bool):
        raise ValueError(f"verbose must be 0, 1 or 2, got {verbose!r}.")
    if not isinstance(skip_done_steps, bool):
        raise TypeError(f"skip_done_steps must be a bool, got {skip_done_steps!r} ({type(skip_done_steps).__name__}).")
    if callbacks is not None and not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"callbacks must be a list of keras.callbacks.Callback or None, got {callbacks!r}.")

    optimizer = model.optimizer
    start = {"step": 0}  # the step the dataset starts at (set after on_train_begin)

    def per_worker(input_context):
        dataset = dataset_fn(input_context)
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(f"dataset_fn must return a tf.data.Dataset, got {dataset!r} ({type(dataset).__name__}).")
        if skip_done_steps and start["step"]:
            # one element per local replica and step
            local = input_context.num_replicas_in_sync // input_context.num_input_pipelines
            dataset = dataset.skip(start["step"] * local)
        return dataset

    if _needs_build(model):  # from the spec of the dataset (before any restore: no skip)
        _build(model, strategy, strategy.distribute_datasets_from_function(per_worker).element_spec)

    spe = int(getattr(model, "steps_per_execution", 1) or 1)
    callback_list = keras.callbacks.CallbackList(
        list(callbacks or []) + model._dp_step_callbacks(),  # as fit: the non-finite count's warning, refusals
        add_history=True,
        add_progbar=verbose != 0 and is_chief(strategy),
        model=model,
        verbose=verbose,
        epochs=1,
        steps=steps,
    )
    model.stop_training = False
    callback_list.on_train_begin()
    first = int(keras.ops.convert_to_numpy(optimizer.iterations))
    start["step"] = first
    if steps is None:  # to the end of the plan, from the (maybe restored) step
        steps = max(0, plan_steps - first)
        callback_list.set_params({**callback_list.params, "steps": steps})
    elif run_steps is not None and first + steps > run_steps:
        raise ValueError(
            f"steps={steps} from step {first} goes past the run's plan of T = {run_steps} steps: at most "
            f"{max(0, run_steps - first)} steps are left (leave steps=None to run them all)."
        )
    plan = {
        "the optimizer (its public configuration)": _optimizer_fingerprint(optimizer),
        "the trainable variables (shapes)": _hash64([list(v.shape) for v in model.trainable_variables]),
        "the start step (optimizer.iterations)": first,
        "steps": steps,
    }
    if fingerprint is not None:
        plan["the run plan (fingerprint)"] = fingerprint
    if data_fingerprint is not None:
        plan[_DATA] = _check_int64("data_fingerprint", data_fingerprint)
    _assert_same(strategy, plan, advice={_DATA: _DATA_ADVICE})
    if probe_rows is None:  # a dataset_fn: the first batch of its pipeline 0
        probe_rows = functools.partial(_first_batch, dataset_fn)
    batch = probe_rows()
    if batch is not None:  # examples apart in training mode, no state from the data (before any step)
        model._dp_probe(*batch)

    iterator = iter(strategy.distribute_datasets_from_function(per_worker))
    any_worker = _any_worker(strategy) if strategy.num_replicas_in_sync > 1 else bool
    model.reset_metrics()
    callback_list.on_epoch_begin(0)
    logs, done = {}, 0
    while done < steps:
        n = min(spe, steps - done)
        callback_list.on_train_batch_begin(done)
        try:
            logs = _floats(_train_function(model, strategy, n)(iterator))
            # the epoch's dropped examples (train_step's counter; the replicas all-reduce the count)
            logs[features.METRIC] = float(features.epoch_count(model._dp_nonfinite))
        except tf.errors.OutOfRangeError as error:
            raise ValueError(
                f"the dataset of dataset_fn ran out after fewer than {first + done + n} steps (started at step "
                f"{first}, {steps} steps asked): it must yield a batch for every step of the plan, one per local "
                "replica and step."
            ) from error
        done += n
        callback_list.on_train_batch_end(done - 1, logs)
        if any_worker(model.stop_training):
            model.stop_training = True
            break
    callback_list.on_epoch_end(0, logs)
    callback_list.on_train_end(logs)
    return model.history
