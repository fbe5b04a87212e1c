"""``inner=``: the privatized mean ĝ_t handed to any Keras optimizer.

Every test here is checked against a hand computation: the plain-SGD path (whose noise
law tests/training/test_optimizer.py checks), a numpy recursion, or a config.

B = 4 and η = 0.5 are powers of two throughout: the plain path multiplies the noisy sum
s by η/B, an inner SGD multiplies ĝ = s/B by η, and the two round identically only
because scaling by a power of two is exact (otherwise they differ by an ulp).
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_noisecurve as knc
from keras_noisecurve.mixing import MixingMatrix, UpdateRule
from keras_noisecurve.training import (
    LinearCooldown,
    MultiplierSchedule,
    NoiseCurveOptimizer,
    learning_rate_schedule,
    make_private,
)
from tests.training.helpers import CrashAt, random_banded_c

ETA, CLIP, SIGMA, B, SEED = 0.5, 1.5, 2.0, 4, 7
STEPS = 5
SHAPES = [(3, 2), (2,), (2, 2, 2)]
BANDED = random_banded_c(STEPS, 3, rng=np.random.default_rng(3), diag_scale=0.5)


class Recorder(keras.optimizers.Optimizer):
    """An optimizer that only records the gradient it is handed (one variable each)."""

    def __init__(self, name="recorder", **kwargs):
        super().__init__(learning_rate=1.0, name=name, **kwargs)

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self.received = [self.add_variable_from_reference(v, name="received") for v in variables]

    def update_step(self, gradient, variable, learning_rate):
        self.assign(self.received[self._get_variable_index(variable)], gradient)


def _sums(steps=STEPS, seed=1):
    """Fixed 'clipped sums' for every step (the optimizer does not look inside them)."""
    rng = np.random.default_rng(seed)
    return [[tf.constant(rng.normal(size=s), tf.float32) for s in SHAPES] for _ in range(steps)]


def _variables(init=None):
    if init is None:
        return [keras.Variable(np.zeros(s, np.float32)) for s in SHAPES]
    return [keras.Variable(np.array(w, np.float32)) for w in init]


def _optimizer(mixing=BANDED, **kw):
    kw.setdefault("l2_norm_clip", CLIP)
    kw.setdefault("noise_multiplier", SIGMA)
    kw.setdefault("expected_batch_size", B)
    kw.setdefault("seed", SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the update-rule warning has its own tests
        return NoiseCurveOptimizer(mixing=mixing, **kw)


def _flat(tensors):
    return np.concatenate([np.asarray(t).ravel() for t in tensors])


def _plain_privatized(mixing, sums):
    """ĝ_t of the plain path, read off the weights: w is reset to 0 before every step
    (the noise does not depend on w), so w_after = −fl(η/B·s) and (0 − w_after)/η is
    exact with η a power of two."""
    variables = _variables()
    opt = _optimizer(mixing, learning_rate=ETA)
    out = []
    for step_sums in sums:
        for v in variables:
            v.assign(tf.zeros_like(v))
        opt.apply_clipped_sum(step_sums, variables)
        out.append(_flat([(0.0 - v.numpy()) / ETA for v in variables]))
    return np.array(out)


def _run(inner, sums, mixing=BANDED, init=None):
    variables = _variables(init)
    opt = _optimizer(mixing, inner=inner)
    weights = []
    for step_sums in sums:
        opt.apply_clipped_sum(step_sums, variables)
        weights.append(_flat([v.numpy() for v in variables]))
    return opt, np.array(weights)


# ------------------------------------------------------------ the privatized law
@pytest.mark.parametrize("mixing", ["banded", "identity", "dpsgd"])
def test_inner_receives_exactly_the_plain_privatized_gradient(mixing):
    """Bit for bit, at every step: the gradient the inner optimizer is handed is the ĝ_t
    of the plain-SGD path (same seed, same ring buffers), for b = 3 and b = 1."""
    c = {"banded": BANDED, "identity": MixingMatrix.identity(STEPS), "dpsgd": "dpsgd"}[mixing]
    sums = _sums()
    expected = _plain_privatized(c, sums)
    variables = _variables()
    recorder = Recorder()
    opt = _optimizer(c, inner=recorder)
    for t, step_sums in enumerate(sums):
        opt.apply_clipped_sum(step_sums, variables)
        np.testing.assert_array_equal(_flat([r.numpy() for r in recorder.received]), expected[t])
    assert int(opt.iterations.numpy()) == int(recorder.iterations.numpy()) == STEPS
    np.testing.assert_array_equal(_flat([v.numpy() for v in variables]), 0.0)  # only the inner updates w
    if mixing == "banded":  # the noise is really correlated: not the independent draws
        assert not np.allclose(expected, _plain_privatized("dpsgd", sums))


def test_inner_sgd_reproduces_the_plain_path_bit_for_bit():
    sums = _sums()
    variables = _variables()
    plain = _optimizer(learning_rate=ETA)
    rows = []
    for step_sums in sums:
        plain.apply_clipped_sum(step_sums, variables)
        rows.append(_flat([v.numpy() for v in variables]))
    _, weights = _run(keras.optimizers.SGD(ETA), sums)
    np.testing.assert_array_equal(weights, np.array(rows))


def test_inner_momentum_sgd_equals_numpy_heavy_ball():
    """m ← βm − η·ĝ_t, w ← w + m (Keras's SGD form), fed with the plain path's ĝ_t."""
    sums = _sums()
    g = _plain_privatized(BANDED, sums).astype(np.float32)
    _, weights = _run(keras.optimizers.SGD(ETA, momentum=0.9), sums)
    w = np.zeros(g.shape[1], np.float32)
    m = np.zeros_like(w)
    for t in range(STEPS):
        m = np.float32(0.9) * m - g[t] * np.float32(ETA)
        w = w + m
        np.testing.assert_allclose(weights[t], w, rtol=1e-6, atol=1e-6)


def _numpy_adam(g, lr, w0, *, beta_1=0.9, beta_2=0.999, epsilon=1e-7, weight_decay=None):
    """Keras's Adam (and AdamW's decoupled decay w ← w − η·λ·w before the step), float32."""
    f = np.float32
    w, m, v = w0.astype(f), np.zeros_like(w0, f), np.zeros_like(w0, f)
    out = []
    for t in range(g.shape[0]):
        if weight_decay is not None:
            w = w - w * f(weight_decay) * f(lr)
        step = f(t + 1)
        alpha = f(lr) * np.sqrt(f(1) - f(beta_2) ** step) / (f(1) - f(beta_1) ** step)
        m = m + (g[t] - m) * f(1 - beta_1)
        v = v + (g[t] ** 2 - v) * f(1 - beta_2)
        w = w - m * alpha / (np.sqrt(v) + f(epsilon))
        out.append(w)
    return np.array(out)


def test_inner_adam_equals_numpy_adam():
    sums = _sums()
    g = _plain_privatized(BANDED, sums).astype(np.float32)
    opt, weights = _run(keras.optimizers.Adam(0.01), sums)
    np.testing.assert_allclose(weights, _numpy_adam(g, 0.01, np.zeros(g.shape[1])), rtol=1e-5, atol=1e-7)
    assert int(opt.inner.iterations.numpy()) == STEPS  # Adam's bias correction used t + 1


def test_inner_adamw_weight_decay_is_applied_by_hand():
    """AdamW's decay w ← w − η·λ·w runs before each step (delegated to the inner)."""
    sums = _sums()
    g = _plain_privatized(BANDED, sums).astype(np.float32)
    init = [np.full(s, 0.7, np.float32) for s in SHAPES]
    _, weights = _run(keras.optimizers.AdamW(0.01, weight_decay=0.2), sums, init=init)
    expected = _numpy_adam(g, 0.01, _flat(init), weight_decay=0.2)
    np.testing.assert_allclose(weights, expected, rtol=1e-5, atol=1e-7)
    _, no_decay = _run(keras.optimizers.Adam(0.01), sums, init=init)
    assert not np.allclose(weights, no_decay)


