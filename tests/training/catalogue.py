"""Every ``*Backbone`` class the installed keras-hub exports, built offline from a tiny config.

:data:`BUILDERS` maps a backbone class name to a function ``(dtype) -> backbone`` that
constructs it directly with small hyperparameters (random weights, no preset, no
download); :data:`NOT_BUILT` lists the exported backbones that are not built, each with
the reason. :func:`make_case` puts a small task head on a backbone (the mean of each of
its float outputs over every axis but the batch and the last, concatenated, then a
``Dense(3)`` classifier) and draws one batch of inputs from the backbone's own input
specs (token ids, padding masks with shorter examples, images, audio features), so one
harness runs text, image, audio, seq2seq and MoE backbones alike.

BatchNormalization layers of convolutional backbones are frozen (``trainable=False``: they
then normalise with their moving statistics, per example), the documented alternative to
``knc.replace_batch_normalization``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import keras
import numpy as np

P = 5  # examples per batch
L = 8  # tokens per sequence
V = 40  # vocabulary
W = 16  # hidden width (feed-forward 2W)
SIDE = 32  # image side for convolutional backbones with unknown input size
CLASSES = 3


def exported_backbones() -> list[str]:
    """Names of every class in ``keras_hub.models`` whose name ends in ``Backbone``."""
    import keras_hub

    return sorted(n for n in dir(keras_hub.models) if n.endswith("Backbone"))


def _hub(name):
    import keras_hub

    return getattr(keras_hub.models, name)


def _text(name, **extra):
    """A BERT-like encoder/decoder constructor ``(vocabulary_size, num_layers, num_heads, hidden_dim,
    intermediate_dim)`` with ``extra`` keyword arguments."""

    def build(dtype):
        kw = dict(vocabulary_size=V, num_layers=2, num_heads=2, hidden_dim=W, intermediate_dim=2 * W)
        return _hub(name)(**{**kw, **extra}, dtype=dtype)

    return build


def _gqa(name, **extra):
    """A Llama-like decoder: grouped-query attention (2 query heads, 1 key/value head)."""

    def build(dtype):
        kw = dict(vocabulary_size=V, num_layers=2, num_query_heads=2, num_key_value_heads=1, hidden_dim=W,
                  intermediate_dim=2 * W)
        return _hub(name)(**{**kw, **extra}, dtype=dtype)

    return build


def _kw(name, **kw):
    return lambda dtype: _hub(name)(**kw, dtype=dtype)


def _under_policy(dtype, build):
    """``build()`` with the global dtype policy set to ``dtype`` (restored after)."""
    old = keras.config.dtype_policy()
    keras.config.set_dtype_policy(dtype)
    try:
        return build()
    finally:
        keras.config.set_dtype_policy(old)


def _no_dtype(name, **kw):
    """A backbone whose constructor takes no ``dtype`` (or whose layers ignore it): built under a dtype policy."""
    return lambda dtype: _under_policy(dtype, lambda: _hub(name)(**kw))


def _resnet(dtype, stages, **kw):
    """The image encoder of the detection and segmentation composites: a ResNet of ``stages``
    basic blocks (keras-hub requires 64 filters in the first), strides 1, 2, 2, …"""
    return _hub("ResNetBackbone")(input_conv_filters=[64], input_conv_kernel_sizes=[3],
                                  stackwise_num_filters=[64, 16, 16, 16][:stages], stackwise_num_blocks=[1] * stages,
                                  stackwise_num_strides=[1, 2, 2, 2][:stages], block_type="basic_block",
                                  dtype=dtype, **{"image_shape": _IMG, **kw})


def _sub(module, cls, dtype, **kw):
    """A sub-model class keras-hub does not export (``keras_hub.src.models.<module>.<cls>``)."""
    import importlib

    return getattr(importlib.import_module(f"keras_hub.src.models.{module}"), cls)(**kw, dtype=dtype)


def _layer(cls, dtype, **kw):
    """A sub-model keras-hub exports as a layer (``keras_hub.layers.<cls>``)."""
    import keras_hub

    return getattr(keras_hub.layers, cls)(**kw, dtype=dtype)


_NO_DROP = dict(dropout=0.0)
_IMG16 = (16, 16, 3)
_IMG = (SIDE, SIDE, 3)
#: the vision and text encoders of the CLIP-like composites: one layer each
_VISION = dict(patch_size=4, hidden_dim=W, num_layers=1, num_heads=2, intermediate_dim=2 * W, image_shape=_IMG16)
_TEXT = dict(vocabulary_size=V, embedding_dim=W, hidden_dim=W, num_layers=1, num_heads=2, intermediate_dim=2 * W,
             max_sequence_length=L)

BUILDERS = {
    # ------------------------------------------------------------------ text encoders
    "AlbertBackbone": _kw("AlbertBackbone", vocabulary_size=V, num_layers=2, num_heads=2, embedding_dim=8,
                          hidden_dim=W, intermediate_dim=2 * W, max_sequence_length=L),
    "BertBackbone": _text("BertBackbone", max_sequence_length=L, **_NO_DROP),
    "DebertaV3Backbone": _text("DebertaV3Backbone", max_sequence_length=L, bucket_size=4, **_NO_DROP),
    "DistilBertBackbone": _text("DistilBertBackbone", max_sequence_length=L, **_NO_DROP),
    "ElectraBackbone": _kw("ElectraBackbone", vocab_size=V, num_layers=2, num_heads=2, hidden_dim=W, embedding_dim=8,
                           intermediate_dim=2 * W, max_sequence_length=L, dropout=0.0),
    "ESMBackbone": _text("ESMBackbone", max_sequence_length=L, **_NO_DROP),
    "ESM2Backbone": _text("ESM2Backbone", max_sequence_length=L, **_NO_DROP),
    "FNetBackbone": _kw("FNetBackbone", vocabulary_size=V, num_layers=2, hidden_dim=W, intermediate_dim=2 * W,
                        max_sequence_length=L, dropout=0.0),
    "RobertaBackbone": _text("RobertaBackbone", max_sequence_length=L + 2, **_NO_DROP),
    "RoformerV2Backbone": _text("RoformerV2Backbone", head_size=8, **_NO_DROP),
    "XLMRobertaBackbone": _text("XLMRobertaBackbone", max_sequence_length=L + 2, **_NO_DROP),
    "XLNetBackbone": _text("XLNetBackbone", **_NO_DROP),
    # ------------------------------------------------------------------ decoders (LMs)
    "BloomBackbone": _text("BloomBackbone"),
    "FalconBackbone": _kw("FalconBackbone", vocabulary_size=V, num_layers=2, num_attention_heads=2, hidden_dim=W,
                          intermediate_dim=2 * W),
    "GPT2Backbone": _text("GPT2Backbone", max_sequence_length=L, **_NO_DROP),
    "GPTNeoXBackbone": _text("GPTNeoXBackbone", max_sequence_length=L),
    "OPTBackbone": _text("OPTBackbone", max_sequence_length=L, **_NO_DROP),
    "GemmaBackbone": _gqa("GemmaBackbone", head_dim=8),
    "Gemma3Backbone": _gqa("Gemma3Backbone", head_dim=8, image_size=16),
    # text only (no vision or audio encoder config): the AltUp/Laurel decoder with per-layer inputs
    "Gemma3nBackbone": _kw("Gemma3nBackbone", text_vocab_size=V, text_hidden_size=W, num_hidden_layers=1,
                           pad_token_id=0, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                           intermediate_size=[2 * W], hidden_activation="gelu_approximate",
                           layer_types=["full_attention"], sliding_window=4, rope_theta=10000.0,
                           max_position_embeddings=2 * L, vocab_size_per_layer_input=V,
                           hidden_size_per_layer_input=2, altup_num_inputs=2, laurel_rank=1),
    # text only (no vision or audio encoder), with per-layer token inputs
    "Gemma4Backbone": _gqa("Gemma4Backbone", num_layers=1, head_dim=8, image_size=16, hidden_size_per_layer_input=2,
                           sliding_window_size=4),
    "LlamaBackbone": _gqa("LlamaBackbone"),
    "Llama3Backbone": _gqa("Llama3Backbone"),
    "MistralBackbone": _gqa("MistralBackbone"),
    "Phi3Backbone": _gqa("Phi3Backbone"),
    "QwenBackbone": _gqa("QwenBackbone"),
    "Qwen2Backbone": _gqa("Qwen2Backbone"),
    "Qwen3Backbone": _gqa("Qwen3Backbone", head_dim=8),
    "Qwen3_5Backbone": _gqa("Qwen3_5Backbone", head_dim=8, num_layers=1, layer_types=["linear_attention"], linear_num_key_heads=2, linear_num_value_heads=2,
                            linear_key_head_dim=8, linear_value_head_dim=8),
    "SmolLMBackbone": _kw("SmolLMBackbone", vocabulary_size=V, hidden_dim=W, intermediate_dim=2 * W, num_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, attention_bias=False, attention_dropout=0.0,
                          rope_layer_enabled_list=[True, True], layer_types=["attention", "attention"],
                          mlp_bias=False, layer_norm_epsilon=1e-6, max_position_embeddings=4 * L,
                          rope_theta=10000.0, partial_rotary_factor=1.0),
    "SmolLM3Backbone": _kw("SmolLM3Backbone", vocabulary_size=V, hidden_dim=W, intermediate_dim=2 * W, num_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, attention_bias=False, attention_dropout=0.0,
                           rope_layer_enabled_list=[True, True], layer_types=["attention", "attention"],
                           mlp_bias=False, layer_norm_epsilon=1e-6, max_position_embeddings=4 * L,
                           rope_theta=10000.0, partial_rotary_factor=1.0),
    "RWKV7Backbone": _kw("RWKV7Backbone", hidden_size=W, head_size=8, num_layers=2, vocabulary_size=V,
                         intermediate_dim=2 * W, gate_lora=4, mv_lora=4, aaa_lora=4, decay_lora=4),
    # ------------------------------------------------------------------ mixture of experts
    "MixtralBackbone": _gqa("MixtralBackbone", num_experts=4, top_k=2, router_aux_loss_coef=0.0),
    "GptOssBackbone": _gqa("GptOssBackbone", num_experts=4, top_k=2, head_dim=8),
    "QwenMoeBackbone": _gqa("QwenMoeBackbone", moe_intermediate_dim=W, shared_expert_intermediate_dim=W,
                            num_experts=4, top_k=2, router_aux_loss_coefficient=0.0),
    "Qwen3MoeBackbone": _gqa("Qwen3MoeBackbone", moe_intermediate_dim=W, num_experts=4, top_k=2, head_dim=8,
                             router_aux_loss_coefficient=0.0),
    "Qwen3_5MoeBackbone": _kw("Qwen3_5MoeBackbone", vocabulary_size=V, num_layers=1, num_query_heads=2,
                              num_key_value_heads=1, head_dim=8, hidden_dim=W, moe_intermediate_dim=W,
                              shared_expert_intermediate_size=W, num_experts=4, top_k=2, linear_num_key_heads=2,
                              linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                              router_aux_loss_coefficient=0.0),
    # ------------------------------------------------------------------ seq2seq, audio
    "BartBackbone": _text("BartBackbone", max_sequence_length=L, **_NO_DROP),
    "T5Backbone": _text("T5Backbone", key_value_dim=8, **_NO_DROP),
    "T5GemmaBackbone": _kw("T5GemmaBackbone", vocabulary_size=V, encoder_hidden_dim=W, encoder_intermediate_dim=2 * W,
                           encoder_num_layers=1, encoder_num_attention_heads=2, encoder_num_key_value_heads=1,
                           encoder_head_dim=8, encoder_layer_types=["full_attention"], decoder_hidden_dim=W,
                           decoder_intermediate_dim=2 * W, decoder_num_layers=1, decoder_num_attention_heads=2,
                           decoder_num_key_value_heads=1, decoder_head_dim=8, decoder_layer_types=["full_attention"]),
    # text only (no vision encoder)
    "T5Gemma2Backbone": _kw("T5Gemma2Backbone", vocabulary_size=V, encoder_hidden_dim=W, encoder_intermediate_dim=2 * W,
                            encoder_num_layers=1, encoder_num_attention_heads=2, encoder_num_key_value_heads=1,
                            encoder_head_dim=8, encoder_layer_types=["full_attention"], decoder_hidden_dim=W,
                            decoder_intermediate_dim=2 * W, decoder_num_layers=1, decoder_num_attention_heads=2,
                            decoder_num_key_value_heads=1, decoder_head_dim=8,
                            decoder_layer_types=["full_attention"]),
    "EdRecBackbone": _kw("EdRecBackbone", vocab_size=V, num_layers_enc=1, num_layers_dec=1, hidden_dim=W,
                         intermediate_dim=2 * W, num_heads=2),
    "WhisperBackbone": _text("WhisperBackbone", num_mels=8, max_encoder_sequence_length=2 * L,
                             max_decoder_sequence_length=L),
    "MoonshineBackbone": _kw("MoonshineBackbone", vocabulary_size=V, filter_dim=W, encoder_num_layers=1,
                             decoder_num_layers=1, hidden_dim=W, intermediate_dim=2 * W, encoder_num_heads=2,
                             decoder_num_heads=2, max_position_embeddings=64),
    # ------------------------------------------------------------------ vision transformers
    "ViTBackbone": _kw("ViTBackbone", image_shape=_IMG16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=W,
                       mlp_dim=2 * W),
    "DeiTBackbone": _kw("DeiTBackbone", image_shape=_IMG16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=W,
                        intermediate_dim=2 * W),
    "DINOV2Backbone": _kw("DINOV2Backbone", patch_size=4, num_layers=2, hidden_dim=W, num_heads=2,
                          intermediate_dim=2 * W, image_shape=_IMG16, position_embedding_shape=_IMG16),
    "DINOV3Backbone": _kw("DINOV3Backbone", patch_size=4, num_layers=2, hidden_dim=W, num_heads=2,
                          intermediate_dim=2 * W, image_shape=_IMG16, num_register_tokens=1),
    "SwinTransformerBackbone": _kw("SwinTransformerBackbone", image_shape=_IMG, embed_dim=8, depths=[1, 1],
                                   num_heads=[2, 2], window_size=4, patch_size=4, drop_path=0.0),
    "ViTDetBackbone": _no_dtype("ViTDetBackbone", hidden_size=W, num_layers=2, intermediate_dim=2 * W, num_heads=2,
                                global_attention_layer_indices=[1], image_shape=_IMG, patch_size=8,
                                num_output_channels=8, window_size=2),
    "MiTBackbone": _no_dtype("MiTBackbone", layerwise_depths=[1, 1], num_layers=2, layerwise_num_heads=[1, 2],
                             layerwise_sr_ratios=[2, 1], max_drop_path_rate=0.0, layerwise_patch_sizes=[7, 3],
                             layerwise_strides=[4, 2], image_shape=_IMG, hidden_dims=[8, 16]),
    "VideoPrismBackbone": _kw("VideoPrismBackbone", num_frames=2, patch_size=4, hidden_dim=W, intermediate_dim=2 * W,
                              num_heads=2, num_spatial_layers=1, num_temporal_layers=1, num_auxiliary_layers=0,
                              image_shape=_IMG16),
    # ------------------------------------------------------------------ convolutional (BatchNorm frozen)
    "ResNetBackbone": _kw("ResNetBackbone", input_conv_filters=[64], input_conv_kernel_sizes=[3],
                          stackwise_num_filters=[64, 16], stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2],
                          block_type="basic_block", image_shape=_IMG),
    "VGGBackbone": _no_dtype("VGGBackbone", stackwise_num_repeats=[1, 1], stackwise_num_filters=[8, 16],
                             image_shape=_IMG),
    "DenseNetBackbone": _no_dtype("DenseNetBackbone", stackwise_num_repeats=[1, 1], image_shape=_IMG,
                                  growth_rate=4),
    "XceptionBackbone": _kw("XceptionBackbone", stackwise_conv_filters=[[8, 8], [16, 16]],
                            stackwise_pooling=[False, True], image_shape=_IMG),
    "CSPNetBackbone": _kw("CSPNetBackbone", stem_filters=8, stem_kernel_size=3, stem_strides=1, stackwise_depth=[1, 1],
                          stackwise_num_filters=[8, 16], stackwise_strides=2, block_type="dark_block",
                          stage_type="csp", down_growth=True, bottle_ratio=(0.5, 1.0), block_ratio=(1.0, 0.5),
                          expand_ratio=(2.0, 1.0), stem_padding="same", image_shape=_IMG),
    # its layers take no dtype (only the functional model does): built under the policy. One stage
    # of each block kind (fused, unfused MBConv, v1), squeeze-and-excitation in the last two.
    "EfficientNetBackbone": _no_dtype("EfficientNetBackbone", stackwise_kernel_sizes=[3, 3, 3],
                                      stackwise_num_repeats=[1, 1, 1], stackwise_input_filters=[8, 8, 16],
                                      stackwise_output_filters=[8, 16, 16], stackwise_expansion_ratios=[1, 2, 2],
                                      stackwise_squeeze_and_excite_ratios=[0.0, 0.25, 0.25],
                                      stackwise_strides=[1, 2, 1], stackwise_block_types=["fused", "unfused", "v1"],
                                      stackwise_force_input_filters=[0] * 3, stackwise_nores_option=[False] * 3,
                                      width_coefficient=1.0, depth_coefficient=1.0, dropout=0.0, num_features=16,
                                      input_shape=_IMG),
    "MobileNetBackbone": _kw("MobileNetBackbone", stackwise_expansion=[[16], [32]], stackwise_num_blocks=[1, 1],
                             stackwise_num_filters=[[8], [16]], stackwise_kernel_size=[[3], [5]],
                             stackwise_num_strides=[[2], [1]], stackwise_se_ratio=[[None], [0.25]],
                             stackwise_activation=[["relu"], ["hard_swish"]], stackwise_padding=[[1], [2]],
                             output_num_filters=16, depthwise_filters=8, depthwise_stride=1,
                             depthwise_residual=False, last_layer_filter=16, squeeze_and_excite=0.5,
                             input_num_filters=8, image_shape=_IMG),
    "HGNetV2Backbone": _kw("HGNetV2Backbone", depths=[1, 1], embedding_size=16, hidden_sizes=[16, 16],
                           stem_channels=[3, 8, 16], hidden_act="relu", use_learnable_affine_block=True,
                           stackwise_stage_filters=[[16, 8, 16, 1, 1, 3], [16, 8, 16, 1, 1, 3]],
                           apply_downsample=[False, True], use_lightweight_conv_block=[False, True],
                           image_shape=_IMG),
    # ------------------------------------------------------------------ composites (tiny sub-models)
    "CLIPBackbone": lambda dtype: _hub("CLIPBackbone")(
        vision_encoder=_sub("clip.clip_vision_encoder", "CLIPVisionEncoder", dtype, **_VISION),
        text_encoder=_sub("clip.clip_text_encoder", "CLIPTextEncoder", dtype, **_TEXT), projection_dim=8,
        dtype=dtype),
    "MetaCLIP2Backbone": lambda dtype: _hub("MetaCLIP2Backbone")(
        vision_encoder=_sub("metaclip_2.metaclip_2_vision_encoder", "MetaCLIP2VisionEncoder", dtype, **_VISION),
        text_encoder=_sub("metaclip_2.metaclip_2_text_encoder", "MetaCLIP2TextEncoder", dtype, **_TEXT),
        projection_dim=8, dtype=dtype),
    "SigLIPBackbone": lambda dtype: _hub("SigLIPBackbone")(
        vision_encoder=_sub("siglip.siglip_vision_encoder", "SigLIPVisionEncoder", dtype, **_VISION),
        text_encoder=_sub("siglip.siglip_text_encoder", "SigLIPTextEncoder", dtype, **_TEXT), dtype=dtype),
    "SegFormerBackbone": lambda dtype: _under_policy(dtype, lambda: _hub("SegFormerBackbone")(
        image_encoder=BUILDERS["MiTBackbone"](dtype), projection_filters=8)),
    "DeepLabV3Backbone": lambda dtype: _under_policy(dtype, lambda: _hub("DeepLabV3Backbone")(
        image_encoder=_resnet(dtype, 3), spatial_pyramid_pooling_key="P3", upsampling_size=2, dilation_rates=[2],
        low_level_feature_key="P2", projection_filters=8, image_shape=_IMG)),
    "RetinaNetBackbone": lambda dtype: _hub("RetinaNetBackbone")(
        image_encoder=_resnet(dtype, 4), min_level=3, max_level=5, use_p5=False, image_shape=_IMG, dtype=dtype),
    "DepthAnythingBackbone": lambda dtype: _hub("DepthAnythingBackbone")(
        image_encoder=_hub("DINOV2Backbone")(patch_size=4, num_layers=4, hidden_dim=W, num_heads=2,
                                             intermediate_dim=2 * W, image_shape=_IMG, position_embedding_shape=_IMG,
                                             apply_layernorm=True, name="image_encoder", dtype=dtype),
        reassemble_factors=[4, 2, 1, 0.5], neck_hidden_dims=[8, 8, 16, 16], fusion_hidden_dim=8, head_hidden_dim=8,
        head_in_index=-1, feature_keys=["stage1", "stage2", "stage3", "stage4"], dtype=dtype),
    "MobileNetV5Backbone": _kw("MobileNetV5Backbone", stackwise_block_types=[["er"], ["uir"], ["mqa"]],
                               stackwise_num_blocks=[1, 1, 1], stackwise_num_filters=[[8], [16], [16]],
                               stackwise_strides=[[2], [2], [1]], stackwise_act_layers=[["relu"], ["gelu"], ["gelu"]],
                               stackwise_exp_ratios=[[2.0], [2.0], [0.0]], stackwise_se_ratios=[[0.0], [0.0], [0.0]],
                               stackwise_dw_kernel_sizes=[[0], [3], [0]], stackwise_dw_start_kernel_sizes=[[0], [3], [0]],
                               stackwise_dw_end_kernel_sizes=[[0], [0], [0]], stackwise_exp_kernel_sizes=[[3], [0], [0]],
                               stackwise_pw_kernel_sizes=[[1], [0], [0]], stackwise_num_heads=[[0], [0], [2]],
                               stackwise_key_dims=[[0], [0], [8]], stackwise_value_dims=[[0], [0], [8]],
                               stackwise_kv_strides=[[0], [0], [2]], stackwise_use_cpe=[[False], [False], [False]],
                               stem_size=8, num_features=16, use_msfa=True, msfa_indices=(-2, -1),
                               msfa_output_resolution=4, layer_scale_init_value=1e-5, image_shape=_IMG),
    "SAMBackbone": lambda dtype: _under_policy(dtype, lambda: _hub("SAMBackbone")(
        image_encoder=_hub("ViTDetBackbone")(hidden_size=W, num_layers=2, intermediate_dim=2 * W, num_heads=2,
                                             global_attention_layer_indices=[1], image_shape=_IMG, patch_size=8,
                                             num_output_channels=8, window_size=2),
        prompt_encoder=_sub("sam.sam_prompt_encoder", "SAMPromptEncoder", dtype, hidden_size=8,
                            image_embedding_size=(4, 4), input_image_size=(SIDE, SIDE), mask_in_channels=4),
        mask_decoder=_sub("sam.sam_mask_decoder", "SAMMaskDecoder", dtype, num_layers=1, hidden_size=8,
                          intermediate_dim=2 * W, num_heads=2, embedding_dim=8, num_multimask_outputs=3,
                          iou_head_depth=2, iou_head_hidden_dim=8),
        dtype=dtype)),
    # a one-layer ViT image encoder + a one-layer permuted autoregressive decoder, dropout off
    "PARSeqBackbone": lambda dtype: _hub("PARSeqBackbone")(
        image_encoder=_hub("ViTBackbone")(image_shape=_IMG16, patch_size=4, num_layers=1, num_heads=2, hidden_dim=W,
                                          mlp_dim=2 * W, dtype=dtype),
        vocabulary_size=V, max_label_length=L, decoder_hidden_dim=W, num_decoder_layers=1, num_decoder_heads=2,
        decoder_mlp_dim=2 * W, dropout_rate=0.0, attention_dropout=0.0, dtype=dtype),
    # a one-layer ViT + a one-layer Q-Former (2 query tokens, cross-attention) + a one-layer OPT decoder
    "BLIP2Backbone": lambda dtype: _hub("BLIP2Backbone")(
        vision_encoder=_sub("blip2.blip2_vision_encoder", "BLIP2VisionEncoder", dtype, image_size=16, patch_size=4,
                            num_layers=1, num_heads=2, hidden_dim=W, intermediate_dim=2 * W, use_patch_bias=True,
                            use_class_token=True, use_mha_bias=True, use_mlp_bias=True, dropout_rate=0.0,
                            layer_norm_epsilon=1e-6, initializer_range=0.02),
        qformer=_sub("blip2.blip2_qformer", "BLIP2QFormer", dtype, num_query_tokens=2, num_layers=1, num_heads=2,
                     hidden_dim=W, intermediate_dim=2 * W, vision_dim=W, cross_attention_frequency=1, dropout=0.0,
                     layer_norm_epsilon=1e-6),
        language_model=_sub("blip2.blip2_custom_opt", "BLIP2CustomOPT", dtype, vocabulary_size=V, num_layers=1,
                            num_heads=2, hidden_dim=W, intermediate_dim=2 * W, num_query_tokens=2, dropout=0.0,
                            max_sequence_length=2 * L, qformer_hidden_dim=W),
        dtype=dtype),
    # a two-stage HGNetV2 (strides 4, 8) + a one-layer hybrid encoder and decoder, 4 queries, no denoising
    "DFineBackbone": lambda dtype: _hub("DFineBackbone")(
        backbone=_hub("HGNetV2Backbone")(depths=[1, 1], embedding_size=16, hidden_sizes=[16, 16], stem_channels=[3, 8, 16],
                                         hidden_act="relu", use_learnable_affine_block=True,
                                         stackwise_stage_filters=[[16, 8, 16, 1, 1, 3], [16, 8, 16, 1, 1, 3]],
                                         apply_downsample=[False, True], use_lightweight_conv_block=[False, True],
                                         image_shape=_IMG, out_features=["stage1", "stage2"], dtype=dtype),
        decoder_in_channels=[W, W], encoder_hidden_dim=W, num_labels=CLASSES, num_denoising=0,
        learn_initial_query=False, num_queries=4, anchor_image_size=(SIDE, SIDE), feat_strides=[4, 8],
        num_feature_levels=2, hidden_dim=W, encoder_in_channels=[W, W], encode_proj_layers=[1], num_attention_heads=2,
        encoder_ffn_dim=2 * W, num_encoder_layers=1, hidden_expansion=0.5, depth_multiplier=0.34, eval_idx=-1,
        num_decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=2 * W, decoder_n_points=[2, 2],
        lqe_hidden_dim=8, num_lqe_layers=2, out_features=["stage1", "stage2"], image_shape=_IMG, seed=0, dtype=dtype),
    "PaliGemmaBackbone": _kw("PaliGemmaBackbone", vocabulary_size=V, image_size=16, num_layers=1, num_query_heads=2,
                             num_key_value_heads=1, hidden_dim=W, intermediate_dim=2 * W, head_dim=8,
                             vit_patch_size=4, vit_num_layers=1, vit_num_heads=2, vit_hidden_dim=W,
                             vit_intermediate_dim=2 * W),
    # a two-layer ViT (one windowed, one global layer) with a two-level FPN on 16×16 pixels, a one-layer
    # text encoder, DETR encoder and decoder and a one-stage mask decoder, on a text prompt (LENGTHS: no box).
    # The geometry encoder has no transformer layer: keras-hub 0.32.0's SAM3GeometryEncoderLayer passes its
    # (P, N) prompt mask (N = boxes + 1) to attention as is (sam3_geometry_encoder.py), which broadcasts it
    # against (P, heads, N, N): it fails for 1 < P ≠ N, and at P = N query q of every example is masked with
    # example q's prompt mask (0.77 apart from one example at a time with padded boxes). No box prompt: a
    # box's first column is its example's position in the batch (its ROI pooling, roi_align.py, gathers that
    # example's features), which the per-example re-run of the whole backbone (see HEAVY)
    # slices as it is and then indexes out of range. 8 queries = the mask decoder's width: its
    # compute_output_shape declares pred_masks' last axis hidden_dim, the queries when run.
    "SAM3PromptableConceptBackbone": lambda dtype: _hub("SAM3PromptableConceptBackbone")(
        vision_encoder=_layer("SAM3VisionEncoder", dtype, image_shape=_IMG16, patch_size=4, num_layers=2,
                              hidden_dim=W, intermediate_dim=2 * W, num_heads=2, fpn_hidden_dim=8,
                              fpn_scale_factors=[2.0, 1.0, 0.5], pretrain_image_shape=_IMG16, window_size=2,
                              global_attn_indexes=[1]),
        text_encoder=_layer("SAM3TextEncoder", dtype, **_TEXT),
        geometry_encoder=_layer("SAM3GeometryEncoder", dtype, num_layers=0, hidden_dim=8, intermediate_dim=W,
                                num_heads=2, roi_size=2),
        detr_encoder=_layer("SAM3DetrEncoder", dtype, num_layers=1, hidden_dim=8, intermediate_dim=W, num_heads=2),
        detr_decoder=_layer("SAM3DetrDecoder", dtype, image_shape=_IMG16, patch_size=4, num_layers=1, hidden_dim=8,
                            intermediate_dim=W, num_heads=2, num_queries=8),
        mask_decoder=_layer("SAM3MaskDecoder", dtype, num_upsampling_stages=1, hidden_dim=8, num_heads=2),
        dtype=dtype),
    # ------------------------------------------------------------------ diffusion transformer
    # one double-stream and one single-stream block on 8 latent tokens of 4 channels and 8 text
    # embeddings; the harness draws every float input ~ N(0, 1) (latents, text embeddings, the
    # pooled text vector y, position ids, timestep, guidance) and pools the predicted velocity
    "FluxBackbone": _kw("FluxBackbone", input_channels=4, hidden_size=W, mlp_ratio=2.0, num_heads=2, depth=1,
                        depth_single_blocks=1, axes_dim=[2, 2, 4], theta=10_000, use_bias=True, guidance_embed=True,
                        image_shape=(L, 4), text_shape=(L, 12), image_ids_shape=(L, 3), text_ids_shape=(L, 3),
                        y_shape=(12,)),
}


#: exported backbones not built, with the reason (each is a finding or a limit, never a silent skip)
NOT_BUILT = {
    "Backbone": "the abstract base class of every backbone, not a model",
    "FeaturePyramidBackbone": "an abstract base class (the pyramid-output interface of image backbones), not a model",
    "BASNetBackbone": ("its prediction head runs 3×3 convolutions of 8× the projection width, and that width must "
                       "equal the first stage of its ResNet encoder, which keras-hub fixes at 64 filters: 48.6M "
                       "weights at 32×32 pixels, too large for the catalogue's CI budget"),
    "StableDiffusion3Backbone": ("its graph is one classifier-free-guided sampling step, not a training forward pass: "
                                 "it reads num_steps[0] and guidance_scale[0] (example 0's values for the whole "
                                 "batch) and runs its MMDiT on 2P rows (each prompt and its negative stacked on the "
                                 "batch axis; stable_diffusion_3_backbone.py), so an example's output depends on "
                                 "example 0 unless every example shares those two inputs; and its parts (an MMDiT, "
                                 "a VAE, CLIP-L/CLIP-G (+ T5) text encoders) have no tiny offline config here yet"),
}


#: built and compared like the others, but as a benchmark (``pytest -m benchmark
#: tests/training/test_catalogue.py``, and tests/jax/test_jax_catalogue.py), not in the default run:
#: the CI budget of the catalogue (106 s together in one process on TensorFlow, peak RSS 2.5 GB, on
#: top of CI's two workers); times on TensorFlow
HEAVY = {
    "DepthAnythingBackbone": ("a DINOv2 encoder + a DPT neck and head of 33 convolutions even at the tiniest "
                              "config: 17 s on 2 quiet cores (~160 s before fit traced its step once)"),
    "DFineBackbone": ("an HGNetV2 (BatchNorm frozen) + a hybrid encoder + a deformable-attention decoder with "
                      "query selection, one layer each: 38 s on 2 quiet cores"),
    "BLIP2Backbone": ("three sub-models (a ViT, a Q-Former with cross-attention, an OPT decoder), one layer each: "
                      "10 s on 2 quiet cores"),
    "SAM3PromptableConceptBackbone": (
        "six sub-models (217 weights) clipped as one caller: its DETR decoder reads its query, reference-point "
        "and presence embeddings as weights in its own call, and the backbone calls that decoder's box head "
        "outside it, so the innermost per-example caller of those reads is the whole backbone, re-run per "
        "example by the fallback: 34 s on 2 quiet cores"),
}


class Case(NamedTuple):
    model: keras.Model  # backbone + task head
    backbone: keras.Model
    x: Any
    y: np.ndarray
    loss: Any


def _freeze_batch_norm(model):
    from keras_noisecurve import _compat

    for layer in _compat.flatten_layers(model, include_self=False):
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.trainable = False


def _inputs(backbone):
    spec = backbone.input
    if isinstance(spec, dict):
        return spec
    if isinstance(spec, (list, tuple)):
        return {t.name: t for t in spec}
    return {"x": spec}


#: sequence lengths of inputs that need another first length than ``L`` (raw audio samples, no mask prompt)
LENGTHS = {"MoonshineBackbone": {"encoder_input_values": 1600, "encoder_padding_mask": 1600},
           "SAMBackbone": {"masks": 0},  # 8 point and 8 box prompts, no mask prompt
           "SAM3PromptableConceptBackbone": {"boxes": 0, "box_labels": 0}}  # a text prompt only


def _data(backbone, rng, lengths_of=None):
    """One batch of P examples for every input of ``backbone``: token ids in [1, V) (0 on
    padding), masks with the later examples shorter, zeros for segment ids, floats ~ N(0, 1)."""
    out = {}
    for name, t in _inputs(backbone).items():
        first = (lengths_of or {}).get(name, L)
        shape = [P] + [d if d is not None else (first if k == 0 else SIDE) for k, d in enumerate(t.shape[1:])]
        dtype = keras.backend.standardize_dtype(t.dtype)
        if "int" in dtype or "bool" in dtype:
            if "mask" in name:
                value = np.ones(shape, dtype)
                for i in range(P):
                    value[i, shape[1] - (i % 3):] = 0
            elif "segment" in name:
                value = np.zeros(shape, dtype)
            elif "position" in name and len(shape) == 2:  # position ids (Gemma4): 0, 1, 2, … in each example
                value = np.tile(np.arange(shape[1], dtype=dtype), (P, 1))
            else:
                value = rng.integers(1, V, size=shape).astype(dtype)
                if len(shape) == 2:
                    for i in range(P):
                        value[i, shape[1] - (i % 3):] = 0
            out[name] = value
        else:
            out[name] = rng.normal(size=shape).astype(dtype)
    if not isinstance(backbone.input, (dict, list, tuple)):
        return out["x"]
    return out  # a list of inputs too is fed by name (see _head): tf.data maps no lists


def _embeddings(backbone, inputs):
    """The image and the text embedding of each example, (P, d) each: the head of a CLIP-like
    backbone. Its own outputs are the (P, P) similarities of every image of the batch with
    every text of the batch, for a contrastive loss over the whole batch, which is not a sum
    of per-example terms: no per-example gradient exists to clip on them."""
    return [backbone.get_vision_embeddings(inputs["images"]), backbone.get_text_embeddings(inputs["token_ids"])]


def _masks(backbone, inputs):
    """SAM's predicted masks and IoU scores: its mask decoder on the backbone's outputs. The
    backbone returns the image and prompt embeddings only (and the positional embedding of the
    image grid, one row for the whole batch); its mask decoder, whose weights it holds, is
    called by the segmenter task, so the head calls it here."""
    out = backbone(inputs)
    return backbone.mask_decoder(out["image_embeddings"], out["prompt_dense_positional_embeddings"],
                                 out["prompt_sparse_embeddings"], out["prompt_dense_embeddings"])


def _sam3(backbone, inputs):
    """SAM3's outputs, its presence logit reshaped to (P, 1): it is (P, 1) when run but declared
    (P, 1, 1) (``SAM3BoxDecoder.compute_output_shape``, sam3_layers.py), and the head's pooling
    would otherwise take the mean of (P, 1) over its last axis when run."""
    out = backbone(inputs)
    return {**out, "presence_logits": keras.ops.reshape(out["presence_logits"], (-1, 1))}


#: backbones whose task head reads other tensors than the backbone's outputs: ``(backbone,
#: its symbolic inputs) -> tensors``
FEATURES = {**{name: _embeddings for name in ("CLIPBackbone", "MetaCLIP2Backbone", "SigLIPBackbone")},
            "SAMBackbone": _masks, "SAM3PromptableConceptBackbone": _sam3}


def _head(backbone, dtype, features=None):
    inputs = backbone.input
    if isinstance(inputs, (list, tuple)):  # a list of inputs (Gemma3n): the classifier takes them by name
        inputs = _inputs(backbone)
    found = features(backbone, inputs) if features else backbone(list(inputs.values()) if isinstance(
        backbone.input, (list, tuple)) else inputs)
    outputs = [t for t in keras.tree.flatten(found)
               if "float" in keras.backend.standardize_dtype(t.dtype) and len(t.shape) >= 3 or
               (len(t.shape) == 2 and t.shape[-1] is not None and "float" in keras.backend.standardize_dtype(t.dtype))]
    if not outputs:
        raise ValueError(f"{backbone.name} has no float output with a known last axis to pool "
                         f"(outputs {keras.tree.map_structure(lambda t: t.shape, found)}): give it FEATURES")
    pooled = []
    for t in outputs:
        axes = list(range(1, len(t.shape) - 1))
        pooled.append(keras.ops.mean(t, axis=axes) if axes else t)
    h = pooled[0] if len(pooled) == 1 else keras.layers.Concatenate(dtype=dtype)(pooled)
    logits = keras.layers.Dense(CLASSES, dtype=dtype, name="task_head")(h)
    return keras.Model(inputs, logits, name=f"{backbone.name}_classifier")


def make_case(name, *, dtype="float64", seed=0) -> Case:
    """Backbone ``name`` built from its tiny config in ``dtype``, with a ``Dense(3)`` head
    over its pooled outputs, and one batch of ``P`` examples drawn with ``seed``."""
    if name not in BUILDERS:
        raise KeyError(f"no builder for {name!r}: it is in NOT_BUILT ({NOT_BUILT.get(name, 'unknown')})")
    keras.utils.set_random_seed(seed)
    backbone = BUILDERS[name](dtype)
    _freeze_batch_norm(backbone)
    model = _head(backbone, dtype, FEATURES.get(name))
    rng = np.random.default_rng(seed)
    x = _data(backbone, rng, LENGTHS.get(name))
    y = rng.integers(0, CLASSES, P)
    return Case(model, backbone, x, y, keras.losses.SparseCategoricalCrossentropy(from_logits=True))


# ------------------------------------------------------------------ the check


class Comparison(NamedTuple):
    norm_error: float  # max_i |norm_i − ref_i| / max_i ref_i
    sum_error: float  # ‖clipped sum − reference‖₂ / ‖reference‖₂ over all variables
    batch_floor: float  # max |f(batch)_i − f(x_i)| / max |f(x_i)|: the model's own batch-vs-single round-off
    engine: str = "ghost"  # JAX: "vectorized" where clipping="auto" handed the model to whole-model vmap


def compare_with_loop(case, *, seed=4) -> Comparison:
    """The default engine (``clipping="auto"``, traced as ``fit`` traces it) against
    :func:`loop_gradients`, with ζ the median of the nonzero per-example norms and one
    padded example (w = 0). Either backend: the engine of the backend Keras runs on."""
    from keras_noisecurve._losses import per_example_loss_fn

    model, loss_fn = case.model, per_example_loss_fn(case.loss)
    rng = np.random.default_rng(seed)
    w = rng.uniform(0.5, 2.0, size=P)
    w[1] = 0.0
    y = case.y
    per_example, outputs = loop_gradients(model, loss_fn, case.x, y, w)
    norms_ref = np.array([np.sqrt(sum(np.sum(g**2) for g in grads)) for grads in per_example])
    clip = float(np.median(norms_ref[norms_ref > 0]))
    factors = np.where(norms_ref > 0, np.minimum(1.0, clip / np.maximum(norms_ref, 1e-300)), 0.0)
    sum_ref = [sum(f * grads[k] for f, grads in zip(factors, per_example)) for k in range(len(per_example[0]))]
    grads, norms, y_pred, engine = _engine_step(model, loss_fn, case.x, y, w, clip)
    norm_error = float(np.max(np.abs(norms - norms_ref)) / np.max(norms_ref))
    diff = np.sqrt(sum(np.sum((np.asarray(g, np.float64) - r) ** 2) for g, r in zip(grads, sum_ref)))
    ref = np.sqrt(sum(np.sum(r**2) for r in sum_ref))
    floor = float(np.max(np.abs(np.asarray(y_pred, np.float64) - outputs)) / np.max(np.abs(outputs)))
    return Comparison(norm_error, float(diff / ref), floor, engine)


def _engine_step(model, loss_fn, x, y, w, clip):
    """The ``clipping="auto"`` engine of the running backend at ``training=False``: ``(clipped
    sums as float64 arrays, norms (P,), predictions, "ghost" or "vectorized")``; "vectorized":
    JAX's ``"auto"`` handed the model to its whole-model ``vmap`` engine."""
    if keras.backend.backend() == "jax":
        import jax
        import jax.numpy as jnp

        from keras_noisecurve.backend.jax.clipping import clipped_sum
        from keras_noisecurve.backend.jax.ghost import ghost_clipped_sum

        handed = []

        def vectorized(*args, **kwargs):
            handed.append(True)
            return clipped_sum(*args, **kwargs)

        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        step = jax.jit(lambda tv, ntv, x, y, w: ghost_clipped_sum(
            model, loss_fn, tv, ntv, x, y, w, l2_norm_clip=clip, training=False, clipping="auto",
            vectorized=vectorized)[:4])
        sums, norms, _, y_pred = step(trainable, non_trainable, x, y, jnp.asarray(w, jnp.float32))
        return ([np.asarray(s, np.float64) for s in sums], np.asarray(norms, np.float64), np.asarray(y_pred),
                "vectorized" if handed else "ghost")
    import tensorflow as tf

    from keras_noisecurve.backend.tensorflow.clipping import get_engine

    engine = get_engine("auto", model)
    got = tf.function(lambda x, y, w: engine(model, loss_fn, x, y, w, l2_norm_clip=clip, training=False))(x, y, w)
    return [np.asarray(g, np.float64) for g in got.grads], got.norms.numpy(), got.y_pred, "ghost"


