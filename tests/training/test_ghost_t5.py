"""T5's relative-attention bias is clipped by its own rule (ghost_t5), never re-run per example.

A tiny float64 T5 (KerasHub ``T5Backbone`` under ``T5Seq2SeqLM``, random weights, padded
encoder and decoder of different lengths, three layers per stack so the first layer's
``position_bias`` is reused by two later layers) against an independent loop over single
examples (plain ``tf.GradientTape``): the per-example norms, the clipped sum, and the bias
table's own per-example norm (the term the rule computes), eagerly and traced, with
a dynamic sequence length too; and the table's per-example norm under ``mixed_bfloat16``.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import keras

from keras_noisecurve import _compat
from keras_noisecurve._losses import per_example_loss_fn
from keras_noisecurve.backend.tensorflow.ghost import describe, ghost_clipped_sum, observe_layer_norms
from keras_noisecurve.backend.tensorflow.ghost_t5 import RelativeAttentionBiasRule, bucket_ids
from tests.training.helpers import float64_layers, loop_reference

keras_hub = pytest.importorskip("keras_hub")

P, VOCAB, WIDTH, ENC_LEN, DEC_LEN = 5, 30, 8, 7, 5
RTOL = 1e-10
KIND = RelativeAttentionBiasRule.kind

float64 = pytest.fixture(autouse=True)(float64_layers)


def _tokens(rng, length):
    ids = rng.integers(1, VOCAB, size=(P, length)).astype("int32")
    mask = np.ones((P, length), "int32")
    for i in range(P):  # the later examples are shorter (padding id 0, mask 0)
        cut = length - (i % 3)
        ids[i, cut:], mask[i, cut:] = 0, 0
    return ids, mask


def _t5(num_layers=3):
    backbone = keras_hub.models.T5Backbone(
        vocabulary_size=VOCAB, num_layers=num_layers, num_heads=2, hidden_dim=WIDTH, intermediate_dim=2 * WIDTH,
        key_value_dim=WIDTH // 2, dropout=0.0, dtype="float64",
    )
    model = keras_hub.models.T5Seq2SeqLM(backbone=backbone, preprocessor=None)
    rng = np.random.default_rng(3)
    enc, enc_mask = _tokens(rng, ENC_LEN)
    dec, dec_mask = _tokens(rng, DEC_LEN)
    x = {"encoder_token_ids": enc, "encoder_padding_mask": enc_mask,
         "decoder_token_ids": dec, "decoder_padding_mask": dec_mask}
    y = np.concatenate([dec[:, 1:], np.zeros((P, 1), "int32")], axis=1)
    model(x)
    # a non-zero bias (KerasHub initialises it at random; make sure it matters for every head)
    for layer in _bias_layers(model):
        table = layer.relative_attention_bias
        table.assign(rng.normal(scale=0.5, size=table.shape))
    loss_fn = per_example_loss_fn(keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0))
    return model, x, y, loss_fn


def _bias_layers(model):
    return [layer for layer in _compat.flatten_layers(model) if getattr(layer, "use_relative_attention_bias", False)]


def _weights():
    w = np.random.default_rng(4).uniform(0.5, 2.0, size=P)
    w[1] = 0.0
    return w


def _compare(model, x, y, loss_fn, step):
    w = _weights()
    norms, _ = loop_reference(model, loss_fn, x, y, w, np.inf)
    clip = float(np.median(norms[norms > 0]))  # some examples clipped, some not
    norms_ref, sum_ref = loop_reference(model, loss_fn, x, y, w, clip)
    got = step(x, y, w, clip)
    np.testing.assert_allclose(got.norms.numpy(), norms_ref, rtol=RTOL, atol=1e-14)
    scale = max(np.max(np.abs(g)) for g in sum_ref)
    for v, g, r in zip(model.trainable_variables, got.grads, sum_ref):
        np.testing.assert_allclose(np.asarray(g), r, rtol=RTOL, atol=RTOL * scale, err_msg=v.path)


def test_describe_puts_the_bias_on_its_rule_and_no_t5_layer_on_the_fallback():
    model, *_ = _t5()
    how = describe(model)
    bias = [(name, kind) for name, cls, kind in how if cls == "T5MultiHeadAttention"]
    assert sorted(kind for _, kind in bias) == [KIND, KIND], how  # the encoder's and the decoder's first layer
    assert not [row for row in how if row[2] == "generic"], how


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
def test_norms_and_clipped_sum_equal_a_per_example_float64_loop(traced):
    model, x, y, loss_fn = _t5()

    def step(x, y, w, clip):
        return ghost_clipped_sum(model, loss_fn, x, y, w, l2_norm_clip=clip, training=False)

    _compare(model, x, y, loss_fn, tf.function(step) if traced else step)


def test_a_dynamic_sequence_length():
    model, x, y, loss_fn = _t5(num_layers=2)
    signature = ({k: tf.TensorSpec([None, None], tf.int32) for k in x}, tf.TensorSpec([None, None], tf.int32),
                 tf.TensorSpec([None], tf.float64), tf.TensorSpec([], tf.float64))

    @tf.function(input_signature=signature)
    def step(x, y, w, clip):
        return ghost_clipped_sum(model, loss_fn, x, y, w, l2_norm_clip=clip, training=False)

    _compare(model, x, y, loss_fn, lambda x, y, w, clip: step(x, y, w, clip))


def test_the_bias_term_is_the_tables_own_per_example_norm_through_every_reuse():
    # the rule's per-layer term against the loop's gradient of the table alone: the first
    # layer's position_bias is reused by the two later layers of its stack, and each use
    # must be counted exactly once (a missed or doubled path changes this norm)
    model, x, y, loss_fn = _t5()
    w = _weights()
    with observe_layer_norms() as seen:
        ghost_clipped_sum(model, loss_fn, x, y, w, l2_norm_clip=1e6, training=False)
    terms = {id(layer): sq.numpy() for layer, rule, _, sq in seen if isinstance(rule, RelativeAttentionBiasRule)}
    assert len(terms) == 2
    for layer in _bias_layers(model):
        table = layer.relative_attention_bias
        expected = []
        for i in range(P):
            xi = {k: v[i : i + 1] for k, v in x.items()}
            with tf.GradientTape() as tape:
                loss = w[i] * loss_fn(y[i : i + 1], model(xi, training=False))[0]
            expected.append(np.sum(tf.convert_to_tensor(tape.gradient(loss, table.value)).numpy() ** 2))
        assert max(expected) > 0
        np.testing.assert_allclose(terms[id(layer)], expected, rtol=RTOL, atol=1e-16)


def test_bucket_ids_reproduce_the_layers_own_lookup():
    model, *_ = _t5(num_layers=1)
    for layer in _bias_layers(model):
        table = layer.relative_attention_bias.numpy()
        ids = bucket_ids(layer, 6, 9).numpy()
        assert ids.shape == (6, 9) and ids.min() >= 0 and ids.max() < table.shape[0]
        assert len(np.unique(ids)) > 1
        got = layer.compute_bias(6, 9).numpy()[0]  # (H, Lq, Lk)
        np.testing.assert_array_equal(got, np.transpose(table[ids], (2, 0, 1)))
        np.testing.assert_array_equal(layer.relative_attention_bias.numpy(), table)  # never assigned


def test_a_cache_is_refused_by_name():
    model, *_ = _t5(num_layers=1)
    layer = _bias_layers(model)[0]
    rule = RelativeAttentionBiasRule()
    assert rule.matches(layer) and rule.check(layer) is None
    hidden = tf.zeros([P, 3, WIDTH], tf.float64)
    cache = tf.zeros([P, 2, 3, 2, WIDTH // 2], tf.float64)
    with pytest.raises(ValueError, match=f"'{layer.name}'.*cache"):
        rule.forward(layer, layer.call, lambda **_: None, hidden, cache=cache, cache_update_index=0)


def test_mixed_bfloat16_the_tables_per_example_norm_matches_the_loop():
    # the bias and its per-example copy are bfloat16 (the compute dtype), the bucket ids read
    # through a bfloat16 lookup stay exact, the norms are float32
    from tests.training import zoo_extra

    keras.config.set_dtype_policy("mixed_bfloat16")  # the float64 fixture restores the policy after
    model, x, y = zoo_extra.t5_seq2seq(np.random.default_rng(1))[:3]
    loss_fn = per_example_loss_fn(keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0))
    assert KIND in {how for *_, how in describe(model)}
    p = len(y)
    with observe_layer_norms() as seen:
        ghost_clipped_sum(model, loss_fn, x, y, np.ones(p, "float32"), l2_norm_clip=1e6, training=False)
    terms = [(layer, sq.numpy()) for layer, rule, _, sq in seen if isinstance(rule, RelativeAttentionBiasRule)]
    assert len(terms) == 2
    for layer, got in terms:
        expected = []
        for i in range(p):
            xi = {k: v[i : i + 1] for k, v in x.items()}
            with tf.GradientTape() as tape:
                loss = loss_fn(y[i : i + 1], model(xi, training=False))[0]
            expected.append(np.sum(tf.convert_to_tensor(tape.gradient(loss, layer.relative_attention_bias.value)).numpy() ** 2))
        assert max(expected) > 0
        np.testing.assert_allclose(got, expected, rtol=1e-3)
