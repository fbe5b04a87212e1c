"""Models the library did not write, built from small configs (random weights, no download).

Each builder returns a :class:`Case`: the model, one batch of ``P`` examples and a
per-example loss. The zoo tests clip every case with the library's default engine and
compare against an independent per-example loop; the builders take ``dtype`` so the
comparison can run in float64.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import keras
import numpy as np

class Size(NamedTuple):
    batch: int = 5  # P examples
    length: int = 8  # tokens per sequence (images are length × length)
    vocab: int = 40
    width: int = 16  # hidden size (the feed-forward is twice as wide)


SMALL = Size()
P = SMALL.batch


class Case(NamedTuple):
    model: keras.Model
    x: Any
    y: np.ndarray
    loss: Any  # what a user passes to compile()


def _tokens(rng, size, padded=True):
    n, length = size.batch, size.length
    ids = rng.integers(1, size.vocab, size=(n, length)).astype("int32")
    mask = np.ones((n, length), "int32")
    if padded:  # the last examples are shorter (padding id 0, mask 0)
        for i in range(n):
            cut = length - (i % 3)
            ids[i, cut:], mask[i, cut:] = 0, 0
    return ids, mask


def bert_classifier(rng, dtype="float32", lora=False, size=SMALL):
    import keras_hub

    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=size.vocab, num_layers=2, num_heads=2, hidden_dim=size.width, intermediate_dim=2 * size.width,
        max_sequence_length=size.length, dropout=0.0, dtype=dtype,
    )
    if lora:
        backbone.enable_lora(rank=2)
    model = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None, dropout=0.0)
    ids, mask = _tokens(rng, size)
    x = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask}
    return Case(model, x, rng.integers(0, 3, size.batch), keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _causal_lm(task, backbone, rng, lora, size):
    """A KerasHub ``CausalLM`` task (``preprocessor=None``): next-token logits from the
    backbone's tied token embedding; the labels of padding positions are 0 (ignored)."""
    import keras_hub

    if lora:
        backbone.enable_lora(rank=2)
    model = getattr(keras_hub.models, task)(backbone=backbone, preprocessor=None)
    ids, mask = _tokens(rng, size)
    x = {"token_ids": ids, "padding_mask": mask}
    y = np.concatenate([ids[:, 1:], np.zeros((size.batch, 1), "int32")], axis=1)
    return Case(model, x, y, keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0))


def gpt2_lm(rng, dtype="float32", lora=False, size=SMALL):
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=size.vocab, num_layers=2, num_heads=2, hidden_dim=size.width, intermediate_dim=2 * size.width,
        max_sequence_length=size.length, dropout=0.0, dtype=dtype,
    )
    return _causal_lm("GPT2CausalLM", backbone, rng, lora, size)


def llama_lm(rng, dtype="float32", lora=False, size=SMALL):
    import keras_hub

    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=size.vocab, num_layers=2, num_query_heads=2, num_key_value_heads=1, hidden_dim=size.width,
        intermediate_dim=2 * size.width, dtype=dtype,
    )
    return _causal_lm("LlamaCausalLM", backbone, rng, lora, size)


def gemma_lm(rng, dtype="float32", lora=False, size=SMALL):
    import keras_hub

    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=size.vocab, num_layers=2, num_query_heads=2, num_key_value_heads=1, hidden_dim=size.width,
        intermediate_dim=2 * size.width, head_dim=8, dtype=dtype,
    )
    return _causal_lm("GemmaCausalLM", backbone, rng, lora, size)


