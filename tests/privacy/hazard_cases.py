"""What can make ε wrong: each path of docs/privacy.md's hazard table, refused, warned or
accounted. Backend-neutral (the public API only): tests/privacy/test_hazards.py runs these
on TensorFlow, tests/jax/test_jax_hazards.py on JAX. A test here fails if its path turns
silent again.

A tiny run (n = 200, B = 20, T = 8, DP-BandMF b = 2 where it matters) on a one-Dense model.
"""

import pickle
import warnings

import keras
import numpy as np
import pytest

import keras_noisecurve as knc
from keras_noisecurve import NoiseCurveOptimizer, PrivateRun, make_private
from keras_noisecurve.callbacks import PrivacyBudget
from keras_noisecurve.mixing import MixingMatrix
from keras_noisecurve.privacy.secrets import FixedSeedWarning, KeysWrittenWarning

N, B, T = 200, 20, 8


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    return x, y


def _banded():
    dense = np.tril(np.ones((T, T))) - np.tril(np.ones((T, T)), -2)
    return MixingMatrix.from_dense(dense / np.linalg.norm(dense, axis=0), bands=2)


def _run(epsilon=8.0, batch_size=B, seed=1):
    return PrivateRun(num_examples=N, batch_size=batch_size, steps=T, mixing=_banded(), epsilon=epsilon, delta=1e-5,
                      seed=seed)


def _private(run, loss="mse", clip=1.0, layers=None, seed=2):
    keras.utils.set_random_seed(0)
    model = make_private(keras.Sequential([keras.Input((5,)), *(layers or [keras.layers.Dense(1)])]))
    model.compile(optimizer=NoiseCurveOptimizer(run=run, learning_rate=0.1, l2_norm_clip=clip, seed=seed), loss=loss)
    return model


class _Crash(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3:
            raise RuntimeError("simulated crash after step 4")


def _crashed_backup(tmp_path, data, run=None):
    """A BackupAndRestore directory of a run that crashed after 4 steps."""
    backup = str(tmp_path / "backup")
    run = run or _run()
    with pytest.raises(RuntimeError, match="simulated crash"):
        _private(run).fit(run.dataset(*data), verbose=0,
                          callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1), _Crash()])
    return backup


def _resume(backup, run, data, model=None):
    model = model or _private(run)
    model.fit(run.dataset(*data), verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1)])
    return model


def _weights_after_three_steps(tmp_path, data, run):
    """The path of a ``.weights.h5`` file of ``run`` saved after 3 private steps."""
    model = _private(run)
    model.fit(run.dataset(*data), verbose=0, steps_per_epoch=3, epochs=1)
    path = str(tmp_path / "three.weights.h5")
    model.save_weights(path)
    return path


def _iterations(model):
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations.value))


def test_resume_under_an_edited_epsilon_is_refused_the_same_plan_resumes(tmp_path, data):
    backup = _crashed_backup(tmp_path, data)
    with pytest.raises(ValueError, match=r"\(step 4\) was saved under another plan.*σ, the noise multiplier"):
        _resume(backup, _run(epsilon=2.0), data)
    assert _iterations(_resume(backup, _run(), data)) == T  # the script as it was: resumes to the end


def test_load_weights_of_another_plan_then_fit_is_refused(tmp_path, data):
    path = _weights_after_three_steps(tmp_path, data, _run())
    other = _run(batch_size=25)
    restored = _private(other)
    restored.optimizer.build(restored.trainable_variables)
    restored.load_weights(path)
    with pytest.raises(ValueError, match=r"what differs: B, the \(expected\) batch size.*P, the padded"):
        restored.fit(other.dataset(*data), verbose=0)


@pytest.mark.parametrize("change", ["one example", "order", "loss", "clip", "activation"])
def test_resume_on_other_inputs_is_refused(tmp_path, data, change):
    """A step run again from a checkpoint must take the same inputs (then it draws the same noise and
    reproduces its output); on other inputs it would reuse its noise, so it is refused."""
    backup = _crashed_backup(tmp_path, data)
    x, y = data
    run, loss, clip, what = _run(), "mse", 1.0, "the training examples or their order"
    if change == "one example":
        x = x.copy()
        x[17, 0] += 1.0  # e.g. a deletion request answered by replacing one example
    elif change == "order":
        order = np.random.default_rng(5).permutation(N)
        x, y = x[order], y[order]
    elif change == "loss":
        loss, what = "mae", "the model's trainable variables or its loss"
    elif change == "clip":
        clip, what = 0.5, "ζ, the clip norm"
    layers = [keras.layers.Dense(1, activation="tanh")] if change == "activation" else None
    if change == "activation":
        what = "the model's trainable variables or its loss"
    with pytest.raises(ValueError, match=f"what differs: {what}"):
        _resume(backup, run, (x, y), model=_private(run, loss=loss, clip=clip, layers=layers))


