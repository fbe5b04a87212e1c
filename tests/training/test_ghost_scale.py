"""Rules for layers recognised by what they compute (RMS norms under any class name), PReLU
and TimeDistributed over a position-wise rule (``ghost_scale``, ``ghost_timedist``).

Every rule is checked against an independent per-example ``GradientTape`` loop in float64
(norms and clipped sum), with KerasHub's real norm layers inside small backbones; layers
that only look like a scale (``x ⊙ w²``, a call that needs another argument, a layer that
mixes examples) must stay on the per-layer fallback."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve._losses import per_example_loss_fn
from keras_noisecurve.backend.tensorflow.clipping import get_engine
from keras_noisecurve.backend.tensorflow.ghost import describe, plan
from keras_noisecurve.backend.tensorflow.engine_fallback import GenericRule
from keras_noisecurve.backend.tensorflow.ghost import probe_affine_scale
from tests.training import zoo, zoo_extra, zoo_norms
from tests.training.helpers import float64_layers, loop_reference, set_precision

RTOL = 1e-6
COMPUTED, FOLDED = "RMSNorm (by computation)", "TimeDistributed (folded)"


@pytest.fixture(autouse=True)
def _float64():
    yield from float64_layers()


def _kinds(model):
    out = {}
    for _, cls, kind in describe(model):
        out.setdefault(cls, set()).add(kind)
    return out


def _compare(model, loss, x, y, rtol=RTOL, eager=False):
    """The default engine (traced, or eager as under ``run_eagerly=True`` and the audit)
    against the per-example loop: norms and clipped sum."""
    loss_fn = per_example_loss_fn(loss)
    engine = get_engine("auto", model)
    w = np.random.default_rng(4).uniform(0.5, 2.0, size=len(y))
    w[1] = 0.0
    norms, _ = loop_reference(model, loss_fn, x, y, w, np.inf)
    clip = float(np.median(norms[norms > 0]))
    norms_ref, sum_ref = loop_reference(model, loss_fn, x, y, w, clip)
    step = lambda x, y, w: engine(model, loss_fn, x, y, w, l2_norm_clip=clip, training=False)  # noqa: E731
    got = (step if eager else tf.function(step))(x, y, w)
    np.testing.assert_allclose(got.norms.numpy(), norms_ref, rtol=rtol, atol=1e-12)
    scale = max(np.max(np.abs(g)) for g in sum_ref)
    for v, g, r in zip(model.trainable_variables, got.grads, sum_ref):
        np.testing.assert_allclose(np.asarray(g), r, rtol=rtol, atol=rtol * scale, err_msg=v.path)


# ------------------------------------------------------------------ layers for the probe


class Scale(keras.layers.Layer):
    """y = rms(x) ⊙ (alpha + w): an RMS norm under a name no rule knows."""

    def __init__(self, alpha=0.0, **kwargs):
        super().__init__(**kwargs)
        self.alpha = alpha

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="random_normal", name="w")

    def call(self, x):
        x = x * keras.ops.rsqrt(keras.ops.mean(keras.ops.square(x), axis=-1, keepdims=True) + 1e-6)
        return x * (self.alpha + keras.ops.cast(self.w, x.dtype))

    def compute_output_shape(self, shape):
        return shape


class Squared(Scale):
    """y = x ⊙ w²: elementwise in w, but not affine."""

    def call(self, x):
        return x * keras.ops.square(self.w)


class NeedsArgument(Scale):
    """An RMS norm whose call needs a second argument: the probe cannot run it."""

    def call(self, x, factor):
        return super().call(x) * factor


class MixesExamples(Scale):
    """Normalises by the batch's statistics: affine in w, but examples are mixed."""

    def call(self, x):
        return x / keras.ops.sqrt(keras.ops.mean(keras.ops.square(x)) + 1e-6) * self.w


class CrossTalk(Scale):
    """y_k = x_k ⊙ w_{k+1}: affine in w, but not entry by entry."""

    def call(self, x):
        return x * keras.ops.roll(self.w, 1, axis=0)


def _dense_model(layer, d=6, length=4):
    inputs = keras.Input((length, d))
    h = layer(keras.layers.Dense(d)(inputs))
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(inputs, outputs)


