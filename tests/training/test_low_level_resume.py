"""The low-level path (an optimizer without a run + ``banded_poisson_dataset``) after a
simulated preemption: ``fit`` + ``BackupAndRestore``, ``ModelCheckpoint`` +
``load_model`` and a custom loop restored from a ``tf.train.Checkpoint`` continue with
the batches of the plan at the restored step, checked against an independent copy of
the plan (``sampling_plan`` drawn separately); a plan that cannot be drawn again
(``seed=None``) is refused before the first step."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.privacy.sampler import banded_poisson_dataset, sampling_plan
from keras_noisecurve.training import NoiseCurveOptimizer, make_private
from tests.training.helpers import CrashAt, random_banded_c

N, B, STEPS, BANDS, PLAN_SEED = 48, 6, 10, 2, 5
C = random_banded_c(STEPS, BANDS, rng=np.random.default_rng(4), diag_scale=0.5)
PLAN = dict(batch_size=B, bands=BANDS, steps=STEPS)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(N, 3)).astype("float32")
    x[:, 0] = np.arange(N)  # column 0 names the example, so a batch tells which examples it took
    return x, rng.integers(0, 2, N)


@pytest.fixture(scope="module")
def expected():
    """The plan's batches (example ids per step), drawn independently of any dataset."""
    plan = sampling_plan(num_examples=N, **PLAN, seed=PLAN_SEED)
    return [sorted(plan.batch(t).tolist()) for t in range(STEPS)]


def _ids(xb, mask):
    return sorted(np.asarray(xb)[np.asarray(mask) > 0, 0].astype(int).tolist())


def _optimizer():
    return NoiseCurveOptimizer(learning_rate=0.1, mixing=C, l2_norm_clip=0.5, noise_multiplier=1.5,
                               expected_batch_size=B, seed=11)


def _model(taken):
    """A private model that records the example ids of every batch it trains on."""
    keras.utils.set_random_seed(2)
    base = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])
    model = make_private(base, clipping="vectorized")
    model.compile(optimizer=_optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  run_eagerly=True)
    _record(model, taken)
    return model


def _record(model, taken):
    step = model.train_step

    def recording(data):
        taken.append((int(np.asarray(data[3])[0]), _ids(data[0], data[2])))
        return step(data)

    model.train_step = recording


def _dataset(data, seed=PLAN_SEED, **kw):
    return banded_poisson_dataset(*data, **PLAN, seed=seed, **kw)


def _iterations(model):
    return int(model.optimizer.iterations.numpy())


@pytest.fixture(scope="module")
def uninterrupted(data, expected):
    taken = []
    model = _model(taken)
    model.fit(_dataset(data), verbose=0)
    assert taken == list(enumerate(expected))
    return model.get_weights()


def _assert_same(weights, reference):
    for a, b in zip(weights, reference):
        np.testing.assert_array_equal(a, b)


def test_backup_and_restore_continues_the_plan(tmp_path, data, expected, uninterrupted):
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=1)
    crashed = []
    with pytest.raises(RuntimeError, match="simulated crash"):
        _model(crashed).fit(_dataset(data), verbose=0, callbacks=[backup, CrashAt(at_step=4)])
    assert crashed == list(enumerate(expected))[:4]
    taken = []  # "a new process": the same code again
    resumed = _model(taken)
    resumed.fit(_dataset(data), verbose=0, callbacks=[backup])
    assert taken == list(enumerate(expected))[4:]  # batches 4 ... 9, once each (not 0 ... 5 again)
    assert _iterations(resumed) == STEPS
    _assert_same(resumed.get_weights(), uninterrupted)


def test_model_checkpoint_and_load_model_continue_the_plan(tmp_path, data, expected, uninterrupted):
    path = str(tmp_path / "m.keras")
    saver = keras.callbacks.ModelCheckpoint(path, save_freq=3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _model([]).fit(_dataset(data), verbose=0, callbacks=[saver, CrashAt(at_step=5)])
    loaded = keras.models.load_model(path)  # saved after step 3
    assert _iterations(loaded) == 3
    taken = []
    loaded.compile(optimizer=loaded.optimizer, loss=loaded.loss, run_eagerly=True)
    _record(loaded, taken)
    loaded.fit(_dataset(data), verbose=0)
    assert taken == list(enumerate(expected))[3:]
    _assert_same(loaded.get_weights(), uninterrupted)


def _custom_loop(model, optimizer, dataset, taken, stop=None):
    from keras_noisecurve.backend.tensorflow.clipping import get_engine, per_example_loss_fn

    engine = get_engine("vectorized", model)
    loss_fn = per_example_loss_fn(keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    @tf.function
    def step(xb, yb, mask):
        clipped = engine(model, loss_fn, xb, yb, mask, l2_norm_clip=optimizer.l2_norm_clip)
        optimizer.apply_clipped_sum(clipped.grads, model.trainable_variables)

    for xb, yb, mask in dataset:
        if stop is not None and len(taken) == stop:
            raise RuntimeError("simulated crash")
        taken.append(_ids(xb, mask))
        step(xb, yb, mask)


def _loop_model():
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])
    optimizer = _optimizer()
    optimizer.build(model.trainable_variables)
    return model, optimizer


def test_custom_loop_restored_from_a_checkpoint_continues_the_plan(tmp_path, data, expected):
    model, optimizer = _loop_model()
    full = []
    _custom_loop(model, optimizer, _dataset(data, optimizer=optimizer), full)
    assert full == expected
    model, optimizer = _loop_model()
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    crashed = []
    with pytest.raises(RuntimeError, match="simulated crash"):
        _custom_loop(model, optimizer, _dataset(data, optimizer=optimizer), crashed, stop=6)
    path = checkpoint.save(str(tmp_path / "ckpt"))
    restored_model, restored = _loop_model()  # "a new process"
    tf.train.Checkpoint(model=restored_model, optimizer=restored).restore(path).assert_consumed()
    taken = []
    _custom_loop(restored_model, restored, _dataset(data, optimizer=restored), taken)
    assert crashed + taken == expected and taken == expected[6:]


def test_a_plan_drawn_from_os_entropy_is_refused_after_a_restore(tmp_path, data):
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=1)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _model([]).fit(_dataset(data, seed=None), verbose=0, callbacks=[backup, CrashAt(at_step=4)])
    taken = []
    resumed = _model(taken)
    with pytest.raises(ValueError, match=r"seed=None\): the optimizer stands at step 4"):
        resumed.fit(_dataset(data, seed=None), verbose=0, callbacks=[backup])
    assert taken == [] and _iterations(resumed) == 4  # refused before the first step
    # the custom loop: the iterator refuses before its first batch
    model, optimizer = _loop_model()
    optimizer.iterations.assign(3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="seed=None"):
        _custom_loop(model, optimizer, _dataset(data, seed=None, optimizer=optimizer), [])


def test_a_plan_drawn_from_os_entropy_continues_in_the_same_process(data):
    taken = []
    model = _model(taken)
    ds = _dataset(data, seed=None)
    model.fit(ds, verbose=0, steps_per_epoch=3, epochs=1)
    model.fit(ds, verbose=0)  # the same plan object: continues at step 3
    assert [t for t, _ in taken] == list(range(STEPS))
    with pytest.raises(RuntimeError, match="the plan of 10 steps is complete"):
        model.fit(ds, verbose=0)
