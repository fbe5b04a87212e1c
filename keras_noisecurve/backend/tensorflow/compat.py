"""The TensorFlow internals this library reads, in one place (as ``keras_noisecurve._compat``
holds Keras's): each with a fallback when a TensorFlow version lacks it."""

from __future__ import annotations

import tensorflow as tf

__all__ = ["in_xla_context"]


def in_xla_context() -> bool:
    """Whether the graph being built is compiled by XLA (``jit_compile=True``); True when
    TensorFlow's test is unavailable (the conservative answer for its callers)."""
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - a TensorFlow without the module
        return True
    if tf.executing_eagerly():
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
