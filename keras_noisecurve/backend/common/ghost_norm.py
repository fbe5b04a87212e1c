"""Ghost-norm kernels of the per-example normalisation layers (scale ``gamma``, offset ``beta``),
one for every backend, in ``keras.ops`` (the contract of
:func:`~keras_noisecurve.backend.common.layer_rules.layer_kernel`).

Per example i the gradients are ``Σ_positions x̂_i ⊙ g_i`` (gamma) and ``Σ_positions g_i`` (beta),
per parameter entry, with x̂ the normalised input.

* ``keras.layers.LayerNormalization`` over any axes but the examples' (``rms_scaling`` too):
  x̂ from :func:`~keras_noisecurve.backend.common.norm_forms.layer_norm_hat`.
* ``keras.layers.GroupNormalization`` (and a class of one's own computing the same,
  :func:`grouped_norm`): groups of channels along ``axis``, mean and variance over the positions
  and each group's channels. With ``μ``, ``inv = 1/√(var + ε)`` per example and group, example i's
  gamma gradient for channel c of group k is ``inv_k·(Σ_s g_sc x_sc − μ_k·Σ_s g_sc)`` (s: the
  positions): x̂ is never formed.

The engines run the ``forward`` of each kernel in place of the layer's call: it computes the
layer's output from the same statistics (``x̂·γ + β``; for a group norm ``x·s + t`` with
``s = γ·inv``, ``t = β − μ·s``, two passes over x as Keras's own layer) and saves them; where it did
not run (rows merged per user) the kernel computes them from the recorded input.
"""

from __future__ import annotations

import functools

import keras
from keras import ops

from keras_noisecurve.backend.common.layer_rules import layer_kernel
from keras_noisecurve.backend.common.norm_forms import layer_norm_hat, per_weight, scale_offset_grads, sum_dtype

__all__ = ["group_norm", "grouped_norm", "layer_norm"]


def _compute(x):
    """``x`` as float64 if it is, else float32 (the dtype the statistics are computed in)."""
    return ops.cast(x, "float64" if keras.backend.standardize_dtype(x.dtype) == "float64" else "float32")


def _axes(layer, rank):
    axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    return sorted(a % rank for a in axes)


def _layer_norm_check(layer):
    axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    return "normalises over the example axis 0 (mixes examples)" if any(a == 0 for a in axes) else None


def _examples_apart(layer, axes):
    """Refuse (``ValueError``, naming the layer) statistics over the example axis, e.g. a negative
    ``axis`` that is axis 0 of the input's rank."""
    if 0 in axes:
        raise ValueError(f"{type(layer).__name__} layer '{layer.name}' normalises over the example axis 0 (axis="
                         f"{layer.axis}): it mixes the examples of a batch, and per-example gradients are not defined")


def _layer_norm_forward(layer, call, x, *args, **kwargs):
    _examples_apart(layer, _axes(layer, len(x.shape)))
    x_hat = layer_norm_hat(_compute(x), _axes(layer, len(x.shape)), layer.epsilon, rms=layer.rms_scaling)
    shape = [1] * len(x.shape)
    for axis in _axes(layer, len(x.shape)):
        shape[axis] = -1 if x.shape[axis] is None else x.shape[axis]
    out = x_hat
    if layer.gamma is not None:
        out = out * ops.reshape(ops.cast(layer.gamma, x_hat.dtype), shape)
    if layer.beta is not None:
        out = out + ops.reshape(ops.cast(layer.beta, x_hat.dtype), shape)
    saved = {"x_hat": x_hat}
    return ops.cast(out, layer.compute_dtype), lambda z: (z, saved)


@layer_kernel(keras.layers.LayerNormalization, weights=("gamma", "beta"), forward=_layer_norm_forward,
              check=_layer_norm_check)
def layer_norm(layer, calls):
    """``keras.layers.LayerNormalization`` (also ``rms_scaling=True``)."""
    dtype = sum_dtype(calls[0]["g"])
    gammas, betas = [], []
    for c in calls:
        rank = len(c["a"].shape)
        _examples_apart(layer, _axes(layer, rank))
        x_hat = c["saved"]["x_hat"] if c["saved"] else layer_norm_hat(
            _compute(c["a"]), _axes(layer, rank), layer.epsilon, rms=layer.rms_scaling)
        gamma, beta = scale_offset_grads(ops.cast(x_hat, dtype), ops.cast(c["g"], dtype), _axes(layer, rank))
        gammas.append(gamma)
        betas.append(beta)
    per = [(w, sum(parts)) for w, parts in ((layer.gamma, gammas), (layer.beta, betas)) if w is not None]
    return per_weight(per)


