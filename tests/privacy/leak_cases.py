"""What leaves a private step without noise: layers and losses that mix the examples of a
batch, state written from the data, padding rows, training logs that steer the run — each
refused, warned or blanked. Backend-neutral (the public API only): tests/privacy/test_leaks.py
runs these on TensorFlow, tests/jax/test_jax_leaks.py on JAX.

A tiny run (n = 64, B = 16, one epoch) on a small image model.
"""

import warnings

import keras
import numpy as np
import pytest

from keras_noisecurve import NoiseCurveOptimizer, PrivateRun, make_private
from keras_noisecurve.training import PrivateLogsWarning
from keras_noisecurve.training.log_guard import say_private_logs
from keras_noisecurve.backend.common.batch_probe import probe_examples

N, B = 64, 16
SHAPE = (4, 4, 3)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, *SHAPE)).astype("float32"), rng.integers(0, 2, N)


class Centre(keras.layers.Layer):
    """Subtracts the batch mean in training mode (a hand-made batch statistic)."""

    def call(self, x, training=None):
        return x - keras.ops.mean(x, axis=0, keepdims=True) if training else x


class RunningMean(keras.layers.Layer):
    """Keeps a running mean of the batches in a non-trainable variable."""

    def build(self, shape):
        self.mean = self.add_weight(shape=(shape[-1],), initializer="zeros", trainable=False)

    def call(self, x, training=None):
        if training:
            self.mean.assign(0.9 * self.mean + 0.1 * keras.ops.mean(x, axis=(0, 1, 2)))
        return x


class CallCounter(keras.layers.Layer):
    """Writes the same value whatever the data (a step counter): not data-dependent."""

    def build(self, shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, x, training=None):
        if training:
            self.calls.assign(self.calls + 1.0)
        return x


class PenaltyOnBatchStatistic(keras.layers.Layer):
    """Assigns a variable from the batch and adds a penalty that reads it (the penalty's
    gradient would escape clipping)."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(), initializer="ones", trainable=True)
        self.stat = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, x, training=None):
        if training:
            self.stat.assign(keras.ops.mean(keras.ops.abs(x)))
            self.add_loss(self.scale * keras.ops.stop_gradient(self.stat) * 1e-2)
        return x * self.scale


class Unreproducible(keras.layers.Layer):
    """Adds a Python-side counter: two identical calls differ (state outside any variable)."""

    calls = 0

    def call(self, x, training=None):
        Unreproducible.calls += 1
        return x + 1e-2 * Unreproducible.calls if training else x


def _model(*layers):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input(SHAPE), *layers, keras.layers.Flatten(), keras.layers.Dropout(0.2),
                             keras.layers.Dense(2)])


def _step(private):
    return int(keras.ops.convert_to_numpy(private.optimizer.iterations.value))


def _run():
    return PrivateRun(num_examples=N, batch_size=B, epochs=1, epsilon=4.0, delta=1e-5)


def _private(model, run=None, loss="sparse_categorical_crossentropy", **optimizer):
    private = make_private(model)
    private.compile(optimizer=NoiseCurveOptimizer(run=run, learning_rate=0.1, **optimizer), loss=loss)
    return private


def _centred_loss(y_true, y_pred):
    """Cross-entropy minus its batch mean: each example's loss depends on the others'."""
    values = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
    return values - keras.ops.mean(values)


# ----------------------------------------------------------------- mixing layers and losses
@pytest.mark.parametrize("layer", [keras.layers.MixUp, keras.layers.CutMix, Centre],
                         ids=["MixUp", "CutMix", "centring"])
def test_a_layer_that_mixes_the_batch_is_refused_before_the_first_step(layer, data):
    run = _run()
    private = _private(_model(layer()), run)
    before = [w.copy() for w in private.get_weights()]
    with pytest.raises(ValueError, match="mixes the examples of a batch"):
        private.fit(run.dataset(*data), verbose=0)
    assert _step(private) == 0
    for old, new in zip(before, private.get_weights()):
        np.testing.assert_array_equal(old, new)


def test_the_refusal_names_a_known_mixing_layer(data):
    run = _run()
    with pytest.raises(ValueError, match=r"The model holds 'mix' \(MixUp\)"):
        _private(_model(keras.layers.MixUp(name="mix")), run).fit(run.dataset(*data), verbose=0)


def test_identical_first_examples_do_not_hide_a_mixing_layer(data):
    # sorted or duplicated data: the probe takes examples with different inputs
    x, y = data
    x = np.concatenate([np.repeat(x[:1], 12, axis=0), x[12:]])
    run = _run()
    with pytest.raises(ValueError, match="mixes the examples of a batch"):
        _private(_model(Centre()), run).fit(run.dataset(x, y), verbose=0)


def _batch_balanced_loss(y_true, y_pred):
    """Cross-entropy weighted by the inverse frequency of each label IN THE BATCH: the
    labels of the others weigh each example's loss."""
    labels = keras.ops.cast(keras.ops.reshape(y_true, (-1,)), "float32")
    share = keras.ops.mean(labels)
    weight = keras.ops.where(labels > 0.5, 0.5 / (share + 1e-3), 0.5 / (1.0 - share + 1e-3))
    return weight * keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


