"""Mechanism checks on a user's model and run (keras_noisecurve.audit.mechanism): correct runs of
every strategy pass every check; bugs planted from outside the library (tests/audit/broken.py:
a layer rule's norm that drops its layer's share, a sampler that repeats examples, a noise of the
wrong scale or correlation) are caught by the check that should catch them."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_noisecurve as knc
from keras_noisecurve.audit.mechanism import check_mechanism, check_sampling
from keras_noisecurve.audit.whitebox import build_mixing
from keras_noisecurve.backend.tensorflow import ghost, engine_fallback

from . import broken

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@keras.saving.register_keras_serializable(package="tests_audit")
class Scale(keras.layers.Layer):
    """A layer the library has no rule for: the per-layer fallback clips it."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="scale")

    def call(self, x):  # x·s² (not affine in s: no rule recognises it by what it computes)
        return x * self.scale * self.scale


class LinearScale(Scale):
    """``x ⊙ s``: the rule for layers recognised by what they compute takes it."""

    def call(self, x):
        return x * self.scale


@pytest.fixture(autouse=True)
def _fresh_keras_session():
    """Each test from a fresh Keras session and fixed seeds (initial weights, the checked
    examples), whatever ran before it in the worker: isolation, so that a failure can be
    rerun alone. (It once hid a real defect: after the input-canary tests, other initial
    weights of the SimpleRNN case made the check name the Dense head instead of the
    SimpleRNN whose share was dropped; the check now names a layer by its own error,
    test_a_dropped_share_is_blamed_on_its_layer_when_another_layers_sum_is_further_off.)"""
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    yield


def _head(inputs, features):
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(features))


def _family_model(family):
    """(model, x) with one layer named 'target' of the family, followed by a Dense head."""
    rng = np.random.default_rng(0)
    n = 12
    if family == "Embedding":
        inputs = keras.Input((5,), dtype="int32")
        h = keras.layers.Embedding(20, 4, name="target")(inputs)
        return _head(inputs, keras.layers.GlobalAveragePooling1D()(h)), rng.integers(0, 20, (n, 5)).astype("int32")
    if family == "Conv":
        inputs = keras.Input((6, 6, 2))
        h = keras.layers.Conv2D(3, 3, name="target")(inputs)
        return _head(inputs, keras.layers.Flatten()(h)), rng.normal(size=(n, 6, 6, 2)).astype("float32")
    if family == "GroupNormalization":
        inputs = keras.Input((4, 4, 4))
        h = keras.layers.GroupNormalization(groups=2, name="target")(inputs)
        return _head(inputs, keras.layers.Flatten()(h)), rng.normal(size=(n, 4, 4, 4)).astype("float32")
    if family == "Recurrent":
        inputs = keras.Input((5, 3))
        h = keras.layers.SimpleRNN(4, name="target")(inputs)
        return _head(inputs, h), rng.normal(size=(n, 5, 3)).astype("float32")
    inputs = keras.Input((6,))
    x = rng.normal(size=(n, 6)).astype("float32")
    if family == "EinsumDense":
        h = keras.layers.EinsumDense("ab,bc->ac", output_shape=8, bias_axes="c", name="target")(inputs)
    elif family == "LayerNormalization":
        h = keras.layers.LayerNormalization(name="target")(keras.layers.Dense(8, name="body")(inputs))
    elif family == "generic":
        h = Scale(name="target")(inputs)
    else:  # Dense, LoRA
        h = keras.layers.Dense(8, activation="tanh", name="target")(inputs)
    model = _head(inputs, h)
    if family == "LoRA":
        model.get_layer("target").enable_lora(rank=2)
    return model, x


FAMILIES = {
    "Dense": "Dense",  # a family whose kernel is written once: its kind
    "EinsumDense": "EinsumDense",
    "Embedding": "Embedding",
    "Conv": "Conv",
    "LayerNormalization": "LayerNormalization",
    "GroupNormalization": "GroupNormalization",
    "LoRA": "LoRA",
    "Recurrent": "Recurrent",
    "generic": engine_fallback.GenericRule,
}


