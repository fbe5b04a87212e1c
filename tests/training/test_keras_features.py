"""Keras features on a private model: ``class_weight``, ``add_loss``, one built-in loss on
several outputs, ``evaluate``/``predict`` — each step checked against a hand-computed
per-example loop (σ = 0, one SGD step: w − η·(Σ_i clip(w_i·∇loss_i) / B + ∇penalty))."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_noisecurve as knc
from keras_noisecurve.training import NoiseCurveOptimizer, make_private
from tests.training.helpers import noiseless

B, LR, CLIP = 8, 0.2, 1.0


def _opt():
    return noiseless(NoiseCurveOptimizer(learning_rate=LR, l2_norm_clip=CLIP, noise_multiplier=1.0,
                                         expected_batch_size=B, seed=0))


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(5)


def _data(outputs=1):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    return x, y, rng


def _loop_step(model, per_example_loss, x, y, weights, penalty_grad=None):
    """Expected weights after one step, by a loop over single examples (plain GradientTape)."""
    variables = model.trainable_variables
    total = [np.zeros(v.shape) for v in variables]
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = weights[i] * per_example_loss(i)
        g = [np.asarray(t) for t in tape.gradient(loss, variables, unconnected_gradients="zero")]
        n = np.sqrt(sum(np.sum(a**2) for a in g))
        total = [s + a * (min(1.0, CLIP / n) if n > 0 else 1.0) for s, a in zip(total, g)]
    penalty_grad = penalty_grad or [np.zeros(v.shape) for v in variables]
    return [v.numpy() - LR * (s / B + p) for v, s, p in zip(variables, total, penalty_grad)]


def _dense():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)])


# ------------------------------------------------------------------ class_weight
def test_class_weight_multiplies_each_example_before_clipping():
    x, y, _ = _data()
    model = _dense()
    cw = {0: 3.0, 1: 0.25}
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    expected = _loop_step(model, lambda i: sce(y[i : i + 1], model(x[i : i + 1])), x, y, [cw[int(c)] for c in y])
    private = make_private(model)
    private.compile(optimizer=_opt(), loss=sce)
    private.fit(x, y, batch_size=B, epochs=1, class_weight=cw, verbose=0)
    for v, e in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(v.numpy(), e, rtol=1e-5, atol=1e-6, err_msg=v.path)


def test_class_weight_with_a_private_run_and_bad_values():
    x, y, _ = _data()
    model = _dense()
    run = knc.PrivateRun(num_examples=B, batch_size=4, steps=2, noise_multiplier=1.0, delta=1e-5,
                         sampling="fixed_epochs", seed=3)
    private = make_private(model)
    private.compile(optimizer=noiseless(knc.NoiseCurveOptimizer(run=run, learning_rate=LR, l2_norm_clip=CLIP)),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [v.numpy().copy() for v in model.trainable_variables]
    private.fit(run.dataset(x, y), class_weight={0: 0.0, 1: 0.0}, verbose=0)  # every example weighs 0
    assert int(private.optimizer.iterations.numpy()) == 2
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(v.numpy(), b)
    with pytest.raises(ValueError, match="class_weight keys"):
        private.fit(run.dataset(x, y), class_weight={-1: 1.0}, verbose=0)
    with pytest.raises(ValueError, match="finite weight"):
        private.fit(run.dataset(x, y), class_weight={0: float("nan")}, verbose=0)


# ---------------------------------------------------------------------- add_loss
class Penalised(keras.layers.Layer):
    """``x·W`` that adds ``c·Σ W²`` (weights only), or ``c·Σ x²`` (the data) with ``on_data``."""

    def __init__(self, c=0.5, on_data=False, **kwargs):
        super().__init__(**kwargs)
        self.c, self.on_data = c, on_data

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 2), name="w")

    def call(self, x):
        self.add_loss(self.c * tf.reduce_sum(tf.square(x if self.on_data else self.w)))
        return tf.matmul(x, self.w)


def test_add_loss_on_weights_is_added_unclipped_like_a_regulariser():
    x, y, _ = _data()
    layer = Penalised(0.5)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), layer])
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    grad_penalty = [np.zeros(v.shape) for v in model.trainable_variables]
    grad_penalty[[v.path for v in model.trainable_variables].index(layer.w.path)] = 2 * 0.5 * layer.w.numpy()
    expected = _loop_step(model, lambda i: sce(y[i : i + 1], model(x[i : i + 1])), x, y, np.ones(B), grad_penalty)
    private = make_private(model)
    private.compile(optimizer=_opt(), loss=sce)
    private.fit(x, y, batch_size=B, epochs=1, verbose=0)
    for v, e in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(v.numpy(), e, rtol=1e-5, atol=1e-6, err_msg=v.path)


def test_add_loss_on_the_data_is_refused_not_dropped():
    x, y, _ = _data()
    model = keras.Sequential([keras.Input((4,)), Penalised(0.5, on_data=True)])
    private = make_private(model)
    private.compile(optimizer=_opt(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [v.numpy().copy() for v in model.trainable_variables]
    with pytest.raises(ValueError, match="depends on the batch"):
        private.fit(x, y, batch_size=B, epochs=1, verbose=0)
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(v.numpy(), b)


# ------------------------------------------------------------- several outputs
def _two_outputs(as_dict):
    inputs = keras.Input((4,))
    h = keras.layers.Dense(3, activation="tanh")(inputs)
    a, b = keras.layers.Dense(2, name="a")(h), keras.layers.Dense(1, name="b")(h)
    return keras.Model(inputs, {"a": a, "b": b} if as_dict else [a, b])


@pytest.mark.parametrize("as_dict", [False, True], ids=["list", "dict"])
def test_one_built_in_loss_is_applied_to_each_output_and_summed(as_dict):
    x, _, rng = _data()
    ya, yb = rng.normal(size=(B, 2)).astype("float32"), rng.normal(size=(B, 1)).astype("float32")
    y = {"a": ya, "b": yb} if as_dict else [ya, yb]
    model = _two_outputs(as_dict)

    def loss_i(i):  # Keras's semantics: mse of each output, summed
        out = model(x[i : i + 1])
        pa, pb = (out["a"], out["b"]) if as_dict else out
        return tf.reduce_mean(tf.square(pa - ya[i : i + 1])) + tf.reduce_mean(tf.square(pb - yb[i : i + 1]))

    expected = _loop_step(model, loss_i, x, y, np.ones(B))
    private = make_private(model)
    private.compile(optimizer=_opt(), loss="mse")
    private.fit(x, y, batch_size=B, epochs=1, verbose=0)
    for v, e in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(v.numpy(), e, rtol=1e-5, atol=1e-6, err_msg=v.path)
    want = np.mean([float(loss_i(i)) for i in range(B)])
    assert private.evaluate(x, y, batch_size=B, verbose=0) == pytest.approx(want, rel=1e-5)
    predicted = private.predict(x, verbose=0)
    assert (predicted["a"] if as_dict else predicted[0]).shape == (B, 2)


def test_evaluate_with_one_combined_loss_over_dict_outputs():
    x, _, rng = _data()
    y = {"a": rng.normal(size=(B, 2)).astype("float32"), "b": rng.normal(size=(B, 1)).astype("float32")}
    model = _two_outputs(True)

    def combined(y_true, y_pred):  # the user's own function: gets the whole dicts
        return tf.reduce_mean(tf.square(y_true["a"] - y_pred["a"]), axis=-1) + 3.0 * tf.square(
            y_true["b"][:, 0] - y_pred["b"][:, 0])

    private = make_private(model)
    private.compile(optimizer=_opt(), loss=combined)
    private.fit(x, y, batch_size=B, epochs=1, verbose=0)
    want = float(np.mean(combined(y, model(x))))
    assert private.evaluate(x, y, batch_size=B, verbose=0) == pytest.approx(want, rel=1e-5)
    assert private.predict(x, verbose=0)["b"].shape == (B, 1)
