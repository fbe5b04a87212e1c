"""Two CPU devices under ``keras.distribution.DataParallel``: the private step sums the
clipped gradients over both halves of the batch and adds ONE noise draw, identical on
both devices, so the weights after a few noisy steps equal those of the same steps on
one device (to float32 rounding of the cross-device sum); a run's batch of P = 15 rows is
padded to a multiple of the devices (a masked row) and ends the same."""

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import json, sys
import numpy as np
import keras, jax
import keras_noisecurve as knc
if sys.argv[1] == "2":
    assert len(jax.devices()) == 2, jax.devices()
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh", use_bias=False),
                          keras.layers.Dense(1, use_bias=False)])
private = knc.make_private(model)
private.compile(optimizer=knc.NoiseCurveOptimizer(learning_rate=0.1, noise_multiplier=1.0, l2_norm_clip=0.5,
                                                  expected_batch_size=8, seed=3), loss="mse")
rng = np.random.default_rng(1)
x = rng.normal(size=(8, 4)).astype("float32"); y = x[:, :1].copy()
for _ in range(3):
    private.train_on_batch(x, y)
out = [[np.asarray(w, np.float64).tolist() for w in model.get_weights()]]
# a PrivateRun of 15 examples: P = 15 rows, padded (mask 0) to 16 over the two devices
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh", use_bias=False),
                          keras.layers.Dense(1, use_bias=False)])
run = knc.PrivateRun(num_examples=15, batch_size=8, steps=3, noise_multiplier=1.0, delta=1e-5, seed=7)
private = knc.make_private(model)
private.compile(optimizer=knc.NoiseCurveOptimizer(run=run, learning_rate=0.1, l2_norm_clip=0.5, seed=3), loss="mse")
x = rng.normal(size=(15, 4)).astype("float32")
private.fit(run.dataset(x, x[:, :1].copy()), verbose=0)
out.append([np.asarray(w, np.float64).tolist() for w in model.get_weights()])
print(json.dumps(out))
"""


def _run(devices):
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=ROOT,
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(devices)], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return [[np.array(w) for w in ws] for ws in json.loads(out.stdout.strip().splitlines()[-1])]


def test_data_parallel_on_two_devices_adds_the_same_single_noise_draw():
    """train_on_batch on a batch of 8, and fit(run.dataset) of a run whose P = 15 rows are
    padded to 16 for the two devices: the weights of one device."""
    one, two = _run(1), _run(2)
    for weights_one, weights_two in zip(one, two):
        for a, b in zip(weights_one, weights_two):
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * np.max(np.abs(a)))
