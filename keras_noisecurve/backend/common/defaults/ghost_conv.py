"""The framework's part of the convolution kernels (``backend.common.ghost_conv``), in
``keras.ops``, for a backend whose ``keras.ops.conv`` takes feature groups with any strides and
dilation (JAX's does; its engine runs the kernels at full float32 precision, so the one-hot and
filter-gradient convolutions below are exact).

All arrays channels last; ``kernel_size``, ``strides``, ``dilation_rate`` and ``padding``
(``"valid"``, ``"same"``, ``"causal"``) as the layer's.
"""

from __future__ import annotations

import math

import numpy as np
from keras import ops

from keras_noisecurve.backend.common.geometry import explicit_padding
from keras_noisecurve.backend.common.norm_forms import ExampleGrads

__all__ = ["example_grads", "refusal", "window_patches"]


def _padded(a, out_shape, kernel_size, strides, dilation_rate, padding):
    """``a`` (P, *N, C) padded as the layer pads it and cut to the extent its windows read."""
    sizes = a.shape[1:-1]
    pads = [explicit_padding(n, o, k, s, d, padding)
            for n, o, k, s, d in zip(sizes, out_shape, kernel_size, strides, dilation_rate)]
    a = ops.pad(a, [(0, 0), *((b, max(e, 0)) for b, e in pads), (0, 0)])
    return a[(slice(None), *(slice(0, n + b + e) for n, (b, e) in zip(sizes, pads)), slice(None))]


def window_patches(a, *, out_shape, kernel_size, strides, dilation_rate, padding):
    """The windows of the convolution of ``a`` (P, *N, C), rank 1, 2 or 3, with ``out_shape`` the
    output's spatial sizes: (P, L, K, C), ``[i, l, t, c] = a_pad[i, l·s + t·d, c]`` (L positions and
    K taps row-major). ONE convolution with a one-hot kernel and C feature groups."""
    taps, channels = math.prod(kernel_size), a.shape[-1]
    eye = np.tile(np.eye(taps, dtype=np.float32).reshape(*kernel_size, 1, taps), channels)  # (*k, 1, C·K)
    windows = ops.conv(_padded(a, out_shape, kernel_size, strides, dilation_rate, padding),
                       ops.cast(eye, a.dtype), strides=strides, padding="valid", data_format="channels_last",
                       dilation_rate=dilation_rate)
    windows = ops.reshape(windows, (ops.shape(a)[0], -1, channels, taps))
    return ops.transpose(windows, (0, 1, 3, 2))


def example_grads(pairs, *, kernel_size, strides, dilation_rate, padding, groups, materialise):
    """Per-example kernel gradients of a convolution in ``groups`` groups, summed over the calls
    ``pairs`` [(a (P, *N, C), g (P, *N', F))], when ``materialise`` (else ``None``: the caller's
    Gram form): an object with ``sq_norms()`` (P,) and ``weighted_sum(c, keep)`` (G, K·C/G, F/G),
    features (tap, channel).

    Per call, ONE convolution with the (example, group) pairs as its feature groups and no
    windows: the input as (C/G, *N, P·G), the output gradient as the filter (*N', 1, P·G·F/G),
    window strides the layer's dilation, filter dilation the layer's strides, on the input padded
    as the layer pads it; the output (C/G, *K, P·G·F/G) has every example's filter gradient.
    """
    if not materialise:
        return None
    total = 0.0
    for a, g in pairs:
        rank, p = len(kernel_size), a.shape[0]
        c, o = a.shape[-1] // groups, g.shape[-1] // groups
        a = _padded(a, g.shape[1:-1], kernel_size, strides, dilation_rate, padding)
        lhs = ops.reshape(a, (p, *a.shape[1:-1], groups, c))
        lhs = ops.reshape(ops.transpose(lhs, (rank + 2, *range(1, rank + 1), 0, rank + 1)), (c, *a.shape[1:-1], -1))
        rhs = ops.reshape(ops.transpose(g, (*range(1, rank + 1), 0, rank + 1)), (*g.shape[1:-1], 1, -1))
        grads = ops.conv(lhs, rhs, strides=dilation_rate, padding="valid", data_format="channels_last",
                         dilation_rate=strides)
        grads = ops.reshape(grads, (c, math.prod(kernel_size), p, groups, o))  # (c, t, i, γ, o)
        total = total + ops.reshape(ops.transpose(grads, (2, 3, 1, 0, 4)), (p, groups, -1, o))
    return ExampleGrads(total)


def refusal(layer):
    """Nothing is refused here: ``None``."""
    return None