@pytest.mark.parametrize("loss", [_centred_loss, _batch_balanced_loss], ids=["batch_mean", "label_counts"])
def test_a_loss_that_mixes_the_batch_is_refused(loss, data):
    # through the predictions (minus their batch mean) or through the labels (batch label counts)
    run = _run()
    with pytest.raises(ValueError, match="mixes the examples of a batch"):
        _private(_model(), run, loss=loss).fit(run.dataset(*data), verbose=0)


def test_data_the_probe_cannot_read_warns_at_the_private_step(data):
    x, y = data

    def batches():
        for start in range(0, N, B):
            yield x[start:start + B], y[start:start + B]

    private = _private(_model(), noise_multiplier=1.0, expected_batch_size=B)
    with pytest.warns(RuntimeWarning, match="batch probe did not run"):
        private.fit(batches(), steps_per_epoch=2, epochs=1, verbose=0)
    private.check_examples_apart(x[:B], y[:B])  # by hand: nothing found


def test_the_low_level_paths_probe_too(data):
    x, y = data
    with pytest.raises(ValueError, match="mixes the examples of a batch"):
        _private(_model(keras.layers.MixUp()), noise_multiplier=1.0, expected_batch_size=B).train_on_batch(x[:B], y[:B])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # epsilon is not tracked on this path
        with pytest.raises(ValueError, match="mixes the examples of a batch"):
            _private(_model(Centre()), noise_multiplier=1.0, expected_batch_size=B).fit(x, y, batch_size=B, verbose=0)


def test_the_probe_measures_the_move_a_centring_layer_makes(data):
    # independent computation: with a linear head f(x) = W·vec(x), centring moves row i's
    # output by W·vec(Δ)/k when row j's input changes by Δ (k probed rows)
    x, _ = data
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input(SHAPE), Centre(), keras.layers.Flatten(),
                              keras.layers.Dense(2, use_bias=False)])
    k = 8
    result = probe_examples(model, x[:k])
    i, j, change = result.mixing
    kernel = keras.ops.convert_to_numpy(model.layers[-1].kernel.value).astype(np.float64)
    flat = x[:k].reshape(k, -1).astype(np.float64)
    base = (flat - flat.mean(axis=0)) @ kernel
    moved = flat.copy()
    moved[j] = flat[(j + 1) % k]
    expected = np.abs((moved - moved.mean(axis=0)) @ kernel - base)[i].max() / np.abs(base).max()
    np.testing.assert_allclose(change, expected, rtol=1e-4)


# ----------------------------------------------------------------- state written from the data
def test_a_running_statistic_is_refused(data):
    run = _run()
    private = _private(_model(RunningMean(name="running")), run)
    with pytest.raises(ValueError, match=r"writes .*running.* from the batch"):
        private.fit(run.dataset(*data), verbose=0)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(private.inner.get_layer("running").mean.value), 0.0)


def test_a_penalty_that_reads_a_variable_assigned_from_the_batch_is_refused(data):
    run = _run()
    with pytest.raises(ValueError, match="from the batch|depends on the data|data-dependent"):
        _private(_model(PenaltyOnBatchStatistic()), run).fit(run.dataset(*data), verbose=0)


def test_state_written_the_same_whatever_the_data_is_accepted(data):
    run = _run()
    private = _private(_model(CallCounter(name="counter")), run)
    private.fit(run.dataset(*data), verbose=0)
    assert _step(private) == run.steps


def test_the_probe_leaves_every_variable_and_random_generator_as_it_found_them(data):
    x, y = data
    model = _model(keras.layers.GaussianNoise(0.1))
    model(x[:2])
    before = [keras.ops.convert_to_numpy(v.value).copy() for v in model.variables]
    result = probe_examples(model, x, y, loss_fn=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None))
    assert result.passed and result.rows == 8 and result.reproducible
    for old, variable in zip(before, model.variables):
        np.testing.assert_array_equal(old, keras.ops.convert_to_numpy(variable.value))


def test_randomness_outside_seed_generators_is_refused_as_unchecked(data):
    run = _run()
    with pytest.raises(ValueError, match="cannot be checked"):
        _private(_model(Unreproducible()), run).fit(run.dataset(*data), verbose=0)


