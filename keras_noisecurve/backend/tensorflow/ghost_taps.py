"""Per-example depthwise kernel gradients where TensorFlow's own filter gradient is slow.

Two exact forms, for small maps and 5×5 kernels (measured in docs/performance.md):
:func:`correlation_example_grads` (one depthwise convolution, any map of 2×2 output
positions or more) and :func:`tap_example_grads` (one slice of the input per live kernel
tap, for the smallest maps, where most taps only read padding).

A depthwise kernel (*k, C, M) has, per example i, channel c, tap t and multiplier m, the
gradient ``∂W_i[c, t, m] = Σ_l a_pad[i, l·s + t·d, c] · g_i[l, c·M + m]``: a product of
the output gradient with the input shifted by the tap (``s`` the strides, ``d`` the
dilation, ``a_pad`` the input zero-padded as the layer). Taking the K shifted slices
directly costs P·L·C·K·M multiply-adds and never forms the windows (K times the input);
taps that only ever read padding (most of a 5×5 ``same`` kernel on a 2×2 or 1×1 map) are
exactly zero and are skipped. :mod:`keras_noisecurve.backend.tensorflow.ghost_conv_kinds` uses this
form for depthwise and separable layers where TensorFlow's own depthwise filter gradient
is slow (small maps, 5×5 kernels; measured in docs/performance.md).
"""

from __future__ import annotations

import tensorflow as tf

from keras_noisecurve.backend.common.geometry import explicit_padding, live_taps

from keras_noisecurve.backend.tensorflow.ghost_forms import per_example_sq, weighted_sum


#: output positions up to which :func:`tap_example_grads` stacks the taps' slices (measured:
#: docs/performance.md, "Depthwise, separable, grouped, 3-D and transposed convolutions")
TAPS_STACKED_POSITIONS = 16


def window_geometry(n, out, k, s, d, padding):
    """(pad_before, pad_after, live taps) of one spatial axis of a convolution: input size
    ``n``, output size ``out``, kernel ``k``, stride ``s``, dilation ``d``, TensorFlow's
    ``"same"``/``"valid"`` padding. Tap j reads padded index o·s + j·d; it is *live* when
    some output position o reads an input entry (not padding) through it."""
    before, after = explicit_padding(n, out, k, s, d, padding)
    return before, max(after, 0), live_taps(n, out, k, s, d, before)


def _check_pair(name, a, g, kernel_size, padding) -> int:
    """The kernel's rank (1 or 2), after checking that ``a`` and ``g`` are (P, *spatial, C)
    of that rank with static spatial sizes and that ``padding`` is TensorFlow's."""
    rank = len(kernel_size)
    if rank not in (1, 2) or a.shape.rank != rank + 2 or g.shape.rank != rank + 2:
        raise ValueError(f"{name} takes rank-1 or rank-2 inputs (P, *spatial, C) with a kernel of the same rank; "
                         f"got a {a.shape}, g {g.shape}, kernel_size={tuple(kernel_size)}")
    if padding not in ("same", "valid"):
        raise ValueError(f"padding must be 'same' or 'valid', got {padding!r}")
    if not (a.shape[1:-1].is_fully_defined() and g.shape[1:-1].is_fully_defined()):
        raise ValueError(f"{name} needs static spatial sizes, got a {a.shape}, g {g.shape}")
    return rank


