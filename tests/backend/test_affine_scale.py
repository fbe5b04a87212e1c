"""The shared decision of the RMS-norm probe (``keras_noisecurve.backend.common.affine_scale``):
``affine_in_weight`` on numpy functions whose affinity in the weight is known by
construction, and ``AffineScaleProbe``'s qualification, cache and refusals. The engines'
own probes (on real layers) are tested in tests/training/test_ghost_scale.py (TensorFlow)
and tests/jax/test_jax_ghost_hub.py (JAX)."""

import contextlib

import keras
import numpy as np
import pytest

from keras_noisecurve.backend.common.affine_scale import AffineScaleProbe, affine_in_weight, single_weight


def _rms(x):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)


AFFINE = {
    "rms * w": lambda v, x: _rms(x) * v,
    "rms * (1 + w)": lambda v, x: _rms(x) * (1.0 + v),
    "x * w": lambda v, x: x * v,
}
NOT_AFFINE = {
    "x * w**2": lambda v, x: x * v * v,
    "x * exp(w)": lambda v, x: x * np.exp(v),
    "w mixes positions": lambda v, x: x * np.roll(v, 1) + np.mean(x * v, axis=-1, keepdims=True),
    "mixes examples": lambda v, x: (x - np.mean(x, axis=0, keepdims=True)) * v + np.mean(x, axis=0, keepdims=True),
    "another shape": lambda v, x: (x * v)[..., :-1],
    "zero": lambda v, x: 0.0 * x * v,
    "no slope": lambda v, x: x + 0.0 * v,
    "not finite": lambda v, x: x * v / 0.0,
}


@pytest.mark.parametrize("name", sorted(AFFINE))
def test_elementwise_affine_scales_are_recognised(name):
    assert affine_in_weight(outputs=AFFINE[name], width=5, compute_dtype="float32")


@pytest.mark.parametrize("name", sorted(NOT_AFFINE))
def test_what_is_not_an_affine_scale_per_example_is_refused(name):
    with np.errstate(divide="ignore", invalid="ignore"):
        assert not affine_in_weight(outputs=NOT_AFFINE[name], width=5, compute_dtype="float32")


def test_a_mixing_of_examples_is_seen_by_the_one_example_check():
    # y = x ⊙ w + mean over examples: affine in w with a slope independent of w, so only
    # the check of example 0 alone refuses it
    def outputs(v, x):
        return x * v + np.mean(x, axis=0, keepdims=True)

    assert not affine_in_weight(outputs=outputs, width=4, compute_dtype="float32")


def test_the_tolerance_follows_the_compute_dtype():
    # a relative error of 1e-3 of the largest output: within float16's 3e-2, not float32's 1e-4
    def outputs(v, x):
        y = x * v
        return y + 1e-3 * np.max(np.abs(y)) * np.sin(np.arange(y.size).reshape(y.shape) + np.sum(v))

    assert affine_in_weight(outputs=outputs, width=6, compute_dtype="float16")
    assert not affine_in_weight(outputs=outputs, width=6, compute_dtype="float32")


def test_the_probe_inputs_are_the_documented_draws():
    seen = []

    def outputs(v, x):
        seen.append((v.copy(), x.copy()))
        return x * v

    assert affine_in_weight(outputs=outputs, width=3, compute_dtype="float64")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 3))
    vectors = [rng.uniform(0.5, 1.5, 3), -rng.uniform(2.0, 3.0, 3), rng.uniform(2.0, 3.0, 3), -rng.uniform(0.2, 0.4, 3)]
    assert len(seen) == 5
    for (v, got_x), want in zip(seen[:4], vectors):
        np.testing.assert_array_equal(v, want)
        np.testing.assert_array_equal(got_x, x)
    np.testing.assert_array_equal(seen[4][0], vectors[0])
    np.testing.assert_array_equal(seen[4][1], x[:1])


def _norm(width=4):
    layer = keras.layers.LayerNormalization(center=False)  # one weight, gamma (width,)
    layer.build((None, 3, width))
    return layer


def test_single_weight_is_the_one_trainable_vector_or_none():
    layer = _norm()
    assert single_weight(layer) is layer.gamma
    dense = keras.layers.Dense(3)
    dense.build((None, 4))
    assert single_weight(dense) is None  # kernel and bias
    frozen = _norm()
    frozen.trainable = False
    assert single_weight(frozen) is None


def test_the_probe_caches_per_layer_and_counts_a_failing_call_as_no():
    calls, scopes = [], []

    @contextlib.contextmanager
    def scope():
        scopes.append(1)
        yield

    def outputs(layer, weight, value, x):
        calls.append(layer.name)
        assert weight is layer.gamma
        return _rms(x) * value

    probe = AffineScaleProbe(outputs=outputs, scope=scope)
    layer = _norm()
    assert probe(layer) and probe(layer)
    assert len(calls) == 5 and len(scopes) == 1  # cached after the first probe

    def failing(layer, weight, value, x):
        raise RuntimeError("this call needs other arguments")

    refusing = AffineScaleProbe(outputs=failing, scope=scope)
    assert not refusing(_norm())
    assert not refusing(keras.layers.LayerNormalization(center=False))  # not built: no weight yet


def test_the_probe_refuses_what_is_not_callable():
    with pytest.raises(TypeError, match="outputs and scope must be callables, but got outputs=None"):
        AffineScaleProbe(outputs=None, scope=contextlib.nullcontext)
