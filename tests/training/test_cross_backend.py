"""The same private run on TensorFlow and on JAX ends with the same weights.

A fixed-seed DP-BandMF run (banded C with b = 2, T = 4 steps, the same initial weights,
the same run key and noise key) trains in this process on TensorFlow and in a subprocess
under ``KERAS_BACKEND=jax``. The batches come from the same numpy sampler, the noise from
the same Philox words (``backend/philox.py``), the clipping from exact per-example
gradients on both sides (ghost norms on TensorFlow, ``vmap`` on JAX), so the final
weights agree to float32 rounding: relative difference ≤ 1e-4 (the noise alone moves the
weights by ~η·ζσ/B ≈ 1e-2 per step, so a wrong noise draw, batch or clip is 100× that).
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import json, sys
import numpy as np
import keras
import keras_noisecurve as knc
from tests.training.helpers import random_banded_c

def run_once():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = (x[:, :1] - 0.5 * x[:, 1:2]).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                              keras.layers.Dense(1)])
    init = np.random.default_rng(1)
    model.set_weights([init.normal(size=w.shape).astype("float32") * 0.5 for w in model.get_weights()])
    mixing = random_banded_c(4, 2, rng=np.random.default_rng(2), diag_scale=2.0)
    run = knc.PrivateRun(num_examples=32, batch_size=8, steps=4, mixing=mixing, noise_multiplier=1.0,
                         delta=1e-5, seed=7)
    private = knc.make_private(model)
    private.compile(optimizer=knc.NoiseCurveOptimizer(run=run, learning_rate=0.1, l2_norm_clip=0.5, seed=5),
                    loss="mse")
    private.fit(run.dataset(x, y), verbose=0)
    return [np.asarray(w, np.float64).tolist() for w in model.get_weights()]

if __name__ == "__main__":
    print(json.dumps(run_once()))
"""


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax installed (pip install -e '.[jax]')")
def test_fixed_seed_bandmf_run_ends_with_the_same_weights_on_tensorflow_and_jax(tmp_path):
    script = tmp_path / "cross_backend_run.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, str(script)], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    jax_weights = [np.array(w) for w in json.loads(out.stdout.strip().splitlines()[-1])]

    namespace = {}
    exec(compile(SCRIPT.replace('if __name__ == "__main__":', "if False:"), "cross_backend", "exec"), namespace)
    tf_weights = [np.array(w) for w in namespace["run_once"]()]
    initial = np.random.default_rng(1)
    moved = False
    for got, want in zip(jax_weights, tf_weights):
        scale = np.max(np.abs(want))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * scale)
        start = initial.normal(size=want.shape) * 0.5
        moved |= np.max(np.abs(want - start)) > 1e-2 * scale
    assert moved  # the run did train
