"""The run flows one way: the optimizer holds the run, the run holds no optimizer, and
nothing is hidden on a tf.data.Dataset; ``run.dataset(x, y).batches(optimizer)`` drives a
custom loop that resumes at the optimizer's step with the key the optimizer saved."""

import gc
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.privacy.spec import RunSpec
from keras_noisecurve.privacy.run import PrivateRun
from keras_noisecurve.privacy.run_data import RunData
from keras_noisecurve.privacy.sampler import BatchSampler
from keras_noisecurve.training import NoiseCurveOptimizer, make_private

N, B, STEPS = 40, 5, 6
PLAN = dict(num_examples=N, batch_size=B, steps=STEPS, noise_multiplier=1.0, delta=1e-5)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(3)
    return rng.normal(size=(N, 3)).astype("float32"), rng.integers(0, 2, N)


def _model(run, seed=0):
    keras.utils.set_random_seed(1)
    model = make_private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]), clipping="vectorized")
    model.compile(optimizer=NoiseCurveOptimizer(run=run, learning_rate=0.2, seed=seed),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _holds(obj, kind, depth=2):
    """Whether ``obj`` refers to an instance of ``kind`` through its attributes (``depth`` levels)."""
    values = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
    for value in values:
        if isinstance(value, (kind, weakref.ref)):
            return True
        if depth > 1 and hasattr(value, "__dict__") and not isinstance(value, type) and _holds(value, kind, depth - 1):
            return True
    return False


def test_an_optimizer_is_collectable_while_its_run_lives():
    run = PrivateRun(**PLAN, seed=1)
    opt = NoiseCurveOptimizer(run=run, learning_rate=0.1, seed=0)
    var = keras.Variable(np.zeros(3, np.float32))
    opt.apply_clipped_sum([tf.ones(3)], [var])  # built: it holds the run's key and a step
    assert opt.run is run and int(opt.iterations.numpy()) == 1
    assert not _holds(run, keras.optimizers.Optimizer)
    dead = weakref.ref(opt)
    del opt
    gc.collect()
    assert dead() is None  # nothing of the run kept it alive
    assert run.steps == STEPS  # the run lives on


def test_run_data_is_public_and_its_batches_carry_nothing_private(data):
    run = PrivateRun(**PLAN, seed=1)
    model = _model(run)
    examples = run.dataset(*data)
    assert isinstance(examples, RunData) and not isinstance(examples, tf.data.Dataset)
    assert examples.run is run and not _holds(examples, keras.optimizers.Optimizer)
    batches = examples.batches(model.optimizer)
    plain = tf.data.Dataset.range(3).prefetch(1)
    assert set(vars(batches)) == set(vars(plain))  # the same attributes as any prefetched dataset
    assert not any(isinstance(v, (PrivateRun, RunData)) for v in vars(batches).values())
    assert not any("knc" in name for name in dir(batches))


def test_custom_loop_batches_resume_at_the_optimizers_step_with_its_key(data):
    run = PrivateRun(**PLAN, seed=1)
    model = _model(run)
    opt = model.optimizer
    train = tf.function(model.train_step)
    for batch in run.dataset(*data).batches(opt).take(2):
        train(batch)
    assert int(opt.iterations.numpy()) == 2
    # another run object of the same plan (a NEW secret key): the batches still follow the
    # optimizer's step and saved key, checked against an independent sampler of that key
    other = PrivateRun(**PLAN, seed=None)
    key = opt.sampling_key.numpy()
    assert not np.array_equal(key, other.initial_key())
    sampler = BatchSampler(spec=RunSpec(num_examples=N, batch_size=B, bands=1, steps=STEPS, sampling="cyclic_poisson"),
                           padded_size=run.padded_batch_size, key=key)
    rest = list(other.dataset(*data).batches(opt).as_numpy_iterator())
    assert [int(b[3][0]) for b in rest] == list(range(2, STEPS))
    for t, (xb, _, mask, _) in zip(range(2, STEPS), rest):
        indices, expected_mask, _ = sampler.batch(t)
        real = expected_mask > 0
        np.testing.assert_array_equal(xb[real], data[0][indices][real])
        assert not np.any(xb[~real])  # padding rows carry no example (not copies of example 0)
        np.testing.assert_array_equal(mask, expected_mask)
    for batch in other.dataset(*data).batches(opt):
        train(batch)
    assert int(opt.iterations.numpy()) == STEPS


def test_fit_takes_the_batches_itself_and_refuses_the_custom_loop_batches(data):
    run = PrivateRun(**PLAN, seed=1)
    model = _model(run)
    with pytest.raises(ValueError, match="for custom loops: give fit run.dataset"):
        model.fit(run.dataset(*data).batches(model.optimizer), verbose=0)
    model.fit(run.dataset(*data), verbose=0)
    assert int(model.optimizer.iterations.numpy()) == STEPS


def test_batches_refuse_an_optimizer_of_another_plan_or_without_a_run(data):
    run = PrivateRun(**PLAN, seed=1)
    examples = run.dataset(*data)
    with pytest.raises(ValueError, match="another plan"):
        examples.batches(NoiseCurveOptimizer(run=PrivateRun(**{**PLAN, "steps": 5}), learning_rate=0.1))
    with pytest.raises(ValueError, match="not created for a PrivateRun"):
        examples.batches(NoiseCurveOptimizer(learning_rate=0.1, noise_multiplier=1.0, expected_batch_size=B))
    with pytest.raises(TypeError, match="not iterable"):
        next(iter(examples))
