"""The convolution kernels' part that needs TensorFlow (the seam module ``ghost_conv``; the
kernels themselves are ``keras_noisecurve.backend.common.ghost_conv``, one for every backend).

Why TensorFlow has its own (``backend.common.defaults.ghost_conv`` is the ``keras.ops`` one):

* the default forms per-example filter gradients as ONE convolution with the (example, group)
  pairs as feature groups, at window strides = the layer's dilation and filter dilation = its
  strides; TensorFlow's CPU kernels run grouped convolutions only with oneDNN, and refuse strides
  and dilation both > 1. Here they are ``Conv2DBackpropFilter``/``Conv3DBackpropFilterV2`` per
  example, or one grouped call per chunk of examples where that kernel runs
  (:func:`conv_chunk`), and TensorFlow's depthwise filter gradient, a correlation or one slice
  per live tap for depthwise kernels (measured: docs/performance.md);
* for a depthwise kernel on small maps or with 5×5 taps, TensorFlow's own depthwise filter
  gradient is slow: one depthwise convolution of the input with the output gradient
  (:func:`correlation_example_grads`, any map of 2×2 output positions or more) or one slice of
  the input per live tap (:func:`tap_example_grads`, the smallest maps, where most taps only read
  padding: ``∂W_i[c, t, m] = Σ_l a_pad[i, l·s + t·d, c]·g_i[l, c·M + m]``, P·L·C·K·M
  multiply-adds, no windows, the taps that read only padding skipped as the exact zeros they are);
* the windows are ``tf.image.extract_patches`` / ``tf.extract_volume_patches`` (or, under 8
  channels, a faster convolution with a one-hot kernel), not a grouped convolution;
* ``refusal``: 3-D windows with dilation (``tf.extract_volume_patches`` has no rates), and a
  grouped or 3-D channels-first convolution on CPU (Keras runs it through XLA, where the bias is
  added over another axis than the layer's definition).

Arrays channels last; ``kernel_size``, ``strides``, ``dilation_rate``, ``padding``
(``"valid"``/``"same"``/``"causal"``) as the layer's.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from keras_noisecurve.backend.common.geometry import explicit_padding, live_taps
from keras_noisecurve.backend.common.norm_forms import ExampleGrads
from keras_noisecurve.backend.tensorflow import kernels as _kernels
from keras_noisecurve.backend.tensorflow.engine_forms import dims, per_example_sq, weighted_sum

#: the seam module's names (those of ``backend.common.defaults.ghost_conv``); the kernels below them
#: (``conv_example_grads``, ``example_grads_3d``, ``patches``, ``conv_chunk``) are this module's own
__all__ = ["example_grads", "refusal", "window_patches"]


#: examples per grouped Conv2DBackpropFilter in :func:`conv_example_grads` where that kernel
#: runs (chosen by measurement: docs/performance.md, "Measurements behind design choices").
CONV_CHUNK = 16


def conv_chunk(dtype, device: str | None = None) -> int:
    """Examples per ``Conv2DBackpropFilter`` call that :func:`conv_sq_norms` uses by default.

    :data:`CONV_CHUNK` where a grouped ``Conv2DBackpropFilter`` runs on ``device``
    (a device type; default: where new ops go) in ``dtype`` (oneDNN CPU kernels,
    cuDNN), else 1: one example per plain ``Conv2DBackpropFilter``, the kernel of
    every ordinary backward pass, which runs wherever TensorFlow runs (Eigen CPU
    kernels, float64). Probed once per device type and dtype
    (:mod:`keras_noisecurve.backend.tensorflow.kernels`).
    """
    device = device or _kernels.device_type()
    grouped = _kernels.grouped_conv_filter_gradient_runs(device, tf.as_dtype(dtype).name)
    return CONV_CHUNK if grouped else 1


class ExampleKernelGrads:
    """Per-example kernel gradients of a 2-D convolution, in the layout they are made.

    ``blocks`` (n, k_h·k_w·c_in, chunk, c_out): example ``i`` is column ``i mod chunk``
    of block ``i // chunk`` (the last block zero-padded past ``examples``); its
    kernel gradient, reshaped to (k_h, k_w, c_in, c_out), is ``blocks[i // chunk, :, i mod chunk, :]``
    summed over the layer's calls. Kept in this layout (no transpose) for
    :meth:`sq_norms` and :meth:`weighted_sum`.
    """

    def __init__(self, blocks, examples):
        self.blocks = blocks
        self.examples = examples  # P, a Python int or a scalar tensor

    def sq_norms(self) -> tf.Tensor:
        """(P,): ‖∂K_i‖²_F per example."""
        return tf.reshape(tf.reduce_sum(tf.square(self.blocks), axis=[1, 3]), [-1])[: self.examples]

    def weighted_sum(self, scale, keep=None) -> tf.Tensor:
        """(1, k_h·k_w·c_in, c_out): ``Σ_i scale_i ∂K_i`` for ``scale`` (P,); an example with
        ``scale_i = 0`` (the dropped ones, ``keep`` false) contributes exactly 0 even when its
        ``∂K_i`` is not finite."""
        n, chunk = tf.shape(self.blocks)[0], self.blocks.shape[2]
        scale = tf.reshape(tf.pad(scale, [[0, n * chunk - tf.shape(scale)[0]]]), [n, chunk])
        keep = tf.not_equal(scale, tf.zeros_like(scale))
        blocks = tf.cond(  # no pass over the blocks when no example is dropped
            tf.reduce_all(keep),
            lambda: tf.identity(self.blocks),
            lambda: tf.where(keep[:, None, :, None], self.blocks, tf.zeros_like(self.blocks)),
        )
        return tf.einsum("nkcm,nc->km", blocks, tf.cast(scale, self.blocks.dtype))[None]


def _check_chunk(chunk, dtype, device):
    if chunk is None:
        return conv_chunk(dtype, device)
    if chunk > 1 and conv_chunk(dtype, device) == 1:
        raise ValueError(
            f"conv_sq_norms(chunk={chunk}) needs a grouped Conv2DBackpropFilter, which TensorFlow's "
            f"{device} kernels do not run in {tf.as_dtype(dtype).name} in this process (on CPUs it needs "
            "oneDNN: TF_ENABLE_ONEDNN_OPTS=1); use chunk=1 or leave chunk=None to choose automatically."
        )
    return chunk


def _take_chunk(t, i, chunk):
    """Examples i·chunk … i·chunk + chunk − 1 of ``t``, zero-padded to ``chunk`` rows (no padding
    op when the static batch fills every chunk)."""
    part = t[i * chunk : (i + 1) * chunk]
    if t.shape[0] is not None and t.shape[0] % chunk == 0:
        return part
    return tf.pad(part, [[0, chunk - tf.shape(part)[0]]] + [[0, 0]] * (t.shape.rank - 1))


def conv_example_grads(images, filter_hw, strides, padding, chunk=None) -> ExampleKernelGrads:
    """Per-example kernel gradients of a 2-D convolution (groups = 1, dilation 1).

    ``images``: the layer's calls as pairs ``(a, g)`` of channels-last input images
    a (P, H, W, c_in) and output gradients g (P, H', W', c_out); ``filter_hw``,
    ``strides`` (2 ints each) and ``padding`` (``"SAME"``/``"VALID"``) as the layer.
    Returns :class:`ExampleKernelGrads` holding ``∂K_i = Σ_calls Σ_positions
    patch(a_i) ⊗ g_i`` for every example i (memory P·k²·c_in·c_out).

    Examples are taken ``chunk`` at a time in a ``tf.map_fn``. With ``chunk = 1``
    each example's kernel gradient is one plain ``Conv2DBackpropFilter``. With
    ``chunk > 1`` the chunk's examples become the groups of ONE grouped
    ``Conv2DBackpropFilter`` (input (1, H, W, chunk·c_in), filter
    (kh, kw, c_in, chunk·c_out)), whose filter gradient is the chunk's per-example
    kernel gradients side by side, with no cross-example terms; only some kernels
    run that (:func:`conv_chunk`). ``chunk`` defaults to :func:`conv_chunk`; an
    explicit ``chunk > 1`` where the grouped kernel does not run is a ``ValueError``
    (raised while tracing, before any step runs).
    """
    dtype = images[0][0].dtype
    chunk = _check_chunk(chunk, dtype, _kernels.device_type(images[0][0]))
    p = tf.shape(images[0][0])[0]
    c_in, c_out = images[0][0].shape[-1], images[0][1].shape[-1]
    width = filter_hw[0] * filter_hw[1] * c_in


    def take(t, i):
        return _take_chunk(t, i, chunk)

    def per_chunk(i):
        """Σ_calls per-example kernel gradients of chunk i: (k²·c_in, chunk, c_out)."""
        total = 0.0
        for a, g in images:
            a, g = take(a, i), take(g, i)  # a (chunk, H, W, c_in), g (chunk, H', W', c_out)
            if chunk > 1:  # the chunk's examples side by side in the channels
                a = tf.reshape(tf.transpose(a, [1, 2, 0, 3]), [1, *dims(a)[1:3], chunk * c_in])
                g = tf.reshape(tf.transpose(g, [1, 2, 0, 3]), [1, *dims(g)[1:3], chunk * c_out])
            kernel = tf.compat.v1.nn.conv2d_backprop_filter(
                a, [*filter_hw, c_in, chunk * c_out], g, strides=[1, *strides, 1], padding=padding
            )
            total += tf.reshape(kernel, [width, chunk, c_out])
        return total

    # slices are taken inside the loop: no copy of the whole batch (as map_fn's
    # unstacking of its inputs would make)
    blocks = tf.map_fn(
        per_chunk, tf.range((p + chunk - 1) // chunk), fn_output_signature=tf.TensorSpec([width, chunk, c_out], dtype)
    )
    return ExampleKernelGrads(blocks, p)


def conv_sq_norms(images, filter_hw, strides, padding, chunk=None) -> tf.Tensor:
    """Per-example squared norm of a 2-D convolution's kernel gradient (groups = 1).

    Arguments as :func:`conv_example_grads`; returns (P,): ‖Σ_calls ∂K_i‖²_F per example.
    """
    return conv_example_grads(images, filter_hw, strides, padding, chunk).sq_norms()


def example_grads_3d(images, kernel_size, strides, padding, chunk=None) -> tf.Tensor:
    """Per-example kernel gradients (P, K·c_in, c_out) of a 3-D convolution (groups = 1,
    dilation 1), summed over the calls ``images`` = [(a (P, D, H, W, c_in), g (P, D', H',
    W', c_out))] (channels-last; the rows of K·c_in in the kernel's (k_d, k_h, k_w, c_in)
    order). The windows (``tf.extract_volume_patches``) would cost far more than either form:

    - ``chunk = 1``: one ``Conv3DBackpropFilterV2`` per example in a ``tf.map_fn`` (the
      kernel of every ordinary backward pass; runs wherever TensorFlow runs).
    - ``chunk > 1`` (where a grouped ``Conv2DBackpropFilter`` runs, :func:`conv_chunk`,
      and the height and width strides are 1): ``chunk`` examples at a time, one grouped
      2-D filter gradient per depth tap t_d:
      ``∂W_i[t_d] = Σ_{d'} conv2d_filter_grad(a_i[t_d + s_d·d'], g_i[d'])``, with the
      depth slices d' as the 2-D batch (the sum over it is the sum over depth positions)
      and the chunk's examples as the groups (side by side in the channels; no
      cross-example terms), after padding the depth as the layer's ``same`` padding does.
      k_d calls per chunk instead of ``chunk`` calls. With oneDNN (B = 32, 3×3×3
      kernels, 8–16 channels on 8³–16³ volumes) it takes 0.55–0.75× the time of the
      batch-1 3-D filter gradients at strides 1, but 2.3× at strides 2, hence the
      condition (docs/performance.md).

    ``chunk`` defaults to :func:`conv_chunk` of the dtype and device; the grouped form
    also needs static depths (else the first form runs).
    """
    a0, g0 = images[0]
    c_in, c_out, k = a0.shape[-1], g0.shape[-1], math.prod(kernel_size)
    if chunk is None:
        chunk = conv_chunk(a0.dtype, _kernels.device_type(a0))
    static_depths = all(a.shape[1] is not None and g.shape[1] is not None for a, g in images)
    if chunk > 1 and static_depths and tuple(strides[1:]) == (1, 1):
        return _example_grads_3d_grouped(images, kernel_size, strides, padding, chunk)

    def one(i):
        return tf.add_n([
            tf.reshape(tf.compat.v1.nn.conv3d_backprop_filter_v2(
                a[i : i + 1], [*kernel_size, c_in, c_out], g[i : i + 1], strides=[1, *strides, 1],
                padding=padding.upper()), [k * c_in, c_out])
            for a, g in images
        ])

    return tf.map_fn(one, tf.range(tf.shape(a0)[0]), fn_output_signature=tf.TensorSpec([k * c_in, c_out], a0.dtype))


def _example_grads_3d_grouped(images, kernel_size, strides, padding, chunk) -> tf.Tensor:
    """:func:`example_grads_3d` with ``chunk`` examples per grouped 2-D filter gradient."""
    a0, g0 = images[0]
    c_in, c_out = a0.shape[-1], g0.shape[-1]
    (kd, kh, kw), (sd, sh, sw) = kernel_size, strides
    width = kh * kw * c_in
    p = tf.shape(a0)[0]

    def take(t, i):
        return _take_chunk(t, i, chunk)

    def side_by_side(t):
        """(chunk, D, H, W, C) -> (D, H, W, chunk·C): example j in channels j·C … j·C + C − 1."""
        d, h, w, c = dims(t)[1:]
        return tf.reshape(tf.transpose(t, [1, 2, 3, 0, 4]), [d, h, w, chunk * c])

    def per_chunk(i):
        total = 0.0
        for a, g in images:
            depth, depth_out = a.shape[1], g.shape[1]
            pad = max((depth_out - 1) * sd + kd - depth, 0) if padding.upper() == "SAME" else 0
            a = tf.pad(take(a, i), [[0, 0], [pad // 2, pad - pad // 2], [0, 0], [0, 0], [0, 0]])
            a, g = side_by_side(a), side_by_side(take(g, i))
            taps = [
                tf.reshape(tf.compat.v1.nn.conv2d_backprop_filter(
                    a[t : t + sd * (depth_out - 1) + 1 : sd], [kh, kw, c_in, chunk * c_out], g,
                    strides=[1, sh, sw, 1], padding=padding.upper()), [width, chunk, c_out])
                for t in range(kd)
            ]
            total += tf.concat(taps, axis=0)  # (k_d·k_h·k_w·c_in, chunk, c_out)
        return total

    blocks = tf.map_fn(per_chunk, tf.range((p + chunk - 1) // chunk),
                       fn_output_signature=tf.TensorSpec([kd * width, chunk, c_out], a0.dtype))
    return tf.reshape(tf.transpose(blocks, [0, 2, 1, 3]), [-1, kd * width, c_out])[:p]


def _depthwise_example_grads(images, kernel_shape, stride, padding):
    """Per-example depthwise kernel gradients (P, C, K, M) from channels-last pairs ``(a, g)``
    (a (P, *spatial, C), g (P, *spatial', C·M)), all examples in ONE depthwise filter-gradient
    call: the (example, channel) pairs become the P·C channels of a batch-1 image, so the
    filter gradient (k…, P·C, M) holds every example's kernel gradient side by side, with no
    cross-example terms. The cost of the layer's ordinary weight-gradient step."""
    *ks, c, m = kernel_shape
    k = math.prod(ks)
    total = 0.0
    for a, g in images:
        if len(ks) == 1:
            a, g = a[:, None], g[:, None]
        p = tf.shape(a)[0]
        a_img = tf.reshape(tf.transpose(a, [1, 2, 0, 3]), [1, *dims(a)[1:3], p * c])
        g_img = tf.reshape(tf.transpose(g, [1, 2, 0, 3]), [1, *dims(g)[1:3], p * c * m])
        kernel = tf.nn.depthwise_conv2d_backprop_filter(
            a_img, [*([1] * (2 - len(ks))), *ks, p * c, m], g_img, strides=[1, stride, stride, 1],
            padding=padding.upper(),
        )
        total += tf.reshape(kernel, [k, p, c, m])
    return tf.transpose(total, [1, 2, 0, 3])


# ------------------------------------------------- depthwise kernels: one slice per tap, a correlation

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
    :class:`~keras_noisecurve.backend.common.norm_forms.ExampleGrads`.

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

    def weighted_sum(self, scale, keep=None) -> tf.Tensor:
        """(C, K, M): ``Σ_i scale_i ∂W_i``; rows with ``scale_i = 0`` (the dropped ones, ``keep``
        false) contribute exactly 0."""
        summed = weighted_sum(self.per_example, scale)  # (T, C, M)
        if len(self.live) != self.taps:
            summed = tf.scatter_nd([[t] for t in self.live], summed, [self.taps, *summed.shape[1:]])
        return tf.transpose(summed, [1, 0, 2])



def _causal(pairs, kernel_size, dilation_rate):
    """Causal padding written out: the inputs padded before by (k − 1)·d, padding ``"valid"``."""
    width = (kernel_size[0] - 1) * dilation_rate[0]
    return [(tf.pad(a, [[0, 0], [width, 0], [0, 0]]), g) for a, g in pairs]


def patches(x, *, kernel_size, strides, dilation_rate, padding: str) -> tf.Tensor:
    """Windows of ``x`` (P, *N, C), rank 1, 2 or 3, as (P, L, K, C) (``padding`` ``"valid"`` or
    ``"same"``; rank 3 needs dilation 1). Under 8 channels a convolution with a one-hot kernel gives
    the same windows several times faster on CPU than ``tf.image.extract_patches`` (with many
    channels its cost, width² per position, loses)."""
    rank, c = len(kernel_size), x.shape[-1]
    ks, st, dr = list(kernel_size), list(strides), list(dilation_rate)
    if rank == 1:
        x, ks, st, dr = x[:, None], [1, *ks], [1, *st], [1, *dr]
    width = math.prod(ks) * c
    if rank == 3:
        if max(dr) != 1:
            raise ValueError(f"3-D patches need dilation_rate 1, got {tuple(dr)}")
        windows = tf.extract_volume_patches(x, ksizes=[1, *ks, 1], strides=[1, *st, 1], padding=padding.upper())
    elif c < 8 and (max(st) == 1 or max(dr) == 1):  # tf.nn.conv2d refuses strides and dilation both > 1
        eye = tf.reshape(tf.eye(width, dtype=x.dtype), [*ks, c, width])
        windows = tf.nn.conv2d(x, eye, strides=[1, *st, 1], padding=padding.upper(), dilations=[1, *dr, 1])
    else:
        windows = tf.image.extract_patches(x, sizes=[1, *ks, 1], strides=[1, *st, 1], rates=[1, *dr, 1],
                                           padding=padding.upper())
    return tf.reshape(windows, [tf.shape(x)[0], -1, math.prod(ks), c])


def window_patches(a, *, out_shape, kernel_size, strides, dilation_rate, padding):
    """The windows (P, L, K, C) of the convolution of ``a`` (P, *N, C) (:func:`patches`)."""
    if padding == "causal":
        (a, _), = _causal([(a, None)], kernel_size, dilation_rate)
        padding = "valid"
    return patches(a, kernel_size=kernel_size, strides=strides, dilation_rate=dilation_rate, padding=padding)


def _depthwise(pairs, kernel_size, strides, dilation_rate, padding):
    """Per-example depthwise gradients (G = C groups of K taps × M), or ``None`` (the windows).

    Four exact forms (measured on CPU at B = 32, docs/performance.md): TensorFlow's depthwise
    filter gradient over the P·C (example, channel) pairs for kernels of at most 3 taps a side on
    inputs of at least 2 kernel sizes a side (1.1–1.9 ms on 8×8 to 32×32 maps, but 50–450 ms on
    4×4 and smaller maps, and with 5×5 kernels on 8×8 and 11×11 inputs); else, for depth
    multiplier 1, dilation 1 and at least 2×2 output positions, one depthwise convolution of the
    input with the output gradient (:func:`correlation_example_grads`: 0.8–2.1 ms on
    EfficientNetB0's 11×11 to 2×2 maps where the taps took 1.3–3.9 ms); else one slice of the
    input per live tap (:func:`tap_example_grads`, 0.4–0.7 ms on 1×1 maps, where one tap of a 5×5
    kernel is live); the windows only when the spatial sizes are not static."""
    c, m = pairs[0][0].shape[-1], pairs[0][1].shape[-1] // pairs[0][0].shape[-1]
    if not all(t.shape[1:-1].is_fully_defined() for pair in pairs for t in pair):
        return None
    stride = [1, *strides] if len(strides) == 1 else list(strides)
    native = max(dilation_rate) == 1 and len(set(stride)) == 1
    large = max(kernel_size) <= 3 and all(n >= 2 * k for a, _ in pairs for n, k in zip(a.shape[1:-1], kernel_size))
    shape = (*kernel_size, c, m)
    if native and large:
        return ExampleGrads(_depthwise_example_grads(pairs, shape, stride[0], padding))
    if m == 1 and max(dilation_rate) == 1 and all(g.shape[1:-1].num_elements() >= 4 for _, g in pairs):
        per = tf.add_n([correlation_example_grads(a, g, kernel_size=kernel_size, strides=strides, padding=padding)
                        for a, g in pairs])
        return ExampleGrads(tf.transpose(per, [0, 2, 1])[..., None])  # (P, C, K, 1)
    taps = [tap_example_grads(a, g, kernel_size=kernel_size, strides=strides, dilation_rate=dilation_rate,
                              padding=padding, multiplier=m) for a, g in pairs]
    return LiveTapGrads(taps, math.prod(kernel_size))


def example_grads(pairs, *, kernel_size, strides, dilation_rate, padding, groups, materialise):
    """Per-example kernel gradients of a convolution of the calls ``pairs`` [(a, g)], without
    windows, where TensorFlow has a kernel for them (else ``None``: the windows' forms):

    * ``groups`` = 1, dilation 1, 2-D or 1-D, when ``materialise`` (L² ≥ I·O; in the Gram regime
      the windows' Gram form is the faster): :func:`conv_example_grads`;
    * ``groups`` = 1, dilation 1, 3-D, always (the volume windows cost far more):
      :func:`example_grads_3d`;
    * depthwise (one input channel per group), 1-D or 2-D: :func:`_depthwise`.

    Returns an object with ``sq_norms()`` (P,) and ``weighted_sum(c, keep)`` (G, K·C/G, F/G)."""
    if padding == "causal":
        pairs, padding = _causal(pairs, kernel_size, dilation_rate), "valid"
    rank, channels = len(kernel_size), pairs[0][0].shape[-1]
    if groups == 1 and max(dilation_rate) == 1 and rank == 3:
        return ExampleGrads(example_grads_3d(pairs, kernel_size, strides, padding)[:, None])
    if groups == 1 and max(dilation_rate) == 1 and materialise:
        if rank == 1:
            pairs, kernel_size, strides = [(a[:, None], g[:, None]) for a, g in pairs], (1, *kernel_size), (1, *strides)
        return conv_example_grads(pairs, list(kernel_size), list(strides), padding.upper())
    if groups > 1 and groups == channels and rank <= 2:
        return _depthwise(pairs, kernel_size, strides, dilation_rate, padding)
    return None


def refusal(layer):
    """What TensorFlow's kernels here do not run, or ``None`` (the module docstring says why)."""
    three_d = isinstance(layer, (keras.layers.Conv3D, keras.layers.Conv3DTranspose))
    if three_d and max(layer.dilation_rate) != 1:
        return f"dilation_rate={tuple(layer.dilation_rate)} (3-D windows need dilation 1)"
    grouped = isinstance(layer, keras.layers.Conv3D) or getattr(layer, "groups", 1) > 1
    if grouped and layer.data_format == "channels_first" and _kernels.device_type() == "CPU":
        return "channels_first on CPU (Keras runs it through XLA; the bias add is not the layer's definition)"
    return None
