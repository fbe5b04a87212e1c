"""``keras_noisecurve.training.describe`` and ``register_rule`` on TensorFlow: the neutral entry
points give the TensorFlow engine's answers (its registry is tested in test_ghost.py and
test_layers.py)."""

import keras
import numpy as np
import pytest

import keras_noisecurve as knc
from keras_noisecurve.backend.tensorflow import ghost, engine_rules
from keras_noisecurve.backend.common.ghost_dense import dense


def _model():
    inp = keras.Input((6,))
    h = keras.layers.Dense(4, name="first")(inp)
    h = keras.layers.LayerNormalization(name="norm")(h)
    return keras.Model(inp, keras.layers.Dense(2, name="head")(h))


def test_describe_is_the_tensorflow_engines_plan():
    model = _model()
    got = knc.training.describe(model)
    assert got == ghost.describe(model)
    assert [name for name, *_ in got] == ["first", "norm", "head"]
    assert got[0][2] == "Dense"
    # the batch is not needed on TensorFlow, and does not change the plan
    assert knc.training.describe(model, np.zeros((2, 6), np.float32)) == got


def test_register_rule_adds_to_the_tensorflow_registry(monkeypatch):
    monkeypatch.setattr(engine_rules, "_REGISTERED", [])

    class Mine(keras.layers.Layer):
        pass

    class MineRule(engine_rules.RelativeAttentionBiasRule):
        kind = "Mine"
        classes = (Mine,)

    knc.training.register_rule(MineRule())
    assert [row["kind"] for row in engine_rules.rule_table()][0] == "Mine"
    with pytest.raises(TypeError, match="Rule instance"):
        knc.training.register_rule(lambda layer, calls: None)  # a JAX rule is not a TensorFlow one


def test_a_layer_rule_registers_its_tensorflow_kernel_under_its_kind(monkeypatch):
    monkeypatch.setattr(engine_rules, "_REGISTERED", [])

    class Mine(keras.layers.Dense):
        pass

    class MineRule(engine_rules.KernelRule):
        def __init__(self):
            super().__init__(dense, "Mine")

        def matches(self, layer):
            return isinstance(layer, Mine)

        def check(self, layer):
            return None

    made = []
    knc.training.register_rule(knc.training.LayerRule("Mine", tensorflow=MineRule, jax=lambda: made.append("jax")))
    assert made == []  # the JAX kernel is not made on TensorFlow
    inp = keras.Input((6,))
    model = keras.Model(inp, Mine(2, name="mine")(keras.layers.Dense(4, name="first")(inp)))
    assert knc.training.describe(model) == [("first", "Dense", "Dense"), ("mine", "Mine", "Mine")]
    # a rule without a TensorFlow kernel changes nothing here
    knc.training.register_rule(knc.training.LayerRule("Other", jax=lambda: made.append("jax")))
    assert len(engine_rules._REGISTERED) == 1 and made == []
    with pytest.raises(TypeError, match="the tensorflow kernel of rule 'Bad' must be a engine_rules.Rule instance"):
        knc.training.register_rule(knc.training.LayerRule("Bad", tensorflow=lambda: (lambda layer, calls: None)))


def test_the_builtin_rules_are_the_tables_tensorflow_kernels_in_its_order():
    from keras_noisecurve.backend.common import layer_rules

    kinds = [rule.kind for rule in engine_rules.RULES]
    assert kinds[:-1] == [spec.kind for spec in layer_rules.BUILTIN]
    assert kinds[-1] == "generic"  # the recurrent layers' re-run fallback, this engine's own


def test_a_kernel_written_once_registers_and_clips_as_the_per_example_loop(monkeypatch):
    """The same keras.ops kernel as tests/jax/test_jax_rules.py's twin (tests/gate_kernel.py),
    registered by a LayerRule with common=, against the per-example loop and the vectorized engine."""
    from tests.gate_kernel import gate_kernel, gate_model
    from tests.training.test_ghost import P, check_model

    monkeypatch.setattr(engine_rules, "_REGISTERED", [])
    keras.utils.set_random_seed(1)
    model = gate_model()
    assert knc.training.describe(model)[1] == ("gate", "Gate", "generic")
    knc.training.register_rule(knc.training.LayerRule("Gate", common=lambda: gate_kernel))
    assert knc.training.describe(model)[1] == ("gate", "Gate", "Gate")
    rng = np.random.default_rng(0)
    check_model(model, rng.normal(size=(P, 5, 4)), rng.normal(size=(P, 3)))