def _kind(family):
    rule = FAMILIES[family]
    return rule if isinstance(rule, str) else rule.kind


def _clipping(model, x, clip=0.05):
    y = np.arange(len(x)) % 3
    return check_mechanism(model=model, x=x, y=y, loss=LOSS, l2_norm_clip=clip, checks=("clipping",), batches=1,
                           batch_size=6).checks["clipping"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_layer_family_passes_the_clipping_check_and_a_dropped_share_is_caught(family, monkeypatch):
    model, x = _family_model(family)
    assert ("target", _kind(family)) in [(name, kind) for name, _, kind in ghost.describe(model)]
    good = _clipping(model, x)
    assert good.passed, good.line
    assert good.worst_error < 1e-4 and good.max_contribution <= 1 + 1e-4
    assert good.reference_dtype.startswith("float64")  # LoRA: "float64 (2 float32 variables)"
    broken.drop_layer_share(monkeypatch, FAMILIES[family])
    bad = _clipping(model, x)
    assert not bad.passed, bad.line
    name, _, rule = bad.worst_layer
    assert rule == _kind(family) and (name == "target" or family == "Dense"), bad.line
    assert bad.worst_error > 0.5  # the layer's share is missing: relative error 1
    assert "clipping: FAIL" in bad.line and f"rule {rule}" in bad.line


def test_a_dropped_share_is_blamed_on_its_layer_when_another_layers_sum_is_further_off(monkeypatch):
    """The clipping check names the layer whose own output is wrong, even when a wrong norm
    distorts ANOTHER layer's part of the clipped sum more (every example's factor changes).

    Closed form, with the rule of ``LinearScale`` (``x ⊙ s``, recognised by what it computes) dropping its share
    and a Dense head, loss_i = y_i·out_i (so ∂loss_i/∂out_i = y_i): scale s = (1, 0), head
    kernel (1, 1), bias 0; examples x = (1, 3), (1, 3), (1, 0) with y = +1, +1, −1. The head's
    per-example gradients (x_1·s_1·y, 0, y) are ±(1, 0, 1), norm √2; Scale's, y·x⊙(1, 1), have
    norms √10, √10, 1; so the true norms are √12, √12, √3 and the true clipped sum of the head,
    ζ·(1, 0, 1)·(2/√12 − 1/√3), is exactly 0, while the engine, whose norms lost Scale's share
    (√2 each), sums the head's parts to ζ·(1, 0, 1)/√2: that part is off by far more than 1
    (relative, floored at 10⁻⁴ of the whole sum), Scale's own part of the sum by 1.5, and
    Scale's norms by exactly 1. The check used to name the head (the largest clipped-sum error);
    it must name Scale, whose rule is at fault (its norms), and the head is correct given the
    factors the engine used."""
    import tensorflow as tf

    from keras_noisecurve.audit.mechanism_clipping import check_clipping

    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(LinearScale(name="target")(inputs)))
    model.set_weights([np.array([1.0, 0.0], "float32"), np.ones((2, 1), "float32"), np.zeros(1, "float32")])
    x = np.array([[1.0, 3.0], [1.0, 3.0], [1.0, 0.0]], "float32")
    y = np.array([[1.0], [1.0], [-1.0]], "float32")

    def linear_loss(y_true, y_pred):  # (P,): loss_i = y_i·out_i
        return tf.reduce_sum(tf.cast(y_true, y_pred.dtype) * y_pred, axis=-1)

    def check():
        return check_clipping(private=knc.make_private(model), loss_fn=linear_loss, l2_norm_clip=0.05, x=x, y=y)

    good = check()
    assert good.passed and good.worst_error < 1e-6, good
    broken.drop_layer_share(monkeypatch, "RMSNorm (by computation)")
    bad = check()
    assert not bad.passed
    by_name = {entry["layer"]: entry for entry in bad.layers}
    # the situation of the closed form: the head's part of the clipped sum is the most distorted
    assert by_name["head"]["sum_error"] > 100 and by_name["target"]["sum_error"] == pytest.approx(
        np.hypot(1 / np.sqrt(2), 6 / np.sqrt(2) - np.sqrt(3)) / np.sqrt(3), rel=1e-5)
    assert by_name["target"]["norm_error"] == pytest.approx(1.0) and by_name["head"]["norm_error"] < 1e-6
    assert bad.worst_layer == ("target", "LinearScale", "RMSNorm (by computation)") and bad.worst_error == pytest.approx(1.0), bad.layers
    # each layer's own error: Scale's norms are off by exactly 1; given the engine's factors,
    # both parts of the sum are right
    assert by_name["target"]["own_sum_error"] < 1e-6 and by_name["head"]["own_sum_error"] < 1e-6
    assert bad.sum_error > 100  # still reported, and failing


