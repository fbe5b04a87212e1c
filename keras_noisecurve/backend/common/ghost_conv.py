"""Ghost-norm kernels of the convolutions, in ``keras.ops``: one kernel for every backend (the
contract of :func:`~keras_noisecurve.backend.common.layer_rules.layer_kernel`).

``Conv1D``/``Conv2D``/``Conv3D`` (any strides, dilation, ``"valid"``/``"same"``/``"causal"``
padding, ``groups`` ≥ 1), ``DepthwiseConv1D``/``DepthwiseConv2D``, ``SeparableConv1D``/
``SeparableConv2D`` and ``Conv1DTranspose``/``Conv2DTranspose``/``Conv3DTranspose``
(``output_padding=None``), channels last or first, exact classes (a subclass may change the
convolution). Every one of these kernels has a per-example gradient that is a sum over output
positions of outer products, one per group of channels:

    ∂W_i[γ] = Σ_l x_ilγ ⊗ y_ilγ          x (P, L, G, I), y (P, L, G, O)

| layer | x | y | G | I | O |
|---|---|---|---|---|---|
| Conv1D/2D/3D, ``groups`` = G | windows of a | g | G | K · c_in/G | filters/G |
| DepthwiseConv1D/2D | windows of a | g | c_in | K | depth multiplier M |
| SeparableConv1D/2D, depthwise kernel | windows of a | g_u = g·P_wᵀ | c_in | K | M |
| SeparableConv1D/2D, pointwise kernel | u (no windows) | g | 1 | c_in·M | filters |
| Conv1D/2D/3DTranspose (roles swapped) | windows of g | a | 1 | K · filters | c_in |

with K = k (1-D), k_h·k_w (2-D) or k_d·k_h·k_w (3-D) taps, L the output positions (row-major),
features ordered (tap, channel) as the kernel's own axes, and ``g`` the gradient of
``Σ_i w_i·loss_i`` at the layer's output before its fused activation. The windows are those of the
layer's own convolution (kernel size, strides, dilation, padding); a 1×1 kernel's are the input's
pixels at the strides. A separable layer's ``u`` is its depthwise stage's output (saved by an
engine that records the forward, else recomputed from ``a`` and the step's depthwise kernel) and
``g_u`` its gradient. A transposed convolution is the input gradient of the convolution with the
same kernel, strides, dilation and padding that takes its output back to its input, so its kernel
gradient is that convolution's filter gradient with the roles swapped.

Per layer the cheaper exact form is chosen by shapes (L summed over the layer's calls):

* L² < I·O: the Gram form ``‖∂W_i‖² = Σ_γ Σ_{l,l'} (x_ilγ·x_il'γ)(y_ilγ·y_il'γ)`` (memory P·G·L²);
  clipped sum ``Σ_{i,l} x_ilγ ⊗ (c_i y_ilγ)``, one contraction;
* else the per-example gradients (memory P·G·I·O), their norms and ``Σ_i c_i ∂W_i``.

What needs the framework is the backend's seam module ``ghost_conv``
(``backend.common.defaults.ghost_conv`` in ``keras.ops`` where a backend has none):
``window_patches`` (the windows), ``example_grads`` (per-example gradients without windows, where
the backend has a faster way, and it may take that way in the Gram regime too) and ``refusal``
(configurations the backend's kernels do not run). The bias gradient is ``Σ_l g_il`` (P, filters).
Everything is computed in float32 (float64 for a float64 model).
"""

from __future__ import annotations

import math

import keras
from keras import ops

from keras_noisecurve import _compat, backend
from keras_noisecurve.backend.common.geometry import explicit_padding
from keras_noisecurve.backend.common.layer_rules import layer_kernel
from keras_noisecurve.backend.common.norm_forms import (
    ExampleGrads, cat, kept, scaled, sequence_sq_norms, sum_dtype, weighted_sum)

__all__ = ["PRE_ACTIVATION", "conv", "conv3d", "conv_transpose", "depthwise", "depthwise_output",
           "grouped_conv", "grouped_sq_norms", "separable"]

_L = keras.layers
_CONV = (_L.Conv1D, _L.Conv2D, _L.Conv3D)
_DEPTHWISE = (_L.DepthwiseConv1D, _L.DepthwiseConv2D)
_SEPARABLE = (_L.SeparableConv1D, _L.SeparableConv2D)
_TRANSPOSE = (_L.Conv1DTranspose, _L.Conv2DTranspose, _L.Conv3DTranspose)

