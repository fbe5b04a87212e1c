"""More models the library did not write (``tests/training/zoo.py``'s :class:`Case`):
the KerasHub backbones whose layers return tensors they also used (T5's relative
attention bias), see a batch-1 broadcast input (ViT's position embedding, DeBERTa-v3's
relative embeddings) or rows that are tokens (Mixtral's MoE router and experts).
Random weights from tiny configs, no download."""

from __future__ import annotations

import keras
import numpy as np

from tests.training.zoo import SMALL, Case, _tokens


def t5_seq2seq(rng, dtype="float32", size=SMALL):
    import keras_hub

    backbone = keras_hub.models.T5Backbone(
        vocabulary_size=size.vocab, num_layers=2, num_heads=2, hidden_dim=size.width, intermediate_dim=2 * size.width,
        key_value_dim=size.width // 2, dropout=0.0, dtype=dtype,
    )
    model = keras_hub.models.T5Seq2SeqLM(backbone=backbone, preprocessor=None)
    enc, enc_mask = _tokens(rng, size)
    dec, dec_mask = _tokens(rng, size)
    x = {"encoder_token_ids": enc, "encoder_padding_mask": enc_mask,
         "decoder_token_ids": dec, "decoder_padding_mask": dec_mask}
    y = np.concatenate([dec[:, 1:], np.zeros((size.batch, 1), "int32")], axis=1)
    return Case(model, x, y, keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0))


def vit_classifier(rng, dtype="float32", size=SMALL):
    import keras_hub

    side = size.length
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(side, side, 3), patch_size=4, num_layers=2, num_heads=2, hidden_dim=size.width,
        mlp_dim=2 * size.width, dtype=dtype,
    )
    model = keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=3, preprocessor=None)
    x = rng.normal(size=(size.batch, side, side, 3)).astype(dtype)
    return Case(model, x, rng.integers(0, 3, size.batch), keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def deberta_classifier(rng, dtype="float32", size=SMALL):
    import keras_hub

    backbone = keras_hub.models.DebertaV3Backbone(
        vocabulary_size=size.vocab, num_layers=2, num_heads=2, hidden_dim=size.width, intermediate_dim=2 * size.width,
        dropout=0.0, max_sequence_length=size.length, bucket_size=4, dtype=dtype,
    )
    model = keras_hub.models.DebertaV3TextClassifier(backbone=backbone, num_classes=3, preprocessor=None, dropout=0.0)
    ids, mask = _tokens(rng, size)
    x = {"token_ids": ids, "padding_mask": mask}
    return Case(model, x, rng.integers(0, 3, size.batch), keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def mixtral_lm(rng, dtype="float32", size=SMALL):
    import keras_hub

    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=size.vocab, num_layers=2, num_query_heads=2, num_key_value_heads=1, hidden_dim=size.width,
        intermediate_dim=2 * size.width, num_experts=4, top_k=2, router_aux_loss_coef=0.0, dtype=dtype,
    )
    model = keras_hub.models.MixtralCausalLM(backbone=backbone, preprocessor=None)
    ids, mask = _tokens(rng, size)
    x = {"token_ids": ids, "padding_mask": mask}
    y = np.concatenate([ids[:, 1:], np.zeros((size.batch, 1), "int32")], axis=1)
    return Case(model, x, y, keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0))


EXTRA = {"t5": t5_seq2seq, "vit": vit_classifier, "deberta-v3": deberta_classifier, "mixtral": mixtral_lm}
