"""Bundled data: fixed stratified split, disjointness, public digits in MNIST format."""

import hashlib

import numpy as np
import pytest

from keras_noisecurve.apps import data


def _hashes(x):
    return {hashlib.sha1(np.ascontiguousarray(img).tobytes()).hexdigest() for img in x}


def test_default_split_sizes_stratified_and_scaled():
    s = data.load_mnist5k()
    assert s.sizes() == {"train": 3500, "val": 500, "test": 1000, "public": 0}
    for y, per_class in ((s.y_train, 350), (s.y_val, 50), (s.y_test, 100)):
        np.testing.assert_array_equal(np.bincount(y, minlength=10), np.full(10, per_class))
    for x in (s.x_train, s.x_val, s.x_test):
        assert x.dtype == np.float32 and x.shape[1:] == (28, 28, 1)
        assert 0.0 <= x.min() and x.max() <= 1.0
    # pixel values are k/255: the scaling is by 255, not by the max of each image
    raw = np.round(s.x_train * 255.0)
    np.testing.assert_allclose(raw / 255.0, s.x_train, atol=1e-6)


def test_splits_are_disjoint_and_cover_the_data():
    s = data.load_mnist5k(public_size=300)
    parts = [s.x_train, s.x_val, s.x_test, s.x_public]
    assert sum(len(p) for p in parts) == data.MNIST5K_SIZE
    hashes = [_hashes(p) for p in parts]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not hashes[i] & hashes[j]


def test_split_is_deterministic_and_seed_dependent():
    a, b = data.load_mnist5k(seed=0), data.load_mnist5k(seed=0)
    np.testing.assert_array_equal(a.x_test, b.x_test)
    c = data.load_mnist5k(seed=1)
    assert not np.array_equal(a.y_test, c.y_test) or not np.array_equal(a.x_test, c.x_test)


@pytest.mark.parametrize(
    "kwargs", [{"validation_size": -1}, {"test_size": 4995}, {"seed": 1.5}, {"public_size": 4000}]
)
def test_bad_split_arguments(kwargs):
    with pytest.raises((ValueError, TypeError)):
        data.load_mnist5k(**kwargs)


def test_public_digits_are_mnist_formatted_and_disjoint():
    pub = data.load_public_digits()
    assert pub.shape == (1797, 28, 28, 1) and pub.dtype == np.float32
    assert pub.min() >= 0.0 and pub.max() <= 1.0
    # the 4-pixel border is empty, as in MNIST's 20x20-box-in-28x28 layout
    assert np.all(pub[:, :4] == 0) and np.all(pub[:, -4:] == 0)
    s = data.load_mnist5k()
    assert not _hashes(pub) & _hashes(np.concatenate([s.x_train, s.x_val, s.x_test]))


def test_bilinear_resize_matches_tensorflow():
    tf = pytest.importorskip("tensorflow")
    rng = np.random.default_rng(0)
    img = rng.random((3, 8, 8))
    ours = data._bilinear_resize(img, 20)
    ref = tf.image.resize(img[..., None], (20, 20), method="bilinear", antialias=False).numpy()[..., 0]
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_load_public_sources():
    s = data.load_mnist5k(public_size=200)
    held = data.load_public("mnist-heldout", splits=s)
    assert held.shape == (200, 28, 28, 1)
    sub = data.load_public("digits", max_examples=100, seed=3)
    assert sub.shape == (100, 28, 28, 1)
    with pytest.raises(ValueError, match="mnist-heldout"):
        data.load_public("mnist-heldout")
    with pytest.raises(ValueError, match="source"):
        data.load_public("cifar")
