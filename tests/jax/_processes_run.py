"""Run by tests/jax/test_jax_processes.py: ``python tests/jax/_processes_run.py N RANK PORT``.

N = 1: one process feeding whole batches. N = 2: process RANK of 2 (``jax.distributed.initialize``
on 127.0.0.1:PORT, CPU collectives over gloo, one CPU device each), under
``keras.distribution.DataParallel`` over the 2 global devices (Keras assembles the global
batch from the processes' parts). Prints one JSON line, a result per scenario:

- ``train_on_batch``: three fixed-seed DP-BandMF steps (b = 3), the process feeding rows
  [4·RANK, 4·RANK + 4) of the same batch of 8; the initial and final weights;
- ``run``: ``fit(run.dataset(x, y))`` of a fixed-seed ``PrivateRun`` (15 examples: P = 15,
  padded to 16 under 2 processes; 3 steps), each process serving its block of every step's
  rows; the final weights;
- ``secret``: the same with ``seed=None`` for the run and the noise (the keys are process 0's
  in every process); the final weights;
- ``host_refused`` (N = 2): process 1 claims to stand at step 1: the error ``fit`` raises;
- ``step_refused`` (N = 2): process 1 feeds the rows of step t + 1 at step t: the error.
"""

import json
import sys

import jax

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
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh", use_bias=False),
                             keras.layers.Dense(1, use_bias=False)])


def _weights(model):
    return [np.asarray(w, np.float64).tolist() for w in model.get_weights()]


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


def _fit(seed, patch=None):
    model = _model()
    run = knc.PrivateRun(num_examples=15, batch_size=8, steps=3, noise_multiplier=1.0, delta=1e-5, seed=seed)
    private = knc.make_private(model)
    optimizer = knc.NoiseCurveOptimizer(run=run, learning_rate=0.1, l2_norm_clip=0.5, seed=seed)
    private.compile(optimizer=optimizer, loss="mse")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(15, 4)).astype("float32")  # P = 15: padded to 16, 8 rows per process
    if patch is not None and rank == 1:
        patch(optimizer)
    try:
        private.fit(run.dataset(x, x[:, :1].copy()), verbose=0)
    except (ValueError, RuntimeError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    return {"final": _weights(model)}


def _claims_step_one(optimizer):
    optimizer.sampling_position = lambda: (1, optimizer.run.initial_key())


def _feeds_the_next_step(optimizer):
    shifted = step_batches.StepBatches.__getitem__
    step_batches.StepBatches.__getitem__ = lambda self, i: (*shifted(self, i)[:3], shifted(self, i)[3] + 1)


results = {"train_on_batch": train_on_batch(), "run": _fit(7), "secret": _fit(None)}
if nproc > 1:
    results["host_refused"] = _fit(7, _claims_step_one)
    results["step_refused"] = _fit(7, _feeds_the_next_step)
print(json.dumps(results))
