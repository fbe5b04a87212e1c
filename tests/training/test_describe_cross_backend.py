"""``describe(model)`` says the same on TensorFlow and on JAX: both engines take their rules from
one table (``keras_noisecurve.backend.common.layer_rules``), so a layer family has one name on both.
The model holds a layer of every family both engines have a rule for; JAX runs in a subprocess."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BUILD = r'''
import json
import keras
import numpy as np
import keras_noisecurve as knc
import keras_noisecurve.apps.layers as apps_layers

L = keras.layers
keras.utils.set_random_seed(0)
ids = keras.Input((8,), dtype="int32", name="ids")
h = L.Embedding(20, 6, name="embedding")(ids)
h = L.LSTM(5, name="lstm")(h)
seq = keras.Input((5, 6), name="seq")
s = L.EinsumDense("abc,cd->abd", output_shape=(None, 6), name="einsum")(seq)
s = L.LayerNormalization(name="layer_norm")(s)
s = L.RMSNormalization(name="rms_norm")(s)
lora = L.Dense(6, name="lora")
s = lora(s)
s = L.MultiHeadAttention(num_heads=2, key_dim=3, name="attention")(s, s)
img = keras.Input((8, 8, 4), name="img")
i = L.Conv2D(4, 3, name="conv")(img)
i = L.Conv2D(4, 3, groups=2, name="grouped_conv")(i)
i = L.DepthwiseConv2D(2, name="depthwise")(i)
i = L.SeparableConv2D(4, 2, name="separable")(i)
i = L.Conv2DTranspose(4, 2, name="transpose")(i)
i = L.GroupNormalization(groups=2, name="group_norm")(i)
i = apps_layers.GroupNorm(groups=2, name="bundled_group_norm")(i)
vol = keras.Input((4, 4, 4, 2), name="vol")
v = L.Conv3D(2, 2, name="conv3d")(vol)
out = L.Concatenate()([h, L.GlobalAveragePooling1D()(s), L.GlobalAveragePooling2D()(i), L.GlobalAveragePooling3D()(v)])
model = keras.Model([ids, seq, img, vol], L.Dense(1, name="head")(out))
lora.enable_lora(2)
print(json.dumps([list(row) for row in knc.training.describe(model)]))
'''


def _describe_on_jax():
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, "-c", BUILD], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return [tuple(row) for row in json.loads(out.stdout.strip().splitlines()[-1])]


def _describe_here(capsys):
    capsys.readouterr()
    exec(compile(BUILD, "BUILD", "exec"), {})
    return [tuple(row) for row in json.loads(capsys.readouterr().out.strip().splitlines()[-1])]


@pytest.mark.slow
def test_describe_names_every_layer_the_same_on_both_backends(capsys):
    tensorflow, jax = _describe_here(capsys), _describe_on_jax()
    # the same rows (TensorFlow lists the layers in its plan's order, JAX in the order it saw them)
    assert sorted(jax) == sorted(tensorflow) and len(tensorflow) == 19
    how = {name: rule for name, _, rule in tensorflow}
    assert how["embedding"] == "Embedding" and how["lstm"] == "Recurrent" and how["einsum"] == "EinsumDense"
    assert how["layer_norm"] == "LayerNormalization" and how["rms_norm"] == "RMS scale" and how["lora"] == "LoRA"
    assert how["conv"] == "Conv" and how["grouped_conv"] == "GroupedConv" and how["conv3d"] == "Conv3D"
    assert how["depthwise"] == "DepthwiseConv" and how["separable"] == "SeparableConv"
    assert how["transpose"] == "ConvTranspose" and how["group_norm"] == "GroupNormalization"
    assert how["bundled_group_norm"] == "GroupNorm" and how["head"] == "Dense"
    assert [how[name] for name in ("query", "key", "value", "attention_output")] == ["EinsumDense"] * 4
