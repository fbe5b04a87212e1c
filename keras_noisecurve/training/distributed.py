"""``fit_distributed``: private training under a ``tf.distribute`` strategy, several machines
included, without ``model.fit`` (Keras 3's ``fit`` fails under
``MultiWorkerMirroredStrategy``, keras-team/keras#20585).

This module checks what the caller gives (the private model, its ``NoiseCurveOptimizer``, the
run and its batches); the loop itself is the TensorFlow backend's
(``keras_noisecurve.backend.tensorflow.distributed``, where the module docstring says what
every worker must agree on and how it does). On JAX, ``model.fit`` itself runs over several
processes (docs/distributed.md).
"""

from __future__ import annotations

from keras_noisecurve import backend as _backend
from keras_noisecurve._validation import check_int
from keras_noisecurve.training import log_guard, plan_guard
from keras_noisecurve.training.dp_model import PrivateModel
from keras_noisecurve.training.optimizer import NoiseCurveOptimizer

__all__ = ["assert_same_on_all_workers", "fit_distributed", "is_chief", "worker_checkpoint_dir"]

#: the helpers of a multi-worker run, the TensorFlow backend's (``tf.distribute``)
_STRATEGY_HELPERS = ("assert_same_on_all_workers", "is_chief", "worker_checkpoint_dir")


