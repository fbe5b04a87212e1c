"""The accuracy benchmark's numpy update rule (momentum + schedule) against Keras's SGD (fast)."""

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

from keras_noisecurve import MixingMatrix, UpdateRule

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "_accuracy_train.py"
_SPEC = importlib.util.spec_from_file_location("_accuracy_train_under_test", _PATH)
TRAIN = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = TRAIN  # dataclasses look their module up there
_SPEC.loader.exec_module(TRAIN)

H = np.array([[2.0, 0.5], [0.5, 1.0]])  # a 2-parameter quadratic, gradient H w − c
C = np.array([1.0, -2.0])


def test_heavy_ball_three_steps_by_hand():
    # β = 0.5, η = 0.1, s = (1, 0.5, 0.25), fixed gradients g_t
    rule = UpdateRule(momentum=0.5, schedule=[1.0, 0.5, 0.25])
    opt = TRAIN.HeavyBall(0.1, 3, rule)
    g = [np.array([1.0, 2.0]), np.array([-1.0, 0.0]), np.array([4.0, -2.0])]
    w = np.array([0.0, 1.0])
    w = opt.step(w, 0, g[0])  # m1 = −0.1·g0 = (−0.1, −0.2)
    np.testing.assert_allclose(w, [-0.1, 0.8], rtol=0, atol=1e-15)
    w = opt.step(w, 1, g[1])  # m2 = 0.5·m1 − 0.05·g1 = (−0.05 + 0.05, −0.1) = (0, −0.1)
    np.testing.assert_allclose(w, [-0.1, 0.7], rtol=0, atol=1e-15)
    w = opt.step(w, 2, g[2])  # m3 = 0.5·m2 − 0.025·g2 = (−0.1, −0.05 + 0.05) = (−0.1, 0)
    np.testing.assert_allclose(w, [-0.2, 0.7], rtol=0, atol=1e-15)


def test_plain_rule_is_the_plain_sgd_step_bit_for_bit():
    rng = np.random.default_rng(0)
    w, g = rng.standard_normal(5), rng.standard_normal(5)
    for rule in (None, UpdateRule()):
        assert np.array_equal(TRAIN.HeavyBall(0.7, 4, rule).step(w, 2, g), w - 0.7 * g)


def _keras_sgd_run(lr, rule, steps, w0, grad_at):
    """w_T of keras.optimizers.SGD(momentum=β, nesterov=False) with learning rate η·s_t (float64)."""
    import keras

    floatx = keras.config.floatx()
    keras.config.set_floatx("float64")  # the optimizer's learning-rate variable and schedule in float64
    try:
        return _keras_sgd_run_f64(keras, lr, rule, steps, w0, grad_at)
    finally:
        keras.config.set_floatx(floatx)


def _keras_sgd_run_f64(keras, lr, rule, steps, w0, grad_at):
    s = rule.multipliers(steps)
    opt = keras.optimizers.SGD(learning_rate=lr * s[0], momentum=rule.momentum)
    var = keras.Variable(w0, dtype="float64")
    for t in range(steps):
        opt.learning_rate = lr * s[t]  # η_t = η·s_t, assigned step by step (float64 variable)
        g = grad_at(np.asarray(var.numpy()), t)
        opt.apply_gradients([(keras.ops.convert_to_tensor(g, dtype="float64"), var)])
    return np.asarray(var.numpy())


# Keras's SGD casts the Python float β through float32 (ops.cast of a Python scalar), so the
# momenta here are exact in float32 (0.875, not 0.9) and the comparison can be to 1e-12.
@pytest.mark.parametrize("rule", [
    UpdateRule(momentum=0.875, schedule="linear-cooldown", cooldown_fraction=0.4),
    UpdateRule(momentum=0.5, schedule="cosine"),
    UpdateRule(momentum=0.0, schedule="linear-cooldown"),
    UpdateRule(momentum=0.75),
], ids=repr)
def test_heavy_ball_matches_keras_sgd_on_a_quadratic(rule):
    steps, lr, w0 = 12, 0.3, np.array([0.5, -1.0])
    grad_at = lambda w, t: H @ w - C + 0.1 * np.sin(t)  # noqa: E731  (state- and step-dependent)
    expected = _keras_sgd_run(lr, rule, steps, w0, grad_at)
    opt, w = TRAIN.HeavyBall(lr, steps, rule), w0.copy()
    for t in range(steps):
        w = opt.step(w, t, grad_at(w, t))
    np.testing.assert_allclose(w, expected, rtol=1e-12, atol=1e-12)
    assert not np.allclose(w, w0)


