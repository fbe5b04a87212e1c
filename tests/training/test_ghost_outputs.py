"""Per-example gradients are seeded only with the gradient from OUTSIDE a layer.

The per-layer fallback re-runs a layer per example and differentiates all its outputs,
so it must be seeded with the gradient that flows into each output from code outside
the layer, whatever the layer returns: an intermediate tensor it also used for its other
output (as T5's attention returns its ``position_bias``), a dict, an output that a later
call of the same layer consumes, a layer shared by several calls. Each model below is
compared in float64 with an independent loop over single examples (plain
``tf.GradientTape``); the clip is the median norm, so some examples are clipped.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import keras

from keras_noisecurve.backend.tensorflow.ghost import describe, ghost_clipped_sum
from tests.training.helpers import float64_layers, loop_reference, mse

P, D = 6, 4
RTOL = 1e-9

float64 = pytest.fixture(autouse=True)(float64_layers)


class ReturnsIntermediate(keras.layers.Layer):
    """``h = x·W``; returns ``(tanh(h)·v + h, h)``: ``h`` is used inside AND returned."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], D), name="w")
        self.v = self.add_weight(shape=(D,), initializer="ones", name="v")

    def call(self, x):
        h = tf.matmul(x, self.w)
        return tf.tanh(h) * self.v + h, h


class BiasOnce(keras.layers.Layer):
    """T5-like: the first call computes a bias from its weight and returns it; a later
    call of the SAME layer takes it back in as an argument."""

    def build(self, shape):
        self.b = self.add_weight(shape=(shape[-1],), name="b")
        self.s = self.add_weight(shape=(), initializer="ones", name="s")

    def call(self, x, bias=None):
        if bias is None:
            bias = tf.sin(self.b) * tf.reduce_mean(x, axis=-1, keepdims=True)
        return tf.tanh(x * self.s + bias), bias


class DictOut(keras.layers.Layer):
    """Returns a dict: ``"sum"`` is built from ``"gate"``, both go out."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), name="w")

    def call(self, x):
        gate = tf.sigmoid(x * self.w)
        return {"gate": gate, "sum": gate * x + self.w, "same": gate}


class Scale(keras.layers.Layer):
    """``x·w`` per feature plus ``c``: a layer to share."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="random_normal", name="w")
        self.c = self.add_weight(shape=(), initializer="ones", name="c")

    def call(self, x):
        return tf.tanh(x * self.w + self.c)


def _intermediate():
    x = keras.Input((5,))
    out, h = ReturnsIntermediate()(x)
    return keras.Model(x, keras.layers.Dense(2)(keras.ops.concatenate([out, h * h], axis=-1)))


def _bias_reused():
    x = keras.Input((D,))
    layer = BiasOnce()
    a, bias = layer(keras.layers.Dense(D)(x))
    b, _ = layer(a, bias=bias)  # the returned bias goes back into the same layer
    return keras.Model(x, keras.layers.Dense(2)(b + bias))


def _dict():
    x = keras.Input((D,))
    d = DictOut()(keras.layers.Dense(D)(x))
    return keras.Model(x, keras.layers.Dense(2)(d["sum"] * d["gate"] + d["same"]))


def _shared_chain():
    x = keras.Input((D,))
    layer = Scale()
    h1 = layer(x)
    h2 = layer(h1)  # the output of one call feeds the next call of the same layer
    h3 = layer(keras.layers.Dense(D)(h2 + h1))
    return keras.Model(x, keras.layers.Dense(2)(h3 * h1))


MODELS = {"intermediate": _intermediate, "bias-reused": _bias_reused, "dict": _dict, "shared-chain": _shared_chain}


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_fallback_matches_a_per_example_loop(name, traced):
    model = MODELS[name]()
    assert "generic" in [how for _, _, how in describe(model)]
    rng = np.random.default_rng(3)
    x = rng.normal(size=(P,) + tuple(model.input.shape[1:]))
    y = rng.normal(size=(P, 2))
    w = rng.uniform(0.5, 2.0, size=P)
    w[1] = 0.0
    unclipped, _ = loop_reference(model, mse, x, y, w, np.inf)
    clip = float(np.median(unclipped[unclipped > 0]))
    norms_ref, sum_ref = loop_reference(model, mse, x, y, w, clip)

    def engine(x, y, w):
        return ghost_clipped_sum(model, mse, x, y, w, l2_norm_clip=clip, training=False)

    got = (tf.function(engine) if traced else engine)(x, y, w)
    np.testing.assert_allclose(got.norms.numpy(), norms_ref, rtol=RTOL, atol=1e-14)
    for v, g, r in zip(model.trainable_variables, got.grads, sum_ref):
        np.testing.assert_allclose(np.asarray(g), r, rtol=RTOL, atol=1e-12, err_msg=v.path)


