"""Per-token losses on TensorFlow: one private step with (P, L) sample weights and a masked
sequence model equals an INDEPENDENT per-example loop (a ``tf.GradientTape`` per example of
a hand-written loss, clipping in float64 numpy). tests/jax/test_jax_losses.py does the same on JAX."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve import NoiseCurveOptimizer, make_private

B, L, V, CLIP, LR = 6, 5, 9, 0.5, 0.5


def _lm(mask_zero):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((L,), dtype="int32"), keras.layers.Embedding(V, 4, mask_zero=mask_zero),
                             keras.layers.Dense(V)])


@pytest.mark.parametrize("clipping", ["auto", "vectorized"])
@pytest.mark.parametrize("case", ["per_token_weights", "mask_zero"])
def test_one_step_equals_the_per_example_loop(case, clipping):
    rng = np.random.default_rng(0)
    x = rng.integers(1, V, (B, L)).astype("int32")
    x[:, 3:] *= rng.integers(0, 2, (B, 1)).astype("int32")
    y = rng.integers(0, V, (B, L)).astype("int32")
    mask_zero = case == "mask_zero"
    weights = rng.uniform(0, 2, (B, L)).astype(np.float32) if case == "per_token_weights" else None
    mask = (x != 0) if mask_zero else np.ones((B, L), bool)
    model, twin = _lm(mask_zero), _lm(mask_zero)
    start = [w.numpy().astype(np.float64) for w in twin.trainable_variables]
    sums = [np.zeros_like(w) for w in start]
    for i in range(B):
        with tf.GradientTape() as tape:
            logits = twin(x[i:i + 1], training=True)
            ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y[i:i + 1], logits=logits)[0]
            w = np.ones(L, np.float32) if weights is None else weights[i]
            loss = tf.reduce_sum(ce * w * mask[i]) / np.sum(mask[i])
        grads = [tf.convert_to_tensor(g).numpy().astype(np.float64)
                 for g in tape.gradient(loss, twin.trainable_variables)]
        norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
        for s, g in zip(sums, grads):
            s += min(1.0, CLIP / norm) * g
    private = make_private(model, clipping=clipping)
    private.compile(optimizer=NoiseCurveOptimizer(learning_rate=LR, l2_norm_clip=CLIP, noise_multiplier=1e-9,
                                                  expected_batch_size=B, seed=0),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    private.train_on_batch(x, y, sample_weight=weights)
    for got, w0, s in zip(model.trainable_variables, start, sums):
        np.testing.assert_allclose(got.numpy(), w0 - LR * s / B, rtol=1e-4, atol=1e-6)
