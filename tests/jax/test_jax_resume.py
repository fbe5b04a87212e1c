"""A private run on JAX resumes exactly, as on TensorFlow (tests/training/test_run_resume.py):
killed mid-run and restored by ``keras.callbacks.BackupAndRestore`` (in ``on_train_begin``,
after ``fit`` made its batches), by ``load_weights`` or ``load_model`` before ``fit``, it
ends with the uninterrupted run's weights, bit for bit. The batches start at the optimizer's
step as it stands after every ``on_train_begin`` restore (``pipeline.RunBatches.restart``),
and ``fit`` runs every remaining step once, also when Keras counted the batches before a
restore to an earlier step, and with an accelerator's look-ahead (forced here on CPU).

A tiny Dense model, 8 steps; each fit of a new model compiles its step once (~1-2 s on CPU).
"""

import functools

import keras
import numpy as np
import pytest

import keras_noisecurve as knc
from tests.training.helpers import CrashAt

N, B, T = 200, 20, 8  # 10 steps per pass, so one epoch of 8 steps


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 4)).astype("float32")
    return x, (x[:, :1] - x[:, 1:2]).astype("float32")


def _run(kind, seed=3, num_examples=N, batch_size=B):
    mixing = knc.solve_mixing_matrix(steps=T, bands=2) if kind == "banded" else "dpsgd"
    return knc.PrivateRun(num_examples=num_examples, batch_size=batch_size, steps=T, mixing=mixing,
                          noise_multiplier=1.0, delta=1e-5, seed=seed)


def _model(run, noise_seed=4):
    keras.utils.set_random_seed(0)
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)],
                             name="inner")
    private = knc.make_private(inner)
    private.compile(optimizer=knc.NoiseCurveOptimizer(run=run, learning_rate=0.1, l2_norm_clip=1.0, seed=noise_seed),
                    loss="mse")
    return private


def _weights(private):
    return [np.asarray(w) for w in private.get_weights()]


def _step(private):
    return int(np.asarray(private.optimizer.iterations.value))


def _assert_same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


