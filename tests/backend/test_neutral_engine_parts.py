"""The engine parts written in Keras for any backend (``backend/common/kernel_rules.py``'s affine-scale
probe, ``backend/common/row_probe.py``), run here on the default backend (TensorFlow, eager), which
the JAX engine that uses them never is: the decisions are read against what the layers compute."""

import contextlib

import keras
import ml_dtypes
import numpy as np
import pytest

from keras_noisecurve.backend.common import kernel_rules, row_probe


class _Squared(keras.layers.Layer):
    """y = x ⊙ w²: one weight (d,), not affine in it."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.w * self.w


class _Rows(keras.layers.Layer):
    """Reshapes (P, L, d) to P·L token rows for its Dense, and back: the Dense's rows are not examples."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        p, length = keras.ops.shape(x)[0], keras.ops.shape(x)[1]
        rows = self.dense(keras.ops.reshape(x, (-1, x.shape[-1])))
        return keras.ops.reshape(rows, (p, length, 3))


@pytest.mark.parametrize("layer, affine", [
    (keras.layers.RMSNormalization(), True),  # y = x̂ ⊙ w
    (keras.layers.LayerNormalization(center=False), True),  # y = x̂ ⊙ γ
    (_Squared(), False),
    (keras.layers.LayerNormalization(), False),  # two weights
    (keras.layers.Dense(4), False),
])
def test_the_affine_scale_probe_runs_the_layer_where_keras_runs_it(layer, affine):
    layer.build((None, 3, 4))
    probe = kernel_rules.affine_scale_probe(scope=contextlib.nullcontext)
    assert probe(layer) is affine


def test_the_probe_runs_a_layer_once_and_again_when_its_weight_changes():
    calls = []

    class _Counted(keras.layers.RMSNormalization):
        def call(self, x):
            calls.append(1)
            return super().call(x)

    layer = _Counted()
    layer.build((None, 3, 4))
    probe = kernel_rules.affine_scale_probe(scope=contextlib.nullcontext)
    assert probe(layer) and calls
    ran = len(calls)
    assert probe(layer) and len(calls) == ran  # cached per layer and weight


def test_the_probe_finds_the_caller_of_a_layer_whose_rows_are_tokens():
    inputs = keras.Input((5, 4))
    rows = _Rows(name="rows")
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(rows(inputs)))
    probe = row_probe.Probe(model)
    with probe.installed():
        model(np.zeros((2, 5, 4), "float32"))
    seen = {layer.name: (rows_in, rows_out) for layer, rows_in, rows_out, _ in probe.calls}
    dense = rows.dense
    assert seen[dense.name] == (10, [10]) and seen["rows"] == (2, [2]) and seen["head"] == (2, [2])
    assert not row_probe.rows_ok(10, [10], 2, grouped=False)
    assert probe.caller(probe.chains(dense), dense.trainable_variables, 2) is rows
    assert probe.leak is None  # the default is_leak recognises nothing


def test_the_probe_counts_floating_outputs_only_and_keeps_a_leak_it_is_told_of():
    ids = keras.Input((3,), dtype="int32")
    embedding = keras.layers.Embedding(7, 2, name="emb")
    model = keras.Model(ids, embedding(ids))
    probe = row_probe.Probe(model)
    with probe.installed():
        model(np.zeros((4, 3), "int32"))
    assert [(rows_in, rows_out) for layer, rows_in, rows_out, _ in probe.calls if layer is embedding] == [(4, [4])]
    assert row_probe._floating(keras.ops.zeros((2,), "bfloat16"))
    assert not row_probe._floating(keras.ops.zeros((2,), "int32"))
    assert row_probe._floating(np.zeros(2, ml_dtypes.float8_e4m3fnuz))  # not a Keras dtype: read by its name

    class _Unlisted:  # an array of a dtype Keras does not know, not a float (a JAX key array's "key<fry>")
        shape, dtype = (2,), "key<fry>"

    assert not row_probe._floating(_Unlisted()) and not row_probe._floating(3.0)

    class _Labels(keras.layers.Layer):  # an integer output is not counted
        def call(self, x):
            return keras.ops.argmax(x, axis=-1)

    inputs = keras.Input((3,))
    labels = _Labels(name="labels")
    model = keras.Model(inputs, labels(inputs))
    probe = row_probe.Probe(model)
    with probe.installed():
        model(np.zeros((4, 3), "float32"))
    assert [(rows_in, rows_out) for layer, rows_in, rows_out, _ in probe.calls] == [(4, [])]

    class _Leaks(keras.layers.Layer):
        failing = False

        def call(self, x):
            if self.failing:
                raise RuntimeError("leaked")
            return x

    leaking = _Leaks(name="leaks")
    model = keras.Model(ids, leaking(keras.ops.cast(ids, "float32")))
    leaking.failing = True
    probe = row_probe.Probe(model, is_leak=lambda error: "leaked" in str(error))
    with pytest.raises(RuntimeError, match="leaked"), probe.installed():
        model(np.zeros((4, 3), "int32"))
    assert probe.leak == (leaking,)