def test_inner_schedule_follows_the_shared_step_counter():
    """SGD(LinearCooldown): w_t = −Σ_{k≤t} η_k·ĝ_k with η_k the schedule at step k."""
    sums = _sums()
    g = _plain_privatized(BANDED, sums)
    schedule = LinearCooldown(ETA, STEPS, cooldown_fraction=0.6)
    opt, weights = _run(keras.optimizers.SGD(schedule), sums)
    rates = ETA * UpdateRule(schedule="linear-cooldown", cooldown_fraction=0.6).multipliers(STEPS)
    assert rates[-1] < rates[0]
    np.testing.assert_allclose(weights, -np.cumsum(rates[:, None] * g, axis=0), rtol=1e-5, atol=1e-6)
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.0, abs=1e-7)  # η_T = 0


def test_tf_train_checkpoint_restores_inner_slots(tmp_path):
    """2 steps, tf.train.Checkpoint, restore into a fresh optimizer (another key until
    restored), 2 more steps: the weights of 4 uninterrupted steps, bit for bit."""
    sums = _sums(steps=4)
    _, uninterrupted = _run(keras.optimizers.Adam(0.01), sums)
    variables = _variables()
    first = _optimizer(inner=keras.optimizers.Adam(0.01))
    for step_sums in sums[:2]:
        first.apply_clipped_sum(step_sums, variables)
    path = tf.train.Checkpoint(variables=variables, optimizer=first).save(str(tmp_path / "ckpt"))
    restored = _variables()
    second = _optimizer(inner=keras.optimizers.Adam(0.01), seed=None)
    second.build(restored)
    tf.train.Checkpoint(variables=restored, optimizer=second).restore(path).assert_consumed()
    assert int(second.iterations.numpy()) == int(second.inner.iterations.numpy()) == 2
    for step_sums in sums[2:]:
        second.apply_clipped_sum(step_sums, restored)
    np.testing.assert_array_equal(_flat([v.numpy() for v in restored]), uninterrupted[-1])


