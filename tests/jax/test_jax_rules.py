"""``keras_noisecurve.training.describe`` and ``register_rule`` on JAX: the rule each layer takes,
read from a traced step, and a rule a user registers for a layer of their own, checked against
an INDEPENDENT per-example loop (tests/jax/helpers.reference_clipped_sum: one ``jax.grad`` per
example, clipping in float64 numpy). Tolerances as in test_jax_ghost_hub.py."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_noisecurve as knc
from keras_noisecurve.backend.common import kernel_rules
from keras_noisecurve.backend.jax.ghost import ghost_clipped_sum
from keras_noisecurve.backend.common.norm_forms import cat, kept, scaled
from tests.jax.helpers import mse_per_example, reference_clipped_sum


class Gate(keras.layers.Layer):
    """y = x ⊙ sigmoid(v) along the last axis: not affine in its weight v, so no built-in rule
    takes it (the RMS-type rule probes for affinity and refuses)."""

    def build(self, shape):
        self.v = self.add_weight(shape=(shape[-1],), initializer="random_normal", name="v")

    def call(self, x):
        return x * keras.ops.sigmoid(self.v)


def gate_rule(layer, calls):
    """Gate: ∂y/∂v = x ⊙ σ'(v), so example i's gradient is Σ_positions g_i ⊙ x_i ⊙ σ'(v)."""
    if type(layer) is not Gate:
        return None
    d = layer.v.shape[0]
    p = calls[0]["a"].shape[0]
    s = jax.nn.sigmoid(jnp.asarray(layer.v.value, jnp.float32))
    a = cat([jnp.reshape(c["a"].astype(jnp.float32), (p, -1, d)) for c in calls])
    g = cat([jnp.reshape(c["g"].astype(jnp.float32), (p, -1, d)) for c in calls])
    per = jnp.sum(g * a, axis=1) * (s * (1 - s))  # (P, d)

    def sums(c, keep=None):
        return {id(layer.v): jnp.sum(scaled(c, kept(per, keep)), axis=0)}

    return jnp.sum(per * per, axis=1), sums


def _model():
    inp = keras.Input((5, 4))
    h = keras.layers.Dense(6, name="first")(inp)
    h = Gate(name="gate")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inp, keras.layers.Dense(3, name="head")(h))


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(kernel_rules, "_REGISTERED", [])
    return kernel_rules._REGISTERED


def test_describe_names_each_layers_rule_and_the_fallback(registry):
    keras.utils.set_random_seed(0)
    model = _model()
    assert knc.training.describe(model) == [
        ("first", "Dense", "Dense"), ("gate", "Gate", "generic"), ("head", "Dense", "Dense")]
    knc.training.register_rule(gate_rule)
    assert knc.training.describe(model, np.zeros((3, 5, 4), np.float32))[1] == ("gate", "Gate", "gate_rule")
    assert kernel_rules.rule_table()[0]["kind"] == "gate_rule"
    assert [row["kind"] for row in kernel_rules.rule_table(registered=False)] == [kind for kind, _ in kernel_rules.RULES]


def test_describe_lists_the_layers_under_a_recurrent_layer():
    seq = keras.Sequential([keras.layers.Embedding(50, 8), keras.layers.LSTM(6, name="lstm"), keras.layers.Dense(2)])
    seq.build((None, 7))
    ids = np.zeros((2, 7), np.int32)
    assert [how for *_, how in knc.training.describe(seq, ids)] == ["Embedding", "Recurrent", "Dense"]
    inside = knc.training.describe(seq, ids, inside=True)
    assert inside[2][1:] == ("LSTMCell", "through 'lstm'")


def test_describe_without_a_batch_needs_known_inputs():
    class Free(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2, name="out")

        def call(self, x):
            return self.d(x)

    model = Free()
    model(np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match="pass a batch of the model's inputs"):
        knc.training.describe(model)
    assert knc.training.describe(model, np.zeros((2, 3), np.float32)) == [("out", "Dense", "Dense")]
    with pytest.raises(TypeError, match="inside must be True or False"):
        knc.training.describe(model, np.zeros((2, 3), np.float32), inside=1)


def test_a_registered_rule_clips_as_the_independent_loop(registry):
    keras.utils.set_random_seed(1)
    model = _model()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 5, 4)).astype(np.float32)
    y = rng.normal(size=(8, 3)).astype(np.float32)
    weights = np.ones(8, np.float32)
    weights[1], weights[2] = 0.0, 0.5
    knc.training.register_rule(gate_rule)
    knc.training.register_rule(gate_rule)  # again: replaced, not added twice
    assert [function for _, function, _ in registry] == [gate_rule]
    _, free = reference_clipped_sum(model, x, y, weights, 1e9, loss=mse_per_example)
    clip = float(np.median(free[free > 0]))
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    step = jax.jit(lambda tv, ntv: ghost_clipped_sum(model, mse_per_example, tv, ntv, x, y, jnp.asarray(weights),
                                                      l2_norm_clip=clip)[:2])
    sums, norms = step(trainable, non_trainable)
    ref_sums, ref_norms = reference_clipped_sum(model, x, y, weights, clip, loss=mse_per_example)
    np.testing.assert_allclose(np.asarray(norms), ref_norms, rtol=1e-4, atol=1e-6)
    scale = max(np.max(np.abs(r)) for r in ref_sums)
    for s, r, v in zip(sums, ref_sums, model.trainable_variables):
        np.testing.assert_allclose(np.asarray(s), r, rtol=1e-4, atol=1e-4 * scale, err_msg=v.path)


