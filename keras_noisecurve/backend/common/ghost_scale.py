"""Ghost-norm kernels of the layers that scale their input elementwise: RMS-type norms and
``PReLU``, one for every backend, in ``keras.ops`` (the contract of
:func:`~keras_noisecurve.backend.common.layer_rules.layer_kernel`). Shapes: P examples, d the
width of the last axis.

* RMS-type norms: a layer whose one weight w (d,) enters as ``y = u(x) ⊙ (α + w)`` along the last
  axis (α = 0 or 1) with ``u`` independent of w: Keras's RMSNormalization, KerasHub's Llama,
  Gemma, Mistral norms by class (:func:`rms_scale`, "RMS scale"), and any layer written the same
  way, recognised by probing its call once (:func:`computed_scale`, "RMSNorm (by computation)":
  KerasHub's Phi-3, Qwen, T5 norms, ``LayerNormalization(rms_scaling=True)`` inside a custom
  layer, ...). The probe is the backend's ``ghost.probe_affine_scale``: only running a layer
  eagerly inside a traced step differs between backends. Per step the slope is
  ``u = y(w = 1) − y(w = 0)``, two calls of the layer with its weight substituted
  (``keras.StatelessScope``, the variable keeps its value), exact for α = 0 or 1 (``2u − u``,
  ``u − 0``); example i's gradient of w is ``G_i = Σ_positions g_i ⊙ u_i`` (d,).
* ``keras.layers.PReLU``: ``y = relu(x) − α ⊙ relu(−x)``, ``∂y/∂α = min(x, 0)``; example i's
  gradient of α (one example's input shape, 1 on the shared axes) is ``Σ min(x_i, 0) ⊙ g_i`` over
  the shared axes and any extra leading position axes (a ``TimeDistributed`` wrapper's T axis).
"""

from __future__ import annotations

import keras
from keras import ops

from keras_noisecurve import backend
from keras_noisecurve.backend.common import affine_scale
from keras_noisecurve.backend.common.layer_rules import layer_kernel
from keras_noisecurve.backend.common.norm_forms import per_weight, sum_dtype

__all__ = ["computed_scale", "prelu", "rms_scale", "slope"]


def slope(layer, weight, call, x):
    """``u = ∂y/∂w`` (x's shape) of a layer computing ``y = u(x) ⊙ (α + w)`` (α = 0 or 1), as
    ``call(x)`` with ``weight`` read as ones minus with zeros (detached)."""
    ones = ops.ones(tuple(weight.shape), weight.dtype)
    outputs = []
    for value in (ones, ops.zeros_like(ones)):
        with keras.StatelessScope(state_mapping=[(weight, value)]):
            outputs.append(ops.cast(call(ops.stop_gradient(x)), sum_dtype(x)))
    return ops.stop_gradient(outputs[0] - outputs[1])


def _single_input(c):
    args, kwargs = c["args"] or ((c["a"],), {})
    return len(args) == 1 and not kwargs


def _scale_forward(layer, call, x, *args, **kwargs):
    weight = affine_scale.single_weight(layer)
    saved = {"slope": slope(layer, weight, lambda v: call(v, *args, **kwargs), x)}
    return call(x, *args, **kwargs), lambda z: (z, saved)


def _scale(layer, calls):
    weight = affine_scale.single_weight(layer)
    d = int(weight.shape[0])
    dtype = sum_dtype(calls[0]["g"])
    per = 0.0
    for c in calls:
        if c["saved"] is None and not _single_input(c):
            return None
        if c["a"].shape[-1] != d:
            return None
        u = c["saved"]["slope"] if c["saved"] else slope(layer, weight, layer.call, c["a"])
        per = per + ops.sum(ops.reshape(ops.cast(c["g"], dtype) * ops.cast(u, dtype), (ops.shape(c["g"])[0], -1, d)),
                            axis=1)
    return per_weight([(weight, per)])


def _last_axis(layer):
    axis = getattr(layer, "axis", -1)
    if list(axis if isinstance(axis, (list, tuple)) else [axis]) != [-1]:
        return f"normalises over axis {axis} (the kernel takes the last axis only)"
    return None


def _weight(layer):
    return [affine_scale.single_weight(layer)]


def _probed(layer) -> bool:
    return backend.module("ghost").probe_affine_scale(layer)


def _known(layer) -> bool:
    return affine_scale.known_rms_norm(layer) and affine_scale.single_weight(layer) is not None


rms_scale = layer_kernel(matches=_known, names=tuple(name.rsplit(".", 1)[-1] for _, name in affine_scale.KNOWN_RMS_NORMS),
                         weights=_weight, forward=_scale_forward, check=_last_axis)(_scale)
rms_scale.__name__ = rms_scale.__qualname__ = "rms_scale"
rms_scale.__doc__ = """An RMS norm known by class normalising the last axis (Keras's RMSNormalization, KerasHub's
Llama, Gemma, Mistral norms): ``G_i = Σ_positions g_i ⊙ u_i`` with the slope ``u = y(w=1) − y(w=0)``."""

computed_scale = layer_kernel(matches=_probed, weights=_weight, forward=_scale_forward)(_scale)
computed_scale.__name__ = computed_scale.__qualname__ = "computed_scale"
computed_scale.__doc__ = """Any layer whose only weight w (d,) enters as ``y = u(x) ⊙ (α + w)`` (α = 0 or 1),
recognised by probing its call once before training (RMS norms under any class name: Qwen, Qwen3,
Phi-3, T5): ``G_i = Σ_positions g_i ⊙ u_i`` with the slope ``u = y(w=1) − y(w=0)``."""


@layer_kernel(keras.layers.PReLU, weights=("alpha",))
def prelu(layer, calls):
    """``keras.layers.PReLU``: ``y = relu(x) − α ⊙ relu(−x)``, example i's gradient of α
    ``Σ min(x_i, 0) ⊙ g_i`` over the shared axes (and any extra leading position axes)."""
    shape = [int(n) for n in layer.alpha.shape]
    dtype = sum_dtype(calls[0]["g"])
    per = 0.0
    for c in calls:
        t = ops.cast(c["g"], dtype) * ops.minimum(ops.cast(c["a"], dtype), 0.0)  # (P, [T, …,] *input_shape)
        extra = len(t.shape) - 1 - len(shape)
        if extra < 0:
            return None
        if extra > 0:  # leading position axes before one example's input axes
            t = ops.sum(t, axis=tuple(range(1, 1 + extra)))
        shared = tuple(k + 1 for k, n in enumerate(shape) if n == 1 and t.shape[k + 1] != 1)
        if shared:
            t = ops.sum(t, axis=shared, keepdims=True)
        per = per + t
    return per_weight([(layer.alpha, per)])
