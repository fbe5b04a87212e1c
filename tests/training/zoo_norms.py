"""Models whose layers the rules recognise by what they compute (``tests/training/zoo.py``'s
:class:`Case`): KerasHub language models with RMS norms under their own class names
(Qwen3, Phi-3, Qwen), a ``TimeDistributed`` tagger and a ``PReLU`` network. Random weights
from tiny configs, no download."""

from __future__ import annotations

import keras
import numpy as np

from tests.training.zoo import SMALL, Case, _causal_lm, _tokens


def qwen3_lm(rng, dtype="float32", size=SMALL):
    import keras_hub

    backbone = keras_hub.models.Qwen3Backbone(
        vocabulary_size=size.vocab, num_layers=2, num_query_heads=2, num_key_value_heads=1, head_dim=8,
        hidden_dim=size.width, intermediate_dim=2 * size.width, dtype=dtype,
    )
    return _causal_lm("Qwen3CausalLM", backbone, rng, False, size)


def phi3_lm(rng, dtype="float32", size=SMALL):
    import keras_hub

    backbone = keras_hub.models.Phi3Backbone(
        vocabulary_size=size.vocab, num_layers=2, num_query_heads=2, num_key_value_heads=1, hidden_dim=size.width,
        intermediate_dim=2 * size.width, dtype=dtype,
    )
    return _causal_lm("Phi3CausalLM", backbone, rng, False, size)


def qwen_lm(rng, dtype="float32", size=SMALL):
    import keras_hub

    backbone = keras_hub.models.QwenBackbone(
        vocabulary_size=size.vocab, num_layers=2, num_query_heads=2, num_key_value_heads=1, hidden_dim=size.width,
        intermediate_dim=2 * size.width, dtype=dtype,
    )
    return _causal_lm("QwenCausalLM", backbone, rng, False, size)


def time_distributed_tagger(rng, dtype="float32", size=SMALL):
    """Tokens → embedding → TimeDistributed(Dense) → TimeDistributed(LayerNormalization) →
    TimeDistributed(PReLU) → pooled classifier: every weight inside TimeDistributed."""
    inputs = keras.Input((size.length,), dtype="int32")
    h = keras.layers.Embedding(size.vocab, size.width, dtype=dtype)(inputs)
    h = keras.layers.TimeDistributed(keras.layers.Dense(2 * size.width, activation="tanh", dtype=dtype), dtype=dtype)(h)
    h = keras.layers.TimeDistributed(keras.layers.LayerNormalization(dtype=dtype), dtype=dtype)(h)
    h = keras.layers.TimeDistributed(keras.layers.PReLU(dtype=dtype), dtype=dtype)(h)
    h = keras.layers.GlobalAveragePooling1D(dtype=dtype)(h)
    outputs = keras.layers.Dense(3, dtype=dtype)(h)
    ids, _ = _tokens(rng, size, padded=False)
    model = keras.Model(inputs, outputs)
    return Case(model, ids, rng.integers(0, 3, size.batch), keras.losses.SparseCategoricalCrossentropy(from_logits=True))


NORMS = {"qwen3-lm": qwen3_lm, "phi3-lm": phi3_lm, "qwen-lm": qwen_lm, "timedistributed": time_distributed_tagger}
