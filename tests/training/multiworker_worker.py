"""One worker of the 2-process MultiWorkerMirroredStrategy tests (tests/training/test_multiworker.py).

Run as ``python -m tests.training.multiworker_worker --task I --ports P0,P1 --out DIR``
(repo root on ``PYTHONPATH``, ``KERAS_BACKEND=tensorflow``, ``CUDA_VISIBLE_DEVICES=""``).
It sets ``TF_CONFIG`` for a cluster of two workers on 127.0.0.1, creates the strategy,
builds the model of :func:`build_model` under its scope and trains it with
``fit_distributed`` on this worker's share of the global batches of :func:`global_batches`
(:func:`shard_fn`), with the fixed seed ``SEED``. It writes ``DIR/worker<I>.npz``: the
final weights (``w0``, ``w1``, …), the noise key (``key``), the step (``iterations``), a
variable created under the scope from this process's own random value (``probe``), and
the logs (``loss``, ``accuracy``). With ``--secret`` it then trains a second model
WITHOUT a seed, checkpointing after 2 steps (``DIR/ckpt``, the chief's), and writes
``DIR/secret<I>.npz``. With ``--run`` it then trains with a ``PrivateRun`` (:func:`private_run`,
:func:`examples`) and no seed at all, and writes ``DIR/run<I>.npz`` (with the sampling
key); with ``--shuffled`` as well, that model is first given worker 1's examples
permuted (x and y, one fixed permutation): ``fit_distributed`` must refuse it on both
workers before the first step; the worker prints the message with its step and trains the
run as above. With ``--refuse`` it then builds a ``PrivateRun`` whose noise multiplier differs
between the workers: the ``ValueError`` of ``fit_distributed`` that refuses it ends
the worker (exit code 1).

One launch runs all the parts: starting a worker (importing TensorFlow) is what
costs time on a small machine.

The test process imports this module for the same data, model and sharding (the
single-process reference).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

STEPS, P, B, FEATURES, CLASSES, BANDS = 4, 8, 6, 5, 3, 2
SEED = 23
N = 24  # examples of the PrivateRun part


def global_batches():
    """The plan's global batches: x (STEPS, P, 5) float32, y (STEPS, P) int64, mask (STEPS, P) float32."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, P, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, (STEPS, P)).astype("int64")
    mask = (rng.random((STEPS, P)) > 0.25).astype("float32")  # padding rows of a Poisson sampler
    return x, y, mask


def examples():
    """The N examples of the ``PrivateRun`` part: x (N, 5) float32, y (N,) int64."""
    import numpy as np

    rng = np.random.default_rng(2)
    return rng.normal(size=(N, FEATURES)).astype("float32"), rng.integers(0, CLASSES, N).astype("int64")


def mixing():
    import numpy as np

    from tests.training.helpers import random_banded_c

    return random_banded_c(STEPS, BANDS, rng=np.random.default_rng(4), diag_scale=0.5)


def private_run(*, seed=None, noise_multiplier=1.0):
    """The ``PrivateRun`` of the run part (``seed=None``: a secret sampling key)."""
    import keras_noisecurve as knc

    return knc.PrivateRun(num_examples=N, batch_size=B, steps=STEPS, mixing=mixing(),
                          noise_multiplier=noise_multiplier, delta=1e-5, seed=seed)


def initial_weights():
    import numpy as np

    rng = np.random.default_rng(1)
    shapes = [(FEATURES, 4), (4,), (4, CLASSES), (CLASSES,)]
    return [(0.5 * rng.normal(size=s)).astype("float32") for s in shapes]


def build_model(*, seed=SEED, noise_multiplier=1.0, run=None):
    """The private model, compiled (call it under ``strategy.scope()``); with ``run``,
    its optimizer is the run's (C, σ and B of the run)."""
    import keras

    import keras_noisecurve as knc

    base = keras.Sequential(
        [keras.Input((FEATURES,)),
         keras.layers.Dense(4, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.05)),
         keras.layers.Dense(CLASSES)]
    )
    base.set_weights(initial_weights())
    model = knc.make_private(base, clipping="vectorized")
    if run is None:
        optimizer = knc.NoiseCurveOptimizer(learning_rate=0.2, mixing=mixing(), l2_norm_clip=0.3,
                                            noise_multiplier=noise_multiplier, expected_batch_size=B, seed=seed)
    else:
        optimizer = knc.NoiseCurveOptimizer(learning_rate=0.2, l2_norm_clip=0.3, seed=seed, run=run)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def shard_fn(x, y, mask):
    """``dataset_fn(input_context)``: this worker's rows of every global batch, cut into
    one batch per local replica and step (global P rows / num_replicas_in_sync each)."""
    import tensorflow as tf

    def dataset_fn(ctx):
        per_replica = ctx.get_per_replica_batch_size(x.shape[1])
        local = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        lo = ctx.input_pipeline_id * local * per_replica
        hi = lo + local * per_replica
        rows = tf.data.Dataset.from_tensor_slices((x[:, lo:hi], y[:, lo:hi], mask[:, lo:hi]))
        return rows.unbatch().batch(per_replica)

    return dataset_fn