def test_an_unbuilt_model_is_built_before_the_snapshot(data):
    # a Sequential without an Input is built by its first call: its running mean must be in
    # the snapshot (watched and restored), not created by the probe's first call
    x, y = data
    model = keras.Sequential([RunningMean(name="running"), keras.layers.Flatten(), keras.layers.Dense(2)])
    private = _private(model, noise_multiplier=1.0, expected_batch_size=B)
    with pytest.raises(ValueError, match=r"writes .*running.* from the batch"):
        private.train_on_batch(x[:B], y[:B])
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(model.get_layer("running").mean.value), 0.0)


# ----------------------------------------------------------------- the audit
def test_the_audit_fails_a_mixing_layer_in_training_mode(data):
    from keras_noisecurve.audit import check_mechanism

    x, y = data
    model = _model(keras.layers.MixUp())
    model(x[:1])
    report = check_mechanism(model=model, x=x, y=y, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                             l2_norm_clip=1.0, checks=("clipping",), batches=1)
    assert not report.passed
    assert "training mode: FAIL" in report.checks["clipping"].line
    clean = check_mechanism(model=_model(), x=x, y=y, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), l2_norm_clip=1.0, checks=("clipping",), batches=1)
    assert clean.passed and clean.checks["clipping"].training_mode == "PASS"


# ----------------------------------------------------------------- padding rows
def test_padding_rows_carry_no_example(data):
    run = _run()
    private = _private(_model(), run)
    private.build((None, *SHAPE))
    private.optimizer.build(private.trainable_variables)
    seen = 0
    for xb, yb, mask, _ in run.dataset(*data).batches(private.optimizer):
        xb, yb, mask = (np.asarray(keras.ops.convert_to_numpy(a)) for a in (xb, yb, mask))
        assert not np.any(xb[mask == 0]) and not np.any(yb[mask == 0])
        assert np.all(np.any(xb[mask > 0].reshape(int((mask > 0).sum()), -1), axis=1))  # real rows are kept
        seen += int((mask == 0).sum())
    assert seen > 0  # the plan pads (P > B)


# ----------------------------------------------------------------- training logs
@pytest.mark.parametrize("callback", [
    lambda: keras.callbacks.ReduceLROnPlateau(monitor="loss"),
    lambda: keras.callbacks.EarlyStopping(monitor="loss"),
    lambda: keras.callbacks.ModelCheckpoint("best.keras", monitor="loss", save_best_only=True),
], ids=["ReduceLROnPlateau", "EarlyStopping", "ModelCheckpoint"])
def test_a_callback_steered_by_a_training_log_is_refused(callback, data):
    run = _run()
    private = _private(_model(), run)
    with pytest.raises(ValueError, match="acts on a training log"):
        private.fit(run.dataset(*data), verbose=0, callbacks=[callback()])
    assert _step(private) == 0


def test_validation_rows_cut_from_the_private_data_steer_nothing(data):
    x, y = data
    private = _private(_model(), noise_multiplier=1.0, expected_batch_size=B)
    with pytest.raises(ValueError, match="validation rows are cut from the private"):
        private.fit(x, y, batch_size=B, validation_split=0.25, verbose=0,
                    callbacks=[keras.callbacks.EarlyStopping(monitor="val_loss")])


def test_a_callback_list_is_checked_as_a_list(data):
    run = _run()
    callbacks = keras.callbacks.CallbackList([keras.callbacks.EarlyStopping(monitor="loss")])
    with pytest.raises(ValueError, match="acts on a training log"):
        _private(_model(), run).fit(run.dataset(*data), verbose=0, callbacks=callbacks)


def test_callbacks_on_validation_logs_are_accepted_and_the_training_logs_said_once(data):
    x, y = data
    run = _run()
    private = _private(_model(), run)
    with pytest.warns(PrivateLogsWarning, match="not covered by the run's epsilon"):
        private.fit(run.dataset(*data), verbose=0, validation_data=(x[:8], y[:8]), callbacks=[
            keras.callbacks.ReduceLROnPlateau(monitor="val_loss"), keras.callbacks.EarlyStopping(monitor="val_loss")])
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivateLogsWarning)
        say_private_logs(private)  # once per model


def test_the_hazard_table_names_every_leak():
    """docs/privacy.md's table lists each path these tests cover."""
    import pathlib

    import keras_noisecurve

    text = (pathlib.Path(keras_noisecurve.__file__).parents[1] / "docs" / "privacy.md").read_text()
    table = text.split("What can make ε wrong")[-1]
    for path in ("MixUp", "CutMix", "padding rows", "non-trainable variable", "add_loss", "ReduceLROnPlateau",
                 "EarlyStopping", "save_best_only", "PrivateLogsWarning"):
        assert path in table, path