def _group_stats(layer, x):
    """``x`` (P, ..., C), channels last → grouped (P, ..., G, C/G), mean and inv (P, 1…1, G, 1)."""
    grouped = ops.reshape(x, (-1, *ops.shape(x)[1:-1], layer.groups, x.shape[-1] // layer.groups))
    axes = (*range(1, len(x.shape) - 1), len(x.shape))
    mean, variance = ops.moments(grouped, axes=axes, keepdims=True)
    return grouped, mean, ops.rsqrt(variance + layer.epsilon)


def _channel_axis(layer, rank):
    return getattr(layer, "axis", -1) % rank


def _move(x, source, target):
    """``ops.moveaxis``, and ``x`` itself when the axis stays (no transpose pass)."""
    rank = len(x.shape)
    return x if source % rank == target % rank else ops.moveaxis(x, source, target)


def _group_norm_check(layer):
    return "groups along the example axis 0 (mixes examples)" if getattr(layer, "axis", -1) == 0 else None


def _group_norm_forward(layer, call, x, *args, **kwargs):
    axis = _channel_axis(layer, len(x.shape))
    _examples_apart(layer, [axis])
    moved = _move(_compute(x), axis, -1)
    grouped, mean, inv = _group_stats(layer, moved)
    groups, width = grouped.shape[-2], grouped.shape[-1]
    scale = inv if layer.gamma is None else inv * ops.reshape(ops.cast(layer.gamma, inv.dtype), (groups, width))
    shift = -mean * scale
    if layer.beta is not None:
        shift = shift + ops.reshape(ops.cast(layer.beta, inv.dtype), (groups, width))
    out = _move(ops.reshape(grouped * scale + shift, ops.shape(moved)), -1, axis)
    saved = {"grouped": grouped, "mean": mean, "inv": inv}
    return ops.cast(out, layer.compute_dtype), lambda z: (z, saved)


def _group_norm(layer, calls):
    dtype = sum_dtype(calls[0]["g"])
    gammas, betas = [], []
    for c in calls:
        axis = _channel_axis(layer, len(c["a"].shape))
        _examples_apart(layer, [axis])
        saved = c["saved"] or dict(zip(("grouped", "mean", "inv"),
                                       _group_stats(layer, _move(_compute(c["a"]), axis, -1))))
        x = ops.cast(saved["grouped"], dtype)
        g = ops.reshape(_move(ops.cast(c["g"], dtype), axis, -1), ops.shape(x))
        positions = tuple(range(1, len(x.shape) - 2))
        g_sum = ops.sum(g, axis=positions) if positions else g  # (P, G, C/G)
        betas.append(g_sum)
        if layer.gamma is not None:
            gx = ops.sum(g * x, axis=positions) if positions else g * x
            mean = ops.reshape(ops.cast(saved["mean"], dtype), (-1, x.shape[-2], 1))
            inv = ops.reshape(ops.cast(saved["inv"], dtype), (-1, x.shape[-2], 1))
            gammas.append(inv * (gx - mean * g_sum))
    per = [(w, ops.reshape(sum(parts), (-1, w.shape[0]))) for w, parts in ((layer.gamma, gammas), (layer.beta, betas))
           if w is not None]
    return per_weight(per)


@functools.lru_cache(maxsize=None)
def grouped_norm(cls):
    """The kernel of a group normalisation layer class ``cls`` of one's own that computes as
    ``keras.layers.GroupNormalization``: attributes ``groups``, ``epsilon``, ``gamma`` and ``beta``
    (per channel, either ``None``), channels along ``axis`` (the last when the layer has none), mean
    and variance over the positions and each group's channels (one kernel per class). Exact type
    only: a subclass may change the statistics without overriding ``call`` (Keras's
    GroupNormalization computes in helper methods)."""
    kernel = layer_kernel(matches=lambda layer: type(layer) is cls, names=(cls.__name__,), weights=("gamma", "beta"),
                          forward=_group_norm_forward, check=_group_norm_check)(_group_norm)
    kernel.__name__ = kernel.__qualname__ = f"{cls.__name__.lower()}_norm"
    kernel.__doc__ = f"{cls.__name__}: gamma ``Σ_s x̂_s ⊙ g_s``, beta ``Σ_s g_s`` (s: positions), per channel."
    return kernel


group_norm = grouped_norm(keras.layers.GroupNormalization)
group_norm.__name__ = group_norm.__qualname__ = "group_norm"
group_norm.__doc__ = "``keras.layers.GroupNormalization`` (groups along ``axis``, one gamma per channel)."
