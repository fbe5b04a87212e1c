"""A model whose optimizer belongs to a PrivateRun trains only on the run's own pipeline:
plain arrays (``fit(x, y, batch_size=40)``), a re-batched, shuffled or mapped dataset,
another plan's dataset and a bare batch (``train_on_batch``) are refused before the
first step, with a message that says to use ``run.dataset(...)``."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.privacy.run import PrivateRun
from keras_noisecurve.training import NoiseCurveOptimizer, make_private

N, B, STEPS = 48, 6, 8
PLAN = dict(num_examples=N, batch_size=B, steps=STEPS, noise_multiplier=1.5, delta=1e-5)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(1)
    return rng.normal(size=(N, 3)).astype("float32"), rng.integers(0, 2, N)


def _model(run):
    keras.utils.set_random_seed(2)
    base = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model = make_private(base, clipping="vectorized")
    model.compile(optimizer=NoiseCurveOptimizer(run=run, learning_rate=0.1, seed=3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _refused(model, call):
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"run\.dataset\(") as info:
        call()
    assert "\n" not in str(info.value)
    assert int(model.optimizer.iterations.numpy()) == 0  # refused BEFORE the first step
    for u, v in zip(before, model.get_weights()):
        np.testing.assert_array_equal(u, v)
    return str(info.value)


def test_fit_on_arrays_with_a_batch_size_is_refused(data):
    run = PrivateRun(**PLAN, seed=1)
    model = _model(run)
    message = _refused(model, lambda: model.fit(*data, batch_size=40, epochs=1, verbose=0))
    assert "PrivateRun" in message and "ndarray" in message


@pytest.mark.parametrize("change", ["unchanged", "shuffle", "rebatch", "map", "prefetch", "unbatch_batch"])
def test_fit_on_a_changed_run_dataset_is_refused(data, change):
    run = PrivateRun(**PLAN, seed=1)
    model = _model(run)
    ds = run.dataset(*data).batches(model.optimizer)  # the custom-loop batches: not for fit
    changed = {
        "unchanged": lambda: ds,
        "shuffle": lambda: ds.shuffle(4, seed=0),
        "rebatch": lambda: ds.rebatch(3),
        "map": lambda: ds.map(lambda *e: e),
        "prefetch": lambda: ds.prefetch(1),
        "unbatch_batch": lambda: ds.unbatch().batch(40),
    }[change]()
    _refused(model, lambda: model.fit(changed, epochs=1, steps_per_epoch=1, verbose=0))


def test_fit_on_a_plain_dataset_and_a_generator_is_refused(data):
    run = PrivateRun(**PLAN, seed=1)
    model = _model(run)
    plain = tf.data.Dataset.from_tensor_slices(data).batch(B)
    _refused(model, lambda: model.fit(plain, epochs=1, verbose=0))
    _refused(model, lambda: model.fit(iter([data]), epochs=1, steps_per_epoch=1, verbose=0))


def test_another_plans_dataset_is_refused_before_a_step(data):
    run = PrivateRun(**PLAN, seed=1)
    model = _model(run)
    other = PrivateRun(**{**PLAN, "batch_size": 4}, seed=1)
    with pytest.raises(ValueError, match="another plan"):
        model.fit(other.dataset(*data), verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_train_on_batch_without_the_step_index_is_refused(data):
    run = PrivateRun(**PLAN, seed=1)
    model = _model(run)
    _refused(model, lambda: model.train_on_batch(data[0][:B], data[1][:B]))


def test_the_runs_own_dataset_still_trains(data):
    run = PrivateRun(**PLAN, seed=1)
    model = _model(run)
    model.fit(run.dataset(*data), verbose=0)
    assert int(model.optimizer.iterations.numpy()) == STEPS


def test_an_optimizer_without_a_run_keeps_fit_on_arrays(data):
    """The low-level optimizer (no run; custom accounting) is not bound to a pipeline."""
    model = make_private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]), clipping="vectorized")
    model.compile(optimizer=NoiseCurveOptimizer(learning_rate=0.1, noise_multiplier=1.0, expected_batch_size=B),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(*data, batch_size=B, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == N // B