def tap_example_grads(a, g, *, kernel_size, strides, dilation_rate, padding, multiplier):
    """Per-example depthwise kernel gradients at the live taps, one slice per tap.

    ``a`` (P, *spatial, C) channels-last input (rank 1 or 2, static spatial sizes),
    ``g`` (P, *spatial', C·M) the output gradient, ``multiplier`` = M. Tap
    t = (j_h, j_w) of the kernel sees the input shifted by t·dilation and taken at the
    layer's strides (zero padding as TensorFlow's ``padding``), so

        ∂W_i[c, t, m] = Σ_l a_pad[i, l·s + t·d, c] · g_i[l, c·M + m]

    (P·L·C·K·M multiply-adds, no windows formed). A tap that reads only padding at every
    output position has a zero gradient and is not computed (a 5×5 ``same`` kernel on a
    1×1 map has one live tap). Strided layers take the taps from the input split into its
    stride phases (one transpose), so that every tap is a contiguous slice.

    On maps of at most :data:`TAPS_STACKED_POSITIONS` output positions the slices are
    stacked and multiplied in one op (fewer, larger ops); on larger maps one product per tap
    (no copy of K times the input).

    Returns ``(per_example, live)``: per_example (P, T, C, M) for the T live taps and
    ``live`` their flat indices (row-major in the kernel's spatial axes) among the K taps.
    """
    rank = _check_pair("tap_example_grads", a, g, kernel_size, padding)
    if g.shape[-1] != a.shape[-1] * multiplier:
        raise ValueError(f"g must have C·M = {a.shape[-1]}·{multiplier} channels, got {g.shape[-1]}")
    ks, st, dr = list(kernel_size), list(strides), list(dilation_rate)
    if rank == 1:
        a, g, ks, st, dr = a[:, None], g[:, None], [1, *ks], [1, *st], [1, *dr]
    c = a.shape[-1]
    (oh, ow), p = g.shape[1:3], tf.shape(a)[0]
    geometry = [window_geometry(n, o, k, s, d, padding)
                for n, o, k, s, d in zip(a.shape[1:3], (oh, ow), ks, st, dr)]
    # pad to the windows' extent, then up to a multiple of the stride, and split each
    # axis into (block, phase): padded index b·s + r
    pads, blocks = [], []
    for (before, after, _), n, s in zip(geometry, a.shape[1:3], st):
        size = before + n + after
        blocks.append(-(-size // s))
        pads.append([before, blocks[-1] * s - size + after])
    a = tf.pad(a, [[0, 0], *pads, [0, 0]])
    if max(st) > 1:
        a = tf.reshape(a, [p, blocks[0], st[0], blocks[1], st[1], c])
        a = tf.transpose(a, [2, 4, 0, 1, 3, 5])  # (s_h, s_w, P, blocks_h, blocks_w, C)
    xs, live = [], []
    for jh in geometry[0][2]:
        for jw in geometry[1][2]:
            (bh, rh), (bw, rw) = divmod(jh * dr[0], st[0]), divmod(jw * dr[1], st[1])
            xs.append(a[rh, rw, :, bh : bh + oh, bw : bw + ow] if max(st) > 1 else a[:, bh : bh + oh, bw : bw + ow])
            live.append(jh * ks[1] + jw)
    y = g if multiplier == 1 else tf.reshape(g, [p, oh, ow, c, multiplier])

    def spread(x):  # x (…, C) against y's (C, M) when M > 1
        return x if multiplier == 1 else x[..., None]

    if oh * ow <= TAPS_STACKED_POSITIONS:  # small maps: one product over all taps at once
        per_example = tf.reduce_sum(spread(tf.stack(xs, axis=1)) * y[:, None], axis=[2, 3])
    else:  # one product per tap: no (P, T, H', W', C) copy
        per_example = tf.stack([tf.reduce_sum(spread(x) * y, axis=[1, 2]) for x in xs], axis=1)
    return (per_example if multiplier > 1 else per_example[..., None]), live  # (P, T, C, M)


def correlation_example_grads(a, g, *, kernel_size, strides, padding) -> tf.Tensor:
    """Per-example depthwise kernel gradients (P, K, C) of a depth-multiplier-1 layer with
    dilation 1, as ONE forward depthwise convolution.

    ``a`` (P, *spatial, C) channels-last input (rank 1 or 2, static spatial sizes), ``g``
    (P, *spatial', C) the output gradient. The gradient at tap t,

        ∂W_i[t, c] = Σ_l a_pad[i, l·s + t, c] · g_i[l, c],

    is the correlation of the padded input with the output gradient taken at rate ``s``
    (the strides): a depthwise convolution ("valid", dilation s) of the batch-1 image
    whose P·C channels are the (example, channel) pairs, with g as a per-channel filter of
    the output's spatial size. Its output has exactly the kernel's K taps (the input is
    padded as the layer pads it and cut to the windows' extent), with no cross-example
    terms. P·K·L·C multiply-adds in one vectorised kernel, against one op per tap for
    :func:`tap_example_grads` and the (slow on small maps) depthwise filter gradient.
    """
    rank = _check_pair("correlation_example_grads", a, g, kernel_size, padding)
    if g.shape[-1] != a.shape[-1]:
        raise ValueError(f"g must have the C = {a.shape[-1]} channels of a (depth multiplier 1), got {g.shape[-1]}")
    ks, st = list(kernel_size), list(strides)
    if rank == 1:
        a, g, ks, st = a[:, None], g[:, None], [1, *ks], [1, *st]
    p, c, out = tf.shape(a)[0], a.shape[-1], g.shape[1:3]
    pads, extents = [], []
    for n, o, k, s in zip(a.shape[1:3], out, ks, st):
        before, after, _ = window_geometry(n, o, k, s, 1, padding)
        pads.append([before, after])
        extents.append((o - 1) * s + k)
    a = tf.pad(a, [[0, 0], *pads, [0, 0]])[:, : extents[0], : extents[1]]
    image = tf.reshape(tf.transpose(a, [1, 2, 0, 3]), [1, *extents, p * c])
    taps_filter = tf.reshape(tf.transpose(g, [1, 2, 0, 3]), [*out, p * c, 1])
    rates = st if max(st) > 1 else None
    corr = tf.nn.depthwise_conv2d(image, taps_filter, strides=[1, 1, 1, 1], padding="VALID", dilations=rates)
    return tf.transpose(tf.reshape(corr, [ks[0] * ks[1], p, c]), [1, 0, 2])  # (P, K, C)


class LiveTapGrads:
    """Per-example depthwise gradients at the live taps, in the interface of
    :class:`~keras_noisecurve.backend.tensorflow.ghost_conv_kinds.GroupedGrads`.

    ``calls``: one ``(per_example (P, T, C, M), live)`` pair per call of the layer
    (:func:`tap_example_grads`), ``taps`` = K. A shared layer's calls are summed over all
    K taps (each call's dead taps as zero rows). ``sq_norms`` reads the live taps only;
    ``weighted_sum`` scatters the clipped sum to (C, K, M), zero at the dead taps.
    """

    def __init__(self, calls, taps):
        if len(calls) == 1:
            self.per_example, self.live = calls[0]
        else:
            self.per_example, self.live = 0.0, list(range(taps))
            for per_example, live in calls:
                padded = tf.concat([per_example, tf.zeros_like(per_example[:, :1])], axis=1)
                self.per_example += tf.gather(padded, [live.index(t) if t in live else len(live) for t in range(taps)],
                                              axis=1)
        self.taps = taps

    def sq_norms(self) -> tf.Tensor:
        """(P,): Σ_c ‖∂W_i[c]‖²_F."""
        return per_example_sq(self.per_example)

    def weighted_sum(self, scale) -> tf.Tensor:
        """(C, K, M): ``Σ_i scale_i ∂W_i``; rows with ``scale_i = 0`` contribute exactly 0."""
        summed = weighted_sum(self.per_example, scale)  # (T, C, M)
        if len(self.live) != self.taps:
            summed = tf.scatter_nd([[t] for t in self.live], summed, [self.taps, *summed.shape[1:]])
        return tf.transpose(summed, [1, 0, 2])


__all__ = ["TAPS_STACKED_POSITIONS", "LiveTapGrads", "correlation_example_grads", "tap_example_grads", "window_geometry"]
