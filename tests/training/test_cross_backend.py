"""The same private run on TensorFlow and on JAX ends with the same weights.

A fixed-seed DP-BandMF run (banded C with b = 2, T = 4 steps, the same initial weights,
the same run key and noise key) trains in this process on TensorFlow and in a subprocess
under ``KERAS_BACKEND=jax``. The batches come from the same numpy sampler, the noise from
the same Philox words (``backend/common/philox.py``), the clipping from exact per-example
gradients on both sides (ghost norms on TensorFlow, ``vmap`` on JAX), so the final
weights agree to float32 rounding: relative difference ≤ 1e-4 (the noise alone moves the
weights by ~η·ζσ/B ≈ 1e-2 per step, so a wrong noise draw, batch or clip is 100× that).

Three more runs have a loss that is not one value per example: the next-token model of
issue 45 (Embedding → Dense on every position, ``SparseCategoricalCrossentropy`` per
token, y of shape (n, 16)), padded sequences (``Embedding(mask_zero=True)``, padding labels
``ignore_class=0``) and a Conv2D/Conv2DTranspose autoencoder with a per-pixel MSE; each
example's loss is the mean over its real positions on both backends (``_losses.py``).
One JAX subprocess runs all four.
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

def _dense(rng):
    x = rng.normal(size=(32, 4)).astype("float32")
    y = (x[:, :1] - 0.5 * x[:, 1:2]).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                              keras.layers.Dense(1)])
    return model, x, y, "mse", dict(num_examples=32, batch_size=8, steps=4), 0.1, 0.5

def _next_token(rng):  # issue 45: Embedding -> Dense on every position, a loss per token
    n, length, vocab = 75, 16, 50
    x = rng.integers(0, vocab, (n, length)).astype("int32")
    y = rng.integers(0, vocab, (n, length)).astype("int32")
    model = keras.Sequential([keras.Input((length,), dtype="int32"), keras.layers.Embedding(vocab, 16),
                              keras.layers.Dense(vocab)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, x, y, loss, dict(num_examples=n, batch_size=25, steps=6), 0.5, 1.0

def _masked_tokens(rng):  # padded sequences: Embedding(mask_zero=True), padding labels ignored
    n, length, vocab = 48, 12, 30
    lengths = rng.integers(3, length + 1, n)
    x = rng.integers(1, vocab, (n, length)).astype("int32") * (np.arange(length) < lengths[:, None])
    y = np.concatenate([x[:, 1:], np.zeros((n, 1), "int32")], axis=1)
    model = keras.Sequential([keras.Input((length,), dtype="int32"), keras.layers.Embedding(vocab, 8, mask_zero=True),
                              keras.layers.Dense(vocab)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)
    return model, x, y, loss, dict(num_examples=n, batch_size=12, steps=4), 0.5, 1.0

def _per_pixel(rng):  # a convolutional autoencoder, a loss per pixel
    x = rng.normal(size=(24, 8, 8, 1)).astype("float32")
    model = keras.Sequential([keras.Input((8, 8, 1)),
                              keras.layers.Conv2D(3, 3, strides=2, padding="same", activation="tanh"),
                              keras.layers.Conv2DTranspose(1, 3, strides=2, padding="same")])
    return model, x, x, "mse", dict(num_examples=24, batch_size=6, steps=4), 0.1, 0.5

CASES = {"dense": _dense, "next_token": _next_token, "masked_tokens": _masked_tokens, "per_pixel": _per_pixel}

def run_once(case="dense"):
    rng = np.random.default_rng(0)
    model, x, y, loss, shape, learning_rate, clip = CASES[case](rng)
    init = np.random.default_rng(1)
    model.set_weights([init.normal(size=w.shape).astype("float32") * 0.5 for w in model.get_weights()])
    mixing = random_banded_c(shape["steps"], 2, rng=np.random.default_rng(2), diag_scale=2.0)
    run = knc.PrivateRun(**shape, mixing=mixing, noise_multiplier=1.0, delta=1e-5, seed=7)
    private = knc.make_private(model)
    private.compile(optimizer=knc.NoiseCurveOptimizer(run=run, learning_rate=learning_rate, l2_norm_clip=clip,
                                                      seed=5), loss=loss)
    private.fit(run.dataset(x, y), verbose=0)
    assert int(np.asarray(private.optimizer.iterations.value)) == shape["steps"]
    return [np.asarray(w, np.float64).tolist() for w in model.get_weights()]

if __name__ == "__main__":
    print(json.dumps({case: run_once(case) for case in CASES}))
"""


@pytest.fixture(scope="module")
def jax_weights(tmp_path_factory):
    """The final weights of every case, trained in one ``KERAS_BACKEND=jax`` subprocess."""
    script = tmp_path_factory.mktemp("cross_backend") / "cross_backend_run.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, str(script)], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return {case: [np.array(w) for w in weights]
            for case, weights in json.loads(out.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax installed (pip install -e '.[jax]')")
@pytest.mark.slow
@pytest.mark.parametrize("case", ["dense", "next_token", "masked_tokens", "per_pixel"])
def test_fixed_seed_bandmf_run_ends_with_the_same_weights_on_tensorflow_and_jax(jax_weights, case):
    namespace = {}
    exec(compile(SCRIPT.replace('if __name__ == "__main__":', "if False:"), "cross_backend", "exec"), namespace)
    tf_weights = [np.array(w) for w in namespace["run_once"](case)]
    initial = np.random.default_rng(1)
    moved = False
    for got, want in zip(jax_weights[case], tf_weights):
        scale = np.max(np.abs(want))
        print(f"{case}: max |JAX - TF| / max |TF| = {np.max(np.abs(got - want)) / scale:.2e}")
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * scale)
        start = initial.normal(size=want.shape) * 0.5
        moved |= np.max(np.abs(want - start)) > 1e-2 * scale
    assert moved  # the run did train
