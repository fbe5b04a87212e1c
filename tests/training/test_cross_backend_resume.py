"""A ``.keras`` file saved halfway through a private run on one backend finishes the run on the
other with the same final weights as an uninterrupted run (float32 rounding), both ways.

The run: DP-BandMF (a banded C with b = 3, T = 6 steps of B = 8), momentum SGD as the inner
optimizer (its slots travel too), fixed initial weights, the run's and the optimizer's seeds.
TensorFlow runs in this process, JAX in subprocesses (``KERAS_BACKEND`` is chosen once per
process). What must survive the change of backend: the plan position (``iterations``), the
noise key and the sampling key (int64 (2,) on TensorFlow, the same bits as int32 (4,) words on
JAX), the noise state (the ring of past draws) and the inner optimizer's momentum. Each loaded
model is loaded in a fresh process that imports ``keras`` and ``keras_noisecurve`` only.
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r'''
import json, sys
import numpy as np
import keras
import keras_noisecurve as knc
from tests.training.helpers import random_banded_c

STEPS, HALF = 6, 3


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    return x, (x[:, :1] - 0.5 * x[:, 1:2]).astype("float32")


def make_run():
    mixing = random_banded_c(STEPS, 3, rng=np.random.default_rng(2), diag_scale=2.0)
    return knc.PrivateRun(num_examples=32, batch_size=8, steps=STEPS, mixing=mixing, noise_multiplier=1.0,
                          delta=1e-5, seed=7)


def fresh():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    init = np.random.default_rng(1)
    model.set_weights([init.normal(size=w.shape).astype("float32") * 0.5 for w in model.get_weights()])
    private = knc.make_private(model)
    private.compile(optimizer=knc.NoiseCurveOptimizer(run=make_run(), l2_norm_clip=0.5, seed=5,
                                                      inner=keras.optimizers.SGD(0.1, momentum=0.9)),
                    loss="mse")
    return private


def key_ints(variable):  # the noise key as int64 (2,) whatever the backend's layout
    value = np.ascontiguousarray(np.asarray(keras.ops.convert_to_numpy(variable.value)))
    return value.astype(np.int32).view(np.int64).tolist() if value.shape == (4,) else value.astype(np.int64).tolist()


def main(mode, path):
    x, y = data()
    if mode == "full":
        private = fresh()
        private.fit(make_run().dataset(x, y), verbose=0)
    elif mode == "first":
        private = fresh()
        private.fit(make_run().dataset(x, y), epochs=1, steps_per_epoch=HALF, verbose=0)
        private.save(path)
    else:  # "second": load (a fresh process) and finish the plan
        private = keras.models.load_model(path)
        assert int(np.asarray(private.optimizer.iterations.value)) == HALF
        private.fit(make_run().dataset(x, y), verbose=0)
    return {"iterations": int(np.asarray(private.optimizer.iterations.value)),
            "noise_key": key_ints(private.optimizer._noise_key),
            "weights": [np.asarray(w, np.float64).tolist() for w in private.get_weights()]}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
'''


def _run(backend, mode, path, script):
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, str(script), mode, str(path)], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _assert_same(result, reference):
    assert result["iterations"] == reference["iterations"] == 6
    assert result["noise_key"] == reference["noise_key"]
    for a, b in zip(result["weights"], reference["weights"]):
        a, b = np.asarray(a), np.asarray(b)
        assert np.max(np.abs(a - b)) <= 1e-5 * max(1.0, np.max(np.abs(b))), (a, b)


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax installed (pip install -e '.[jax]')")
@pytest.mark.slow
def test_a_run_saved_halfway_on_one_backend_finishes_on_the_other_with_the_same_weights(tmp_path):
    script = tmp_path / "resume_run.py"
    script.write_text(SCRIPT)
    here = {"__name__": "resume_run"}  # this process is TensorFlow's: its runs need no subprocess
    exec(compile(SCRIPT, str(script), "exec"), here)
    reference = here["main"]("full", "-")
    here["main"]("first", str(tmp_path / "tf.keras"))
    _assert_same(_run("jax", "second", tmp_path / "tf.keras", script), reference)
    _run("jax", "first", tmp_path / "jax.keras", script)
    _assert_same(_run("tensorflow", "second", tmp_path / "jax.keras", script), reference)
    # (the uninterrupted JAX run equals the TensorFlow one: tests/training/test_cross_backend.py)
