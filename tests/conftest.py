"""Test configuration shared by the whole suite.

Keras runs on TensorFlow; the CPU is split into two logical devices (before
TensorFlow initialises) so ``tf.distribute.MirroredStrategy`` can be tested on a
machine without accelerators.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def pytest_configure(config):
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
