"""Random-access example sources: every kind gathers exactly the rows numpy indexing gives."""

import subprocess
import sys
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.privacy.sources import MAX_MATERIALIZED_BYTES, ExampleSource, as_source

N, P, STEPS = 45, 16, 6


def _data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4, 3)).astype(np.float32)
    tags = rng.integers(0, 1000, size=(n, 2)).astype(np.int32)
    y = rng.integers(0, 10, size=n).astype(np.int64)
    return x, tags, y


def _indices(n=N, steps=STEPS, p=P, seed=1):
    """(steps, P) int64 indices with repeats inside a step (every step repeats its first index)."""
    idx = np.random.default_rng(seed).integers(0, n, size=(steps, p)).astype(np.int64)
    idx[:, -1] = idx[:, 0]
    return idx


def _batches(source: ExampleSource, indices):
    """Gather through a tf.data map as the run's pipeline does; return the numpy batches."""
    ds = tf.data.Dataset.from_tensor_slices(indices)
    ds = ds.map(source.tf_gather, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).prefetch(2)
    return ds, list(ds.as_numpy_iterator())


def _assert_same(actual, expected):
    tf.nest.assert_same_structure(actual, expected)
    for a, e in zip(tf.nest.flatten(actual), tf.nest.flatten(expected)):
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(a, e)


def _check(source, x_ref, y_ref, *, kind, n=N):
    """tf_gather (in tf.data, parallel) and gather equal the numpy reference; static specs."""
    assert source.kind == kind and source.num_examples == n == len(source)
    assert source.has_labels == (y_ref is not None)
    idx = _indices(n)
    take = lambda a: a[idx[0]]  # noqa: E731
    x_spec, y_spec = source.element_spec
    _assert_spec(x_spec, x_ref)
    if y_ref is None:
        assert y_spec is None
    else:
        _assert_spec(y_spec, y_ref)
    ds, batches = _batches(source, idx)
    xs_spec, ys_spec = ds.element_spec
    for spec, ref in zip(tf.nest.flatten(xs_spec), tf.nest.flatten(x_ref)):
        assert spec.shape == (P,) + ref.shape[1:] and spec.shape.is_fully_defined()
    assert len(batches) == STEPS
    for t, (xb, yb) in enumerate(batches):
        pick = lambda a: a[idx[t]]  # noqa: E731
        _assert_same(xb, tf.nest.map_structure(pick, x_ref))
        if y_ref is None:
            assert yb is None
        else:
            _assert_same(yb, tf.nest.map_structure(pick, y_ref))
    xg, yg = source.gather(idx[0])  # the numpy path, same rows
    _assert_same(xg, tf.nest.map_structure(take, x_ref))
    if y_ref is not None:
        _assert_same(yg, tf.nest.map_structure(take, y_ref))


def _assert_spec(spec, ref):
    for s, r in zip(tf.nest.flatten(spec), tf.nest.flatten(ref)):
        assert isinstance(s, tf.TensorSpec)
        assert s.shape == r.shape[1:] and s.dtype == tf.as_dtype(r.dtype)


# ------------------------------------------------------------------ in memory
def test_in_memory_arrays_dicts_and_no_labels():
    x, tags, y = _data()
    _check(as_source(x, y), x, y, kind="memory")
    _check(as_source({"image": x, "tags": tags}, y), {"image": x, "tags": tags}, y, kind="memory")
    _check(as_source((x, tags)), (x, tags), None, kind="memory")
    _check(as_source(x, {"digit": y, "tags": tags}), x, {"digit": y, "tags": tags}, kind="memory")


def test_in_memory_path_is_a_plain_tf_gather():
    x, _, y = _data()
    source = as_source(x, y)

    @tf.function
    def f(idx):
        return source.tf_gather(idx)

    ops = {op.type for op in f.get_concrete_function(tf.TensorSpec([P], tf.int64)).graph.get_operations()}
    assert "GatherV2" in ops and not {"PyFunc", "EagerPyFunc", "PyFuncStateless"} & ops
    assert source.sample_weight is None


def test_tf_data_inputs_are_materialised_with_labels_and_weights():
    x, tags, y = _data()
    w = np.linspace(0.5, 1.5, N).astype(np.float64)
    source = as_source(tf.data.Dataset.from_tensor_slices((x, y, w)).batch(7))  # batched -> unbatched
    _check(source, x, y, kind="memory")
    assert source.sample_weight.dtype == np.float32
    np.testing.assert_allclose(source.sample_weight, w.astype(np.float32))
    _check(as_source(tf.data.Dataset.from_tensor_slices({"image": x, "tags": tags})),
           {"image": x, "tags": tags}, None, kind="memory")
    _check(as_source(tf.data.Dataset.from_tensor_slices((x,))), x, None, kind="memory")
    assert MAX_MATERIALIZED_BYTES == 2 * 1024**3


