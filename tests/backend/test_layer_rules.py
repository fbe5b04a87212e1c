"""The table of ghost-norm rules of both engines (``keras_noisecurve.backend.common.layer_rules``): a
rule's validation, its kernels made only when asked for, and the built-in table itself."""

import re

import numpy as np
import pytest

from keras_noisecurve.backend.common import layer_rules
from keras_noisecurve.backend.common.layer_rules import BUILTIN, GENERIC, LayerRule


def test_a_rule_makes_only_the_kernel_asked_for():
    made = []
    rule = LayerRule("Mine", tensorflow=lambda: made.append("tf") or "tf kernel", jax=lambda: "jax kernel")
    assert made == []  # naming the kernels made none
    assert rule.kernel("jax") == "jax kernel" and made == []
    assert rule.kernel("tensorflow") == "tf kernel" and made == ["tf"]
    assert LayerRule("Only TF", tensorflow=lambda: 1).kernel("jax") is None
    with pytest.raises(ValueError, match=r"backend must be one of \('tensorflow', 'jax'\), got 'torch'"):
        rule.kernel("torch")


def _kernel():
    return None


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(kind="", jax=_kernel), TypeError, "kind must be a non-empty string, got ''"),
    (dict(kind=3, jax=_kernel), TypeError, "kind must be a non-empty string, got 3"),
    (dict(kind=GENERIC, jax=_kernel), ValueError, "names the per-layer fallback"),
    (dict(kind="Mine", jax="ghost_dense:dense_rule"), TypeError, "jax must be a function of no arguments"),
    (dict(kind="Mine"), ValueError, "rule 'Mine' has no kernel"),
])
def test_a_rule_is_validated(kwargs, error, match):
    with pytest.raises(error, match=match):
        LayerRule(**kwargs)


def test_the_builtin_table_names_each_family_once_with_a_tensorflow_kernel():
    kinds = [rule.kind for rule in BUILTIN]
    assert len(set(kinds)) == len(kinds)
    assert all(rule.tensorflow is not None or rule.common is not None for rule in BUILTIN)
    # one kernel for every backend: these families' kernels are written once, in keras.ops
    assert {rule.kind for rule in BUILTIN if rule.common is not None} >= {
        "Dense", "EinsumDense", "Embedding", "LoRA", "LayerNormalization", "GroupNormalization", "ReversibleEmbedding",
        "PositionEmbedding", "RMS scale", "PReLU", "RMSNorm (by computation)"}
    assert not any(rule.common is not None and (rule.tensorflow or rule.jax) for rule in BUILTIN)
    rows = layer_rules.table()
    assert [row["kind"] for row in rows] == kinds
    assert {row["kind"] for row in rows if not row["jax"]} == {
        "T5 relative-attention bias", "TimeDistributed (folded)", "TimeDistributed"}
    # the probe-based rule is tried last: a layer a named rule takes is never probed
    assert kinds[-1] == "RMSNorm (by computation)"


def test_every_builtin_kernel_resolves_on_each_backend_that_names_one():
    # resolving imports that backend's module: both are installed with the dev extra
    pytest.importorskip("tensorflow")
    pytest.importorskip("jax")
    for rule in BUILTIN:
        for backend in layer_rules.BACKENDS:
            if getattr(rule, backend) is not None or rule.common is not None:
                kernel = rule.kernel(backend)
                assert kernel is not None and (callable(kernel) or hasattr(kernel, "analyse")), (rule.kind, backend)


class _Layer:
    pass


@pytest.mark.parametrize("args, kwargs, match", [
    ((), dict(weights=("v",)), "takes one or more layer classes or matches=, not both; got classes ()"),
    (("Dense",), dict(weights=("v",)), "takes one or more layer classes or matches=, not both; got classes ('Dense',)"),
    ((_Layer,), dict(weights=("v",), matches=bool), "not both; got classes"),
    ((), dict(weights=("v",), matches=3), "matches must be a function or None, got 3"),
    ((_Layer,), dict(weights=("v",), forward="f"), "forward must be a function or None, got 'f'"),
    ((_Layer,), dict(weights="kernel"), "weights must be a tuple of the layer's weight attribute names"),
    ((_Layer,), dict(weights=3), "or a function weights(layer); got 3"),
    ((_Layer,), dict(weights=()), "weights must be a tuple"),
    ((_Layer,), dict(weights=("v",), pre_activation=3), "pre_activation must be a function or None, got 3"),
    ((_Layer,), dict(weights=("v",), check="no"), "check must be a function or None, got 'no'"),
])
def test_layer_kernel_validates_its_arguments(args, kwargs, match):
    with pytest.raises(TypeError, match=re.escape(match)):
        layer_rules.layer_kernel(*args, **kwargs)


def test_a_declared_kernel_takes_only_its_classes_and_configurations():
    keras = pytest.importorskip("keras")
    with pytest.raises(TypeError, match="decorates a function"):
        layer_rules.layer_kernel(keras.layers.Dense, weights=("kernel",))(3)
    seen = []
    kernel = layer_rules.layer_kernel(keras.layers.Dense, weights=("kernel", "bias"),
                                      check=lambda layer: "too wide" if layer.units > 4 else None)(
        lambda layer, calls: seen.append(layer.name) or "result")
    dense, wide, other = keras.layers.Dense(2, name="d"), keras.layers.Dense(8), keras.layers.LayerNormalization()
    for layer, shape in ((dense, 3), (wide, 3), (other, 3)):
        layer.build((None, shape))
    calls = [{"a": np.zeros((2, 3)), "g": np.zeros((2, 2)), "args": None}]
    assert kernel.reason(dense) is None and kernel(dense, calls) == "result" and seen == ["d"]
    assert kernel.reason(wide) == "too wide" and kernel(wide, calls) is None
    assert "not one of ['Dense']" in kernel.reason(other)
    dense.enable_lora(1)
    assert kernel.reason(dense) == "LoRA is enabled"
    assert kernel(keras.layers.Dense(2), [{"a": (1, 2), "g": None}]) is None  # not arrays: the fallback


def test_a_kernel_declared_by_matches_and_a_weights_function():
    keras = pytest.importorskip("keras")
    seen = []
    kernel = layer_rules.layer_kernel(matches=lambda layer: layer.name.startswith("mine"), names=("Mine",),
                                      weights=lambda layer: [layer.kernel])(
        lambda layer, calls: seen.append(calls[0]["saved"]) or "result")
    mine, other = keras.layers.Dense(2, name="mine", use_bias=False), keras.layers.Dense(2, name="other")
    biased = keras.layers.Dense(2, name="mine_biased")
    for layer in (mine, other, biased):
        layer.build((None, 3))
    assert kernel.layer_names == ("Mine",) and kernel.classes == ()
    assert kernel.matches(mine) and not kernel.matches(other)
    assert kernel.weights(mine) == [mine.kernel]
    assert "not a layer" in kernel.reason(other)
    assert "unexpected own trainable variables" in kernel.reason(biased)  # its bias is not in weights(layer)
    calls = [{"a": np.zeros((2, 3)), "g": np.zeros((2, 2)), "args": None}]
    assert kernel(mine, calls) == "result" and seen == [None]  # an engine that saved nothing: "saved" is None