def _xy(n=5, length=4, d=6):
    rng = np.random.default_rng(3)
    return rng.normal(size=(n, length, d)), rng.integers(0, 3, n)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.parametrize("rank", [2, 3])
def test_a_scale_matches_the_loop_when_the_step_runs_eagerly(rank):
    """Regression: the output the enclosing tape differentiates must not be the one computed
    under the forward accumulator (an eager GradientTape gives it a zero gradient, and the
    scale's gradient was silently dropped: found by the audit's clipping check)."""
    x, y = _xy()
    if rank == 2:
        inputs = keras.Input((6,))
        model = keras.Model(inputs, keras.layers.Dense(3)(Scale(alpha=1.0)(keras.layers.Dense(6)(inputs))))
        x = x[:, 0]
    else:
        model = _dense_model(Scale(alpha=1.0))
    assert COMPUTED in _kinds(model)["Scale"]
    _compare(model, LOSS, x, y, eager=True)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_a_scale_of_any_name_takes_the_rule_and_matches_the_loop(alpha):
    layer = Scale(alpha)
    model = _dense_model(layer)
    assert _kinds(model)["Scale"] == {COMPUTED}
    _compare(model, LOSS, *_xy())


@pytest.mark.parametrize("cls", [Squared, MixesExamples, CrossTalk])
def test_what_is_not_an_elementwise_affine_scale_stays_on_the_fallback(cls):
    model = _dense_model(cls())
    assert _kinds(model)[cls.__name__] == {"generic"}
    if cls is not MixesExamples:  # (a layer that mixes examples has no per-example gradient at all)
        _compare(model, LOSS, *_xy())  # and the fallback is exact


def test_a_call_that_needs_another_argument_stays_on_the_fallback():
    layer = NeedsArgument()
    inputs = keras.Input((4, 6))
    h = layer(keras.layers.Dense(6)(inputs), factor=2.0)
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))
    assert not probe_affine_scale(layer)
    assert _kinds(model)["NeedsArgument"] == {"generic"}


def test_probing_leaves_the_weight_alone_and_runs_once():
    layer = Scale()
    layer.build((None, 6))
    before = layer.w.numpy().copy()
    assert probe_affine_scale(layer)
    np.testing.assert_array_equal(layer.w.numpy(), before)
    calls = []
    original = Scale.call
    Scale.call = lambda self, x: calls.append(1) or original(self, x)
    try:
        assert probe_affine_scale(layer)  # cached: the layer is not called again
    finally:
        Scale.call = original
    assert calls == []


def test_probing_inside_a_traced_function_runs_eagerly():
    layer = Scale()
    layer.build((None, 6))
    seen = []

    @tf.function
    def traced():
        seen.append(probe_affine_scale(layer))
        return tf.constant(0.0)

    traced()
    assert seen == [True]


@pytest.mark.parametrize("name", ["llama", "gemma", "mistral"])
def test_kerashub_rms_norms_with_a_class_rule_are_also_affine_scales(name):
    # the class-named kernel ("RMS scale", ghost_scale.rms_scale) takes them first; the probe
    # recognises them all the same, Gemma's (1 + w) included
    import importlib

    module, cls = {
        "llama": ("keras_hub.src.models.llama.llama_layernorm", "LlamaLayerNorm"),
        "gemma": ("keras_hub.src.models.gemma.rms_normalization", "RMSNormalization"),
        "mistral": ("keras_hub.src.models.mistral.mistral_layer_norm", "MistralLayerNormalization"),
    }[name]
    pytest.importorskip("keras_hub")
    layer = getattr(importlib.import_module(module), cls)()
    layer.build((None, 4, 6))
    assert probe_affine_scale(layer)


def test_layer_normalization_with_rms_scaling_keeps_its_own_rule():
    model = _dense_model(keras.layers.LayerNormalization(rms_scaling=True))
    assert _kinds(model)["LayerNormalization"] == {"LayerNormalization"}
    _compare(model, LOSS, *_xy())


# ------------------------------------------------------------------ KerasHub backbones