def _run(strategy="banded", sampling="fixed_epochs", n=120, batch=12, epochs=2, **optimizer):
    steps = epochs * -(-n // batch)
    mixing = (build_mixing(strategy=strategy, steps=steps, bands=2, buffers=2, participations=epochs,
                           separation=-(-n // batch)) if strategy != "bisr"
              else knc.solve_mixing_matrix(steps=steps, strategy="bisr", bands=3))
    run = knc.PrivateRun(num_examples=n, batch_size=batch, steps=steps, mixing=mixing, epsilon=4.0, delta=1e-5,
                         sampling=sampling, seed=0)
    return run


def _private(run, factory=knc.NoiseCurveOptimizer, **kwargs):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(run.num_examples, 6)).astype("float32")
    y = rng.integers(0, 3, run.num_examples)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.LayerNormalization(), keras.layers.Dense(3)])
    private = knc.make_private(model)
    kwargs.setdefault("learning_rate", None if "inner" in kwargs else 0.1)
    private.compile(optimizer=factory(run=run, l2_norm_clip=0.5, seed=2, **kwargs), loss=LOSS)
    return private, x, y


@pytest.mark.filterwarnings("ignore:the (update this optimizer runs|mixing matrix):UserWarning")
@pytest.mark.parametrize("strategy, sampling, inner", [
    ("dpsgd", "fixed_epochs", None),
    ("banded", "fixed_epochs", "momentum"),
    ("banded", "cyclic_poisson", None),
    ("toeplitz", "fixed_epochs", "adam"),
    ("blt", "fixed_epochs", None),
    ("bisr", "fixed_epochs", None),
])
def test_correct_runs_of_every_strategy_pass_every_check(strategy, sampling, inner):
    run = _run(strategy, sampling)
    kwargs = {}
    if inner == "momentum":
        kwargs["inner"] = keras.optimizers.SGD(0.1, momentum=0.9)
    elif inner == "adam":
        kwargs["inner"] = keras.optimizers.Adam(0.01)
    private, x, y = _private(run, **kwargs)
    report = check_mechanism(model=private, x=x, y=y, batches=1, batch_size=8)
    assert report.passed, report.lines()
    assert list(report.checks) == ["clipping", "sampling", "noise"]
    assert abs(report.checks["noise"].scale - 1) < 0.03
    assert all(line.split(":")[1].strip().startswith("PASS") for line in report.lines())


@pytest.mark.parametrize("plant, sampling", [(broken.overlapping_fixed_epochs, "fixed_epochs"),
                                             (broken.poisson_from_every_partition, "cyclic_poisson")])
def test_a_sampler_that_puts_examples_in_other_steps_is_caught(plant, sampling, monkeypatch):
    run = _run("banded", sampling)
    assert check_sampling(run=run).passed
    plant(monkeypatch)
    result = check_sampling(run=run)
    assert not result.passed and result.offenders > 0, result.line
    assert "sampling: FAIL" in result.line
    if sampling == "fixed_epochs":  # batches overlap by half: an example in two consecutive steps
        assert result.min_gap == 1 < result.separation


