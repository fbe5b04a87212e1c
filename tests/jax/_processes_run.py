"""Run by tests/jax/test_jax_processes.py: ``python tests/jax/_processes_run.py N RANK PORT DIR``.

N = 1: one process feeding whole batches. N = 2: process RANK of 2 (``jax.distributed.initialize``
on 127.0.0.1:PORT, CPU collectives over gloo, one CPU device each), under
``keras.distribution.DataParallel`` over the 2 global devices (Keras assembles the global
batch from the processes' parts). Prints one JSON line, a result per scenario:

- ``train_on_batch``: three fixed-seed DP-BandMF steps (b = 3), the process feeding rows
  [4·RANK, 4·RANK + 4) of the same batch of 8; the initial and final weights;
- ``run``: ``fit(run.dataset(x, y))`` of a fixed-seed DP-BandMF ``PrivateRun`` (b = 2; 30
  examples: P = 15, padded to 16 under 2 processes; 3 steps), each process serving its
  block of every step's rows; the final weights, the shapes of this process's shards of
  the hidden kernel and of its noise state;
- ``secret``: the same with ``seed=None`` for the run and the noise (the keys are process 0's
  in every process); the final weights;
- ``host_refused`` (N = 2): process 1 claims to stand at step 1: the error ``fit`` raises;
- ``step_refused`` (N = 2): process 1 feeds the rows of step t + 1 at step t: the error;
- ``data_refused`` (N = 2): process 1 holds the examples in another order (x, y permuted, as
  an unseeded shuffle would): the error, the optimizer's step then, and this process's
  fingerprint of its examples;
- ``model_parallel`` (N = 2): ``run`` under ``ModelParallel`` on a 1 × 2 mesh, the kernels
  and their noise states split across the two processes (each feeds the whole batch);
- ``orbax`` (N = 2, orbax-checkpoint installed): the same, checkpointed after 2 steps with
  ``keras.callbacks.OrbaxCheckpoint`` into DIR and finished by a new model restored from it
  (``model.save`` refused first).
"""

import importlib.util
import json
import os
import sys

import jax
from jax.experimental import multihost_utils

nproc, rank, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if nproc > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=rank,
                               initialization_timeout=120)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_noisecurve as knc  # noqa: E402
from keras_noisecurve.privacy import step_batches  # noqa: E402
from tests.training.helpers import random_banded_c  # noqa: E402

assert len(jax.devices()) == nproc and jax.process_count() == nproc, (jax.devices(), jax.process_count())
keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, activation="tanh", use_bias=False, name="hidden"),
                             keras.layers.Dense(1, use_bias=False, name="out")], name="net")  # the same paths each time


def _weights(model):
    """The weights as nested lists (a weight split across processes gathered whole)."""
    return [np.asarray(multihost_utils.process_allgather(v.value, tiled=True), np.float64).tolist()
            for v in model.weights]


