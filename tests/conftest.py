"""Test configuration shared by the whole suite.

Keras runs on TensorFlow; the CPU is split into two logical devices (before
TensorFlow initialises) so ``tf.distribute.MirroredStrategy`` can be tested on a
machine without accelerators.
"""

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