def loop_gradients(model, loss_fn, x, y, w):
    """Per-example gradients ``w_i·∇loss_i`` one example at a time (independent of the
    clipping engines): ``tf.GradientTape`` on TensorFlow, ``jax.grad`` of the model's
    ``stateless_call`` on a batch of one on JAX. Returns ``(a list over examples of lists of
    float64 arrays, the model's outputs (P, ...) computed one example at a time)``."""
    if keras.backend.backend() == "jax":
        return _jax_loop_gradients(model, loss_fn, x, y, w)
    import tensorflow as tf

    out, outputs = [], []
    for i in range(len(w)):
        xi = tf.nest.map_structure(lambda t: t[i : i + 1], x)
        with tf.GradientTape() as tape:
            pred = model(xi, training=False)
            loss = w[i] * loss_fn(y[i : i + 1], pred)[0]
        grads = tape.gradient(loss, model.trainable_variables)  # None: a weight the model does not use
        out.append([np.zeros(v.shape) if g is None else tf.convert_to_tensor(g).numpy().astype(np.float64)
                    for v, g in zip(model.trainable_variables, grads)])
        outputs.append(np.asarray(pred, np.float64)[0])
    return out, np.stack(outputs)


def _jax_loop_gradients(model, loss_fn, x, y, w):
    """:func:`loop_gradients` on JAX: one ``jax.grad`` of ``stateless_call`` per example (a batch
    of one, no ``vmap``), ``w_i`` applied in float64 afterwards."""
    import jax

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss_one(tv, xi, yi):
        pred, _ = model.stateless_call(tv, non_trainable, xi, training=False)
        return loss_fn(yi, pred)[0], pred

    grad_one = jax.jit(jax.grad(loss_one, has_aux=True))
    out, outputs = [], []
    for i in range(len(w)):
        xi = keras.tree.map_structure(lambda t: t[i : i + 1], x)
        grads, pred = grad_one(trainable, xi, y[i : i + 1])
        out.append([float(w[i]) * np.asarray(g, np.float64) for g in grads])
        outputs.append(np.asarray(pred, np.float64)[0])
    return out, np.stack(outputs)


