"""A weight read outside its own layer's call (TensorFlow engine, ``engine_reads``).

Such a read is clipped through the innermost layer enclosing the read and every call of
the weight's layer whose calls take one row per example (the model itself at worst), or
refused. Every check compares against the per-example float64 ``GradientTape`` loop of
``tests/training/helpers.py`` (``loop_reference``), independent of the engines.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.backend.tensorflow.ghost import describe, ghost_clipped_sum, supports
from tests.training.helpers import float64_layers, loop_reference, mse

P = 5

float64 = pytest.fixture(autouse=True)(float64_layers)


def _compare(model, x, y, *, eager=False, loss_fn=mse):
    """Norms and clipped sum (ζ = the median norm, one padded example) against the loop."""
    rng = np.random.default_rng(7)
    w = rng.uniform(0.5, 2.0, size=P)
    w[1] = 0.0
    norms, _ = loop_reference(model, loss_fn, x, y, w, np.inf)
    assert np.count_nonzero(norms) == P - 1
    clip = float(np.median(norms[norms > 0]))
    norms, total = loop_reference(model, loss_fn, x, y, w, clip)
    assert min(norms[norms > 0]) < clip < max(norms)  # some examples clipped, some not

    def run(x, y, w):
        return ghost_clipped_sum(model, loss_fn, x, y, w, l2_norm_clip=clip, training=False)

    got = run(x, y, w) if eager else tf.function(run)(x, y, w)
    np.testing.assert_allclose(got.norms.numpy(), norms, rtol=1e-10, atol=1e-14)
    assert len(got.grads) == len(total)
    scale = max(np.max(np.abs(r)) for r in total)
    for g, r in zip(got.grads, total):
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-10, atol=1e-12 * scale)


class KernelReader(keras.layers.Layer):
    """Calls its sublayer ``inner`` AND applies ``inner.kernel`` and ``inner.bias`` directly
    (Gemma4's decoder block reads its feed-forward kernels so); ``called=False``: only the
    direct read, ``inner`` is never called."""

    def __init__(self, units, called=True, **kwargs):
        super().__init__(**kwargs)
        self.called = called
        self.inner = keras.layers.Dense(units, name="inner")
        self.gate = keras.layers.Dense(units, name="gate")

    def build(self, input_shape):
        self.inner.build(input_shape)
        self.gate.build(input_shape)

    def call(self, x):
        direct = keras.ops.matmul(x, self.inner.kernel) + self.inner.bias
        called = self.inner(x) if self.called else direct
        return keras.activations.tanh(self.gate(x)) * direct + called * called


def _reader_model(shape, called):
    inputs = keras.Input(shape)
    h = keras.layers.Dense(3, activation="tanh", name="first")(inputs)
    h = KernelReader(4, called=called, name="reader")(h)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(h))


@pytest.mark.parametrize("called", [True, False], ids=["also-called", "never-called"])
@pytest.mark.parametrize("shape", [(3,), (4, 3)], ids=["vectors", "sequences"])
def test_a_layer_reading_its_sublayers_kernel_is_clipped_through_that_layer(shape, called):
    model = _reader_model(shape, called)
    # the reader takes the inner Dense (and its other sublayer) with it; the rest keep their rules
    assert describe(model) == [("first", "Dense", "Dense"), ("head", "Dense", "Dense"),
                               ("reader", "KernelReader", "generic")]
    assert describe(model, inside=True)[2:] == [("reader", "KernelReader", "generic"),
                                                ("inner", "Dense", "through 'reader'"),
                                                ("gate", "Dense", "through 'reader'")]
    rng = np.random.default_rng(len(shape) + 2 * called)
    x, y = rng.normal(size=(P, *shape)), rng.normal(size=(P, *shape[:-1], 2))
    _compare(model, x, y)
    _compare(model, x, y, eager=True)


class SharedOwner(keras.layers.Layer):
    """Reads its sublayer ``inner``'s kernel directly, and owns ``other``, which the model
    calls outside this layer (Gemma3n's text model owns the token embedding that its
    backbone calls)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(3, name="inner")
        self.other = keras.layers.Dense(3, name="other")

    def build(self, input_shape):
        self.inner.build(input_shape)
        self.other.build(input_shape)

    def call(self, x):
        return keras.activations.tanh(keras.ops.matmul(x, self.inner.kernel) + self.inner.bias)


def test_a_caller_whose_sublayer_is_also_used_outside_it_is_passed_over_for_an_outer_one():
    # 'owner' encloses the read and takes one row per example, but a weight under it is used
    # outside its call ('other', called by the model): re-running 'owner' per example would
    # miss that use, so the model (the next enclosing layer) is the caller
    inputs = keras.Input((3,))
    owner = SharedOwner(name="owner")
    h = owner(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(owner.other(h) * h), name="outer")
    assert describe(model) == [("outer", "Functional", "generic")]
    rng = np.random.default_rng(13)
    _compare(model, rng.normal(size=(P, 3)), rng.normal(size=(P, 2)))


class Gain(keras.layers.Layer):
    """A (d,) weight ``g``; its own call is x·g, but the model below also reads ``g`` itself
    (Gemma3n's decoder block multiplies by its AltUp layer's ``correct_output_scale``)."""

    def build(self, input_shape):
        self.g = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="g")

    def call(self, x):
        return x * self.g


