"""Resume: save at step k, reload, continue to T ⇒ the same weights as an uninterrupted run."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.training import NoiseCurveOptimizer, make_private
from tests.training.helpers import CrashAt, random_banded_c

B, STEPS, BANDS, SEED = 4, 6, 3, 17
C = random_banded_c(STEPS, BANDS, rng=np.random.default_rng(9), diag_scale=0.5)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2 * B, 3)).astype("float32")  # one epoch = 2 steps
    y = rng.integers(0, 2, 2 * B)
    return x, y


@pytest.fixture(scope="module")
def initial_weights():
    keras.utils.set_random_seed(2)
    return _base().get_weights()


def _base():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)])


def _model(weights, seed=SEED):
    base = _base()
    base.set_weights(weights)
    model = make_private(base, clipping="vectorized")
    model.compile(
        optimizer=NoiseCurveOptimizer(learning_rate=0.3, mixing=C, l2_norm_clip=0.5, noise_multiplier=2.0,
                                      expected_batch_size=B, seed=seed),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _fit(model, data, epochs, **kw):
    x, y = data
    return model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0, **kw)


@pytest.fixture(scope="module")
def uninterrupted(data, initial_weights):
    model = _model(initial_weights)
    _fit(model, data, STEPS // 2)
    assert int(model.optimizer.iterations.numpy()) == STEPS
    return model.get_weights()


def _assert_same(weights, reference):
    for a, b in zip(weights, reference):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_keras_save_and_load(tmp_path, data, initial_weights, uninterrupted):
    model = _model(initial_weights)
    _fit(model, data, 1)  # 2 of 6 steps: the ring buffers are non-trivial
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.optimizer.seed is None  # the seed is not in the file's config; the noise key variable is
    _fit(loaded, data, 2)
    assert int(loaded.optimizer.iterations.numpy()) == STEPS
    _assert_same(loaded.get_weights(), uninterrupted)
    # and the result differs from a run restarted WITHOUT the optimizer state
    fresh = _model(initial_weights)
    fresh.set_weights(model.get_weights())
    fresh.optimizer.build(fresh.trainable_variables)
    _fit(fresh, data, 2)
    assert not np.allclose(fresh.get_weights()[0], uninterrupted[0])


def test_backup_and_restore(tmp_path, data, initial_weights, uninterrupted):
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    model = _model(initial_weights)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(model, data, STEPS // 2, callbacks=[backup, CrashAt(at_step=3)])  # mid epoch 2
    # a new process: fresh model (a different secret key unless restored), same backup dir
    resumed = _model(initial_weights, seed=999)  # the key must come from the backup
    _fit(resumed, data, STEPS // 2, callbacks=[backup])
    assert int(resumed.optimizer.iterations.numpy()) == STEPS
    _assert_same(resumed.get_weights(), uninterrupted)


def test_tf_train_checkpoint(tmp_path, data, initial_weights, uninterrupted):
    model = _model(initial_weights)
    _fit(model, data, 2)  # 4 steps
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    path = ckpt.save(str(tmp_path / "ckpt"))
    restored = _model(initial_weights, seed=None)  # a different (secret) key until restored
    restored.optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(path).assert_consumed()
    np.testing.assert_array_equal(restored.optimizer._noise_key.numpy(), model.optimizer._noise_key.numpy())
    _fit(restored, data, 1)
    _assert_same(restored.get_weights(), uninterrupted)
