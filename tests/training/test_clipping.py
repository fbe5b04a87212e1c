"""The vectorized clipping engine against a Python loop over single examples."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.backend.tensorflow.clipping import (
    add_regularization,
    get_engine,
    per_example_loss_fn,
    vectorized_clipped_sum,
)

CLIP = 1.0


@pytest.fixture(scope="module")
def model():
    keras.utils.set_random_seed(0)
    inp = keras.Input((6,))
    h = keras.layers.Dense(5, activation="tanh")(inp)
    out = keras.layers.Dense(3)(h)
    return keras.Model(inp, out)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 6)).astype("float32")
    y = rng.integers(0, 3, 7)
    w = np.array([1, 1, 0, 1, 0.5, 1, 0], np.float32)
    return x, y, w


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _loop(model, x, y, w, clip):
    """Reference: one tape per example, global-norm clip, Python sum."""
    variables = model.trainable_variables
    total = [np.zeros(v.shape, np.float64) for v in variables]
    norms, losses = [], []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = LOSS(y[i : i + 1], model(x[i : i + 1]))  # a batch of one: mean == the example
            weighted = loss * w[i]
        g = [t.numpy().astype(np.float64) for t in tape.gradient(weighted, variables)]
        norm = np.sqrt(sum(np.sum(gi**2) for gi in g))
        factor = min(1.0, clip / norm) if norm > 0 else 1.0
        total = [a + gi * factor for a, gi in zip(total, g)]
        norms.append(norm)
        losses.append(float(loss))
    return total, np.array(norms), np.array(losses)


@pytest.mark.parametrize("microbatch_size", [None, 3])
def test_equals_python_loop(model, batch, microbatch_size):
    x, y, w = batch
    out = vectorized_clipped_sum(
        model, per_example_loss_fn(LOSS), x, y, w, l2_norm_clip=CLIP, microbatch_size=microbatch_size
    )
    total, norms, losses = _loop(model, x, y, w, CLIP)
    for got, want in zip(out.grads, total):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.norms.numpy(), norms, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out.per_example_loss.numpy(), losses, rtol=1e-5)
    np.testing.assert_allclose(out.y_pred.numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    assert np.all(out.norms.numpy()[w == 0] == 0)  # masked examples contribute nothing


def test_masked_examples_contribute_nothing(model, batch):
    x, y, w = batch
    fn = per_example_loss_fn(LOSS)
    full = vectorized_clipped_sum(model, fn, x, y, w, l2_norm_clip=CLIP)
    keep = w > 0
    sub = vectorized_clipped_sum(model, fn, x[keep], y[keep], w[keep], l2_norm_clip=CLIP)
    for a, b in zip(full.grads, sub.grads):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)


def test_huge_gradient_moves_sum_by_at_most_clip(model, batch):
    x, y, _ = batch
    fn = per_example_loss_fn(LOSS)
    base = vectorized_clipped_sum(model, fn, x[:-1], y[:-1], None, l2_norm_clip=CLIP)
    w_big = np.array([1, 1, 1, 1, 1, 1, 1e4], np.float32)  # weights act before clipping
    big = vectorized_clipped_sum(model, fn, x, y, w_big, l2_norm_clip=CLIP)
    assert big.norms.numpy()[-1] > 100 * CLIP
    diff = np.sqrt(sum(np.sum((a.numpy() - b.numpy()) ** 2) for a, b in zip(big.grads, base.grads)))
    assert diff <= CLIP * (1 + 1e-5)
    assert diff > 0.5 * CLIP  # it was clipped to ζ, not dropped


def test_regularization_added_once_unclipped():
    keras.utils.set_random_seed(0)
    reg = keras.regularizers.L2(0.3)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, kernel_regularizer=reg)])
    clipped = vectorized_clipped_sum(
        model, per_example_loss_fn("mse"), np.ones((3, 2), np.float32), np.zeros((3, 2), np.float32),
        l2_norm_clip=CLIP,
    )
    out = add_regularization(model, clipped, expected_batch_size=8, num_replicas=2)
    kernel = model.trainable_variables[0].numpy()
    np.testing.assert_allclose(out.grads[0].numpy() - clipped.grads[0].numpy(), 8 / 2 * 2 * 0.3 * kernel, rtol=1e-5)
    np.testing.assert_array_equal(out.grads[1].numpy(), clipped.grads[1].numpy())


def test_loss_functions_and_refusals():
    y = np.array([[1.0, 2.0], [0.0, 0.0]], np.float32)
    p = np.array([[0.0, 0.0], [1.0, 3.0]], np.float32)
    for loss in ("mse", keras.losses.MeanSquaredError(), keras.losses.mean_squared_error):
        np.testing.assert_allclose(per_example_loss_fn(loss)(y, p).numpy(), [2.5, 5.0])
    with pytest.raises(ValueError, match="single loss"):
        per_example_loss_fn(["mse", "mse"])
    with pytest.raises(ValueError, match="compiled with a loss"):
        per_example_loss_fn(None)
    with pytest.raises(ValueError, match="l2_norm_clip must be > 0"):
        vectorized_clipped_sum(None, None, None, None, l2_norm_clip=-1.0)


def test_engine_registry(model):
    assert get_engine("vectorized") is vectorized_clipped_sum
    assert callable(get_engine("auto", model))
    with pytest.raises(ValueError, match="clipping must be one of"):
        get_engine("magic")


@pytest.mark.parametrize("onednn", ["1", "0"])
def test_reference_is_exact_on_both_kernel_paths(onednn):
    """The reference on the paper's GroupNorm CNN against a float64 per-example loop, in a
    process with oneDNN forced on / off (TensorFlow picks its kernels at start-up)."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": onednn, "PYTHONPATH": str(root), "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run([sys.executable, "-m", "tests.training.reference_exactness"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    errors = json.loads(out.stdout.strip().splitlines()[-1])
    assert errors["onednn"] == onednn
    assert errors["vectorized"] <= 1e-6, errors  # measured 6.0e-8 with oneDNN on and off
    assert errors["auto"] <= 3e-6, errors


