"""Run by tests/jax/test_jax_processes.py: ``python tests/jax/_processes_run.py N RANK PORT``.

N = 1: one process, the whole batch of 8. N = 2: process RANK of 2 (``jax.distributed.initialize``
on 127.0.0.1:PORT, CPU collectives over gloo, one CPU device each), under
``keras.distribution.DataParallel`` over the 2 global devices, feeding rows
[4·RANK, 4·RANK + 4) of the same batch (Keras assembles the global batch from the processes'
parts). Three fixed-seed DP-BandMF steps (b = 3); prints the initial and final weights as JSON.
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
from tests.training.helpers import random_banded_c  # noqa: E402

assert len(jax.devices()) == nproc and jax.process_count() == nproc, (jax.devices(), jax.process_count())
keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh", use_bias=False),
                          keras.layers.Dense(1, use_bias=False)])
initial = [np.asarray(w, np.float64).tolist() for w in model.get_weights()]
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
final = [np.asarray(w, np.float64).tolist() for w in model.get_weights()]
print(json.dumps({"initial": initial, "final": final}))