def coverage(model) -> dict:
    """``{rule kind: number of layers}`` of the engine's plan (``"generic"``: the per-layer fallback)."""
    from keras_noisecurve.backend.tensorflow.ghost import describe

    counts = {}
    for _, _, how in describe(model):
        counts[how] = counts.get(how, 0) + 1
    return dict(sorted(counts.items()))


def fit_and_compare(case, *, seed=3) -> float:
    """One private step of ``case.model`` through the documented API — ``make_private``,
    a ``PrivateRun`` (B = P, one step, every example once), ``NoiseCurveOptimizer`` with
    plain SGD at η = 1, ``fit(run.dataset(x, y))`` — with the noise switched off after
    construction (σ = 0, a test-only setting), against :func:`loop_gradients`.

    ζ is half the smallest per-example norm of the loop, so every example is clipped and
    its factor ζ/‖g_i‖ enters the sum: an error in any example's norm shows in the sum.
    The step moves the weights by Δw = −η·S/B (docs/design.md#update-rule), so the clipped
    sum the engine computed inside ``fit`` is S = −B·Δw.

    Returns ‖S − S_ref‖₂ / ‖S_ref‖₂ over all trainable variables.
    """
    import keras_noisecurve as knc
    from keras_noisecurve._losses import per_example_loss_fn

    model = case.model
    per_example, _ = loop_gradients(model, per_example_loss_fn(case.loss), case.x, case.y, np.ones(P))
    norms = np.array([np.sqrt(sum(np.sum(g**2) for g in grads)) for grads in per_example])
    clip = 0.5 * float(np.min(norms[norms > 0]))
    sum_ref = [sum(min(1.0, clip / n) * grads[k] for n, grads in zip(norms, per_example) if n > 0)
               for k in range(len(per_example[0]))]
    run = knc.PrivateRun(num_examples=P, batch_size=P, steps=1, noise_multiplier=1.0, delta=1e-5,
                         sampling="fixed_epochs", seed=seed)
    private = knc.make_private(model)
    optimizer = knc.NoiseCurveOptimizer(run=run, learning_rate=1.0, l2_norm_clip=clip)
    optimizer.noise_multiplier = 0.0  # σ = 0: no privacy, an exact comparison (set before the first step)
    private.compile(optimizer=optimizer, loss=case.loss)
    before = [keras.ops.convert_to_numpy(v).astype(np.float64) for v in model.trainable_variables]
    history = private.fit(run.dataset(case.x, case.y), verbose=0)
    if not np.isfinite(history.history["loss"]).all():
        raise AssertionError(f"non-finite loss: {history.history['loss']}")
    after = [keras.ops.convert_to_numpy(v).astype(np.float64) for v in model.trainable_variables]
    got = [-P * (a - b) for a, b in zip(after, before)]
    diff = np.sqrt(sum(np.sum((g - r) ** 2) for g, r in zip(got, sum_ref)))
    return float(diff / np.sqrt(sum(np.sum(r**2) for r in sum_ref)))
