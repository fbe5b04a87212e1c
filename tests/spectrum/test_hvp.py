"""Hessian-vector products vs finite differences of gradients; GroupNorm second derivatives."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.spectrum.dense import dense_hessian
from keras_noisecurve.spectrum.hvp import HessianOperator
from keras_noisecurve.spectrum.moments import exact_moments, moment_layers

from .conftest import groupnorm_cnn, reference_hessian, tanh_mlp

SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _fd_hvp(op, v, h):
    """Central difference of exact first derivatives: (g(w+hv) − g(w−hv)) / 2h."""
    w0 = op.flat_weights()
    try:
        op.assign(w0 + h * v)
        gp = op.gradient()
        op.assign(w0 - h * v)
        gm = op.gradient()
    finally:
        op.assign(w0)
    return (gp - gm) / (2 * h)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_hvp_matches_finite_differences_and_is_symmetric(rng):
    model = tanh_mlp(inputs=5, hidden=(12, 8), outputs=3)
    x = rng.normal(size=(37, 5))
    y = rng.integers(0, 3, size=37)
    op = HessianOperator(model, x, y, loss=SCCE, batch_size=10)  # unequal last batch
    v = rng.normal(size=op.dimension)
    hv = op.matvec(v)
    errors = [_rel(hv, _fd_hvp(op, v, h)) for h in (1e-3, 1e-4)]
    # Central differences: O(h²) error, so 10× smaller h gives ≈100× smaller error.
    assert errors[1] < errors[0] / 30, errors
    assert errors[1] < 1e-6
    u = rng.normal(size=op.dimension)
    assert np.dot(u, hv) == pytest.approx(np.dot(v, op.matvec(u)), rel=1e-10)
    assert op.num_hvps == 2
    # Batch size does not change the operator (examples are weighted by count).
    whole = HessianOperator(model, x, y, loss=SCCE, batch_size=1000)
    np.testing.assert_allclose(whole.matvec(v), hv, rtol=1e-10, atol=1e-13)
    # matmat == stacked matvecs; and equals the jacobian-of-gradient reference.
    V = rng.normal(size=(op.dimension, 3))
    HV = op.matmat(V)
    np.testing.assert_allclose(HV[:, 0], op.matvec(V[:, 0]), rtol=1e-10, atol=1e-13)
    ref = reference_hessian(model, x, y, SCCE.call)
    np.testing.assert_allclose(HV, ref @ V, rtol=1e-9, atol=1e-12)


def test_user_weights_untouched_and_validation(rng):
    model = tanh_mlp(inputs=4, hidden=(5,), outputs=2)
    x, y = rng.normal(size=(9, 4)), rng.integers(0, 2, size=9)
    before = [w.copy() for w in model.get_weights()]
    op = HessianOperator(model, x, y, loss=SCCE)
    op.matvec(np.ones(op.dimension))
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="entries"):
        op.matvec(np.ones(3))
    with pytest.raises(ValueError, match="same number of examples"):
        HessianOperator(model, x, y[:4], loss=SCCE)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        HessianOperator(model, x, y, loss=SCCE, batch_size=0)


def test_groupnorm_hvp_is_exact_only_with_the_moments_fix(rng):
    model = groupnorm_cnn()
    assert [s.split(" ")[1] for s in moment_layers(model)] == ["(GroupNormalization)"]
    x = rng.normal(size=(12, 6, 6, 2))
    y = rng.integers(0, 3, size=12)
    v = rng.normal(size=sum(int(np.prod(w.shape)) for w in model.trainable_variables))
    naive = HessianOperator(model, x, y, loss=SCCE, batch_size=5, exact_moments=False)
    fixed = HessianOperator(model, x, y, loss=SCCE, batch_size=5)
    fd = _fd_hvp(fixed, v, 1e-4)
    err_naive = _rel(naive.matvec(v), fd)
    err_fixed = _rel(fixed.matvec(v), fd)
    assert err_naive > 1e-4, err_naive  # Keras' tf.nn.moments stops the mean's gradient
    assert err_fixed < 1e-6, err_fixed
    assert _rel(fixed.matvec(v), _fd_hvp(fixed, v, 1e-5)) < err_fixed / 10  # converges as h → 0
    H, asymmetry = dense_hessian(fixed, chunk_size=128, return_asymmetry=True)
    assert asymmetry < 1e-12
    np.testing.assert_allclose(H @ v, fixed.matvec(v), rtol=1e-10, atol=1e-13)
    # The patch is scoped: after the context, Keras' own moments are back.
    from keras.src.backend.tensorflow import nn as tf_nn

    original = tf_nn._compute_moments
    with exact_moments():
        assert tf_nn._compute_moments is not original
    assert tf_nn._compute_moments is original


def test_distribution_strategy_gives_the_same_products(rng):
    if len(tf.config.list_logical_devices("CPU")) < 2:
        pytest.skip("needs two logical CPU devices (tests/conftest.py)")
    model = tanh_mlp(inputs=4, hidden=(6,), outputs=3)
    x, y = rng.normal(size=(21, 4)), rng.integers(0, 3, size=21)
    strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")[:2]])
    plain = HessianOperator(model, x, y, loss=SCCE, batch_size=8)
    dist = HessianOperator(model, x, y, loss=SCCE, batch_size=8, strategy=strategy)
    v = rng.normal(size=plain.dimension)
    np.testing.assert_allclose(dist.matvec(v), plain.matvec(v), rtol=1e-10, atol=1e-13)
