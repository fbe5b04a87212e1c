"""The custom training loop of docs/training.md equals a private model's fit; microbatching; memory."""

import keras
import numpy as np
import tensorflow as tf

from keras_noisecurve.training import NoiseCurveOptimizer, make_private
from keras_noisecurve.backend.tensorflow.clipping import add_regularization, get_engine, per_example_loss_fn
from tests.training.helpers import random_banded_c

B = 6
C = random_banded_c(4, 3, rng=np.random.default_rng(0), diag_scale=0.5)


def _base(weights=None):
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, activation="relu", kernel_regularizer=keras.regularizers.L2(0.1)),
         keras.layers.Dense(2)]
    )
    if weights is not None:
        model.set_weights(weights)
    return model


def _opt():
    return NoiseCurveOptimizer(learning_rate=0.1, mixing=C, l2_norm_clip=0.5, noise_multiplier=1.0,
                               expected_batch_size=B, seed=3)


def test_custom_loop_equals_fit_with_microbatches():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2 * B, 3)).astype("float32")
    y = rng.integers(0, 2, 2 * B)
    mask = np.ones(2 * B, np.float32)
    mask[[2, 7]] = 0.0
    keras.utils.set_random_seed(0)
    init = _base().get_weights()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    # the loop from docs/training.md
    model = _base(init)
    engine = get_engine("vectorized")
    loss_fn = per_example_loss_fn(loss)
    opt = _opt()

    @tf.function
    def train_step(x, y, mask):
        clipped = engine(model, loss_fn, x, y, mask, l2_norm_clip=opt.l2_norm_clip)
        clipped = add_regularization(model, clipped, expected_batch_size=B)
        opt.apply_clipped_sum(clipped.grads, model.trainable_variables)
        return clipped.per_example_loss

    for s in range(2):
        train_step(x[s * B : (s + 1) * B], y[s * B : (s + 1) * B], mask[s * B : (s + 1) * B])

    # fit with microbatches of 4 (6 = 4 + 2: a ragged last chunk)
    private = make_private(_base(init), clipping="vectorized", microbatch_size=4)
    private.compile(optimizer=_opt(), loss=loss)
    private.fit(x, y, sample_weight=mask, batch_size=B, epochs=1, shuffle=False, verbose=0)

    for a, b in zip(model.get_weights(), private.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    params = sum(int(np.prod(w.shape)) for w in init)
    assert opt.noise_state_bytes() == (C.bands - 1) * params * 4