# ------------------------------------------------------- learning-rate plumbing
def test_learning_rate_forwards_to_the_inner_optimizer():
    inner = keras.optimizers.SGD(0.1, momentum=0.9)
    opt = _optimizer(inner=inner)
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.1)
    opt.learning_rate = 0.02  # what LearningRateScheduler / ReduceLROnPlateau do
    assert float(inner.learning_rate.numpy()) == pytest.approx(0.02)
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.02)
    assert not any("learning_rate" in v.path for v in opt._variables)  # no outer rate of its own
    plain = _optimizer(learning_rate=0.1)
    plain.learning_rate = 0.03
    assert float(plain.learning_rate.numpy()) == pytest.approx(0.03)



def test_config_round_trip_with_inner_and_schedule():
    inner = keras.optimizers.SGD(LinearCooldown(0.1, STEPS, cooldown_fraction=0.4), momentum=0.9, nesterov=False)
    opt = _optimizer(inner=inner, name="private")
    config = opt.get_config()
    assert "learning_rate" not in config  # the inner optimizer's, inside config["inner"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BANDED was not solved for momentum: tested below
        again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(opt))
    assert again.get_config() == config
    assert isinstance(again.inner, keras.optimizers.SGD) and again.inner.momentum == 0.9
    assert isinstance(again.inner._learning_rate, LinearCooldown)
    assert again.inner._learning_rate.get_config() == inner._learning_rate.get_config()
    with pytest.raises(ValueError, match="learning_rate is required"):  # inner=None: no silent default rate
        _optimizer()
    assert _optimizer(learning_rate=0.01).get_config()["learning_rate"] == pytest.approx(0.01)
    assert "inner" not in _optimizer(learning_rate=0.01).get_config()

def test_learning_rate_scheduler_callback_drives_the_inner_rate(fit_data, fit_init):
    model = _fit_model(fit_init)
    seen = []
    scheduler = keras.callbacks.LearningRateScheduler(lambda epoch, lr: seen.append(float(lr)) or 0.01 / (epoch + 1))
    _fit(model, fit_data, 2, callbacks=[scheduler])
    assert seen == [pytest.approx(0.05), pytest.approx(0.01)]  # read through the private optimizer
    assert float(model.optimizer.inner.learning_rate.numpy()) == pytest.approx(0.005)


# ------------------------------------------------------------ make_private fit
FIT_B, FIT_SEED = 8, 31
FIT_C = random_banded_c(12, 3, rng=np.random.default_rng(5), diag_scale=0.5)


@pytest.fixture(scope="module")
def fit_data():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(4 * FIT_B, 3)).astype("float32")  # one epoch = 4 steps
    y = (x[:, 0] + x[:, 1] > 0).astype("int64")
    return x, y