def train_on_batch():
    model = _model()
    initial = _weights(model)
    private = knc.make_private(model)
    mixing = random_banded_c(4, 3, rng=np.random.default_rng(0), diag_scale=2.0)
    private.compile(optimizer=knc.NoiseCurveOptimizer(learning_rate=0.1, mixing=mixing, noise_multiplier=1.0,
                                                      l2_norm_clip=0.5, expected_batch_size=8, seed=3), loss="mse")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 4)).astype("float32")
    y = x[:, :1].copy()
    rows = slice(rank * 8 // nproc, (rank + 1) * 8 // nproc)
    for _ in range(3):
        private.train_on_batch(x[rows], y[rows])
    return {"initial": initial, "final": _weights(model)}


def _model_parallel():
    """The 2 devices (one per process) as a 1 × 2 mesh: one model replica, the Dense kernels
    split over ``model`` (across the processes), the batch whole in each process."""
    mesh = keras.distribution.DeviceMesh((1, len(jax.devices())), ("data", "model"), jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*hidden/kernel"] = (None, "model")  # (4, 4): 2 columns per process
    layout_map[".*out/kernel"] = ("model", None)  # (4, 1): 2 rows per process
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")


def _private_run(seed, permuted=False):
    """``(model, private model, run, its data)``: a DP-BandMF run (b = 2) of 3 steps;
    ``permuted``: process 1's examples in another order."""
    model = _model()
    mixing = random_banded_c(3, 2, rng=np.random.default_rng(0), diag_scale=2.0)
    run = knc.PrivateRun(num_examples=30, batch_size=6, steps=3, mixing=mixing, noise_multiplier=1.0, delta=1e-5,
                         seed=seed)
    private = knc.make_private(model)
    private.compile(optimizer=knc.NoiseCurveOptimizer(run=run, learning_rate=0.1, l2_norm_clip=0.5, seed=seed),
                    loss="mse")
    x = np.random.default_rng(1).normal(size=(30, 4)).astype("float32")  # P = 15: padded to 16, 8 rows per process
    if permuted and rank == 1:
        x = x[np.random.default_rng(11).permutation(len(x))]
    return model, private, run, run.dataset(x, x[:, :1].copy())


def _fit(seed, patch=None, distribution=None, permuted=False):
    if distribution is not None:
        keras.distribution.set_distribution(distribution)
    model, private, run, data = _private_run(seed, permuted)
    optimizer = private.optimizer
    original = step_batches.StepBatches.__getitem__
    if patch is not None and rank == 1:
        patch(optimizer)
    try:
        private.fit(data, verbose=0)
    except (ValueError, RuntimeError) as error:
        return {"error": f"{type(error).__name__}: {error}", "step": int(np.asarray(optimizer.iterations.value)),
                "fingerprint": data.source.fingerprint()}
    finally:
        step_batches.StepBatches.__getitem__ = original
    kernel, state = model.layers[0].kernel, optimizer.variables[-2]  # the hidden kernel's noise state (1, 4, 4)
    return {"final": _weights(model), "state": list(state.shape),
            "shards": [sorted({tuple(s.data.shape) for s in v.value.addressable_shards}) for v in (kernel, state)]}


def _orbax(directory):
    """Under ``_model_parallel``: ``model.save`` refused; 2 of the 3 steps checkpointed by
    Keras's ``OrbaxCheckpoint`` (every process writes its shards), a new model restored from
    it with ``load_weights`` finishing the run; the final weights."""
    model, private, run, data = _private_run(7)
    private.fit(data, verbose=0, epochs=1, steps_per_epoch=2,
                callbacks=[keras.callbacks.OrbaxCheckpoint(directory, save_freq=2, save_on_background=False)])
    try:
        private.save(os.path.join(directory, "refused.keras"))
        refused = None
    except ValueError as error:
        refused = str(error)
    model, private, run, data = _private_run(7)
    private.optimizer.build(private.trainable_variables)
    private.load_weights(directory)
    step = int(np.asarray(private.optimizer.iterations.value))
    private.fit(data, verbose=0)
    return {"final": _weights(model), "save_refused": refused, "restored_step": step}


def _claims_step_one(optimizer):
    optimizer.sampling_position = lambda: (1, optimizer.run.initial_key())


def _feeds_the_next_step(optimizer):
    shifted = step_batches.StepBatches.__getitem__
    step_batches.StepBatches.__getitem__ = lambda self, i: (*shifted(self, i)[:3], shifted(self, i)[3] + 1)


results = {"train_on_batch": train_on_batch(), "run": _fit(7), "secret": _fit(None)}
if nproc > 1:
    results["host_refused"] = _fit(7, _claims_step_one)
    results["step_refused"] = _fit(7, _feeds_the_next_step)
    results["data_refused"] = _fit(7, permuted=True)
    results["model_parallel"] = _fit(7, distribution=_model_parallel())
    if importlib.util.find_spec("orbax") is not None:
        results["orbax"] = _orbax(sys.argv[4])
print(json.dumps(results))