@pytest.mark.parametrize("factory, what", [(broken.ScaledNoiseOptimizer, "scale"),
                                           (broken.IndependentNoiseOptimizer, "covariance"),
                                           (broken.ForwardCOptimizer, "covariance")])
def test_a_noise_that_is_not_the_claimed_one_is_caught(factory, what):
    private, x, y = _private(_run("banded", epochs=3), factory=factory)
    result = check_mechanism(model=private, x=x, y=y, checks=("noise",)).checks["noise"]
    assert not result.passed, result.line
    if what == "scale":
        assert result.scale == pytest.approx(0.5, abs=0.02)
    else:
        assert result.covariance_error > result.covariance_threshold


@pytest.mark.parametrize("kwargs, message", [
    ({"checks": ("clipping", "speed")}, "checks must be a non-empty subset"),
    ({"tolerance": 1.5}, "tolerance must lie strictly between 0 and 1, got 1.5"),
    ({"batches": 0}, "batches must be >= 1, got 0"),
    ({"noise_steps": 1}, "noise_steps must be >= 2, got 1"),
    ({"run": "run.json"}, "run must be a keras_noisecurve.PrivateRun, got str"),
])
def test_bad_arguments_are_refused_with_the_value_and_what_is_allowed(kwargs, message):
    private, x, y = _private(_run())
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        check_mechanism(model=private, x=x, y=y, **kwargs)


def test_a_plain_model_needs_the_loss_the_clip_and_for_sampling_the_run():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    x, y = np.zeros((4, 6), "float32"), np.zeros(4, "int64")
    with pytest.raises(ValueError, match="loss is needed"):
        check_mechanism(model=model, x=x, y=y, checks=("clipping",))
    with pytest.raises(ValueError, match="l2_norm_clip"):
        check_mechanism(model=model, x=x, y=y, loss=LOSS, checks=("clipping",))
    with pytest.raises(ValueError, match="the sampling check needs the run"):
        check_mechanism(model=model, x=x, y=y, loss=LOSS, l2_norm_clip=1.0, checks=("sampling",))


def _adaptive_private(factory=knc.NoiseCurveOptimizer):
    run = knc.PrivateRun(num_examples=120, batch_size=12, steps=30, mixing=build_mixing(strategy="banded", steps=30,
                         bands=3), noise_multiplier=1.0, delta=1e-5, seed=0,
                         adaptive_clip=knc.AdaptiveClip(initial=0.2, learning_rate=0.5, count_stddev=0.5))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(run.num_examples, 6)).astype("float32")
    y = rng.integers(0, 3, run.num_examples)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    private = knc.make_private(model)
    private.compile(optimizer=factory(run=run, learning_rate=0.1, seed=2), loss=LOSS)
    return private, x, y


def test_an_adaptive_clip_passes_every_check_and_noise_frozen_at_the_first_clip_is_caught():
    """The noise check divides each step's noise by that step's ζ_t (the privacy argument:
    noise ζ_t·σ·z̃_t on a sum clipped at ζ_t). Its count sees norms 0.01 … 100 (median 1), so ζ
    moves from 0.2 toward 1 (the twin's noise key is fresh, so its count noise is kept small for the
    drift to win); noise left at ζ_0·σ is then measurably off."""
    private, x, y = _adaptive_private()
    report = check_mechanism(model=private, x=x, y=y, batches=1, batch_size=8, noise_steps=24)
    assert report.passed, report.lines()
    assert abs(report.checks["noise"].scale - 1) < 0.03
    private, x, y = _adaptive_private(broken.FrozenClipNoiseOptimizer)
    frozen = check_mechanism(model=private, x=x, y=y, checks=("noise",), noise_steps=24).checks["noise"]
    assert not frozen.passed and abs(frozen.scale - 1) > 0.1, frozen.line