@pytest.fixture(scope="module")
def fit_init():
    keras.utils.set_random_seed(3)
    return _fit_base().get_weights()


def _fit_base():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])


def _fit_model(weights, seed=FIT_SEED, sigma=0.5, learning_rate=0.05):
    base = _fit_base()
    base.set_weights(weights)
    model = make_private(base, clipping="vectorized")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Adam is not the SGD C was optimised for (tested below)
        optimizer = knc.NoiseCurveOptimizer(inner=keras.optimizers.Adam(learning_rate), mixing=FIT_C,
                                            l2_norm_clip=1.0, noise_multiplier=sigma,
                                            expected_batch_size=FIT_B, seed=seed)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _fit(model, data, epochs, **kw):
    x, y = data
    return model.fit(x, y, batch_size=FIT_B, epochs=epochs, shuffle=False, verbose=0, **kw)


def _optimizer_state(optimizer):
    return [v.numpy() for v in optimizer.variables]


def test_make_private_with_adam_trains(fit_data, fit_init):
    model = _fit_model(fit_init, sigma=0.05)
    x, y = fit_data
    before = model.evaluate(x, y, verbose=0)
    _fit(model, fit_data, 3)  # 12 steps, the whole plan
    assert int(model.optimizer.iterations.numpy()) == int(model.optimizer.inner.iterations.numpy()) == 12
    assert model.evaluate(x, y, verbose=0) < 0.8 * before


@pytest.fixture(scope="module")
def uninterrupted(fit_data, fit_init):
    model = _fit_model(fit_init)
    _fit(model, fit_data, 3)
    return model.get_weights()


def _assert_same(weights, reference):
    for a, b in zip(weights, reference):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_keras_save_and_load_with_adam(tmp_path, fit_data, fit_init, uninterrupted):
    model = _fit_model(fit_init)
    _fit(model, fit_data, 1)
    path = tmp_path / "m.keras"
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # from_config re-checks the update rule (Adam)
        loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer.inner, keras.optimizers.Adam)
    assert loaded.optimizer.inner.get_config() == model.optimizer.inner.get_config()
    assert int(loaded.optimizer.iterations.numpy()) == int(loaded.optimizer.inner.iterations.numpy()) == 4
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    state = _optimizer_state(model.optimizer)  # key, rings, Adam's iterations, rate, moments
    assert len(state) == len(loaded.optimizer.variables) and any(np.any(s != 0) for s in state[-4:])
    for a, b in zip(_optimizer_state(loaded.optimizer), state):
        np.testing.assert_array_equal(a, b)
    _fit(loaded, fit_data, 2)
    _fit(model, fit_data, 2)
    _assert_same(loaded.get_weights(), model.get_weights())
    _assert_same(loaded.get_weights(), uninterrupted)


def test_backup_and_restore_with_adam(tmp_path, fit_data, fit_init, uninterrupted):
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    model = _fit_model(fit_init)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(model, fit_data, 3, callbacks=[backup, CrashAt(at_step=6)])  # mid epoch 2
    resumed = _fit_model(fit_init, seed=999)  # key, rings and Adam's moments come from the backup
    _fit(resumed, fit_data, 3, callbacks=[backup])
    assert int(resumed.optimizer.iterations.numpy()) == int(resumed.optimizer.inner.iterations.numpy()) == 12
    _assert_same(resumed.get_weights(), uninterrupted)


def _two_devices():
    devices = tf.config.list_logical_devices("CPU")
    if len(devices) < 2:
        pytest.skip("needs the 2 logical CPU devices created by tests/conftest.py")
    return tf.distribute.MirroredStrategy([d.name for d in devices[:2]])


def test_mirrored_with_adam_equals_single_device(fit_data, fit_init):
    single = _fit_model(fit_init)
    _fit(single, fit_data, 1)
    strategy = _two_devices()
    with strategy.scope():
        mirrored = _fit_model(fit_init)
    _fit(mirrored, fit_data, 1)
    assert int(mirrored.optimizer.inner.iterations.numpy()) == 4
    for var, ref in zip(mirrored.trainable_variables, single.trainable_variables):
        copies = [c.numpy() for c in var.value.values]
        np.testing.assert_array_equal(copies[0], copies[1])  # every replica identical
        np.testing.assert_allclose(copies[0], ref.numpy(), rtol=1e-5, atol=1e-6)
    for slot, ref in zip(mirrored.optimizer.inner.variables, single.optimizer.inner.variables):
        np.testing.assert_allclose(slot.numpy(), ref.numpy(), rtol=1e-5, atol=1e-7)