# ------------------------------------------------------------------ memmap
def test_memmap_is_streamed_not_converted(tmp_path):
    x, tags, y = _data()
    np.save(tmp_path / "x.npy", x)
    xm = np.load(tmp_path / "x.npy", mmap_mode="r")
    raw = np.memmap(tmp_path / "tags.bin", dtype=np.int32, mode="w+", shape=tags.shape)
    raw[:] = tags
    raw.flush()
    source = as_source(xm, y)
    _check(source, x, y, kind="memmap")

    @tf.function
    def f(idx):
        return source.tf_gather(idx)

    graph = f.get_concrete_function(tf.TensorSpec([P], tf.int64)).graph
    assert not [op for op in graph.get_operations() if op.type == "Const" and op.outputs[0].shape.num_elements() > 100]
    _check(as_source({"image": xm, "tags": raw}), {"image": x, "tags": tags}, None, kind="memmap")
    _check(as_source(xm[5:], y[5:]), x[5:], y[5:], kind="memmap", n=N - 5)  # a view of a map is still a map


def test_memmap_reads_its_own_map_or_falls_back_to_the_users(tmp_path):
    x, _, y = _data()
    np.save(tmp_path / "x.npy", x)
    xm = np.load(tmp_path / "x.npy", mmap_mode="r")
    own = as_source(xm[5:], y[5:])._leaves[0]
    assert not np.shares_memory(own, xm)  # a separate read-only map of the same bytes ...
    np.testing.assert_array_equal(own, x[5:])  # ... at the view's offset
    copy_on_write = np.load(tmp_path / "x.npy", mmap_mode="c")
    copy_on_write[3] = -1.0  # in this process only: not in the file
    changed = x.copy()
    changed[3] = -1.0
    _check(as_source(copy_on_write, y), changed, y, kind="memmap")
    _check(as_source(xm[:, ::2]), x[:, ::2], None, kind="memmap")  # not contiguous: the user's map


# ------------------------------------------------------------------ sequences
class _Examples:
    """A random-access sequence of (x, y) examples; counts the calls it gets."""

    def __init__(self, x, y):
        self.x, self.y = x, y
        self.calls = 0
        self.lock = threading.Lock()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        with self.lock:
            self.calls += 1
        return self.x[i], self.y[i]


class _DictSource:
    """A duck-typed stand-in for ``tfds.data_source(...)``: dict examples, ``__getitems__``."""

    def __init__(self, x, tags, y):
        self.x, self.tags, self.y = x, tags, y
        self.requests = []

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"image": self.x[i], "tags": self.tags[i], "label": int(self.y[i])}

    def __getitems__(self, keys):
        assert isinstance(keys, list) and all(type(k) is int for k in keys)
        self.requests.append(list(keys))
        return [self[k] for k in keys]


def test_sequence_of_examples_with_and_without_labels():
    x, tags, y = _data()
    seq = _Examples(x, y)
    _check(as_source(seq), x, y, kind="sequence")
    seq_x_only = _Examples(x, y)
    seq_x_only.__class__ = type("XOnly", (_Examples,), {"__getitem__": lambda self, i: self.x[i]})
    _check(as_source(seq_x_only), x, None, kind="sequence")
    _check(as_source(seq_x_only, {"digit": y}), x, {"digit": y}, kind="sequence")  # labels in memory


def test_sequence_reads_each_needed_example_once_per_batch():
    x, _, y = _data()
    seq = _Examples(x, y)
    source = as_source(seq)
    seq.calls = 0
    idx = np.array([3, 3, 7, 3, 0], dtype=np.int64)
    source.gather(idx)
    assert seq.calls == 3


def test_tfds_like_source_with_example_fn_uses_getitems():
    x, tags, y = _data()
    data = _DictSource(x, tags, y)
    source = as_source(data, example_fn=lambda ex: ({"image": ex["image"], "tags": ex["tags"]}, ex["label"]))
    _check(source, {"image": x, "tags": tags}, y, kind="sequence")
    assert data.requests and all(r == sorted(set(r)) for r in data.requests)  # sorted, no repeats
    source = as_source(data, example_fn=lambda ex: ex["image"])
    _check(source, x, None, kind="sequence")


