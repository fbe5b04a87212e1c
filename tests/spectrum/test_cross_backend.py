"""The spectrum on TensorFlow (this process) and on JAX (a subprocess with
``KERAS_BACKEND=jax``) for the same weights and data, exchanged through an .npz file.

In the subprocess: Hessian-vector products equal the exact Hessian (``jax.hessian`` of
the loss of the flattened parameters, written out in jnp) times v, ``estimate_spectrum``
runs with TensorFlow unimportable. Here: the top eigenvalues from Lanczos (after the
same random-label-free pre-training on both backends) and all eigenvalues of a
GroupNormalization CNN (dense Hessian, the moments pitfall patched on TensorFlow, absent
on JAX) agree with the subprocess's: the MLP's to the Lanczos tolerance (1e-8 relative
residuals), the CNN's to 1e-6 (see the comment there).

The models use sigmoid, not tanh: Keras 3.15's JAX ``ops.tanh`` computes in float32 even
for float64 inputs (its ``result_type(float64, float)`` is float32), which would cap the
agreement at ≈1e-7."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

BUILD = '''
import keras

def mlp():
    inp = keras.Input((6,), dtype="float64")
    h = keras.layers.Dense(16, activation="sigmoid", dtype="float64")(inp)
    h = keras.layers.Dense(8, activation="sigmoid", dtype="float64")(h)
    return keras.Model(inp, keras.layers.Dense(3, dtype="float64")(h))

def groupnorm_cnn():
    inp = keras.Input((5, 5, 2), dtype="float64")
    h = keras.layers.Conv2D(4, 3, padding="same", dtype="float64")(inp)
    h = keras.layers.GroupNormalization(groups=2, dtype="float64")(h)
    h = keras.layers.Activation("sigmoid", dtype="float64")(h)
    h = keras.layers.GlobalAveragePooling2D(dtype="float64")(h)
    return keras.Model(inp, keras.layers.Dense(3, dtype="float64")(h))

def load(model, data, prefix):
    model.set_weights([data[f"{prefix}{i}"] for i in range(len(model.weights))])
    return model
'''

SPECTRA = '''
from keras_noisecurve import estimate_spectrum
from keras_noisecurve.spectrum.hvp import HessianOperator

def spectra(data):
    # pretrain_learning_rate 0.25, exact in float32: Keras's SGD on TensorFlow keeps its
    # learning rate in a float32 variable, the JAX step in float64 (0.3 would differ by 4e-8).
    net = load(mlp(), data, "mlp")
    top = estimate_spectrum(net, data["x"], data["y"], loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                            pretrain_epochs=2, pretrain_batch_size=16, pretrain_learning_rate=0.25, method="lanczos",
                            top_k=8, batch_size=24, seed=3)
    cnn = load(groupnorm_cnn(), data, "cnn")
    full = estimate_spectrum(cnn, data["xc"], data["y"], pretrain_epochs=0, method="exact", batch_size=24)
    return top, full

def every(spectrum):
    """All p eigenvalues, descending (Spectrum merges equal values, e.g. the clamped zeros)."""
    import numpy as np
    return np.repeat(spectrum.eigenvalues, np.round(spectrum.multiplicities).astype(int))
'''

# TensorFlow is made unimportable in the child, as on a machine without it (the GPU
# machines): any import of it by this library fails the run. (Keras itself probes for
# TensorFlow when it serialises a layer, e.g. in clone_model for the pre-training; with
# TensorFlow absent the probe answers False.)
CHILD = '''
import sys
sys.modules["tensorflow"] = None
''' + BUILD + SPECTRA + '''
import jax
import jax.numpy as jnp
import numpy as np

data = np.load(sys.argv[1])
net = load(mlp(), data, "mlp")
x, y = data["x"], data["y"]
op = HessianOperator(net, x, y, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), batch_size=24)
shapes = [tuple(v.shape) for v in net.trainable_variables]

def mean_loss(flat):
    parts, offset = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        parts.append(flat[offset:offset + size].reshape(shape))
        offset += size
    logits, _ = net.stateless_call(parts, [], jnp.asarray(x), training=False)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(y)[:, None], axis=1))

H = np.asarray(jax.hessian(mean_loss)(jnp.asarray(op.flat_weights())))
v = np.random.default_rng(0).normal(size=op.dimension)
hvp_error = float(np.linalg.norm(op.matvec(v) - H @ v) / np.linalg.norm(H @ v))
top, full = spectra(data)
np.savez(sys.argv[2], top=top.eigenvalues, converged=top.metadata["converged"], full=every(full),
         hvp_error=hvp_error, x64=bool(jax.config.jax_enable_x64), backend=keras.backend.backend())
'''


def _data(path):
    import keras

    namespace = {}
    exec(BUILD, namespace)
    rng = np.random.default_rng(0)
    arrays = {"x": rng.normal(size=(70, 6)), "xc": rng.normal(size=(70, 5, 5, 2)), "y": rng.integers(0, 3, size=70)}
    for prefix, model in (("mlp", namespace["mlp"]()), ("cnn", namespace["groupnorm_cnn"]())):
        for i, w in enumerate(model.get_weights()):
            arrays[f"{prefix}{i}"] = rng.normal(scale=0.6, size=w.shape) + (1.0 if "cnn" in prefix and w.ndim == 1 and i == 2 else 0.0)
    assert keras.backend.backend() == "tensorflow"
    np.savez(path, **arrays)
    return np.load(path)


@pytest.mark.slow
def test_estimate_spectrum_agrees_on_tensorflow_and_jax(tmp_path):
    pytest.importorskip("jax")
    data = _data(tmp_path / "data.npz")
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "data.npz"), str(tmp_path / "jax.npz")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    child = np.load(tmp_path / "jax.npz")
    assert str(child["backend"]) == "jax" and bool(child["x64"])
    assert float(child["hvp_error"]) < 1e-12  # float64: H·v from jvp-of-grad equals jax.hessian's H times v

    namespace = {}
    exec(BUILD + SPECTRA, namespace)
    top, full = namespace["spectra"](data)
    assert top.metadata["converged"] == 8 and int(child["converged"]) == 8
    np.testing.assert_allclose(child["top"][:8], top.eigenvalues[:8], rtol=1e-8, atol=0)  # the Lanczos top-k
    # the fitted tail beyond k (SLQ count + least-squares power law): to the fit's tolerance
    assert child["top"].size == top.eigenvalues.size > 8
    np.testing.assert_allclose(child["top"], top.eigenvalues, rtol=1e-5, atol=0)
    assert top.metadata["moments"]["layers"] == [] and full.metadata["moments"]["layers"]
    # GroupNorm CNN: 1e-6, not 1e-8. On JAX this model's products differ from jax.hessian's
    # by ≈3e-8 relative even in float64 (some step of Keras's JAX conv/normalisation path
    # rounds a tangent to float32, as ops.tanh does); the two backends then agree to ≈2e-7.
    every = namespace["every"](full)
    assert every.size == full.dimension == child["full"].size
    np.testing.assert_allclose(child["full"], every, rtol=1e-6, atol=1e-8 * every.max())
    print(json.dumps({"top": top.eigenvalues.tolist()}))