def test_inner_from_another_strategy_is_refused():
    strategy = _two_devices()
    inner = keras.optimizers.Adam(0.01)  # created outside the scope
    with strategy.scope():
        with pytest.raises(ValueError, match=r"same `with strategy.scope\(\):`"):
            _optimizer(inner=inner)


# ----------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "make_inner, error, match",
    [
        (lambda: _optimizer(learning_rate=0.1), ValueError, "itself a private optimizer"),
        (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), ValueError,
         "LossScaleOptimizer is not supported.*inner_optimizer"),
        (lambda: keras.optimizers.SGD(0.1, clipnorm=1.0), ValueError, "clipnorm=1.0.*NOISY mean"),
        (lambda: keras.optimizers.Adam(0.1, clipvalue=0.5), ValueError, "clipvalue=0.5.*NOISY mean"),
        (lambda: keras.optimizers.SGD(0.1, global_clipnorm=2.0), ValueError, "global_clipnorm=2.0.*l2_norm_clip"),
        (lambda: keras.optimizers.SGD(0.1, use_ema=True), ValueError, "use_ema=True"),
        (lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), ValueError,
         "gradient_accumulation_steps=2.*privacy plan"),
        (lambda: keras.optimizers.SGD(0.1, loss_scale_factor=8.0), ValueError, "loss_scale_factor=8.0"),
        (lambda: "sgd", TypeError, "inner must be a keras.optimizers.Optimizer"),
    ],
)
def test_refused_inner_optimizers(make_inner, error, match):
    with pytest.raises(error, match=match):
        _optimizer(inner=make_inner())


def test_outer_learning_rate_with_inner_is_refused():
    with pytest.raises(ValueError, match="learning_rate=0.1 is given together with inner=SGD"):
        _optimizer(learning_rate=0.1, inner=keras.optimizers.SGD(0.1))


def test_outer_weight_decay_points_to_the_inner_optimizer():
    with pytest.raises(ValueError, match="weight_decay=0.01 is not supported.*AdamW"):
        _optimizer(learning_rate=0.1, weight_decay=0.01)


def test_inner_built_on_other_variables_is_refused():
    inner = keras.optimizers.Adam(0.01)
    inner.build([keras.Variable(np.zeros(3, np.float32))])
    opt = _optimizer(inner=inner)
    with pytest.raises(ValueError, match="already built on other variables"):
        opt.build(_variables())
    # built on the same variables (and not stepped) is fine
    variables = _variables()
    inner = keras.optimizers.Adam(0.01)
    inner.build(variables)
    _optimizer(inner=inner).build(variables)
    # ... but not one that has already stepped on its own (non-private gradients)
    inner.apply([tf.ones(s) for s in SHAPES], variables)
    with pytest.raises(ValueError, match="already taken 1 steps of its own"):
        _optimizer(inner=inner).build(variables)


# ------------------------------------------------------ update-rule warning
T_RULE = 40


def _c_with_rule(rule, learning_rate=None, objective="noisecurve"):
    meta = {"objective": objective, "update_rule": rule.to_metadata()}
    if learning_rate is not None:
        meta["learning_rate"] = learning_rate
    band_values = random_banded_c(T_RULE, 3, rng=np.random.default_rng(8)).band_values
    return MixingMatrix(band_values, metadata=meta)


