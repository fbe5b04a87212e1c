"""keras_noisecurve._losses: one loss per example from a loss with one value per position
(per token, per pixel), checked against closed forms in numpy; the same code runs on JAX
(tests/jax/test_jax_losses.py checks the JAX steps against a per-example loop)."""

import keras
import numpy as np
import pytest

from keras_noisecurve._losses import per_example_loss_fn, reduce_positions, split_sample_weight

V = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32)


@pytest.mark.parametrize("reduction, mask, weight, want", [
    ("sum_over_batch_size", None, None, [2.0, 5.0]),
    ("sum_over_batch_size", [[1, 1, 0], [1, 0, 0]], None, [1.5, 4.0]),
    ("sum_over_batch_size", [[0, 0, 0], [1, 1, 1]], None, [0.0, 5.0]),  # nothing left: loss 0
    ("sum_over_batch_size", None, [[1, 1, 1], [0, 0, 3]], [2.0, 6.0]),
    ("sum", None, [[1, 1, 1], [0, 0, 3]], [6.0, 18.0]),
    ("mean_with_sample_weight", [[1, 1, 1], [1, 1, 0]], [[1, 1, 1], [0, 2, 3]], [2.0, 5.0]),
])
def test_reduce_positions_is_keras_batch_reduction_per_example(reduction, mask, weight, want):
    got = reduce_positions(keras.ops.convert_to_tensor(V), mask=None if mask is None else np.array(mask, bool),
                           weight=None if weight is None else np.array(weight, np.float32), reduction=reduction)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_a_masked_sequence_output_is_one_mean_over_its_real_positions():
    """The Keras mask of an Embedding(mask_zero=True) output reaches the per-example loss; a loss
    of your own that already returns (P,) is taken as it is."""
    ids = np.array([[1, 0, 0], [2, 3, 4]])
    out = keras.layers.Embedding(5, 2, mask_zero=True)(keras.ops.convert_to_tensor(ids))
    target = np.zeros((2, 3, 2), np.float32)
    squares = np.mean(np.asarray(out) ** 2, axis=-1)
    mask = ids != 0
    want = np.sum(squares * mask, 1) / np.sum(mask, 1)
    np.testing.assert_allclose(np.asarray(per_example_loss_fn("mse")(target, out)), want, rtol=1e-6)
    own = per_example_loss_fn(lambda t, p: keras.ops.mean(keras.ops.square(p - t), axis=(1, 2)))
    np.testing.assert_allclose(np.asarray(own(target, out)), np.mean(squares, 1), rtol=1e-6)


def test_ignore_class_and_per_token_weights():
    logits = np.random.default_rng(0).normal(size=(2, 3, 4)).astype(np.float32)
    labels = np.array([[1, 2, 0], [3, 0, 0]])
    weights = np.array([[1.0, 2.0, 5.0], [0.5, 1.0, 1.0]], np.float32)
    ce = -np.take_along_axis(logits - np.log(np.sum(np.exp(logits), -1, keepdims=True)), labels[..., None], -1)[..., 0]
    real = labels != 0
    fn = per_example_loss_fn(keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0))
    np.testing.assert_allclose(np.asarray(fn(labels, logits)), np.sum(ce * real, 1) / np.sum(real, 1), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(fn(labels, logits, weights)),
                               np.sum(ce * real * weights, 1) / np.sum(real, 1), rtol=1e-5)
    with pytest.raises(ValueError, match="one weight per example"):
        per_example_loss_fn("mse")(np.zeros((2, 3)), np.ones((2, 3)), weights)  # (P,) values, (P, L) weights


def test_split_sample_weight_by_shape():
    rows, positions = split_sample_weight(np.ones((4, 1), np.float32))
    assert positions is None and tuple(rows.shape) == (4,)
    rows, positions = split_sample_weight(np.ones((4, 6), np.float32))
    assert rows is None and tuple(positions.shape) == (4, 6)
    assert split_sample_weight(None) == (None, None)
