"""Two CPU devices under ``keras.distribution.DataParallel``: the private step sums the
clipped gradients over both halves of the batch and adds ONE noise draw, identical on
both devices, so the weights after a few noisy steps equal those of the same steps on
one device (to float32 rounding of the cross-device sum)."""

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
print(json.dumps([np.asarray(w, np.float64).tolist() for w in model.get_weights()]))
"""


def _run(devices):
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=ROOT,
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(devices)], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return [np.array(w) for w in json.loads(out.stdout.strip().splitlines()[-1])]


def test_data_parallel_on_two_devices_adds_the_same_single_noise_draw():
    one, two = _run(1), _run(2)
    for a, b in zip(one, two):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * np.max(np.abs(a)))