class GainModel(keras.Model):
    """A subclassed model whose own call multiplies by its sublayer's weight: only the
    model encloses that read and the sublayer's call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(3, activation="tanh", name="first")
        self.gain = Gain(name="gain")
        self.head = keras.layers.Dense(2, name="head")

    def call(self, x):
        h = self.first(x)
        return self.head(self.gain(h) + keras.ops.square(self.gain.g) * h)


def test_a_model_multiplying_by_its_sublayers_weight_is_clipped_through_the_model():
    rng = np.random.default_rng(11)
    model = GainModel()
    x, y = rng.normal(size=(P, 4)), rng.normal(size=(P, 2))
    model(x)
    for v in model.trainable_variables:  # away from the initial values (g = 1, zero biases)
        v.assign(v + rng.normal(scale=0.3, size=v.shape))
    _compare(model, x, y)
    _compare(model, x, y, eager=True)


class Table(keras.layers.Layer):
    """Returns its sibling's kernel (shape (3, 4)): an output that is not one row per example."""

    def __init__(self, other, **kwargs):
        super().__init__(**kwargs)
        self.other = other

    def call(self, x):
        return self.other.kernel + 0.0 * keras.ops.sum(x)


def test_a_read_with_no_per_example_caller_is_refused_naming_the_weight_and_the_reader():
    from keras_noisecurve.training import make_private

    encoder = keras.layers.Dense(4, name="enc")
    inputs = keras.Input((5,))  # the table has 5 rows (not the probe's batch of 3)
    # the model returns the table read by 'table' beside its per-example output: no layer
    # encloses that read with per-example rows, not even the model
    model = keras.Model(inputs, [encoder(inputs), Table(encoder, name="table")(inputs)])
    ok, reason = supports(model)
    assert not ok
    assert "'enc/kernel' of Dense layer 'enc' is read outside that layer's own call" in reason
    assert "Table layer 'table'" in reason and "one row per example" in reason
    with pytest.raises(ValueError, match=r"'enc/kernel' of Dense layer 'enc' is read outside .*'table'"):
        make_private(model)  # refused before compile
    with pytest.raises(ValueError, match=r"'enc/kernel'.*read outside"):
        ghost_clipped_sum(model, lambda y, p: mse(y, p[0]), np.ones((P, 5)), np.ones((P, 4)), None, l2_norm_clip=1.0)


def test_a_read_the_probe_cannot_see_is_refused_when_the_step_is_traced(monkeypatch):
    # without the probe (here: switched off), the traced step's graph still shows the read
    from keras_noisecurve.backend.tensorflow import engine_rows

    monkeypatch.setattr(engine_rows, "_input_specs", lambda model, like=None: None)
    model = _reader_model((3,), called=True)
    assert ("inner", "Dense", "Dense") in describe(model)  # planned under its own rule
    step = tf.function(lambda x, y: ghost_clipped_sum(model, mse, x, y, None, l2_norm_clip=1.0).grads)
    with pytest.raises(ValueError, match=r"inner/kernel' of Dense layer 'inner' is read outside that layer's own "
                                         r"call .*one row per example"):
        step(np.ones((P, 3)), np.ones((P, 2)))


def test_describe_takes_inside_as_a_boolean():
    model = _reader_model((3,), called=True)
    with pytest.raises(TypeError, match="inside must be True or False, got 'yes'"):
        describe(model, inside="yes")