def rnn_classifier(rng, dtype="float32", kind="LSTM", size=SMALL):
    layer = {"LSTM": keras.layers.LSTM, "GRU": keras.layers.GRU, "SimpleRNN": keras.layers.SimpleRNN}[kind]
    model = keras.Sequential(
        [
            keras.Input((size.length,), dtype="int32"),
            keras.layers.Embedding(size.vocab, size.width, mask_zero=True, dtype=dtype),
            layer(size.width, dtype=dtype),
            keras.layers.Dense(2, dtype=dtype),
        ]
    )
    ids, _ = _tokens(rng, size)
    return Case(model, ids, rng.integers(0, 2, size.batch),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def groupnorm_resnet(rng, dtype="float32", size=SMALL):
    side = size.length
    inputs = keras.Input((side, side, 3))
    h = keras.layers.Conv2D(size.width // 2, 3, padding="same", dtype=dtype)(inputs)
    for _ in range(2):
        r = keras.layers.GroupNormalization(groups=2, dtype=dtype)(h)
        r = keras.layers.Activation("relu", dtype=dtype)(r)
        r = keras.layers.Conv2D(size.width // 2, 3, padding="same", dtype=dtype)(r)
        h = keras.layers.Add(dtype=dtype)([h, r])
    h = keras.layers.GlobalAveragePooling2D(dtype=dtype)(h)
    model = keras.Model(inputs, keras.layers.Dense(3, dtype=dtype)(h))
    return Case(model, rng.normal(size=(size.batch, side, side, 3)).astype(dtype), rng.integers(0, 3, size.batch),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def recommender(rng, dtype="float32", size=SMALL):
    """Embedding-heavy: user and item tables, a dot product and a small tower."""
    users, items = keras.Input((1,), dtype="int32", name="user"), keras.Input((1,), dtype="int32", name="item")
    u = keras.layers.Flatten()(keras.layers.Embedding(300 * size.vocab // 40, size.width // 2, dtype=dtype)(users))
    v = keras.layers.Flatten()(keras.layers.Embedding(500 * size.vocab // 40, size.width // 2, dtype=dtype)(items))
    dot = keras.layers.Dot(axes=1, dtype=dtype)([u, v])
    tower = keras.layers.Dense(4, activation="relu", dtype=dtype)(keras.layers.Concatenate(dtype=dtype)([u, v]))
    score = keras.layers.Dense(1, dtype=dtype)(keras.layers.Concatenate(dtype=dtype)([dot, tower]))
    model = keras.Model({"user": users, "item": items}, score)
    x = {"user": rng.integers(0, 300 * size.vocab // 40, (size.batch, 1)).astype("int32"),
         "item": rng.integers(0, 500 * size.vocab // 40, (size.batch, 1)).astype("int32")}
    return Case(model, x, rng.normal(size=(size.batch, 1)).astype(dtype), "mse")


@keras.saving.register_keras_serializable(package="knc_zoo")
class Gate(keras.layers.Layer):
    """A custom layer with its own weight: x·sigmoid(w) per feature, plus a learned shift."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="zeros", name="w")
        self.shift = self.add_weight(shape=(), initializer="zeros", name="shift")

    def call(self, x):
        return x * keras.ops.sigmoid(self.w) + self.shift


def attention_with_custom_layer(rng, dtype="float32", size=SMALL):
    """Attention plus a layer no rule knows: what crashed ``clipping="auto"`` before."""
    inputs = keras.Input((size.length, 6))
    h = keras.layers.Dense(size.width, dtype=dtype)(inputs)
    h = h + keras.layers.MultiHeadAttention(num_heads=2, key_dim=size.width // 2, dtype=dtype)(h, h)
    h = Gate(dtype=dtype)(keras.layers.LayerNormalization(dtype=dtype)(h))
    model = keras.Model(inputs, keras.layers.Dense(2, dtype=dtype)(keras.layers.GlobalAveragePooling1D()(h)))
    return Case(model, rng.normal(size=(size.batch, size.length, 6)).astype(dtype), rng.integers(0, 2, size.batch),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True))


ZOO = {
    "bert": bert_classifier,
    "bert-lora": lambda rng, dtype="float32", size=SMALL: bert_classifier(rng, dtype, True, size),
    "gpt2-lm": gpt2_lm,
    "gpt2-lm-lora": lambda rng, dtype="float32", size=SMALL: gpt2_lm(rng, dtype, True, size),
    "llama-lm": llama_lm,
    "llama-lm-lora": lambda rng, dtype="float32", size=SMALL: llama_lm(rng, dtype, True, size),
    "gemma-lm": gemma_lm,
    "gemma-lm-lora": lambda rng, dtype="float32", size=SMALL: gemma_lm(rng, dtype, True, size),
    "lstm": lambda rng, dtype="float32", size=SMALL: rnn_classifier(rng, dtype, "LSTM", size),
    "gru": lambda rng, dtype="float32", size=SMALL: rnn_classifier(rng, dtype, "GRU", size),
    "groupnorm-resnet": groupnorm_resnet,
    "recommender": recommender,
    "attention-custom": attention_with_custom_layer,
}
