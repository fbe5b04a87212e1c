"""Test configuration shared by the whole suite.

Keras runs on TensorFlow; the CPU is split into two logical devices (before
TensorFlow initialises) so ``tf.distribute.MirroredStrategy`` can be tested on a
machine without accelerators. After every test the survivors of a garbage collection
are moved out of the collector's sight (:func:`_freeze_what_survives`).
"""

import gc
import os
import sys

import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def pytest_configure(config):
    if os.environ["KERAS_BACKEND"] != "tensorflow":  # tests/jax: TensorFlow is not needed
        return
    try:
        import tensorflow as tf
    except ImportError:  # pragma: no cover - the numpy-only tests still run
        return
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
        )
    except RuntimeError:  # already initialised
        pass


@pytest.fixture(autouse=True)
def _separate_collective_keys():
    """Give every test's ``MirroredStrategy`` its own collective keys.

    Each new ``MirroredStrategy`` numbers its collective groups and instances from the
    same start, and TensorFlow's collective executor remembers the shapes of the
    instances it has run: a second strategy in the same process then all-reduces
    against the first one's shapes ("Shape mismatch in the collective instance 100",
    tensorflow/tensorflow#62790). TensorFlow's own tests move the keys' base for
    every strategy (``strategy_combinations.py``); so do we, before every test.
    """
    if "tensorflow" in sys.modules:
        from tensorflow.python.distribute import mirrored_strategy

        mirrored_strategy.MirroredStrategy._collective_key_base += 100_000
    yield


@pytest.fixture(autouse=True)
def _freeze_what_survives():
    """After each test, collect garbage, then ``gc.freeze()`` what is left.

    TensorFlow (2.13 and later) never frees the graphs ``tf.function`` traces for
    ``fit``, even after the model is gone and ``keras.backend.clear_session()`` ran
    (plain Keras too: keras-team/tf-keras#286, tensorflow/tensorflow#61791): their
    operations form reference cycles through TensorFlow's C++ graph, which Python's
    collector cannot see. Each test worker accumulates them (~20k operations per
    KerasHub model of the catalogue), and every later full collection walks them again,
    so the suite slowed down as it ran. Frozen objects are skipped by later collections;
    what is garbage is collected first, so nothing collectable is kept. Measured: ten
    catalogue backbones and one collecting test in one process, 125.5 s -> 95.8 s.
    """
    yield
    gc.collect()
    gc.freeze()