class _QuadraticModel:
    """A 2-parameter stand-in for the benchmark's models: every example's gradient is H w − c."""

    p = 2

    def init(self, rng):
        return np.array([0.5, -1.0])

    def clipped_sum(self, w, x, y, clip):
        return len(y) * (H @ w - C)


def test_train_dp_applies_the_rule_like_keras_sgd():
    """train_dp with σ = 0, C = I: ĝ_t = |B_t|/B · (H w − c), stepped like Keras's SGD."""
    n, batch, steps, lr = 40, 8, 10, 0.2
    rule = UpdateRule(momentum=0.875, schedule="linear-cooldown", cooldown_fraction=0.5)
    problem = TRAIN.Problem(np.ones((n, 1)), np.zeros(n, int), None, None, None, None, None, 2)
    mixing = MixingMatrix.identity(steps)
    w = TRAIN.train_dp(problem, _QuadraticModel(), mixing=mixing, sigma=0.0, lr=lr, clip=1.0, batch_size=batch,
                       seed=3, rule=rule)
    sizes = [len(b) for b in TRAIN.cyclic_poisson_batches(n, batch, 1, steps, np.random.default_rng([3, 1]))]
    expected = _keras_sgd_run(lr, rule, steps, np.array([0.5, -1.0]),
                              lambda w_, t: sizes[t] / batch * (H @ w_ - C))
    np.testing.assert_allclose(w, expected, rtol=1e-12, atol=1e-12)


def test_mixing_cache_key_includes_the_rule_and_plain_keys_hash_as_before(tmp_path):
    import argparse
    import hashlib
    import json
    import runpy

    bench = runpy.run_path(str(_PATH.parent / "accuracy.py"), run_name="bench_rule")
    spectrum = type("S", (), {"digest": lambda self: "abc"})()

    def cache_for(rule):
        args = argparse.Namespace(rule=rule, cache_dir=str(tmp_path), steps=40, solver_tol=1e-3, lr_scale="none")
        return bench["Cache"](args, spectrum, None, None, None, None)

    variant, plain_variant = bench["Variant"], bench["Variant"]("noisecurve", "noisecurve")
    matched = variant("noisecurve+rule", "noisecurve", matched=True)
    rule_a = UpdateRule(momentum=0.9, schedule="linear-cooldown")
    rule_b = UpdateRule(momentum=0.9, schedule="cosine")
    key_a = cache_for(rule_a).mixing_key(matched, 4, 2.0, 0.5)
    key_b = cache_for(rule_b).mixing_key(matched, 4, 2.0, 0.5)
    assert key_a[:3] == key_b[:3] == ("noisecurve", 4, 2.0) and key_a != key_b
    assert UpdateRule.from_metadata(json.loads(key_a[3])) == rule_a
    assert cache_for(rule_a)._path(key_a) != cache_for(rule_b)._path(key_b)
    # the plain workload ignores the training rule, and its file name is the one used before rules existed
    key_p = cache_for(rule_a).mixing_key(plain_variant, 4, 2.0, 0.5)
    assert key_p == cache_for(UpdateRule()).mixing_key(plain_variant, 4, 2.0, 0.5) == ("noisecurve", 4, 2.0, None)
    old = hashlib.sha256(json.dumps([["noisecurve", 4, 2.0], 40, 1e-3, "abc"]).encode()).hexdigest()[:24]
    assert cache_for(rule_a)._path(key_p) == str(tmp_path / f"{old}.npz")
    assert cache_for(rule_a).mixing_key(matched, 1, 2.0, 0.5) is None  # b = 1 is C = I for any rule