#: the layer types whose output an engine records before the fused activation (their ``call`` is
#: ``activation(convolution + bias)``)
PRE_ACTIVATION = _CONV + _DEPTHWISE + _SEPARABLE + _TRANSPOSE


def grouped_sq_norms(x, y):
    """``(sq, per)`` for ``x`` (P, L, G, I), ``y`` (P, L, G, O): ``sq`` (P,) the per-example
    ``Σ_γ ‖Σ_l x_lγ ⊗ y_lγ‖²_F``; ``per`` an :class:`ExampleGrads` when they were formed (L known
    and L² ≥ I·O), else ``None`` (the Gram form: P·G·L² numbers; for one group and an L known only
    when the step runs, ``norm_forms.sequence_sq_norms`` chooses the smaller form then)."""
    length, d_in, d_out = x.shape[1], x.shape[3], y.shape[3]
    single = x.shape[2] == 1  # one group: plain (batched) matmuls
    if length is not None and length * length >= d_in * d_out:
        per = ops.einsum("pli,plo->pio", x[:, :, 0], y[:, :, 0])[:, None] if single else ops.einsum(
            "plgi,plgo->pgio", x, y)
        per = ExampleGrads(per)
        return per.sq_norms(), per
    if single:  # the Gram form, or (L known only when the step runs) whichever is smaller then
        return sequence_sq_norms(x[:, :, 0], y[:, :, 0]), None
    xx = ops.einsum("plgi,pmgi->pglm", x, x)
    yy = ops.einsum("plgo,pmgo->pglm", y, y)
    return ops.sum(xx * yy, axis=(1, 2, 3)), None


def _gram_sum(x, y, c, keep):
    """(G, I, O) ``Σ_{i,l} x_ilγ ⊗ (c_i y_ilγ)``: the factor with fewer entries carries ``c``."""
    x, y = kept(x, keep), kept(y, keep)
    if x.shape[-1] < y.shape[-1]:
        x = scaled(c, x)
    else:
        y = scaled(c, y)
    if x.shape[2] == 1:
        return ops.einsum("ni,nj->ij", ops.reshape(x, (-1, x.shape[-1])), ops.reshape(y, (-1, y.shape[-1])))[None]
    return ops.einsum("plgi,plgo->gio", x, y)


def _channels_last(layer, t):
    return ops.moveaxis(t, 1, -1) if layer.data_format == "channels_first" else t


def _with_bias(layer, z):
    if not layer.use_bias:
        return z
    rank = len(layer.kernel_size)
    shape = (1,) * (rank + 1) + (-1,) if layer.data_format == "channels_last" else (1, -1) + (1,) * rank
    return ops.add(z, ops.reshape(layer.bias, shape))


def linear(layer, x):
    """A convolution layer's output before its activation, as the layer computes it."""
    padding = layer.padding
    if padding == "causal":
        x, padding = ops.pad(x, _compat.causal_padding(layer)), "valid"
    geometry = dict(strides=layer.strides, padding=padding, dilation_rate=layer.dilation_rate,
                    data_format=layer.data_format)
    if isinstance(layer, _DEPTHWISE):
        z = ops.depthwise_conv(x, layer.kernel, **geometry)
    elif isinstance(layer, _TRANSPOSE):
        z = ops.conv_transpose(x, layer.kernel, output_padding=None, **geometry)
    else:
        z = ops.conv(x, layer.kernel, **geometry)
    return _with_bias(layer, z)


def _separable_forward(layer, call, x, *args, **kwargs):
    """A separable layer's pre-activation output, saving its depthwise stage's output ``u``."""
    u = ops.depthwise_conv(x, layer.depthwise_kernel, strides=layer.strides, padding=layer.padding,
                           dilation_rate=layer.dilation_rate, data_format=layer.data_format)
    if layer.data_format == "channels_first":  # (TensorFlow's CPU convolutions take channels last only)
        pointwise = ops.reshape(layer.pointwise_kernel, tuple(layer.pointwise_kernel.shape[-2:]))
        z = ops.einsum("bc...,cf->bf...", u, pointwise)
    else:
        z = ops.conv(u, layer.pointwise_kernel, strides=1, padding="valid", data_format="channels_last")
    activation = layer.activation or (lambda t: t)
    return _with_bias(layer, z), lambda z: (activation(z), {"u": u})