@pytest.mark.parametrize("name", ["qwen3-lm", "phi3-lm", "qwen-lm"])
def test_kerashub_norms_by_computation_match_the_loop(name):
    pytest.importorskip("keras_hub")
    case = zoo_norms.NORMS[name](np.random.default_rng(1), dtype="float64")
    kinds = _kinds(case.model)
    norms = [cls for cls, k in kinds.items() if "LayerNorm" in cls]
    assert norms and all(kinds[cls] == {COMPUTED} for cls in norms), kinds
    assert not any(isinstance(rule, GenericRule) for _, rule, _ in plan(case.model))
    _compare(case.model, case.loss, case.x, case.y)


def test_t5_layer_norm_takes_the_rule():
    pytest.importorskip("keras_hub")
    case = zoo_extra.t5_seq2seq(np.random.default_rng(1), dtype="float64")
    assert _kinds(case.model)["T5LayerNorm"] == {COMPUTED}  # test_zoo_extra compares T5 with the loop


def test_llama_and_gemma_norms_keep_the_class_rule():
    pytest.importorskip("keras_hub")
    assert _kinds(zoo.llama_lm(np.random.default_rng(1)).model)["LlamaLayerNorm"] == {"RMS scale"}


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("model", ["qwen3", "llama"])
def test_mixed_precision_rms_scales(policy, model):
    # Qwen3's norm by computation, Llama's by the class rule: under a mixed policy the
    # scale is autocast inside the call, and the forward-mode derivative must still see it
    pytest.importorskip("keras_hub")
    set_precision("float32")
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    build, norm, kind = {"qwen3": (zoo_norms.qwen3_lm, "Qwen3LayerNorm", COMPUTED),
                         "llama": (zoo.llama_lm, "LlamaLayerNorm", "RMS scale")}[model]
    case = build(np.random.default_rng(1), dtype=None)
    assert _kinds(case.model)[norm] == {kind}
    # the same model, clipped by the engine and by the loop, both under the policy
    _compare(case.model, case.loss, case.x, case.y, rtol=3e-2 if policy == "mixed_bfloat16" else 3e-3)


# ------------------------------------------------------------------ PReLU and TimeDistributed


@pytest.mark.parametrize("shared_axes", [None, [1], [1, 2]])
def test_prelu_matches_the_loop(shared_axes):
    layer = keras.layers.PReLU(alpha_initializer=keras.initializers.RandomUniform(0.1, 0.5), shared_axes=shared_axes)
    model = _dense_model(layer)
    assert _kinds(model)["PReLU"] == {"PReLU"}
    _compare(model, LOSS, *_xy())


def test_time_distributed_tagger_matches_the_loop():
    case = zoo_norms.time_distributed_tagger(np.random.default_rng(1), dtype="float64")
    assert _kinds(case.model)["TimeDistributed"] == {FOLDED}
    _compare(case.model, case.loss, case.x, case.y)


@pytest.mark.parametrize("inner", ["embedding", "scale", "prelu", "rms-layernorm"])
def test_time_distributed_over_each_positionwise_rule(inner):
    rng = np.random.default_rng(2)
    if inner == "embedding":
        inputs = keras.Input((3, 4), dtype="int32")
        h = keras.layers.TimeDistributed(keras.layers.Embedding(20, 6))(inputs)
        h = keras.layers.Reshape((12, 6))(h)
        x = rng.integers(0, 20, size=(5, 3, 4)).astype("int32")
    else:
        layer = {"scale": lambda: Scale(1.0), "prelu": lambda: keras.layers.PReLU(
            alpha_initializer=keras.initializers.RandomUniform(0.1, 0.5), shared_axes=[1]),
            "rms-layernorm": lambda: keras.layers.LayerNormalization(rms_scaling=True)}[inner]()
        inputs = keras.Input((3, 4, 6))
        h = keras.layers.TimeDistributed(layer)(keras.layers.Dense(6)(inputs))
        h = keras.layers.Reshape((12, 6))(h)
        x = rng.normal(size=(5, 3, 4, 6))
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))
    assert _kinds(model)["TimeDistributed"] == {FOLDED}
    _compare(model, LOSS, x, rng.integers(0, 3, 5))


def test_time_distributed_over_a_layer_without_a_positionwise_rule_stays_on_the_fallback():
    inputs = keras.Input((3, 6, 6, 2))
    h = keras.layers.TimeDistributed(keras.layers.Conv2D(3, 3))(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
    assert _kinds(model)["TimeDistributed"] == {"TimeDistributed"}
