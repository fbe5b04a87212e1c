"""Keras 3 layers of keras-noisecurve (any backend).

- ``GroupNorm``: group normalisation (Wu & He 2018) whose *second* derivatives are
  exact. Keras' ``GroupNormalization`` computes its variance with
  ``keras.ops.moments``, which on the TensorFlow backend is ``tf.nn.moments``:
  ``mean((x − stop_gradient(mean))²)``. First derivatives are unaffected (the
  deviations sum to 0), but Hessian-vector products through it miss the mean's path
  and are off by 1e-3 to 1e-2 relative (docs/spectrum.md, "The GroupNormalization
  pitfall"), which matters for the spectrum of a Hessian upper bound.
  ``GroupNorm`` takes the variance as the mean of squared deviations from the mean,
  with no stop-gradient.
- ``AdaptiveAveragePooling2D``: PyTorch's ``AdaptiveAvgPool2d`` (the paper's CNN
  pools its last feature map to 2×2 with it).

Both are registered for Keras serialization as ``keras_noisecurve>GroupNorm`` and
``keras_noisecurve>AdaptiveAveragePooling2D``, so saved ``.keras`` files load after
``import keras_noisecurve.apps.layers`` (``keras_noisecurve.apps.models`` imports it).
Importing this module also registers the ghost-norm rule of ``GroupNorm``, ``GROUP_NORM_RULE``
(a ``keras_noisecurve.training.LayerRule`` of kind ``"GroupNorm"``, made by
``keras_noisecurve.backend.common.layer_rules.group_norm_rule``: the group-normalisation kernel of
every backend, ``keras_noisecurve.backend.common.ghost_norm.grouped_norm``, for this class), so the per-layer engine clips it from ``(a, g)`` instead of with its
per-layer fallback. The module imports no framework: only the kernel of the backend in use is made.
"""

from __future__ import annotations

import math

import keras
from keras import ops

from keras_noisecurve import backend
from keras_noisecurve._validation import check_int
from keras_noisecurve.backend.common.layer_rules import group_norm_rule
from keras_noisecurve.training.rules import register_rule

__all__ = ["GROUP_NORM_RULE", "AdaptiveAveragePooling2D", "GroupNorm"]


@keras.saving.register_keras_serializable(package="keras_noisecurve")
class GroupNorm(keras.layers.Layer):
    """Group normalisation over the channel axis (channels last) with exact 2nd derivatives.

    ``y = (x − mean_g) / sqrt(var_g + epsilon) · gamma + beta``, where mean and
    variance are taken over the spatial axes and the channels of each group g
    (Wu & He 2018). Same parameters as ``keras.layers.GroupNormalization``:
    ``gamma`` and ``beta`` of shape (channels,). Input (batch, *spatial, channels)
    with static spatial and channel sizes → output of the same shape.

    Args:
      groups: number of groups; must divide the number of channels.
      epsilon: added to the variance.
    """

    def __init__(self, groups: int = 8, epsilon: float = 1e-5, **kwargs):
        super().__init__(**kwargs)
        self.groups = check_int("groups", groups, minimum=1)
        self.epsilon = float(epsilon)

    def build(self, input_shape):
        channels = input_shape[-1]
        if channels is None or channels % self.groups:
            raise ValueError(
                f"GroupNorm: groups ({self.groups}) must divide the number of channels ({channels})."
            )
        self.gamma = self.add_weight(name="gamma", shape=(channels,), initializer="ones")
        self.beta = self.add_weight(name="beta", shape=(channels,), initializer="zeros")

    def call(self, x):
        channels = x.shape[-1]
        spatial = tuple(x.shape[1:-1])
        grouped = ops.reshape(x, (-1, *spatial, self.groups, channels // self.groups))
        axes = tuple(range(1, len(spatial) + 1)) + (len(spatial) + 2,)
        mean = ops.mean(grouped, axis=axes, keepdims=True)
        centred = grouped - mean
        var = ops.mean(centred * centred, axis=axes, keepdims=True)
        normed = ops.reshape(centred / ops.sqrt(var + self.epsilon), (-1, *spatial, channels))
        return normed * self.gamma + self.beta

    def get_config(self):
        return {**super().get_config(), "groups": self.groups, "epsilon": self.epsilon}


@keras.saving.register_keras_serializable(package="keras_noisecurve")
class AdaptiveAveragePooling2D(keras.layers.Layer):
    """PyTorch's ``AdaptiveAvgPool2d`` for channels-last inputs of any static size.

    Output cell (i, j) of an ``(out_h, out_w)`` grid averages input rows
    ``floor(i·H/out_h) … ceil((i+1)·H/out_h) − 1`` and the analogous columns, so
    windows overlap when H is not a multiple of ``out_h`` (exactly PyTorch's rule).

    Input (batch, H, W, C) → output (batch, out_h, out_w, C).
    """

    def __init__(self, output_size=(2, 2), **kwargs):
        super().__init__(**kwargs)
        if isinstance(output_size, int):
            output_size = (output_size, output_size)
        self.output_size = tuple(check_int("output_size", s, minimum=1) for s in output_size)

    @staticmethod
    def _windows(size, out):
        return [(math.floor(i * size / out), math.ceil((i + 1) * size / out)) for i in range(out)]

    def call(self, x):
        height, width = x.shape[1], x.shape[2]
        if height is None or width is None:
            raise ValueError("AdaptiveAveragePooling2D needs static spatial dimensions.")
        rows = []
        for r0, r1 in self._windows(height, self.output_size[0]):
            cols = []
            for c0, c1 in self._windows(width, self.output_size[1]):
                cols.append(ops.mean(x[:, r0:r1, c0:c1, :], axis=(1, 2)))
            rows.append(ops.stack(cols, axis=1))
        return ops.stack(rows, axis=1)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], *self.output_size, input_shape[-1])

    def get_config(self):
        return {**super().get_config(), "output_size": self.output_size}


#: the ghost-norm rule of :class:`GroupNorm`, one kernel for every backend
#: (``backend.common.ghost_norm.grouped_norm`` for this class, made when the rule is registered)
GROUP_NORM_RULE = group_norm_rule("GroupNorm", GroupNorm)


if backend.supported():  # the layers themselves run on any backend
    register_rule(GROUP_NORM_RULE)