def _check(layer):
    """What no backend runs (and what this one refuses: its ``ghost_conv.refusal``)."""
    if getattr(layer, "data_format", None) not in ("channels_last", "channels_first"):
        return f"data_format={getattr(layer, 'data_format', None)!r}"
    if layer.padding not in ("valid", "same", "causal"):
        return f"padding={layer.padding!r}"
    if isinstance(layer, _TRANSPOSE) and layer.output_padding is not None:
        return f"output_padding={layer.output_padding}"
    return backend.module("ghost_conv").refusal(layer)


def _calls(layer, calls, dtype=None):
    """The calls' channels-last ``(a, g)`` in the dtype the norms are computed in; ``None`` when a
    call's input or gradient is not (P, *spatial, C) of the kernel's rank."""
    rank = len(layer.kernel_size)
    if any(len(c["a"].shape) != rank + 2 or len(c["g"].shape) != rank + 2 for c in calls):
        return None
    dtype = dtype or sum_dtype(calls[0]["g"])
    return [(_channels_last(layer, ops.cast(ops.stop_gradient(c["a"]), dtype)),
             _channels_last(layer, ops.cast(c["g"], dtype))) for c in calls]


def _positions(t):
    return ops.reshape(t, (ops.shape(t)[0], -1, t.shape[-1]))


def _windows(a, out_shape, geometry):
    """(P, L, K, C) windows of ``a``: a 1×1 kernel's are the pixels at the strides."""
    if math.prod(geometry["kernel_size"]) > 1:
        return backend.module("ghost_conv").window_patches(a, out_shape=out_shape, **geometry)
    # a 1×1 window never reads the padding: output position o reads input o·s, for every padding
    index = tuple(slice(None, None, s) for s in geometry["strides"])
    return ops.expand_dims(_positions(a[(slice(None), *index)]), 2)


