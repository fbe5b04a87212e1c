"""The install without a backend and the JAX install without TensorFlow: ``missing_backend``
names the extras, and a process in which TensorFlow cannot be imported (an import hook
raising ``ModuleNotFoundError`` for it, as in an environment where it is not installed)
gets that message from the training API and ``noisecurve demo`` under Keras's default
backend, and trains under ``KERAS_BACKEND=jax`` (``apps.layers`` included). CI's JAX-install
stage checks the same in a real virtual environment without TensorFlow."""

import os
import subprocess
import sys

import pytest

from keras_noisecurve.backend import missing_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NO_TENSORFLOW = r"""
import importlib.abc, sys
class _NoTensorFlow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("tensorflow", "tf_keras", "tensorflow_privacy", "tensorflow_datasets"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoTensorFlow())
"""


@pytest.mark.parametrize("name", ["tensorflow", "tensorflow.python.trackable", "jax"])
def test_a_missing_backend_is_named_with_the_extras_to_install(name):
    better = missing_backend(ModuleNotFoundError(f"No module named {name!r}", name=name))
    assert isinstance(better, ImportError)
    assert f"Keras's backend {name.split('.')[0]!r} is not installed" in str(better)
    assert 'pip install "keras-noisecurve[tensorflow]"' in str(better)
    assert 'pip install "keras-noisecurve[jax]" and set KERAS_BACKEND=jax' in str(better)


@pytest.mark.parametrize("error", [ModuleNotFoundError("No module named 'foo'", name="foo"), ImportError("other")])
def test_other_import_errors_are_left_alone(error):
    assert missing_backend(error) is None


def _run(code, backend):
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    if backend is not None:
        env["KERAS_BACKEND"] = backend
    env["PYTHONPATH"] = ROOT
    return subprocess.run([sys.executable, "-c", NO_TENSORFLOW + code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_without_tensorflow_the_default_backend_names_the_extras():
    out = _run("""
import keras_noisecurve as knc
try:
    knc.make_private
except ImportError as error:
    print("training:", error)
from keras_noisecurve.apps import cli
try:
    cli.main(["demo", "--quick"])
except SystemExit as exit:
    print("demo:", exit)
""", backend=None)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "training: Keras's backend 'tensorflow' is not installed" in out.stdout
    assert "demo: error: Keras's backend 'tensorflow' is not installed" in out.stdout


def test_without_tensorflow_the_jax_backend_trains_and_imports_the_apps_layers():
    out = _run("""
import numpy as np, keras
import keras_noisecurve as knc
from keras_noisecurve.apps import layers, models
model = knc.make_private(keras.Sequential([keras.Input((4,)), layers.GroupNorm(groups=1), keras.layers.Dense(1)]))
model.compile(optimizer=knc.NoiseCurveOptimizer(learning_rate=0.1, noise_multiplier=1.0, l2_norm_clip=1.0,
                                                expected_batch_size=4, seed=0), loss="mse")
model.train_on_batch(np.ones((4, 4), "float32"), np.ones((4, 1), "float32"))
print("trained", "tensorflow" in sys.modules)
""", backend="jax")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained False" in out.stdout
