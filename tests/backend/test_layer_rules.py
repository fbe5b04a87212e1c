"""The table of ghost-norm rules of both engines (``keras_noisecurve.backend.common.layer_rules``): a
rule's validation, its kernels made only when asked for, and the built-in table itself."""

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
    assert {rule.kind for rule in BUILTIN if rule.common is not None} >= {"Dense", "EinsumDense", "Embedding", "LoRA"}
    assert not any(rule.common is not None and (rule.tensorflow or rule.jax) for rule in BUILTIN)
    rows = layer_rules.table()
    assert [row["kind"] for row in rows] == kinds
    assert {row["kind"] for row in rows if not row["jax"]} == {
        "T5 relative-attention bias", "PReLU", "TimeDistributed (folded)", "TimeDistributed"}
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