def _form(pairs, geometry, groups):
    """An :class:`ExampleGrads`-like object, or ``(x, y)`` for the Gram form, of a convolution's
    calls ``pairs`` [(a (P, *N, C), g (P, *N', F))] in ``groups`` groups."""
    taps = math.prod(geometry["kernel_size"])
    length = sum(math.prod(g.shape[1:-1]) for _, g in pairs) if all(
        None not in g.shape[1:-1] for _, g in pairs) else None
    d_in, d_out = taps * pairs[0][0].shape[-1] // groups, pairs[0][1].shape[-1] // groups
    materialise = length is not None and length * length >= d_in * d_out
    if taps > 1:
        grads = backend.module("ghost_conv").example_grads(pairs, groups=groups, materialise=materialise, **geometry)
        if grads is not None:
            return grads
    xs, ys = [], []
    for a, g in pairs:
        p, c = ops.shape(a)[0], a.shape[-1] // groups
        x = _windows(a, tuple(g.shape[1:-1]), geometry)  # (P, L, K, C)
        if groups > 1:
            x = ops.reshape(ops.transpose(ops.reshape(x, (p, -1, taps, groups, c)), (0, 1, 3, 2, 4)),
                            (p, -1, groups, taps * c))
        xs.append(ops.reshape(x, (p, -1, groups, taps * c)))
        ys.append(ops.reshape(g, (p, -1, groups, g.shape[-1] // groups)))
    x, y = cat(xs), cat(ys)
    sq, per = grouped_sq_norms(x, y)
    return per if per is not None else (x, y, sq)


def _part(weight, form, shape):
    """``(sq, {id(weight): sum(c, keep)})`` of one kernel from its form (:func:`_form`): the
    norms (P,) and the clipped sum in the kernel's ``shape`` (*k, I/K, O·G), from (G, I, O)."""
    if isinstance(form, tuple):
        x, y, sq = form

        def summed(c, keep):
            return _gram_sum(x, y, c, keep)
    else:
        sq, summed = form.sq_norms(), form.weighted_sum

    def kernel_sum(c, keep):
        s = summed(c, keep)  # (G, K·c, O), features (tap, channel)
        k, (g, i, o) = math.prod(shape[:-2]), s.shape
        return ops.reshape(ops.transpose(ops.reshape(s, (g, k, i // k, o)), (1, 2, 0, 3)), shape)

    return sq, {id(weight): kernel_sum}


def _bias(layer, pairs):
    return sum(ops.sum(_positions(g), axis=1) for _, g in pairs) if layer.use_bias else None


def _finish(layer, parts, bias_i):
    """The kernel's ``(sq, sums)`` from ``parts`` [(sq, {id(weight): sum(c, keep)})] and the
    per-example bias gradients ``bias_i`` (P, F) or ``None``."""
    sq = sum(s for s, _ in parts)
    if bias_i is not None:
        sq = sq + ops.sum(bias_i * bias_i, axis=1)

    def sums(c, keep=None):
        out = {key: fn(c, keep) for _, part in parts for key, fn in part.items()}
        if bias_i is not None:
            out[id(layer.bias)] = weighted_sum(bias_i, c, keep)
        return out

    return sq, sums


def _geometry(layer):
    return dict(kernel_size=tuple(layer.kernel_size), strides=tuple(layer.strides),
                dilation_rate=tuple(layer.dilation_rate), padding=layer.padding)


def _exactly(*classes, groups=None):
    def matches(layer):
        if type(layer) not in classes:
            return False
        return groups is None or (layer.groups == 1) == (groups == 1)

    return dict(matches=matches, names=tuple(cls.__name__ for cls in classes), check=_check)


def _convolution(layer, calls):
    pairs = _calls(layer, calls)
    if pairs is None:
        return None
    form = _form(pairs, _geometry(layer), layer.groups)
    return _finish(layer, [_part(layer.kernel, form, tuple(layer.kernel.shape))], _bias(layer, pairs))


@layer_kernel(weights=("kernel", "bias"), pre_activation=linear, **_exactly(_L.Conv1D, _L.Conv2D, groups=1))
def conv(layer, calls):
    """``keras.layers.Conv1D`` / ``Conv2D`` with ``groups=1``: per example, the kernel gradient
    ``Σ_l x_l ⊗ g_l`` of the input's windows x and the output gradient g, its squared norm by the
    Gram form ``Σ_{l,l'} (x_l·x_l')(g_l·g_l')`` when L² < K·c_in·c_out, else from the per-example
    kernel gradients themselves (formed without windows); a 1×1 kernel as a ``Dense`` map of the
    pixels at the strides."""
    return _convolution(layer, calls)


@layer_kernel(weights=("kernel", "bias"), pre_activation=linear, **_exactly(_L.Conv1D, _L.Conv2D, groups=2))
def grouped_conv(layer, calls):
    """``keras.layers.Conv1D`` / ``Conv2D`` with ``groups`` > 1: group g's kernel gradient is the
    plain convolution's, on the input channels and filters of group g only (the windows of the
    input, grouped)."""
    return _convolution(layer, calls)


@layer_kernel(weights=("kernel", "bias"), pre_activation=linear, **_exactly(_L.Conv3D))
def conv3d(layer, calls):
    """``keras.layers.Conv3D`` (any ``groups``): the plain convolution's forms on the volume's
    windows (a backend may refuse a dilation its windows do not take: TensorFlow's)."""
    return _convolution(layer, calls)


@layer_kernel(weights=("kernel", "bias"), pre_activation=linear, **_exactly(*_DEPTHWISE))
def depthwise(layer, calls):
    """``keras.layers.DepthwiseConv1D`` / ``DepthwiseConv2D``: per channel c, the kernel gradient is
    ``Σ_l x_l[c] ⊗ g_l[c]`` (K taps × depth multiplier M, output channel c·M + m), the grouped
    convolution's forms with one group per input channel."""
    pairs = _calls(layer, calls)
    if pairs is None:
        return None
    form = _form(pairs, _geometry(layer), layer.kernel.shape[-2])
    return _finish(layer, [_part(layer.kernel, form, tuple(layer.kernel.shape))], _bias(layer, pairs))


def depthwise_output(a, kernel, *, out_shape, strides, dilation_rate, padding):
    """The depthwise stage of a channels-last separable convolution, recomputed: ``a``
    (P, *N, C), ``kernel`` (*k, C, M) -> (P, *out_shape, C·M), the layer's padding written out
    (:func:`~keras_noisecurve.backend.common.geometry.explicit_padding`)."""
    sizes = a.shape[1:-1]
    pads = [explicit_padding(n, o, k, s, d, padding)
            for n, o, k, s, d in zip(sizes, out_shape, kernel.shape[:-2], strides, dilation_rate)]
    a = ops.pad(a, [(0, 0), *((b, max(e, 0)) for b, e in pads), (0, 0)])
    a = a[(slice(None), *(slice(0, n + b + e) for n, (b, e) in zip(sizes, pads)), slice(None))]
    return ops.depthwise_conv(a, kernel, strides=strides, padding="valid", data_format="channels_last",
                              dilation_rate=dilation_rate)


@layer_kernel(weights=("depthwise_kernel", "pointwise_kernel", "bias"), forward=_separable_forward,
              **_exactly(*_SEPARABLE))
def separable(layer, calls):
    """``keras.layers.SeparableConv1D`` / ``SeparableConv2D``: the depthwise stage (kernel
    (*k, C, M)) then the pointwise 1×1 stage (kernel (1…, C·M, F)). The depthwise output u is saved
    by a recording forward (else recomputed from the input); its gradient is ``g_u = g·Wₚᵀ`` (one
    matmul), and the two kernels' per-example gradients are a depthwise one on (a, g_u) and a dense
    one on (u, g), both summed into each example's norm with the bias's."""
    pairs = _calls(layer, calls)
    if pairs is None:
        return None
    dtype = pairs[0][1].dtype
    channels, filters = layer.depthwise_kernel.shape[-2], layer.pointwise_kernel.shape[-1]
    pointwise = ops.cast(ops.reshape(layer.pointwise_kernel, (-1, filters)), dtype)
    geometry = _geometry(layer)
    inner, us = [], []
    for call, (a, g) in zip(calls, pairs):
        if call["saved"] is not None:
            u = _channels_last(layer, ops.cast(ops.stop_gradient(call["saved"]["u"]), dtype))
        else:
            u = depthwise_output(a, ops.cast(layer.depthwise_kernel, dtype), out_shape=tuple(g.shape[1:-1]),
                                 **{k: v for k, v in geometry.items() if k != "kernel_size"})
        g_u = ops.matmul(_positions(g), ops.transpose(pointwise))  # (P, L, C·M)
        spatial = [n if n is not None else ops.shape(g)[i + 1] for i, n in enumerate(g.shape[1:-1])]
        inner.append((a, ops.reshape(g_u, (ops.shape(g)[0], *spatial, pointwise.shape[0]))))
        us.append((u, g))
    depthwise_form = _form(inner, geometry, channels)
    x = cat([ops.expand_dims(_positions(u), 2) for u, _ in us])
    y = cat([ops.expand_dims(_positions(g), 2) for _, g in us])
    sq, per = grouped_sq_norms(x, y)
    pointwise_form = per if per is not None else (x, y, sq)
    parts = [_part(layer.depthwise_kernel, depthwise_form, tuple(layer.depthwise_kernel.shape)),
             _part(layer.pointwise_kernel, pointwise_form, tuple(layer.pointwise_kernel.shape))]
    return _finish(layer, parts, _bias(layer, pairs))


def _transposed_length(size, kernel, stride, dilation, padding):
    """Keras's output length of a transposed convolution with ``output_padding=None``."""
    if padding == "same":
        return size * stride
    return (size - 1) * stride + max((kernel - 1) * dilation + 1, stride)


@layer_kernel(weights=("kernel", "bias"), pre_activation=linear, **_exactly(*_TRANSPOSE))
def conv_transpose(layer, calls):
    """``keras.layers.Conv1DTranspose`` / ``Conv2DTranspose`` / ``Conv3DTranspose`` with
    ``output_padding=None``, kernel (*k, F, C): the gradient is the forward convolution's filter
    gradient with the roles swapped, ``∂W_i = Σ_l patch(g_i)_l ⊗ a_il`` over the input positions l
    (the windows of the output gradient at the layer's strides, dilation and padding)."""
    pairs = _calls(layer, calls)
    if pairs is None:
        return None
    for a, g in pairs:
        for n, out, k, s, d in zip(a.shape[1:-1], g.shape[1:-1], layer.kernel_size, layer.strides,
                                   layer.dilation_rate):
            if None not in (n, out) and out != _transposed_length(n, k, s, d, layer.padding):
                return None
    form = _form([(g, a) for a, g in pairs], _geometry(layer), 1)
    return _finish(layer, [_part(layer.kernel, form, tuple(layer.kernel.shape))], _bias(layer, pairs))
