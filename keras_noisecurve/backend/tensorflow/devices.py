"""TensorFlow's devices and logs: what the command line and the optimizers start with."""

from __future__ import annotations

import tensorflow as tf

__all__ = ["before_first_variable", "probe", "quiet_python_logs"]


def probe() -> None:
    """Let TensorFlow find its devices (the GPU drivers are probed, and complain, here)."""
    tf.config.list_physical_devices()


def quiet_python_logs() -> None:
    """Hold back TensorFlow's Python notices below errors (``vectorized_map``'s "uses a
    while_loop" notices are not progress)."""
    tf.get_logger().setLevel("ERROR")


def before_first_variable() -> None:
    """Probe the devices once, with TensorFlow's C++ start-up notices held back: the first
    variable an optimizer creates would otherwise print them ("failed call to cuInit" on a
    machine without a GPU reads like a crash)."""
    from keras_noisecurve._quiet import probe_devices_quietly

    probe_devices_quietly()