def __getattr__(name):
    if name in _STRATEGY_HELPERS:  # a backend without tf.distribute refuses them there, saying why
        return getattr(_backend.module("distributed"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_model(model):
    if not isinstance(model, PrivateModel):
        raise TypeError(
            "model must be a private model (keras_noisecurve.make_private(model)) compiled with a "
            f"NoiseCurveOptimizer; got {model!r} ({type(model).__name__})."
        )
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, NoiseCurveOptimizer):
        raise ValueError(
            f"model {model.name!r} is not compiled with a NoiseCurveOptimizer (optimizer={optimizer!r}): call "
            "model.compile(optimizer=keras_noisecurve.NoiseCurveOptimizer(...), loss=...) under strategy.scope() first."
        )


def _run_dataset_fn(model, run, x, y, sample_weight, example_fn, skip_done_steps, fingerprint):
    """``(dataset_fn, data)`` of a ``PrivateRun``: ``input_context ->
    run.dataset(...).batches(model.optimizer, input_context=input_context)``, and the
    ``RunData``, whose examples' fingerprint in their order (``data.source.fingerprint()``)
    the workers compare and whose first examples the batch probe runs on."""
    from keras_noisecurve.privacy.run import PrivateRun
    from keras_noisecurve.privacy.run_data import check_optimizer

    if not isinstance(run, PrivateRun):
        raise TypeError(f"run must be a keras_noisecurve.PrivateRun or None, got {run!r} ({type(run).__name__}).")
    if skip_done_steps is not None:
        raise ValueError(
            f"skip_done_steps={skip_done_steps!r} does not apply with run=: run.dataset starts at the optimizer's "
            "step by itself."
        )
    if fingerprint is not None:
        raise ValueError(f"fingerprint={fingerprint!r} does not apply with run=: run.fingerprint() is compared.")
    check_optimizer(run, model.optimizer)  # refuses an optimizer made without the run or for another plan
    data = run.dataset(x, y, sample_weight=sample_weight, example_fn=example_fn)

    def dataset_fn(input_context):
        return data.batches(model.optimizer, input_context=input_context)

    return dataset_fn, data


def fit_distributed(
    model,
    data,
    y=None,
    *,
    run=None,
    sample_weight=None,
    example_fn=None,
    steps=None,
    strategy=None,
    callbacks=None,
    verbose=1,
    skip_done_steps=None,
    fingerprint=None,
):
    """Train ``model`` for ``steps`` optimizer steps under ``strategy``, without ``model.fit``.

    Works under ``MultiWorkerMirroredStrategy`` (where Keras 3's ``fit`` fails,
    keras-team/keras#20585), ``MirroredStrategy`` and without a strategy. Every worker
    runs the same call; one step is ``strategy.run(model.train_step, (batch,))`` on
    every replica: each replica clips its share of the global batch, the optimizer
    SUM-all-reduces the clipped sums and adds the noise once, so all replicas take
    the same step. TensorFlow backend only (on JAX, ``fit`` runs over several processes).

    Two ways to give the data:

    - ``fit_distributed(model, x, y, run=run)``: the batches of a ``PrivateRun``,
      ``run.dataset(x, y, sample_weight=..., example_fn=...).batches(optimizer,
      input_context=ctx)`` on every worker (its share of each global batch). The model's optimizer must be
      the run's (``NoiseCurveOptimizer(run=run, ...)``); the dataset starts at the
      optimizer's step by itself, ``steps`` defaults to the plan's remaining steps
      T − ``iterations``, and ``run.fingerprint()`` and a fingerprint of the examples in
      their order (``run.dataset(x, y).source.fingerprint()``: x, y and the sample weights)
      are compared across workers: every worker must hold the same arrays in the same order
      (load them deterministically, shuffle with a fixed seed or not at all; the run's
      sampling does the shuffling).
    - ``fit_distributed(model, dataset_fn)``: ``dataset_fn(input_context) ->
      tf.data.Dataset``, as ``strategy.distribute_datasets_from_function`` expects:
      this worker's share of every global batch, as per-replica batches, one per
      local replica and step (``input_context.input_pipeline_id`` is the worker,
      ``input_context.get_per_replica_batch_size(P)`` the per-replica size of a
      global batch of P rows). Element t is the batch of step t of the plan (counted
      from 0), e.g. ``(x, y, mask)`` rows of ``banded_poisson_dataset``. Here the
      workers' data are NOT compared (each worker's dataset is its own, with no source
      to fingerprint): only the optimizer's configuration, the variables' shapes, the
      start step, ``steps`` and the optional ``fingerprint``. Every worker's
      ``dataset_fn`` must cut its rows from the same global batches.

    Args:
      model: a private model (``make_private(...)``) created and compiled
        with a ``NoiseCurveOptimizer`` inside ``strategy.scope()``. It is built here (from the
        batch spec, as ``fit`` does) if it is not yet.
      data: the examples x (with ``run``), else ``dataset_fn``.
      y, sample_weight, example_fn: with ``run`` only, as ``PrivateRun.dataset``.
      run: a ``keras_noisecurve.PrivateRun``, or ``None``.
      steps: the number of optimizer steps to run (≥ 0), from the optimizer's
        ``iterations`` at the start of training (read after the callbacks'
        ``on_train_begin``, so a restoring callback counts); ``None`` (default): to
        the end of the plan, T − ``iterations``, with T = ``run.steps``, else the
        optimizer's ``mixing.steps`` (required for ``mixing="dpsgd"``, which has no
        plan). With a restoring callback (``BackupAndRestore``) leave it ``None``.
      strategy: the ``tf.distribute.Strategy`` (default: the model's).
      callbacks: a list of ``keras.callbacks.Callback`` (``PrivacyBudget``,
        ``BackupAndRestore`` with ``worker_checkpoint_dir``, …), called as by
        ``fit`` with one epoch: ``on_train_begin/end``, ``on_epoch_begin/end(0)``,
        ``on_train_batch_begin/end(i, logs)`` with i counted from 0 in this call.
      verbose: 0 (silent), 1 (progress bar) or 2 (one line at the end); only the
        chief prints.
      skip_done_steps: for ``dataset_fn`` only. ``True`` (default): the dataset
        starts at step 0 of the plan and the ``optimizer.iterations`` batches
        already used are skipped (``.skip``), so a resumed run uses batch t at step
        t. ``False``: the dataset starts at the current step.
      fingerprint: for ``dataset_fn`` only: an optional int64 fingerprint of the run
        plan, compared across workers with the rest (with ``run``: ``run.fingerprint()``).

    Returns:
      the ``keras.callbacks.History``: one entry per metric (e.g. ``loss``), the
      epoch's value over the steps of this call, synchronised over all replicas, and
      ``nonfinite_examples``, as in ``fit``: the number of real examples dropped in this
      call because their loss or gradient was not finite (counted over the whole global
      batch of every step). As ``fit`` does, a call that dropped examples warns once
      (``RuntimeWarning``, naming the steps), and a step refused under XLA or a float16
      loss scale raises a ``RuntimeError`` right after it.

    Raises:
      RuntimeError: on a backend other than TensorFlow.
      ValueError: on every worker, before the first step, when the workers' plans
        differ (optimizer configuration, variable shapes, start step, ``steps``, run
        plan fingerprint) or, with ``run``, their examples or the examples' order;
        ``steps`` beyond the run's plan; when the dataset runs out before ``steps`` steps;
        a callback steered by a training log (``ReduceLROnPlateau(monitor="loss")``, ...);
        after the workers agreed, a model whose examples reach one another in training
        mode or that writes state from the data (the batch probe, on the run's first
        examples or the first batch of ``dataset_fn``, as ``fit`` does).
    """
    loop = _backend.module("distributed")
    loop.check_supported()  # RuntimeError on a backend without tf.distribute
    _check_model(model)
    if isinstance(callbacks, (list, tuple)):
        log_guard.check_callbacks(callbacks)  # none may steer the run by a training log
    log_guard.say_private_logs(model)
    rows = None  # the batch probe's examples (None: the first batch of dataset_fn)
    if run is not None:
        dataset_fn, examples = _run_dataset_fn(model, run, data, y, sample_weight, example_fn,
                                               skip_done_steps, fingerprint)
        data_fingerprint, rows = examples.source.fingerprint(), plan_guard.probe_rows(source=examples.source)
        fingerprint, skip_done_steps = run.fingerprint(), False  # run.dataset starts at the optimizer's step
    else:
        for name, value in (("y", y), ("sample_weight", sample_weight), ("example_fn", example_fn)):
            if value is not None:
                raise ValueError(
                    f"{name}= is for fit_distributed(model, x, y, run=run); without run= the second argument is "
                    f"dataset_fn(input_context) and its dataset carries the labels and weights (got {name}={value!r})."
                )
        dataset_fn, data_fingerprint = data, None  # the workers' datasets are theirs: nothing to fingerprint
        skip_done_steps = True if skip_done_steps is None else skip_done_steps
    plan_steps = run.steps if run is not None else model.optimizer.noise.steps
    if steps is not None:
        steps = check_int("steps", steps, minimum=0)
    elif plan_steps is None:
        raise ValueError(
            "steps=None runs to the end of the optimizer's privacy plan, but its mixing is 'dpsgd' (C = I without "
            "a step plan): pass steps=<number of steps>, or use mixing=MixingMatrix.identity(T)."
        )
    return loop.train(
        model, dataset_fn, run_steps=None if run is None else run.steps, plan_steps=plan_steps, steps=steps,
        strategy=strategy, callbacks=callbacks, verbose=verbose, skip_done_steps=skip_done_steps,
        fingerprint=fingerprint, data_fingerprint=data_fingerprint, probe_rows=rows,
    )