def _save(path, model, history, **extra):
    import numpy as np

    arrays = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    arrays["key"] = model.optimizer._noise_key.numpy()
    arrays["iterations"] = np.asarray(int(model.optimizer.iterations.numpy()))
    for name, values in history.history.items():
        arrays[name] = np.asarray(values)
    np.savez(path, **arrays, **extra)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", type=int, required=True)
    parser.add_argument("--ports", required=True, help="P0,P1: the two workers' ports on 127.0.0.1")
    parser.add_argument("--out", required=True)
    parser.add_argument("--secret", action="store_true",
                        help="then also train a model without a seed (secret key), saving a checkpoint after "
                             "2 steps (the chief's in OUT/ckpt)")
    parser.add_argument("--run", action="store_true",
                        help="then train with a PrivateRun and no seed at all (secret sampling and noise keys)")
    parser.add_argument("--shuffled", action="store_true",
                        help="with --run: first give the run's model worker 1's examples in another order: both "
                             "workers must refuse it before the first step (printed), then train the run")
    parser.add_argument("--refuse", action="store_true",
                        help="last, train with a PrivateRun whose noise multiplier is 1 + task: fit_distributed "
                             "must refuse it (the worker exits with the ValueError)")
    args = parser.parse_args(argv)
    ports = args.ports.split(",")
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": args.task}}
    )
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")

    import numpy as np
    import tensorflow as tf

    from keras_noisecurve.training.distributed import fit_distributed, worker_checkpoint_dir

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build_model(seed=SEED)
        # a per-process random initial value: the chief's is broadcast to every worker
        probe = tf.Variable(np.random.default_rng().integers(0, 2**62, size=2), dtype=tf.int64)
    dataset_fn = shard_fn(*global_batches())
    history = fit_distributed(model, dataset_fn, steps=STEPS, strategy=strategy, verbose=1)
    _save(os.path.join(args.out, f"worker{args.task}.npz"), model, history, probe=probe.numpy())

    if args.secret:
        with strategy.scope():
            model = build_model(seed=None)  # each process draws a key; the chief's is broadcast
        fit_distributed(model, dataset_fn, steps=2, strategy=strategy, verbose=0)
        checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        chief_dir = os.path.join(args.out, "ckpt")
        directory = worker_checkpoint_dir(chief_dir, strategy)
        tf.train.CheckpointManager(checkpoint, directory, max_to_keep=1).save()  # every worker saves
        if directory != chief_dir:
            tf.io.gfile.rmtree(directory)  # only the chief's copy is kept
        history = fit_distributed(model, dataset_fn, strategy=strategy, verbose=0)  # to the end of the plan
        _save(os.path.join(args.out, f"secret{args.task}.npz"), model, history)
    print(f"worker {args.task}: trained", flush=True)

    if args.run:
        run = private_run()  # each process draws a sampling key; the chief's is broadcast
        with strategy.scope():
            model = build_model(seed=None, run=run)
        if args.shuffled:  # first the same examples in another order on worker 1 (as an unseeded shuffle)
            x, y = examples()
            if args.task == 1:
                order = np.random.default_rng(11).permutation(N)
                x, y = x[order], y[order]
            try:
                fit_distributed(model, x, y, run=run, strategy=strategy, verbose=0)
                print(f"worker {args.task}: shuffled data NOT refused", flush=True)
            except ValueError as error:
                step = int(model.optimizer.iterations.numpy())
                print(f"worker {args.task}: refused the shuffled data at step {step}: {error}", flush=True)
        history = fit_distributed(model, *examples(), run=run, strategy=strategy, verbose=0)
        _save(os.path.join(args.out, f"run{args.task}.npz"), model, history,
              sampling_key=model.optimizer.sampling_key.numpy(), run_key=run.initial_key())
        print(f"worker {args.task}: trained the run", flush=True)

    if args.refuse:
        run = private_run(noise_multiplier=1.0 + args.task)  # another plan on every worker
        with strategy.scope():
            model = build_model(run=run)
        fit_distributed(model, *examples(), run=run, strategy=strategy, verbose=0)  # raises
        print(f"worker {args.task}: NOT refused", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