def test_a_checkpoint_saved_before_the_first_step_cannot_start_runs(tmp_path, data):
    """Two runs started from one step-0 file would share their noise (and release their difference)."""
    run = _run()
    first = _private(run, seed=None)
    first.optimizer.build(first.trainable_variables)
    path = str(tmp_path / "init.weights.h5")
    first.save_weights(path)
    again = _private(run, seed=None)
    again.load_weights(path)
    with pytest.raises(ValueError, match="restored from a file saved before its first private step"):
        again.fit(run.dataset(*data), verbose=0)
    assert _iterations(again) == 0


def test_load_weights_before_the_optimizer_is_built_restores_its_state(tmp_path, data):
    run = _run()
    path = _weights_after_three_steps(tmp_path, data, run)
    restored = _private(run)  # compiled, optimizer not built: Keras alone would skip its state
    restored.load_weights(path)
    assert _iterations(restored) == 3


def test_resuming_with_random_layers_warns(tmp_path, data):
    backup = str(tmp_path / "backup")
    run = _run()
    layers = [keras.layers.Dropout(0.2), keras.layers.Dense(1)]
    with pytest.raises(RuntimeError, match="simulated crash"):
        _private(run, layers=layers).fit(run.dataset(*data), verbose=0,
                                         callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1), _Crash()])
    with pytest.warns(RuntimeWarning, match=r"resuming at step 4 with layers that draw random numbers .*Dropout"):
        _resume(backup, run, data, model=_private(run, layers=layers))


def test_privacy_budget_takes_the_optimizers_run_and_refuses_another(data):
    run = _run()
    model = _private(run)
    other = _run(epsilon=1.0)
    with pytest.raises(ValueError, match="another run .* than the one the model's optimizer trains"):
        model.fit(run.dataset(*data), verbose=0, callbacks=[PrivacyBudget(run=other, verbose=0)])
    assert _iterations(model) == 0  # refused before the first step
    budget = PrivacyBudget(verbose=0)
    history = model.fit(run.dataset(*data), verbose=0, callbacks=[budget])
    assert budget.run is run
    assert history.history["epsilon"][-1] == pytest.approx(run.epsilon(T))


def test_a_non_private_optimizer_has_no_epsilon_to_report(data):
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="adds no noise"):
        model.fit(*data, verbose=0, callbacks=[PrivacyBudget(run=_run(), verbose=0)])


def test_files_that_hold_the_keys_say_so_and_the_inner_model_holds_none(tmp_path, data):
    run = _run()
    model = _private(run)
    model.fit(run.dataset(*data), verbose=0, steps_per_epoch=2, epochs=1)
    path = tmp_path / "private.keras"
    with pytest.warns(KeysWrittenWarning, match=f"{path}.*secret noise key and sampling key"):
        model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KeysWrittenWarning)
        model.inner.save(tmp_path / "release.keras")  # the documented release: no optimizer, no key
    released = keras.models.load_model(tmp_path / "release.keras")
    assert getattr(released, "optimizer", None) is None
    np.testing.assert_array_equal(released.get_weights()[0], model.inner.get_weights()[0])


def test_a_fixed_seed_warns_and_never_enters_a_config():
    with pytest.warns(FixedSeedWarning, match="PrivateRun.*batches predictable"):
        run = PrivateRun(num_examples=N, batch_size=B, steps=T, noise_multiplier=1.0, delta=1e-5, seed=0)
    with pytest.warns(FixedSeedWarning, match="NoiseCurveOptimizer.*noise predictable"):
        optimizer = NoiseCurveOptimizer(run=run, learning_rate=0.1, seed=0)
    assert "seed" not in optimizer.get_config() and "seed" not in run.get_config()
    with pytest.raises(ValueError, match=r"unknown \['seed'\].*A seed is never part of a config"):
        PrivateRun.from_config({**run.get_config(), "seed": 0})
    with warnings.catch_warnings():
        warnings.simplefilter("error", FixedSeedWarning)
        PrivateRun.from_config(run.get_config())  # no seed: a secret key, no warning


def test_a_pickled_run_leaves_its_key_out():
    run = _run()
    again = pickle.loads(pickle.dumps(run))
    words = [int(w) for w in run.initial_key()]
    blob = pickle.dumps(run)
    assert not any(int(w).to_bytes(8, "little", signed=True) in blob for w in words)
    assert again.epsilon() == run.epsilon() and again.same_plan(run)
    with pytest.raises(ValueError, match="unpickled"):
        again.sampler()


