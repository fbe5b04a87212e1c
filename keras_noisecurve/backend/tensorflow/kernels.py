"""Which formulations the current TensorFlow kernels execute.

Some fast formulations of a per-example computation rely on kernels that only part
of TensorFlow's builds run. The one that matters here: a *grouped*
``Conv2DBackpropFilter`` (input channels a multiple of the filter's input
channels) runs through oneDNN on CPUs (turned on by default only on CPUs with
neural-network instructions, or by ``TF_ENABLE_ONEDNN_OPTS=1``) and through cuDNN on
GPUs, but TensorFlow's plain Eigen CPU kernel refuses it ("filter_size does not have
enough elements"). Code that would use such a kernel asks here first and takes a
portable formulation where the answer is no.

Each question is answered once per process, device type and dtype, by running the
kernel on a tiny input eagerly (outside any ``tf.function`` being traced); the
answer is cached. The oneDNN switch is read by TensorFlow at start-up, so it cannot
change within a process.
"""

from __future__ import annotations

import functools

import tensorflow as tf


def device_type(tensor=None) -> str:
    """The device type (``"CPU"``, ``"GPU"``, ...) ``tensor``'s ops are placed on.

    Uses the tensor's requested device when it names one (e.g. under
    ``tf.distribute``), else the device type TensorFlow places new ops on by default
    (the first GPU if there is one).
    """
    requested = getattr(tensor, "device", "") or ""
    if requested:
        kind = tf.DeviceSpec.from_string(requested).device_type
        if kind:
            return kind.upper()
    return "GPU" if tf.config.list_logical_devices("GPU") else "CPU"


@functools.lru_cache(maxsize=None)
def grouped_conv_filter_gradient_runs(device: str, dtype: str) -> bool:
    """Whether a grouped ``Conv2DBackpropFilter`` runs on ``device`` (a type) in ``dtype``.

    Probes input (1, 2, 2, 2·2) against a filter (1, 1, 2, 2·3), i.e. 2 groups,
    and checks the result against the two ungrouped gradients it must equal.
    Args: ``device``: device type, e.g. ``"CPU"``; ``dtype``: a float dtype name.
    """
    dt = tf.as_dtype(dtype)
    with tf.init_scope(), tf.device(f"/{device}:0"):
        a = tf.reshape(tf.range(16, dtype=dt), [1, 2, 2, 4])
        g = tf.reshape(tf.range(24, dtype=dt) / 7, [1, 2, 2, 6])
        try:
            grouped = tf.compat.v1.nn.conv2d_backprop_filter(
                a, [1, 1, 2, 6], g, strides=[1, 1, 1, 1], padding="VALID"
            )
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError, tf.errors.NotFoundError):
            return False
        want = tf.concat(
            [
                tf.compat.v1.nn.conv2d_backprop_filter(
                    a[..., 2 * k : 2 * k + 2], [1, 1, 2, 3], g[..., 3 * k : 3 * k + 3],
                    strides=[1, 1, 1, 1], padding="VALID",
                )
                for k in range(2)
            ],
            axis=-1,
        )
        return bool(tf.reduce_all(tf.abs(grouped - want) <= 1e-4 * (1.0 + tf.abs(want))))