def test_real_tfds_array_record_data_source(tmp_path):
    """``tfds`` ``ArrayRecordDataSource`` of a tiny dataset built offline in tmp_path."""
    tfds = pytest.importorskip("tensorflow_datasets")
    pytest.importorskip("array_record")
    x, _, y = _data()

    class TinyKncExamples(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            features = tfds.features.FeaturesDict(
                {"image": tfds.features.Tensor(shape=(4, 3), dtype=np.float32),
                 "label": tfds.features.ClassLabel(num_classes=10)}
            )
            return tfds.core.DatasetInfo(builder=self, features=features)

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            for i in range(N):
                yield i, {"image": x[i], "label": int(y[i])}

    builder = TinyKncExamples(data_dir=str(tmp_path), file_format="array_record")
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    data = builder.as_data_source(split="train")
    assert hasattr(data, "__getitems__") and len(data) == N
    # tfds stores the examples in its own (shuffled) order: the reference is the source itself
    x_ref = np.stack([data[i]["image"] for i in range(N)])
    y_ref = np.array([data[i]["label"] for i in range(N)])
    source = as_source(data, example_fn=lambda ex: (ex["image"], ex["label"]))
    _check(source, x_ref, y_ref, kind="sequence")


def test_sequence_refusals():
    x, tags, y = _data()
    with pytest.raises(ValueError, match="dict with keys.*example_fn"):
        as_source(_DictSource(x, tags, y))
    with pytest.raises(ValueError, match="already hold labels"):
        as_source(_Examples(x, y), y)
    with pytest.raises(ValueError, match="y has 44 examples but x has 45"):
        as_source(type("XOnly", (_Examples,), {"__getitem__": lambda self, i: self.x[i]})(x, y), y[:-1])
    with pytest.raises(ValueError, match="sample_weight"):
        as_source(type("W", (_Examples,), {"__getitem__": lambda self, i: (self.x[i], self.y[i], 1.0)})(x, y))
    ragged = type("Ragged", (_Examples,), {"__getitem__": lambda self, i: self.x[i][: 1 + i % 2]})(x, y)
    source = as_source(ragged)
    with pytest.raises(ValueError, match="shape of example 0"):
        source.gather(np.array([0, 1]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="shape of example 0"):
        _batches(source, np.array([[0, 1]], dtype=np.int64))  # the message reaches the training loop


# ------------------------------------------------------------------ PyDataset
class _Batches(keras.utils.PyDataset):
    def __init__(self, x, y, k, *, sizes=None):
        super().__init__()
        self.x, self.y, self.k = x, y, k
        self.sizes = sizes  # optional list of rows per batch (to break the contract)
        self.loaded = []

    def __len__(self):
        return len(self.sizes) if self.sizes else -(-len(self.x) // self.k)

    def __getitem__(self, b):
        self.loaded.append(b)
        start = sum(self.sizes[:b]) if self.sizes else b * self.k
        stop = start + (self.sizes[b] if self.sizes else self.k)
        if self.y is None:
            return self.x[start:stop]
        return {"image": self.x[start:stop]}, self.y[start:stop]


def test_py_dataset_with_a_short_last_batch():
    x, _, y = _data()  # 45 = 5 batches of 8 + 5
    data = _Batches(x, y, 8)
    source = as_source(data)
    assert source.num_examples == N
    _check(source, {"image": x}, y, kind="py_dataset")
    data.loaded.clear()
    source.gather(np.array([9, 8, 44, 9], dtype=np.int64))
    assert sorted(data.loaded) == [1, 5]  # only the batches holding the examples
    _check(as_source(_Batches(x, None, 8)), x, None, kind="py_dataset")
    _check(as_source(_Batches(x, y, 45)), {"image": x}, y, kind="py_dataset")  # one batch


def test_py_dataset_refusals():
    x, _, y = _data()
    with pytest.raises(ValueError, match="last batch of the PyDataset has 10 rows, more than batch 0"):
        as_source(_Batches(x, y, 8, sizes=[8, 8, 8, 8, 3, 10]))
    source = as_source(_Batches(x, y, 8, sizes=[8, 8, 7, 9, 8, 5]))  # a middle batch has 7 rows
    with pytest.raises(ValueError, match="batch 2 of the PyDataset has 7 rows"):
        source.gather(np.array([17], dtype=np.int64))
    with pytest.raises(ValueError, match="y comes from its batches"):
        as_source(_Batches(x, y, 8), y)

    class Infinite(keras.utils.PyDataset):
        @property
        def num_batches(self):
            return None

        def __getitem__(self, b):
            return x[:8], y[:8]

    with pytest.raises(ValueError, match="infinite"):
        as_source(Infinite())


# ------------------------------------------------------------------ refusals
def test_refuses_what_cannot_be_indexed_and_mismatched_lengths():
    x, _, y = _data()
    for bad in ((row for row in x), iter(x), zip(x, y), 3.0, "images"):
        with pytest.raises(ValueError, match="cannot be indexed.*Allowed"):
            as_source(bad)
    with pytest.raises(ValueError, match="y has 44 examples but x has 45"):
        as_source(x, y[:-1])
    with pytest.raises(ValueError, match="same leading"):
        as_source({"a": x, "b": x[:-1]})
    with pytest.raises(ValueError, match=r"sample_weight must have shape \(45,\)"):
        as_source(x, y, sample_weight=np.ones(44))
    with pytest.raises(ValueError, match="finite and >= 0"):
        as_source(x, y, sample_weight=-np.ones(N))
    with pytest.raises(ValueError, match="example_fn applies to a random-access sequence"):
        as_source(x, y, example_fn=lambda ex: ex)
    with pytest.raises(TypeError, match="example_fn must be callable"):
        as_source(_Examples(x, y), example_fn=3)
    with pytest.raises(ValueError, match="put y and sample_weight inside"):
        as_source(tf.data.Dataset.from_tensor_slices(x), y)
    with pytest.raises(ValueError, match="a list of examples"):
        as_source([(x[i], y[i]) for i in range(N)])
    with pytest.raises(ValueError, match="y must be numpy arrays"):
        as_source(x, _Examples(y, y))


def test_importing_the_module_does_not_import_tensorflow():
    code = "import sys, keras_noisecurve.privacy.sources; assert 'tensorflow' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