def test_a_layer_rule_registers_its_jax_kernel_under_its_kind(registry):
    keras.utils.set_random_seed(0)
    model = _model()
    made = []
    knc.training.register_rule(knc.training.LayerRule("Gate", tensorflow=lambda: made.append("tf"), jax=lambda: gate_rule))
    assert made == []  # the TensorFlow kernel is not made on JAX
    assert knc.training.describe(model)[1] == ("gate", "Gate", "Gate")
    assert kernel_rules.rule_table()[0]["kind"] == "Gate"
    # the same kind again replaces it; a rule without a JAX kernel changes nothing here
    knc.training.register_rule(knc.training.LayerRule("Gate", jax=lambda: gate_rule))
    knc.training.register_rule(knc.training.LayerRule("Other", tensorflow=lambda: made.append("tf")))
    assert [kind for kind, _, _ in registry] == ["Gate"] and made == []
    with pytest.raises(TypeError, match="the jax kernel of rule 'Bad' must be a function"):
        knc.training.register_rule(knc.training.LayerRule("Bad", jax=lambda: "not a function"))


def test_register_rule_refuses_what_is_not_a_rule(registry):
    with pytest.raises(TypeError, match="rule must be a LayerRule or a function"):
        knc.training.register_rule("gate_rule")
    assert registry == []


def test_the_bundled_group_norm_registers_its_jax_rule_and_it_is_exact():
    from keras_noisecurve.apps.layers import GroupNorm

    keras.utils.set_random_seed(2)
    inp = keras.Input((6, 6, 4))
    h = keras.layers.Conv2D(8, 3, name="conv")(inp)
    h = GroupNorm(groups=2, name="gn")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inp, keras.layers.Dense(3, name="head")(h))
    model.get_layer("gn").gamma.assign(np.linspace(0.5, 1.5, 8).astype(np.float32))  # not the identity
    assert knc.training.describe(model)[1] == ("gn", "GroupNorm", "GroupNorm")
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 6, 6, 4)).astype(np.float32)
    y = rng.normal(size=(6, 3)).astype(np.float32)
    weights = np.ones(6, np.float32)
    _, free = reference_clipped_sum(model, x, y, weights, 1e9, loss=mse_per_example)
    clip = float(np.median(free))
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    sums, norms = jax.jit(lambda tv, ntv: ghost_clipped_sum(model, mse_per_example, tv, ntv, x, y,
                                                             jnp.asarray(weights), l2_norm_clip=clip)[:2])(
        trainable, non_trainable)
    ref_sums, ref_norms = reference_clipped_sum(model, x, y, weights, clip, loss=mse_per_example)
    np.testing.assert_allclose(np.asarray(norms), ref_norms, rtol=1e-4, atol=1e-6)
    scale = max(np.max(np.abs(r)) for r in ref_sums)
    for s, r, v in zip(sums, ref_sums, model.trainable_variables):
        np.testing.assert_allclose(np.asarray(s), r, rtol=1e-4, atol=1e-4 * scale, err_msg=v.path)


def test_a_kernel_written_once_registers_and_clips_as_the_independent_loop(registry):
    """The same keras.ops kernel as the TensorFlow test's (tests/gate_kernel.py), registered by a
    LayerRule with common=."""
    from tests.gate_kernel import gate_kernel, gate_model

    keras.utils.set_random_seed(1)
    model = gate_model()
    knc.training.register_rule(knc.training.LayerRule("Gate", common=lambda: gate_kernel))
    assert knc.training.describe(model)[1] == ("gate", "Gate", "Gate")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 5, 4)).astype(np.float32)
    y = rng.normal(size=(8, 3)).astype(np.float32)
    weights = np.ones(8, np.float32)
    weights[1], weights[2] = 0.0, 0.5
    _, free = reference_clipped_sum(model, x, y, weights, 1e9, loss=mse_per_example)
    clip = float(np.median(free[free > 0]))
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    sums, norms = jax.jit(lambda tv, ntv: ghost_clipped_sum(model, mse_per_example, tv, ntv, x, y, jnp.asarray(weights),
                                                             l2_norm_clip=clip)[:2])(trainable, non_trainable)
    ref_sums, ref_norms = reference_clipped_sum(model, x, y, weights, clip, loss=mse_per_example)
    np.testing.assert_allclose(np.asarray(norms), ref_norms, rtol=1e-4, atol=1e-6)
    scale = max(np.max(np.abs(r)) for r in ref_sums)
    for s, r, v in zip(sums, ref_sums, model.trainable_variables):
        np.testing.assert_allclose(np.asarray(s), r, rtol=1e-4, atol=1e-4 * scale, err_msg=v.path)
