"""PrivacyBudget on a real (tiny) Keras fit with plain SGD."""

import keras
import numpy as np
import pytest

from keras_noisecurve import NoiseCurveOptimizer, make_private
from keras_noisecurve.callbacks import PrivacyBudget
from keras_noisecurve.mixing import MixingMatrix
from keras_noisecurve.privacy import compute_epsilon
from keras_noisecurve.privacy.ledger import PLD_RTOL
from keras_noisecurve.privacy.run import PrivateRun
from keras_noisecurve.privacy.sampler import banded_poisson_dataset

N, B, BANDS, T, SIGMA, DELTA = 400, 20, 2, 40, 1.0, 1e-5


def _run(steps=T, accountant="pld"):
    """A run with a b = 2 banded C of unit columns (sensitivity 1, as compute_epsilon without mixing)."""
    dense = np.tril(np.ones((steps, steps))) - np.tril(np.ones((steps, steps)), -BANDS)
    mixing = MixingMatrix.from_dense(dense / np.linalg.norm(dense, axis=0), bands=BANDS)
    return PrivateRun(num_examples=N, batch_size=B, steps=steps, mixing=mixing, noise_multiplier=SIGMA, delta=DELTA,
                      accountant=accountant, seed=0)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 4)).astype("float32")
    y = (x[:, :1] > 0).astype("float32")
    return x, y


def _model(run):
    """A private model whose optimizer (no run: the low-level path) has ``run``'s C, σ and B."""
    model = make_private(keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]))
    model.compile(optimizer=NoiseCurveOptimizer(learning_rate=0.05, mixing=run.mixing, noise_multiplier=SIGMA,
                                                expected_batch_size=B, seed=3), loss="mse")
    return model


def _eps(steps, accountant):
    return compute_epsilon(noise_multiplier=SIGMA, delta=DELTA, num_examples=N, batch_size=B, steps=steps,
                           bands=BANDS, accountant=accountant)


@pytest.mark.parametrize("accountant,target", [("rdp", 3.0), ("pld", 2.0)])
def test_stops_before_target_epsilon_and_logs_it(accountant, target, capsys):
    x, y = _data()
    ds = banded_poisson_dataset(x, y, batch_size=B, bands=BANDS, steps=T, seed=1)
    run = _run(accountant=accountant)
    model = _model(run)
    cb = PrivacyBudget(run=run, target_epsilon=target)
    history = model.fit(ds, epochs=4, steps_per_epoch=10, callbacks=[cb], verbose=0)
    done = int(model.optimizer.iterations.numpy())
    assert done < T
    # eps is non-decreasing in the step count, so this pins done = max{k : eps(k) <= target}
    eps_done = _eps(done, accountant)
    assert eps_done <= target < _eps(done + 1, accountant)
    # the ledger's PLD epsilon equals the from-scratch one up to FFT round-off (PLD_RTOL)
    assert history.history["epsilon"][-1] == pytest.approx(eps_done, rel=PLD_RTOL if accountant == "pld" else 1e-12)
    assert "target_epsilon" in capsys.readouterr().out
    # resuming the same model: no step is left, so fit refuses before overspending
    with pytest.raises(RuntimeError, match="no further step"):
        model.fit(ds, epochs=1, steps_per_epoch=1, callbacks=[cb], verbose=0)


def test_stops_at_step_plan_and_counts_across_fits():
    x, y = _data()
    steps = 12
    ds = banded_poisson_dataset(x, y, batch_size=B, bands=BANDS, steps=steps, seed=2).repeat()
    run = _run(steps, "rdp")
    model = _model(run)
    cb = PrivacyBudget(run=run, log_every_step=True, verbose=0)
    seen = []
    recorder = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(logs["epsilon"]))
    model.fit(ds, epochs=1, steps_per_epoch=5, callbacks=[cb, recorder], verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 5 and not model.stop_training
    # per-step epsilon: ceil(k/2) compositions after k steps (k = 1 is checked through k = 2)
    assert seen[1] == seen[0] and seen[3] == seen[2]
    assert seen[1:] == pytest.approx([_eps(k, "rdp") for k in range(2, 6)], rel=1e-12)
    history = model.fit(ds, epochs=3, steps_per_epoch=5, callbacks=[cb], verbose=0)
    assert int(model.optimizer.iterations.numpy()) == steps
    assert "step plan" in cb.stop_reason
    assert history.history["epsilon"] == pytest.approx([_eps(10, "rdp"), _eps(12, "rdp")], rel=1e-12)


def test_get_config_round_trip_and_validation():
    run = PrivateRun(num_examples=1000, batch_size=10, steps=300, sampling="fixed_epochs", noise_multiplier=1.3,
                     delta=1e-6, accountant="rdp", seed=0)
    cb = PrivacyBudget(run=run, target_epsilon=5.0, verbose=0)
    assert cb.ledger is run.ledger and cb.spec is run.spec  # shared, not rebuilt
    clone = PrivacyBudget.from_config(cb.get_config())
    assert clone.get_config() == cb.get_config()
    assert clone.run.same_plan(run) and clone.allowed_steps() == cb.allowed_steps()
    assert clone.epsilon_at(150) == pytest.approx(
        compute_epsilon(noise_multiplier=1.3, delta=1e-6, num_examples=1000, batch_size=10, steps=200,
                        sampling="fixed_epochs", epochs=2, accountant="rdp"), rel=1e-12)
    assert clone.epsilon_at(0) == 0.0


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(run={"steps": T}), TypeError, "run must be a keras_noisecurve.PrivateRun or None, got dict"),
        (dict(target_epsilon=0.0), ValueError, "target_epsilon must be > 0, got 0.0"),
        (dict(verbose=-1), ValueError, "verbose must be >= 0, got -1"),
    ],
)
def test_validation_messages(kwargs, error, match):
    with pytest.raises(error, match=match):
        PrivacyBudget(**{"run": _run(12, "rdp"), **kwargs})
    with pytest.raises(TypeError):
        PrivacyBudget(noise_multiplier=SIGMA, delta=DELTA, num_examples=N, batch_size=B, steps=T)  # no loose run


class _Optimizer:
    def __init__(self, iterations, run):
        self.iterations = iterations
        self.run = run


class _Model:
    def __init__(self, iterations, run):
        self.optimizer = _Optimizer(iterations, run)
        self.stop_training = False


def test_no_epsilon_is_computed_after_train_begin_except_new_epoch_ends():
    """The end of fit costs nothing: on_train_begin computed epsilon at the last allowed step."""
    run = _run()
    cb = PrivacyBudget(run=run, verbose=0)
    cb.set_model(_Model(np.int64(0), run))
    cb.on_train_begin()
    ledger = cb.ledger
    assert ledger.mechanism_builds == 1 and ledger.evaluations == 1
    for step in range(1, T + 1):
        cb.model.optimizer.iterations = np.int64(step)
        cb.on_train_batch_end(step - 1, {})
    assert cb.model.stop_training and "step plan" in cb.stop_reason
    logs = {}
    cb.on_epoch_end(0, logs)
    assert ledger.evaluations == 1  # the final epsilon was already there
    assert logs["epsilon"] == pytest.approx(_eps(T, "pld"), rel=1e-8)
