"""``run.dataset(...)`` on JAX takes every example source TensorFlow takes: a random-access
sequence of examples (with ``example_fn`` for dict examples, as ``tfds.data_source`` gives
them), a ``keras.utils.PyDataset`` of batches, memory-mapped arrays and a ``tf.data.Dataset``
(where TensorFlow is installed). Each trains to the same final weights as the same run on
plain numpy arrays: the plan draws the same indices, every source gathers the same rows."""

from __future__ import annotations

import sys

import keras
import numpy as np
import pytest

import keras_noisecurve as knc

N, B, T = 40, 8, 6


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 5)).astype("float32"), rng.integers(0, 3, N).astype("int32")


def _train(make_data):
    keras.utils.set_random_seed(0)
    run = knc.PrivateRun(num_examples=N, batch_size=B, steps=T, mixing=knc.solve_mixing_matrix(steps=T, bands=2),
                         noise_multiplier=1.0, delta=1e-5, seed=3)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)])
    model.set_weights([np.full(w.shape, 0.1, "float32") * (i + 1) for i, w in enumerate(model.get_weights())])
    private = knc.make_private(model)
    private.compile(optimizer=knc.NoiseCurveOptimizer(run=run, learning_rate=0.2, l2_norm_clip=1.0, seed=4),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    private.fit(make_data(run), verbose=0)
    assert int(np.asarray(private.optimizer.iterations.value)) == T
    return [np.asarray(w) for w in private.get_weights()]


class _Examples:
    """A random-access sequence of dict examples, as ``tfds.data_source`` returns them."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"features": self.x[i], "label": self.y[i]}


class _Batches(keras.utils.PyDataset):
    def __init__(self, x, y, k):
        super().__init__()
        self.x, self.y, self.k = x, y, k

    def __len__(self):
        return -(-len(self.y) // self.k)

    def __getitem__(self, b):
        return self.x[b * self.k:(b + 1) * self.k], self.y[b * self.k:(b + 1) * self.k]


@pytest.fixture(scope="module")
def reference():
    x, y = _data()
    return _train(lambda run: run.dataset(x, y))


def _memmap(tmp_path, array):
    path = tmp_path / "x.npy"
    np.save(path, array)
    return np.load(path, mmap_mode="r")


@pytest.mark.parametrize("kind", ["sequence", "py_dataset", "memmap", "tf_data"])
def test_every_example_source_trains_like_the_arrays_on_jax(kind, reference, tmp_path):
    x, y = _data()
    if kind == "sequence":
        make = lambda run: run.dataset(_Examples(x, y), example_fn=lambda ex: (ex["features"], ex["label"]))  # noqa: E731
    elif kind == "py_dataset":
        make = lambda run: run.dataset(_Batches(x, y, k=6))  # noqa: E731
    elif kind == "memmap":
        mapped = _memmap(tmp_path, x)
        make = lambda run: run.dataset(mapped, y)  # noqa: E731
    else:
        tf = pytest.importorskip("tensorflow")
        make = lambda run: run.dataset(tf.data.Dataset.from_tensor_slices((x, y)))  # noqa: E731
    source = make(knc.PrivateRun(num_examples=N, batch_size=B, steps=T, noise_multiplier=1.0, delta=1e-5)).source
    assert source.kind == {"sequence": "sequence", "py_dataset": "py_dataset", "memmap": "memmap",
                           "tf_data": "memory"}[kind]
    for got, want in zip(_train(make), reference):
        np.testing.assert_array_equal(got, want)


def test_numpy_sources_do_not_import_tensorflow_on_jax():
    """Arrays, sequences and PyDatasets are gathered in numpy: no TensorFlow import on JAX."""
    import subprocess

    code = (
        "import sys, numpy as np, keras, keras_noisecurve as knc\n"
        "run = knc.PrivateRun(num_examples=10, batch_size=5, steps=2, noise_multiplier=1.0, delta=1e-5)\n"
        "x = np.ones((10, 3), 'float32'); y = np.zeros(10, 'int32')\n"
        "class S:\n    def __len__(self): return 10\n    def __getitem__(self, i): return x[i], y[i]\n"
        "for data in (run.dataset(x, y), run.dataset(S())):\n"
        "    b = data.batches()[0][0]['inputs']; assert b.shape == (run.padded_batch_size, 3), b.shape\n"
        "print('tensorflow' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "KERAS_BACKEND": "jax"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