def test_weights_changed_between_private_fits_warn(data):
    run = _run()
    model = _private(run)
    model.fit(run.dataset(*data), verbose=0, steps_per_epoch=2, epochs=1)
    inner = model.inner
    inner.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    inner.fit(*data, verbose=0, epochs=1)  # non-private steps on the private data
    with pytest.warns(RuntimeWarning, match="weights changed since its last private step"):
        model.fit(run.dataset(*data), verbose=0, steps_per_epoch=2, epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model.fit(run.dataset(*data), verbose=0, steps_per_epoch=2, epochs=1)  # nothing changed in between


def test_the_low_level_path_on_arrays_warns_that_epsilon_is_not_tracked(data):
    model = make_private(keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)]))
    model.compile(optimizer=NoiseCurveOptimizer(learning_rate=0.1, noise_multiplier=1.0, expected_batch_size=20),
                  loss="mse")
    with pytest.warns(RuntimeWarning, match="epsilon is not tracked.*batches of 100 examples are not the "
                                            "expected_batch_size=20"):
        model.fit(*data, batch_size=100, epochs=1, verbose=0)


def test_a_padded_batch_size_that_overflows_is_refused():
    """max_batch_size = B overflows with probability ~1: ε at δ would be no guarantee (total δ 1)."""
    with pytest.raises(ValueError, match=r"max_batch_size=20 has an overflow probability p = 1 .*delta = 1e-05.*"
                                         r"at most delta/10.*Use max_batch_size >= \d+ "):
        PrivateRun(num_examples=N, batch_size=B, steps=T, mixing=_banded(), noise_multiplier=1.0, delta=1e-5,
                   max_batch_size=B)


def test_the_hazard_table_names_every_path():
    """docs/privacy.md's table lists each path these tests cover."""
    import pathlib

    text = (pathlib.Path(knc.__file__).parents[1] / "docs" / "privacy.md").read_text()
    table = text.split("What can make ε wrong")[-1]
    for path in ("edited", "load_weights", "PrivacyBudget(run=", "other data", "another order", "loss",
                 "clip", ".keras", "seed", "from_config", "pickle", "non-private", "low-level", "sampler(key)",
                 "BackupAndRestore", "max_batch_size", "BandedMatrixFactorizationQuery.from_run"):
        assert path in table, path


def test_a_budget_listed_before_backup_and_restore_counts_from_the_restored_step(tmp_path, data):
    backup = _crashed_backup(tmp_path, data)
    run = _run()
    budget = PrivacyBudget(log_every_step=True, verbose=0)
    history = _private(run).fit(run.dataset(*data), verbose=0,
                                callbacks=[budget, keras.callbacks.BackupAndRestore(backup, save_freq=1)])
    assert budget.stopped_at_step == T  # 4 restored + 4 run: the plan's end, not 4
    assert history.history["epsilon"][-1] == pytest.approx(run.epsilon(T))


def test_weights_that_carry_private_steps_refuse_a_fresh_optimizer(tmp_path, data):
    """load_model(..., compile=False) then a new optimizer: the weights carry 3 private steps that
    the new optimizer would not count."""
    run = _run()
    model = _private(run)
    model.fit(run.dataset(*data), verbose=0, steps_per_epoch=3, epochs=1)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras", compile=False)
    loaded.compile(optimizer=NoiseCurveOptimizer(run=run, learning_rate=0.1, seed=2), loss="mse")
    with pytest.raises(ValueError, match="written after 3 private steps, but the optimizer stands at step 0"):
        loaded.fit(run.dataset(*data), verbose=0)
    resumed = keras.models.load_model(tmp_path / "m.keras")  # compiled: the optimizer's state comes back
    resumed.fit(run.dataset(*data), verbose=0)
    assert _iterations(resumed) == T
    fresh = _private(_run(seed=4))  # a new run from those weights, on purpose
    fresh.inner.set_weights(loaded.inner.get_weights())
    fresh.fit(fresh.optimizer.run.dataset(*data), verbose=0)


def test_a_step_zero_file_of_an_interrupted_fit_cannot_start_runs(tmp_path, data):
    """A fit that stopped before its first step has bound the data and model words: its file still
    holds a step-0 noise key that two runs would share."""
    run = _run()
    first = _private(run, seed=None)

    class Stop(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            raise RuntimeError("stopped before the first step")

    with pytest.raises(RuntimeError, match="before the first step"):
        first.fit(run.dataset(*data), verbose=0, callbacks=[Stop()])
    first.save(tmp_path / "step0.keras")
    again = keras.models.load_model(tmp_path / "step0.keras")
    with pytest.raises(ValueError, match="restored from a file saved before its first private step"):
        again.fit(run.dataset(*data), verbose=0)


def test_a_second_fit_in_the_same_process_is_no_resume(data):
    run = _run()
    model = _private(run, layers=[keras.layers.Dropout(0.2), keras.layers.Dense(1)])
    model.fit(run.dataset(*data), verbose=0, steps_per_epoch=3, epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model.fit(run.dataset(*data), verbose=0)  # continues at step 3: no restore, no warning
    assert _iterations(model) == T
