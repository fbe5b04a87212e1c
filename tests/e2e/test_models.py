"""Model builders: parameter counts from the paper's table, exact layers."""

import math

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from keras_noisecurve.apps import layers, models  # noqa: E402


def _cnn_params(channels_in, dense_size, classes):
    convs = [(channels_in, 16), (16, 32), (32, 64)]
    conv = sum(9 * cin * cout + cout for cin, cout in convs)
    norm = sum(2 * cout for _, cout in convs)  # GroupNorm gamma + beta
    dense = (256 * dense_size + dense_size) + (dense_size * classes + classes)
    return conv + norm + dense


@pytest.mark.parametrize(
    "shape,dense,classes", [((32, 32, 3), 64, 10), ((32, 32, 3), 32, 10), ((28, 28, 1), 32, 10), ((28, 28, 1), 16, 3)]
)
def test_cnn_parameter_count_matches_the_table(shape, dense, classes):
    model = models.small_groupnorm_cnn(shape, num_classes=classes, dense_size=dense)
    assert model.count_params() == _cnn_params(shape[-1], dense, classes)
    assert model.output_shape == (None, classes)


def test_cnn_default_is_about_41k_parameters():
    assert models.small_groupnorm_cnn().count_params() == 40906


def test_mlp_and_softmax_regression_counts():
    assert models.mlp((28, 28, 1), 10, (64, 32)).count_params() == 785 * 64 + 65 * 32 + 33 * 10
    assert models.softmax_regression((28, 28, 1), 10).count_params() == 785 * 10
    assert models.mlp((50,), 4, ()).count_params() == 51 * 4


def test_adaptive_pool_matches_pytorch_rule():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 7, 5, 3)).astype(np.float32)
    out = layers.AdaptiveAveragePooling2D((2, 3))(x).numpy()
    ref = np.zeros((2, 2, 3, 3))
    for i in range(2):
        r0, r1 = (i * 7) // 2, -((-(i + 1) * 7) // 2)
        for j in range(3):
            c0, c1 = (j * 5) // 3, -((-(j + 1) * 5) // 3)
            ref[:, i, j] = x[:, r0:r1, c0:c1].mean(axis=(1, 2))
    np.testing.assert_allclose(out, ref, atol=1e-6)
    assert (r0, r1) == (3, 7)  # overlapping windows: rows 0-3 and 3-6


def test_groupnorm_forward_matches_keras_and_numpy():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 4, 5, 8)).astype(np.float32)
    ours = layers.GroupNorm(groups=2)(x).numpy()
    g = x.reshape(3, 4, 5, 2, 4)
    ref = ((g - g.mean(axis=(1, 2, 4), keepdims=True)) / np.sqrt(g.var(axis=(1, 2, 4), keepdims=True) + 1e-5)).reshape(x.shape)
    np.testing.assert_allclose(ours, ref, atol=1e-5)
    np.testing.assert_allclose(ours, keras.layers.GroupNormalization(groups=2, epsilon=1e-5)(x).numpy(), atol=1e-5)


def test_groupnorm_second_derivative_is_exact():
    """HVP by double backprop agrees with a central finite difference of the gradient."""
    rng = np.random.default_rng(3)
    x = tf.constant(rng.standard_normal((2, 3, 3, 4)), dtype=tf.float64)
    w = tf.constant(rng.standard_normal((2, 3, 3, 4)), dtype=tf.float64)
    v = tf.constant(rng.standard_normal((2, 3, 3, 4)), dtype=tf.float64)
    layer = layers.GroupNorm(groups=2, dtype="float64")

    def grad(inp):
        with tf.GradientTape() as tape:
            tape.watch(inp)
            loss = tf.reduce_sum(tf.sin(layer(inp) * w))
        return tape.gradient(loss, inp)

    with tf.GradientTape() as outer:
        outer.watch(x)
        g = grad(x)
        gv = tf.reduce_sum(g * v)
    hvp = outer.gradient(gv, x).numpy()
    h = 1e-5
    fd = (grad(x + h * v) - grad(x - h * v)).numpy() / (2 * h)
    np.testing.assert_allclose(hvp, fd, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs", [{"groups": 3}, {"dense_size": 0}, {"input_shape": (28, 28)}, {"padding": "full"}, {"num_classes": 1}]
)
def test_cnn_bad_arguments(kwargs):
    with pytest.raises((ValueError, TypeError)):
        models.small_groupnorm_cnn(**kwargs)