def test_reference_runs_multi_head_attention_exactly():
    """pfor crashed (a segmentation fault) on MultiHeadAttention; the loop has no pfor."""
    keras.utils.set_random_seed(3)
    inp = keras.Input((4, 6))
    h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3)(inp, inp)
    out = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
    mha = keras.Model(inp, out)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(5, 4, 6)).astype("float32")
    y = rng.integers(0, 3, 5)
    w = np.array([1, 1, 0, 1, 1], np.float32)
    got = tf.function(lambda a, b, c: vectorized_clipped_sum(mha, per_example_loss_fn(LOSS), a, b, c,
                                                              l2_norm_clip=0.1))(x, y, w)
    total, norms, losses = _loop(mha, x, y, w, 0.1)
    for g, want in zip(got.grads, total):
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got.norms.numpy(), norms, rtol=1e-5, atol=1e-7)


def test_reference_runs_a_kernel_with_a_dimension_of_one_traced():
    """A Dense(1) then a Dense on sequences: TensorFlow's gradient of the (1, 3) kernel has a
    static shape (1, 3) for example 0 but (None, 3) at the loop's dynamic row, which the loop
    refused (Gemma3n's rank-1 LAuReL block under clipping="vectorized")."""
    keras.utils.set_random_seed(4)
    inp = keras.Input((4, 6))
    h = keras.layers.Dense(3)(keras.layers.Dense(1, activation="tanh")(inp))
    rank_one = keras.Model(inp, keras.layers.GlobalAveragePooling1D()(h))
    rng = np.random.default_rng(6)
    x = rng.normal(size=(5, 4, 6)).astype("float32")
    y = rng.integers(0, 3, 5)
    w = np.array([1, 0.5, 0, 1, 1], np.float32)
    got = tf.function(lambda a, b, c: vectorized_clipped_sum(rank_one, per_example_loss_fn(LOSS), a, b, c,
                                                              l2_norm_clip=0.1))(x, y, w)
    total, norms, _ = _loop(rank_one, x, y, w, 0.1)
    assert got.grads[2].shape == (1, 3)
    for g, want in zip(got.grads, total):
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got.norms.numpy(), norms, rtol=1e-5, atol=1e-7)