def _construct(mixing, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        NoiseCurveOptimizer(mixing=mixing, l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=B, **kw)
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear-cooldown", "custom"])
def test_matching_sgd_does_not_warn(schedule):
    custom = np.linspace(1.0, 0.1, T_RULE) if schedule == "custom" else schedule
    rule = UpdateRule(momentum=0.9, schedule=custom, cooldown_fraction=0.3 if schedule == "linear-cooldown" else None)
    c = _c_with_rule(rule, learning_rate=0.1)
    rate = learning_rate_schedule(rule, learning_rate=0.1, steps=T_RULE)
    assert _construct(c, inner=keras.optimizers.SGD(rate, momentum=0.9)) == []


def test_mismatch_warns_once_naming_each_difference():
    rule = UpdateRule(momentum=0.9, schedule="linear-cooldown")
    c = _c_with_rule(rule, learning_rate=0.1)
    messages = _construct(c, inner=keras.optimizers.SGD(0.2, momentum=0.5, nesterov=True))
    assert len(messages) == 1
    (message,) = messages
    assert "learning rate 0.1 and update rule (SGD, momentum 0.9, linear cooldown" in message
    assert "Nesterov" in message
    assert "momentum is 0.5; C was optimised for 0.9" in message
    assert "differs from C's 'linear-cooldown' schedule" in message
    assert "learning rate is 0.2; C was optimised for 0.1" in message
    assert "update_rule=UpdateRule(" in message


def test_plain_path_checks_the_same_rule():
    """No inner: momentum 0 and the outer learning rate (a C for momentum 0.9 warns,
    a matching outer schedule does not)."""
    c = _c_with_rule(UpdateRule(momentum=0.9))
    (message,) = _construct(c, learning_rate=0.1)
    assert "momentum is 0; C was optimised for 0.9" in message
    c = _c_with_rule(UpdateRule(schedule="cosine"))
    assert _construct(c, learning_rate=keras.optimizers.schedules.CosineDecay(0.1, T_RULE)) == []
    (message,) = _construct(c, learning_rate=keras.optimizers.schedules.CosineDecay(0.1, 2 * T_RULE))
    assert "differs from C's 'cosine' schedule" in message


def test_non_sgd_inner_warns_unless_dpsgd():
    c = _c_with_rule(UpdateRule(), objective="bandmf")
    (message,) = _construct(c, inner=keras.optimizers.Adam(0.01))
    assert "optimised for heavy-ball SGD" in message and "Adam" in message
    assert _construct(MixingMatrix.identity(T_RULE), inner=keras.optimizers.Adam(0.01)) == []
    assert _construct(MixingMatrix.identity(T_RULE), inner=keras.optimizers.SGD(0.1, momentum=0.9)) == []
    assert _construct("dpsgd", inner=keras.optimizers.Adam(0.01)) == []


# ---------------------------------------------------------------- schedules
@pytest.mark.parametrize("steps", [1, 7, 100])
@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear-cooldown", "custom"])
def test_learning_rate_schedule_runs_the_rule_multipliers(schedule, steps):
    if schedule == "custom":
        rule = UpdateRule(schedule=np.random.default_rng(steps).uniform(0.1, 2.0, steps))
    elif schedule == "linear-cooldown":
        rule = UpdateRule(schedule=schedule, cooldown_fraction=0.3)
    else:
        rule = UpdateRule(schedule=schedule)
    eta = 0.3
    rate = learning_rate_schedule(rule.to_metadata(), learning_rate=eta, steps=steps)
    expected = eta * rule.multipliers(steps)
    if schedule == "constant":
        assert rate == eta
        return
    kind = {"cosine": keras.optimizers.schedules.CosineDecay, "linear-cooldown": LinearCooldown,
            "custom": MultiplierSchedule}[schedule]
    assert isinstance(rate, kind)
    got = np.array([float(rate(t)) for t in range(steps)])  # step by step, as an optimizer calls it
    np.testing.assert_allclose(got, expected, rtol=0, atol=4 * np.finfo(np.float32).eps * eta)
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(rate))
    np.testing.assert_array_equal([float(again(t)) for t in range(steps)], got)


def test_linear_cooldown_by_hand():
    """T = 10, f = 0.25: round(2.5) = 2 cooldown steps (Python rounds half to even), so
    T_c = 8: η, …, η (t < 8), then η·(1 − 0/2), η·(1 − 1/2), and 0 from t = T on."""
    schedule = LinearCooldown(2.0, 10)
    assert schedule.cooldown_start == 8
    np.testing.assert_allclose([float(schedule(t)) for t in range(12)], [2.0] * 9 + [1.0, 0.0, 0.0])
    assert knc.LinearCooldown is LinearCooldown and knc.learning_rate_schedule is learning_rate_schedule
    with pytest.raises(ValueError, match="cooldown_fraction must lie in"):
        LinearCooldown(1.0, 10, cooldown_fraction=0.0)
