"""Quiet in Python: building an optimizer prints no CUDA start-up lines (the device
probe of its first variable runs with TensorFlow's start-up notices held back). On a
machine whose TensorFlow prints none anyway, this test cannot fail.

The child runs with ``jax`` made unimportable: where jaxlib is installed beside
TensorFlow (the dev extra brings both), Keras imports it, and TensorFlow's device probe
then makes jaxlib's own copy of XLA log "failed call to cuInit" through a stream the
redirection does not reach (docs/backends.md, "Installing"). What this test measures is
the library's own start-up on a TensorFlow-only install."""

import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CODE = """
import sys
import keras
print("MARKER", file=sys.stderr, flush=True)
import keras_noisecurve as knc
opt = knc.NoiseCurveOptimizer(learning_rate=0.1, noise_multiplier=1.0, expected_batch_size=4)
opt.build([keras.Variable([0.0, 1.0])])
print("DONE", file=sys.stderr, flush=True)
"""


def test_building_an_optimizer_prints_no_cuda_lines():
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    blocked = tempfile.mkdtemp()
    os.makedirs(os.path.join(blocked, "jax"))
    with open(os.path.join(blocked, "jax", "__init__.py"), "w") as f:
        f.write("raise ImportError('jax is hidden from this test')\n")
    env.update(PYTHONPATH=os.pathsep.join([blocked, ROOT]), KERAS_BACKEND="tensorflow")
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    after = proc.stderr.split("MARKER", 1)[1]
    assert "DONE" in after
    assert "cuInit" not in after and "cuda" not in after.lower(), after