class _Steps(keras.callbacks.Callback):
    """The optimizer's step count after every batch ``fit`` trains on."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append(_step(self.model))


@functools.cache
def _uninterrupted(kind):
    """The final weights of the run trained in one ``fit``."""
    run = _run(kind)
    private = _model(run)
    private.fit(run.dataset(*_data()), verbose=0)
    assert _step(private) == T
    return _weights(private)


@pytest.fixture(params=["dpsgd", "banded"])
def uninterrupted(request):
    return request.param, _uninterrupted(request.param)


@pytest.fixture
def look_ahead(monkeypatch):
    """Keras's JAX iteration as on an accelerator: each batch read one ahead of the step
    (``JAXEpochIterator._one_batch_ahead_iterator``, which Keras leaves out on CPU)."""
    from keras.src.backend.jax.trainer import JAXEpochIterator

    def ahead(self):
        return self._one_batch_ahead_iterator(self.data_adapter.get_jax_iterator())

    monkeypatch.setattr(JAXEpochIterator, "_get_iterator", ahead)


def test_backup_and_restore_after_a_crash_ends_with_the_uninterrupted_weights(tmp_path, uninterrupted):
    kind, want = uninterrupted
    backup = str(tmp_path / "backup")
    run = _run(kind)
    private = _model(run)
    with pytest.raises(RuntimeError, match="simulated crash"):
        private.fit(run.dataset(*_data()), verbose=0,
                    callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1), CrashAt(at_step=4)])
    # "the same script run again": a new model, optimizer and run object (a new secret key, a new
    # noise seed: both come from the backup)
    run = _run(kind, seed=None)
    resumed = _model(run, noise_seed=999)
    steps = _Steps()
    resumed.fit(run.dataset(*_data()), verbose=0,
                callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1), steps])
    assert steps.steps == [5, 6, 7, 8]  # steps 4 ... 7, once each
    assert _step(resumed) == T
    _assert_same(_weights(resumed), want)


def test_a_restore_to_an_earlier_step_than_fit_began_at_runs_every_remaining_step(tmp_path, uninterrupted):
    """The optimizer stands at step 6 when ``fit`` is called, its backup at step 4: ``fit``
    runs steps 4 ... 7 (Keras counted the batches before the restore)."""
    kind, want = uninterrupted
    backup = str(tmp_path / "backup")
    run = _run(kind)
    private = _model(run)
    private.fit(run.dataset(*_data()), verbose=0, steps_per_epoch=4,
                callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1, delete_checkpoint=False)])
    private.fit(run.dataset(*_data()), verbose=0, steps_per_epoch=2)
    assert _step(private) == 6
    steps = _Steps()
    private.fit(run.dataset(*_data()), verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup), steps])
    assert steps.steps == [5, 6, 7, 8]
    _assert_same(_weights(private), want)


def test_backup_and_restore_across_epochs(tmp_path):
    """4 steps per epoch, 2 epochs: a crash in the second epoch resumes there."""
    kind = "dpsgd"
    data = _data()
    data = data[0][:40], data[1][:40]
    run = _run(kind, num_examples=40, batch_size=10)
    assert (run.steps_per_epoch, run.epochs) == (4, 2)
    reference = _model(run)
    reference.fit(run.dataset(*data), verbose=0)
    backup = str(tmp_path / "backup")
    crashed = _model(run)
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit(run.dataset(*data), verbose=0,
                    callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1), CrashAt(at_step=5)])
    other = _run(kind, seed=None, num_examples=40, batch_size=10)
    resumed = _model(other, noise_seed=999)
    steps = _Steps()
    resumed.fit(other.dataset(*data), verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup), steps])
    assert steps.steps == [6, 7, 8]
    _assert_same(_weights(resumed), _weights(reference))


@pytest.mark.parametrize("how", ["weights.h5", "keras"])
def test_load_before_fit_continues_the_plan(tmp_path, uninterrupted, how):
    kind, want = uninterrupted
    run = _run(kind)
    private = _model(run)
    private.fit(run.dataset(*_data()), verbose=0, steps_per_epoch=4)
    assert _step(private) == 4
    other = _run(kind, seed=None)
    if how == "keras":
        path = str(tmp_path / "mid.keras")
        private.save(path)
        resumed = keras.models.load_model(path)
    else:
        path = str(tmp_path / "mid.weights.h5")
        private.save_weights(path)
        resumed = _model(other, noise_seed=999)
        resumed.optimizer.build(resumed.trainable_variables)
        resumed.load_weights(path)
    assert _step(resumed) == 4
    steps = _Steps()
    resumed.fit(other.dataset(*_data()), verbose=0, callbacks=[steps])
    assert steps.steps == [5, 6, 7, 8]
    _assert_same(_weights(resumed), want)


def test_a_custom_loop_reads_the_start_when_it_iterates(tmp_path):
    """``batches(optimizer)`` made before a restore starts at the restored step and key once
    iterated, as the ``tf.data`` pipeline does."""
    run = _run("dpsgd")
    private = _model(run)
    private.fit(run.dataset(*_data()), verbose=0, steps_per_epoch=3)
    path = str(tmp_path / "mid.weights.h5")
    private.save_weights(path)
    other = _run("dpsgd", seed=None)
    fresh = _model(other, noise_seed=999)
    fresh.optimizer.build(fresh.trainable_variables)
    batches = other.dataset(*_data()).batches(fresh.optimizer)
    assert batches.start == 0 and len(batches) == T
    fresh.load_weights(path)
    got = list(batches)
    assert [int(b[3][0]) for b in got] == list(range(3, T)) and batches.start == 3 and len(batches) == T - 3
    sampler = run.sampler(private.optimizer.sampling_position()[1])  # the saved run's key
    x = _data()[0]
    for t, (xb, _, mask, step) in zip(range(3, T), got):
        indices, want_mask, _ = sampler.batch(t)
        np.testing.assert_array_equal(mask, want_mask)
        real = want_mask > 0
        np.testing.assert_array_equal(xb[real], x[indices][real])
        assert not np.any(xb[~real])  # padding rows are blanked


def test_an_accelerator_s_look_ahead_reads_no_batch_past_the_plan(tmp_path, look_ahead):
    """With a batch read ahead of each step: a BackupAndRestore resume, and a model loaded
    with one step left (the batches Keras builds the model from hold one)."""
    want = _uninterrupted("dpsgd")
    backup = str(tmp_path / "backup")
    run = _run("dpsgd")
    private = _model(run)
    with pytest.raises(RuntimeError, match="simulated crash"):
        private.fit(run.dataset(*_data()), verbose=0,
                    callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1, delete_checkpoint=False),
                               CrashAt(at_step=T - 1)])
    resumed = _model(_run("dpsgd", seed=None), noise_seed=999)
    resumed.fit(run.dataset(*_data()), verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert _step(resumed) == T
    _assert_same(_weights(resumed), want)
    path = str(tmp_path / "last.weights.h5")
    private.save_weights(path)  # the crashed model, at step T - 1
    loaded = _model(_run("dpsgd", seed=None), noise_seed=999)
    loaded.optimizer.build(loaded.trainable_variables)
    loaded.load_weights(path)
    assert _step(loaded) == T - 1
    loaded.fit(run.dataset(*_data()), verbose=0)
    assert _step(loaded) == T
    _assert_same(_weights(loaded), want)


def test_the_low_level_path_resumes_exactly_through_backup_and_restore(tmp_path):
    """An optimizer without a run, fixed batches of arrays (shuffle=False): killed in the second
    epoch and restored from the first epoch's backup, it ends with the uninterrupted weights."""
    x, y = _data()
    c = knc.solve_mixing_matrix(steps=30, bands=2)

    def model():
        keras.utils.set_random_seed(0)
        private = knc.make_private(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)], name="low"))
        private.compile(optimizer=knc.NoiseCurveOptimizer(learning_rate=0.1, mixing=c, noise_multiplier=1.0,
                                                          expected_batch_size=B, seed=9), loss="mse")
        return private

    def fit(private, **kwargs):
        return private.fit(x[:40], y[:40], batch_size=B, epochs=3, shuffle=False, verbose=0, **kwargs)

    with pytest.warns(RuntimeWarning, match="epsilon is not tracked"):
        whole = fit(model()).model.get_weights()
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError):
        fit(model(), callbacks=[keras.callbacks.BackupAndRestore(backup), CrashAt(3)])
    resumed = model()
    fit(resumed, callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert int(np.asarray(resumed.optimizer.iterations.value)) == 6
    for a, b in zip(resumed.get_weights(), whole):
        np.testing.assert_array_equal(a, b)


def test_a_banded_poisson_dataset_fit_starts_and_continues_at_the_optimizer_s_step():
    """The low-level plan (``banded_poisson_dataset``) on JAX: its dataset reads the start step
    when first iterated, after Keras moved the optimizer's variables into the JAX training state
    (unreadable then: this was a TypeError). ``fit`` records the step it begins at; a second
    ``fit`` continues the plan where the first stopped (the private step checks each batch's
    step), and a third, past the plan's end, is refused."""
    x, y = _data()
    keras.utils.set_random_seed(0)
    private = knc.make_private(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
    optimizer = knc.NoiseCurveOptimizer(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0,
                                        expected_batch_size=B, seed=1)
    private.compile(optimizer=optimizer, loss="mse")
    with pytest.warns(Warning):
        dataset = knc.banded_poisson_dataset(x, y, batch_size=B, bands=1, steps=2 * T, seed=5)
    for done in (T, 2 * T):
        private.fit(dataset, epochs=1, steps_per_epoch=T, verbose=0)
        assert int(np.asarray(optimizer.iterations.value)) == done
    with pytest.raises(RuntimeError, match="the plan of 16 steps is complete"):
        private.fit(dataset, epochs=1, steps_per_epoch=T, verbose=0)


def test_a_backend_that_leaves_out_its_pipeline_trains_the_same_run_from_the_default(monkeypatch):
    """``pipeline`` is optional: a backend without one (one process) is served
    ``backend/common/defaults/pipeline.py``, whose batches make the same run as JAX's own pipeline
    (its processes' agreement added to the default), bit for bit."""
    from keras_noisecurve import backend
    from keras_noisecurve.backend import jax as jax_package
    from keras_noisecurve.backend.common.defaults import pipeline as default

    monkeypatch.setattr(jax_package, "MODULES", tuple(m for m in jax_package.MODULES if m != "pipeline"))
    assert backend.module("pipeline") is default
    run = _run("banded")
    private, steps = _model(run), _Steps()
    private.fit(run.dataset(*_data()), verbose=0, callbacks=[steps])
    assert steps.steps == list(range(1, T + 1))
    _assert_same(_weights(private), _uninterrupted("banded"))
    with pytest.raises(ValueError, match="input_context is a tf.distribute argument; the jax backend has none"):
        default.plan_batches(None, input_context=object())