class Broadcast(keras.layers.Layer):
    """Adds a learned row to every example, computed by a Dense on ONE constant row and
    broadcast: its input has 1 row whatever the batch."""

    def build(self, shape):
        self.proj = keras.layers.Dense(shape[-1])
        self.proj.build((1, 3))

    def call(self, x):
        return x + self.proj(tf.ones((1, 3), x.dtype))


class Tokens(keras.layers.Layer):
    """A Dense on the P·L token rows of a (P, L, D) batch, reshaped back."""

    def build(self, shape):
        self.dense = keras.layers.Dense(shape[-1], activation="tanh")
        self.dense.build((None, shape[-1]))

    def call(self, x):
        rows = tf.reshape(x, (-1, x.shape[-1]))
        return tf.reshape(self.dense(rows) * rows, tf.shape(x)), rows


def _assert_rows_match_the_loop(model, rng):
    """The traced engine's norms and clipped sum on P sequences of 3 rows equal the
    per-example float64 loop's, at the median norm as the clip."""
    x, y = rng.normal(size=(P, 3, D)), rng.normal(size=(P, 2))
    w = rng.uniform(0.5, 2.0, size=P)
    unclipped, _ = loop_reference(model, mse, x, y, w, np.inf)
    clip = float(np.median(unclipped))
    norms_ref, sum_ref = loop_reference(model, mse, x, y, w, clip)
    got = tf.function(lambda x, y, w: ghost_clipped_sum(model, mse, x, y, w, l2_norm_clip=clip, training=False))(x, y, w)
    np.testing.assert_allclose(got.norms.numpy(), norms_ref, rtol=RTOL, atol=1e-14)
    for v, g, r in zip(model.trainable_variables, got.grads, sum_ref):
        np.testing.assert_allclose(np.asarray(g), r, rtol=RTOL, atol=1e-12, err_msg=v.path)


def test_rows_that_are_not_examples_are_clipped_through_their_caller():
    rng = np.random.default_rng(5)
    inputs = keras.Input((3, D))
    h = Broadcast()(inputs)
    h, rows = Tokens()(h)
    out = keras.layers.Dense(2)(keras.ops.mean(h, axis=1) + keras.ops.mean(rows) * 0.0)
    model = keras.Model(inputs, out)
    how = {cls: kind for _, cls, kind in describe(model)}  # known before any step
    assert how == {"Broadcast": "generic", "Tokens": "generic", "Dense": "Dense"}
    _assert_rows_match_the_loop(model, rng)


def test_rows_refused_before_compile_when_no_caller_takes_examples():
    import keras_noisecurve as knc
    from keras_noisecurve.backend.tensorflow.ghost import supports

    inputs = keras.Input((3, D))
    flat = keras.layers.Lambda(lambda t: tf.reshape(t, (-1, D)))(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(flat))  # outputs are P·3 rows
    ok, reason = supports(model)
    assert not ok and "rows that are not examples" in reason and "vectorized" not in reason
    with pytest.raises(ValueError, match="rows that are not examples"):
        knc.make_private(model)


class Router(keras.layers.Layer):
    """Owns a weight, takes (P, L, D) and returns (P, L, D) plus its P·L router rows."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 2), name="w")

    def call(self, x):
        logits = tf.matmul(tf.reshape(x, (-1, x.shape[-1])), self.w)
        gate = tf.reshape(tf.sigmoid(logits[:, :1]), (-1, x.shape[1], 1))
        return x * gate, logits


def test_a_layer_returning_token_rows_is_its_own_caller():
    rng = np.random.default_rng(6)
    inputs = keras.Input((3, D))
    h, logits = Router()(inputs)
    per_example = keras.ops.mean(keras.ops.reshape(logits, (-1, 6)), axis=1, keepdims=True)  # P·3 rows back to P
    out = keras.layers.Dense(2)(keras.ops.mean(h, axis=1)) + 0.1 * per_example
    model = keras.Model(inputs, out)
    _assert_rows_match_the_loop(model, rng)
