"""Ghost clipping of recurrent layers (LSTM, GRU, SimpleRNN) equals per-example clipping.

The reference is a Python loop over single examples with ``tf.GradientTape`` through
the layers' *own* Keras call (Keras's recurrence, not the rule's unrolled one), in
float64, so the tolerance (rtol 1e-5, atol 1e-5 × the largest entry of each variable's
reference) measures the method, not round-off. Sequences
are padded with token 0 (``Embedding(mask_zero=True)``), the clip ζ is the median
norm and one example has weight 0. Sizes: P = 6 examples, L = 7 steps, vocabulary
20, 5 units.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import keras

from tests.training.helpers import noiseless
from keras_noisecurve.backend.tensorflow import ghost
from keras_noisecurve.backend.tensorflow.ghost import ghost_clipped_sum, supports
from keras_noisecurve.backend.tensorflow.engine_rules import RULES, find_rule
from tests.training.helpers import float64_layers, loop_reference, mse, set_precision

P, L, VOCAB, UNITS, DIM = 6, 7, 20, 5, 4
RTOL = 1e-5
RECURRENT = next(rule for rule in RULES if rule.kind == "Recurrent")  # the common kernel in this engine


float64 = pytest.fixture(autouse=True)(float64_layers)


def padded_tokens(rng, n=P, length=L):
    """Token ids in 1..VOCAB-1, right-padded with 0 to different lengths (one unpadded)."""
    ids = rng.integers(1, VOCAB, size=(n, length))
    for i, keep in enumerate(rng.integers(2, length + 1, size=n)):
        ids[i, keep:] = 0
    ids[0, :] = rng.integers(1, VOCAB, size=length)
    return ids


def check_model(model, x, y, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.uniform(0.5, 2.0, size=P)
    w[1] = 0.0  # a padded example of the batch sampler
    ok, reason = supports(model)
    assert ok, reason
    norms, _ = loop_reference(model, mse, x, y, w, np.inf)
    assert np.count_nonzero(norms) == P - 1
    clip = float(np.median(norms[norms > 0]))
    norms_ref, sum_ref = loop_reference(model, mse, x, y, w, clip)
    got = ghost_clipped_sum(model, mse, x, y, w, l2_norm_clip=clip, training=False)
    np.testing.assert_allclose(got.norms.numpy(), norms_ref, rtol=RTOL, atol=1e-12)
    for v, g, r in zip(model.trainable_variables, got.grads, sum_ref):
        scale = np.max(np.abs(r))
        assert scale > 0, v.path  # every weight is reached
        np.testing.assert_allclose(np.asarray(g), r, rtol=RTOL, atol=RTOL * scale, err_msg=v.path)
    return got


def text_model(rnn, *, head=2, mask_zero=True):
    return keras.Sequential(
        [
            keras.Input((L,), dtype="int32"),
            keras.layers.Embedding(VOCAB, DIM, mask_zero=mask_zero),
            rnn,
            keras.layers.Dense(head),
        ]
    )


RNNS = {
    "lstm-impl2": lambda **k: keras.layers.LSTM(UNITS, **k),
    "lstm-impl1": lambda **k: keras.layers.LSTM(UNITS, implementation=1, **k),
    "gru-reset-after": lambda **k: keras.layers.GRU(UNITS, **k),
    "gru-reset-before": lambda **k: keras.layers.GRU(UNITS, reset_after=False, **k),
    "simple-rnn": lambda **k: keras.layers.SimpleRNN(UNITS, **k),
}


# -------------------------------------------------- clipped sum vs per-example loop


@pytest.mark.parametrize("name", sorted(RNNS))
@pytest.mark.parametrize("use_bias", [True, False])
def test_classifier_on_padded_sequences(name, use_bias):
    rng = np.random.default_rng(1)
    model = text_model(RNNS[name](use_bias=use_bias))
    check_model(model, padded_tokens(rng), rng.normal(size=(P, 2)))


@pytest.mark.parametrize("name", ["lstm-impl2", "gru-reset-after", "gru-reset-before", "simple-rnn"])
def test_sequence_outputs_backwards_without_mask(name):
    # return_sequences with a per-step head, go_backwards, no masking, linear/relu activations
    rng = np.random.default_rng(2)
    rnn = RNNS[name](return_sequences=True, go_backwards=True, activation="relu")
    model = text_model(rnn, head=3, mask_zero=False)
    check_model(model, rng.integers(0, VOCAB, size=(P, L)), rng.normal(size=(P, L, 3)))


@pytest.mark.parametrize("merge_mode", ["concat", "sum"])
@pytest.mark.parametrize("sequences", [True, False])
def test_bidirectional_lstm_and_gru(merge_mode, sequences):
    rng = np.random.default_rng(3)
    layers = [keras.Input((L,), dtype="int32"), keras.layers.Embedding(VOCAB, DIM, mask_zero=True)]
    layers.append(keras.layers.Bidirectional(keras.layers.LSTM(UNITS, return_sequences=True), merge_mode=merge_mode))
    layers.append(keras.layers.Bidirectional(keras.layers.GRU(UNITS, return_sequences=sequences)))
    layers.append(keras.layers.Dense(2))
    model = keras.Sequential(layers)
    y = rng.normal(size=(P, L, 2) if sequences else (P, 2))
    check_model(model, padded_tokens(rng), y)


def test_stacked_layers_initial_state_and_generic_rnn():
    # an LSTM's final states start a GRU-free decoder: RNN(LSTMCell) with initial_state,
    # plus a SimpleRNN sharing its weights across two calls.
    rng = np.random.default_rng(4)
    ids = keras.Input((L,), dtype="int32")
    emb = keras.layers.Embedding(VOCAB, DIM, mask_zero=True)(ids)
    _, h, c = keras.layers.LSTM(UNITS, return_state=True)(emb)
    decoded = keras.layers.RNN(keras.layers.LSTMCell(UNITS), return_sequences=True)(emb, initial_state=[h, c])
    shared = keras.layers.SimpleRNN(3)
    out = keras.layers.Concatenate()([shared(decoded), shared(decoded[:, ::-1] * 0.5)])
    model = keras.Model(ids, keras.layers.Dense(2)(out))
    check_model(model, padded_tokens(rng), rng.normal(size=(P, 2)))


# --------------------------------------------------------- the recorded forward


FORWARD_CASES = [
    dict(name=name, return_sequences=seq, return_state=state, go_backwards=back, mask=mask, init=init, zero=zero)
    for name in sorted(RNNS)
    for seq, state, back, mask, init, zero in [
        (False, False, False, None, False, False),
        (True, True, True, "random", True, False),
        (True, False, False, "left", False, True),
        (False, True, True, "left", True, True),
    ]
]


@pytest.mark.parametrize("case", FORWARD_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_recorded_forward_equals_the_layers_own_call(case):
    rng = np.random.default_rng(5)
    layer = RNNS[case["name"]](
        return_sequences=case["return_sequences"], return_state=case["return_state"],
        go_backwards=case["go_backwards"], zero_output_for_mask=case["zero"],
    )
    x = tf.constant(rng.normal(size=(P, L, DIM)))
    kwargs = {}
    if case["mask"] == "random":  # any pattern, including a fully masked example
        mask = rng.uniform(size=(P, L)) < 0.6
        mask[2] = False
        kwargs["mask"] = tf.constant(mask)
    elif case["mask"] == "left":  # left padding: the first steps of some examples are masked
        mask = np.ones((P, L), bool)
        mask[1, :3] = mask[4, :5] = False
        kwargs["mask"] = tf.constant(mask)
    if case["init"]:
        states = 2 if "lstm" in case["name"] else 1
        kwargs["initial_state"] = [tf.constant(rng.normal(size=(P, UNITS))) for _ in range(states)]
    want = layer(x, **kwargs)
    rule = find_rule(layer)
    assert rule is RECURRENT and rule.check(layer) is None
    with ghost._recording([(layer, rule)]) as recorder:
        got = layer(x, **kwargs)
    (call,) = recorder.calls[id(layer)]
    assert call["out"].shape == (P, L, layer.cell.kernel.shape[1])
    assert call["saved"]["h"].shape == (P, L, UNITS)
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-12, atol=1e-12)
    assert len(tf.nest.flatten(got)) == len(tf.nest.flatten(want))


# ------------------------------------------------------------- support and refusal


class PeepholeCell(keras.layers.LSTMCell):
    pass


def test_cell_weights_belong_to_the_recurrent_layer():
    bidirectional = keras.layers.Bidirectional(keras.layers.GRU(UNITS))
    model = text_model(bidirectional)
    owners = {id(layer): own for layer, _, own in ghost.plan(model)}
    embedding, dense = model.layers[0], model.layers[-1]
    rnns = [bidirectional.forward_layer, bidirectional.backward_layer]
    assert sorted(owners) == sorted(id(layer) for layer in [embedding, dense, *rnns])
    for rnn in rnns:  # the cell's kernel, recurrent kernel and bias, and no lookup of the cell itself
        cell = rnn.cell
        assert [id(v) for v in owners[id(rnn)]] == [id(cell.kernel), id(cell.recurrent_kernel), id(cell.bias)]


@pytest.mark.parametrize(
    "layer, match",
    [
        (keras.layers.GRU(UNITS, dropout=0.1), "dropout"),
        (keras.layers.SimpleRNN(UNITS, recurrent_dropout=0.2), "recurrent_dropout"),
        (keras.layers.RNN(PeepholeCell(UNITS)), None),
        (keras.layers.RNN([keras.layers.GRUCell(3), keras.layers.GRUCell(3)]), "StackedRNNCells"),
    ],
)
def test_configurations_the_rule_refuses_take_the_exact_per_layer_fallback(layer, match):
    model = keras.Sequential([keras.Input((L, DIM)), layer, keras.layers.Dense(2)])
    rule = RECURRENT
    if match is not None:
        assert rule.matches(layer) and match in rule.check(layer)
    assert ghost.describe(model)[0] == (layer.name, type(layer).__name__, "generic")
    rng = np.random.default_rng(9)
    check_model(model, rng.normal(size=(P, L, DIM)), rng.normal(size=(P, 2)))


def test_stateful_recurrent_layers_are_refused():
    model = keras.Sequential([keras.Input((L, DIM), batch_size=P), keras.layers.LSTM(UNITS, stateful=True, name="st")])
    ok, reason = supports(model)
    assert not ok and "stateful" in reason and "'st'" in reason


def test_unknown_batch_and_sequence_length_in_tf_function():
    # traced once for (None, None) inputs, run on two lengths: equals the eager loop
    rng = np.random.default_rng(7)
    model = keras.Sequential(
        [keras.Input((None,), dtype="int32"), keras.layers.Embedding(VOCAB, DIM, mask_zero=True),
         keras.layers.GRU(UNITS, return_sequences=True), keras.layers.LSTM(UNITS), keras.layers.Dense(2)]
    )
    assert supports(model)[0]

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None, 2], tf.float64)])
    def step(x, y):
        out = ghost_clipped_sum(model, mse, x, y, None, l2_norm_clip=0.05)
        return out.norms, out.grads

    for length in (L, 3):
        x, y = padded_tokens(rng, length=length), rng.normal(size=(P, 2))
        norms_ref, sum_ref = loop_reference(model, mse, x, y, np.ones(P), 0.05)
        norms, grads = step(tf.constant(x, tf.int32), tf.constant(y))
        np.testing.assert_allclose(norms.numpy(), norms_ref, rtol=RTOL)
        for g, r in zip(grads, sum_ref):
            np.testing.assert_allclose(np.asarray(g), r, rtol=RTOL, atol=RTOL * np.max(np.abs(r)))
    assert len(step.get_concrete_function().graph.get_operations()) > 0
    assert step.experimental_get_tracing_count() == 1


# ---------------------------------------------------------- make_private integration


def test_make_private_fit_lstm_classifier_takes_the_clipped_sgd_step():
    # One fit step with σ = 0 moves the weights by exactly −η·Σ_i clip(g_i)/B, the
    # clipped sum from the per-example loop; clipping="auto" picks the ghost engine.
    from keras_noisecurve.training import NoiseCurveOptimizer, make_private
    from keras_noisecurve.backend.tensorflow.clipping import get_engine

    set_precision("float32")
    rng = np.random.default_rng(6)
    model = text_model(keras.layers.LSTM(UNITS))
    x, y = padded_tokens(rng), rng.normal(size=(P, 2)).astype("float32")
    before = [v.numpy().astype(np.float64) for v in model.trainable_variables]
    norms, _ = loop_reference(model, mse, x, y, np.ones(P), np.inf)
    clip = float(np.median(norms))
    _, total = loop_reference(model, mse, x, y, np.ones(P), clip)
    private = make_private(model, clipping="auto")
    assert get_engine("auto", private) is ghost_clipped_sum
    lr = 0.5
    private.compile(
        optimizer=noiseless(NoiseCurveOptimizer(learning_rate=lr, l2_norm_clip=clip, noise_multiplier=1.0,
                                                expected_batch_size=P, seed=0)),
        loss="mse",
    )
    private.fit(x, y, batch_size=P, epochs=1, shuffle=False, verbose=0)
    assert private._engine() is ghost_clipped_sum
    for v, w0, s in zip(model.trainable_variables, before, total):
        np.testing.assert_allclose(v.numpy(), w0 - lr * s / P, rtol=1e-4, atol=1e-5, err_msg=v.path)
