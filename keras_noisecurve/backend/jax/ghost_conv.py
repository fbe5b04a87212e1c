"""Ghost-norm rules for convolutions on the JAX backend, in ``jax.numpy`` (traced inside the
jitted train step): ``Conv1D``/``Conv2D``/``Conv3D`` (any strides, dilation,
``"valid"``/``"same"``/``"causal"`` padding, ``groups`` ≥ 1; a 1×1 kernel as a ``Dense`` map of
the pixels), ``DepthwiseConv1D``/``DepthwiseConv2D``, ``SeparableConv1D``/``SeparableConv2D`` and
``Conv1DTranspose``/``Conv2DTranspose``/``Conv3DTranspose`` (``output_padding=None``), channels
last. The rule contract is the one of
:mod:`keras_noisecurve.backend.jax.ghost_rules` (``rule(layer, calls) -> (sq, sums)`` or ``None``).

Every one of these kernels has a per-example gradient that is a sum over output positions of
outer products, one per group of channels (the same table as the TensorFlow rules,
:mod:`keras_noisecurve.backend.tensorflow.ghost_conv_kinds`):

    ∂W_i[γ] = Σ_l x_ilγ ⊗ y_ilγ          x (P, L, G, d_in), y (P, L, G, d_out)

| layer | x (windows of the input a) | y | G | d_in | d_out |
|---|---|---|---|---|---|
| Conv1D/2D/3D, ``groups`` = G | patches of a | g | G | c_in/G · K | filters/G |
| DepthwiseConv1D/2D | patches of a | g | c_in | K | depth multiplier |
| SeparableConv1D/2D, depthwise kernel | patches of a | g_d = g·P_wᵀ | c_in | K | depth multiplier |
| SeparableConv1D/2D, pointwise kernel | d (no patches) | g | 1 | c_in·M | filters |
| Conv1D/2D/3DTranspose (roles swapped) | patches of g | a | 1 | filters · K | c_in |

with K = k (1-D), k_h·k_w (2-D) or k_d·k_h·k_w (3-D) taps, L the output positions (row-major) and ``g`` the gradient
of ``Σ_i w_i·loss_i`` at the layer's output BEFORE its fused activation (the engine records
these layers' outputs there: ``ghost_rules.uses_pre_activation``). The patches are the
windows of the layer's own convolution (``jax.lax.conv_general_dilated_patches`` with the
layer's kernel size, strides, dilation and padding written out as explicit (before, after)
pairs: TensorFlow's ``"same"`` convention, ``(k−1)·d`` zeros before for ``"causal"``); their
features are ordered (channel, tap). A 1×1 kernel needs no patches: x is the input taken at
the strides (a 1×1 window never reaches the padding).

A separable layer computes ``z = d·P_w + b``, ``d = depthwise(a)`` (P, L, c_in·M), P_w its
pointwise kernel (1…, c_in·M, filters) as a matrix: ``d`` is recomputed from ``a`` and the
step's depthwise kernel (:func:`depthwise_output`; the rule reads the kernels' values under the
engine's stateless scope), the gradient at ``d`` is ``g_d = g·P_wᵀ``, and the example's squared
norm is the sum of the depthwise kernel's, the pointwise kernel's and the bias's.

A transposed convolution is the input gradient of the convolution that takes its output back
to its input (same kernel, strides, dilation and padding), so its kernel gradient is that
convolution's filter gradient with the roles swapped (:func:`conv_transpose_rule`): x = the
windows of ``g`` (the output gradient as the "input"), y = ``a``, L = the input positions.

Per layer the cheaper exact form is chosen by shapes, as the TensorFlow rules do
(L summed over the layer's calls):

* L² < d_in·d_out — Gram form: ``‖∂W_i‖² = Σ_γ Σ_{l,l'} (x_ilγ·x_il'γ)(y_ilγ·y_il'γ)``
  (memory P·G·L²); clipped sum ``Σ_{i,l} x_ilγ ⊗ (c_i y_ilγ)``, one contraction.
* else — the per-example gradients ``∂W_i`` (memory P·G·d_in·d_out), ``‖∂W_i‖²`` and
  ``Σ_i c_i ∂W_i`` from them. For a kernel of more than one tap they come from ONE
  ``conv_general_dilated`` with the (example, group) pairs as its feature groups
  (:func:`example_grads`: no patches, the form ``jax.vmap`` of a filter gradient also
  lowers to); a 1×1 kernel contracts its strided pixels with ``g`` (one einsum).

The bias gradient is ``Σ_l g_il`` (P, filters). Kernels are returned in Keras's layout,
(*kernel_size, c_in/G, filters) and (*kernel_size, c_in, multiplier). Everything is computed in
float32 (a bfloat16/float16 input or gradient of a mixed-precision policy is cast first).

Not ruled (``None``: the engine's exact per-layer fallback clips them): ``channels_first``,
LoRA or quantized layers, subclasses, transposed convolutions with an ``output_padding``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import keras

from keras_noisecurve.backend.common.geometry import explicit_padding

__all__ = ["PRE_ACTIVATION", "conv3d_rule", "conv_rule", "conv_transpose_rule", "depthwise_output", "depthwise_rule",
           "example_grads", "grouped_conv_rule", "explicit_padding", "grouped_sq_norms", "separable_rule", "window_patches"]

_F32 = jnp.float32
_CONV = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
_DEPTHWISE = (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
_SEPARABLE = (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)
_TRANSPOSE = (keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose, keras.layers.Conv3DTranspose)

#: the layer types whose output the engine records before the fused activation (their
#: ``call`` is ``activation(convolution + bias)``)
PRE_ACTIVATION = _CONV + _DEPTHWISE + _SEPARABLE + _TRANSPOSE


#: ``jax.lax`` dimension numbers (input, kernel, output) of a channels-last convolution, by spatial rank
_SPECS = {1: ("NWC", "WIO", "NWC"), 2: ("NHWC", "HWIO", "NHWC"), 3: ("NDHWC", "DHWIO", "NDHWC")}


def _ruled(layer, types, calls) -> bool:
    """Exact type, channels last, no LoRA/quantization, one (P, *spatial, C) input and output per call."""
    if type(layer) not in types or getattr(layer, "data_format", None) != "channels_last":
        return False
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None) is not None:
        return False
    rank = len(layer.kernel_size)
    return all(hasattr(c["a"], "shape") and hasattr(c["g"], "shape") and c["a"].ndim == rank + 2
               and c["g"].ndim == rank + 2 and c["a"].shape[0] == c["g"].shape[0] for c in calls)


def window_patches(a, *, out_shape, kernel_size, strides, dilation_rate, padding):
    """The windows of a channels-last convolution of ``a`` (P, *spatial, C), rank 1, 2 or 3.

    ``out_shape``: the output's spatial sizes; the rest as the layer (``padding`` one of
    ``"valid"``, ``"same"``, ``"causal"``). Returns (P, L, C, K): L = prod(out_shape) positions
    row-major, K = prod(kernel_size) taps row-major, ``[i, l, c, t] = a_pad[i, l·s + t·d, c]``;
    ``None`` for an unknown padding.
    """
    p, c = a.shape[0], a.shape[-1]
    spatial = a.shape[1:-1]
    pads = [explicit_padding(n, o, k, s, d, padding)
            for n, o, k, s, d in zip(spatial, out_shape, kernel_size, strides, dilation_rate)]
    if any(pad is None for pad in pads):
        return None
    taps = 1
    for k in kernel_size:
        taps *= k
    if taps == 1:  # a 1×1 window: the input pixels at the strides (never the padding)
        index = tuple(slice(before, before + (o - 1) * s + 1, s)
                      for (before, _), o, s in zip(pads, out_shape, strides))
        x = jnp.pad(a, [(0, 0)] + [(max(b, 0), max(e, 0)) for b, e in pads] + [(0, 0)])[(slice(None), *index)]
        return jnp.reshape(x, (p, -1, c, 1))
    spec = _SPECS[len(spatial)]
    windows = jax.lax.conv_general_dilated_patches(
        a, tuple(kernel_size), tuple(strides), pads, rhs_dilation=tuple(dilation_rate), dimension_numbers=spec,
        precision=jax.lax.Precision.HIGHEST)
    return jnp.reshape(windows, (p, -1, c, taps))


def grouped_sq_norms(x, y):
    """Per-example ``Σ_γ ‖Σ_l x_lγ ⊗ y_lγ‖²_F`` for ``x`` (P, L, G, I), ``y`` (P, L, G, O).

    Returns ``(sq, per)``: ``sq`` (P,); ``per`` the per-example gradients (P, G, I, O) when they
    were formed (L² ≥ I·O), else ``None`` (the Gram form: P·G·L² numbers)."""
    length, d_in, d_out = x.shape[1], x.shape[3], y.shape[3]
    if length * length < d_in * d_out:
        xx = jnp.einsum("plgi,pmgi->pglm", x, x)
        yy = jnp.einsum("plgo,pmgo->pglm", y, y)
        return jnp.sum(xx * yy, axis=(1, 2, 3)), None
    per = jnp.einsum("plgi,plgo->pgio", x, y)
    return jnp.sum(per * per, axis=(1, 2, 3)), per


def _kept(x, keep):
    """``x`` (P, ...) with the rows of dropped examples (``keep`` false) zeroed; ``keep=None``: ``x``."""
    if keep is None:
        return x
    return jnp.where(jnp.reshape(keep, (-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros_like(x))


def _scaled(c, y):
    return y * jnp.reshape(c.astype(y.dtype), (-1,) + (1,) * (y.ndim - 1))


def example_grads(a, g, *, kernel_size, strides, dilation_rate, padding, groups):
    """Per-example kernel gradients (P, G, I, O), I = (channel, tap) = c_in/G·K, O = c_out/G, of a
    channels-last convolution with ``groups`` groups: ``[i, γ, (c, t), o] = Σ_l a_pad[i, l·s + t·d, γ·c_in/G + c]
    · g[i, l, γ·O + o]``, as ONE ``conv_general_dilated`` with the (example, group) pairs as its
    feature groups (no patches): input ``a`` as (c_in/G, *spatial, P·G), filter ``g`` as
    (*out_spatial, 1, P·G·O), window strides = the layer's dilation, filter dilation = the layer's
    strides, the layer's padding made explicit (:func:`explicit_padding`), output (c_in/G, *K, P·G·O).
    ``None`` for an unknown padding."""
    p, c = a.shape[0], a.shape[-1]
    spatial, out, rank = a.shape[1:-1], g.shape[1:-1], a.ndim - 2
    c_group, o_group = c // groups, g.shape[-1] // groups
    pads = [explicit_padding(n, o, k, s, d, padding)
            for n, o, k, s, d in zip(spatial, out, kernel_size, strides, dilation_rate)]
    if any(pad is None for pad in pads):
        return None
    lhs = jnp.reshape(a, (p, *spatial, groups, c_group))
    lhs = jnp.reshape(jnp.transpose(lhs, (rank + 2, *range(1, rank + 1), 0, rank + 1)), (c_group, *spatial, p * groups))
    rhs = jnp.reshape(jnp.transpose(g, (*range(1, rank + 1), 0, rank + 1)), (*out, 1, p * groups * o_group))
    spec = _SPECS[rank]
    grads = jax.lax.conv_general_dilated(
        lhs, rhs, window_strides=tuple(dilation_rate), padding=pads, rhs_dilation=tuple(strides),
        dimension_numbers=spec, feature_group_count=p * groups, precision=jax.lax.Precision.HIGHEST)
    grads = jnp.reshape(grads, (c_group, -1, p, groups, o_group))  # (c, t, i, γ, o)
    return jnp.reshape(jnp.transpose(grads, (2, 3, 0, 1, 4)), (p, groups, -1, o_group))


def _form(layer, calls, groups):
    """``(x, y, per)``: the calls' windows x (P, L, G, I) and gradients y (P, L, G, O) for the
    Gram form (``per`` None), or the per-example gradients ``per`` (P, G, I, O) summed over the
    calls (x None), whichever :func:`grouped_sq_norms`' criterion L² ≥ I·O picks; ``None`` for
    an unknown padding. A kernel of more than one tap in the per-example form takes
    :func:`example_grads` (no patches); a 1×1 kernel's windows are the input's strided pixels."""
    p = calls[0]["g"].shape[0]
    taps = 1
    for k in layer.kernel_size:
        taps *= k
    length = sum(math.prod(c["g"].shape[1:-1]) for c in calls)
    d_in, d_out = calls[0]["a"].shape[-1] // groups * taps, calls[0]["g"].shape[-1] // groups
    geometry = dict(kernel_size=layer.kernel_size, strides=layer.strides, dilation_rate=layer.dilation_rate,
                    padding=layer.padding)
    if taps > 1 and length * length >= d_in * d_out:
        per = [example_grads(c["a"].astype(_F32), c["g"].astype(_F32), groups=groups, **geometry) for c in calls]
        return None if any(q is None for q in per) else (None, None, sum(per))
    xs, ys = [], []
    for c in calls:
        a, g = c["a"].astype(_F32), c["g"].astype(_F32)
        x = window_patches(a, out_shape=g.shape[1:-1], **geometry)
        if x is None:
            return None
        xs.append(jnp.reshape(x, (p, x.shape[1], groups, -1)))  # (channel, tap) features split by group
        ys.append(jnp.reshape(g, (p, -1, groups, g.shape[-1] // groups)))
    x = xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=1)
    y = ys[0] if len(ys) == 1 else jnp.concatenate(ys, axis=1)
    if length * length >= d_in * d_out:
        return None, None, jnp.einsum("plgi,plgo->pgio", x, y)
    return x, y, None


def _analyse(layer, calls, groups, to_kernel, kernel_var=None, bias_var=None, bias_calls=None):
    """``(sq, sums)`` of a convolution in ``groups`` groups: ``to_kernel`` maps (G, I, O) to the kernel's layout.
    ``kernel_var``/``bias_var``: the variables the sums are keyed by (default ``layer.kernel`` and,
    with ``layer.use_bias``, ``layer.bias``; a separable layer passes its depthwise kernel and no bias).
    ``bias_calls``: the calls whose ``g`` the bias gradient sums (default ``calls``; a transposed
    convolution passes its own, ``calls`` being their swapped roles)."""
    p = calls[0]["g"].shape[0]
    if kernel_var is None:
        kernel_var, bias_var = layer.kernel, (layer.bias if layer.use_bias else None)
    form = _form(layer, calls, groups)
    if form is None:
        return None
    x, y, per = form
    sq = jnp.sum(per * per, axis=(1, 2, 3)) if per is not None else grouped_sq_norms(x, y)[0]
    bias_i = None
    if bias_var is not None:
        bias_i = sum(jnp.sum(jnp.reshape(c["g"].astype(_F32), (p, -1, c["g"].shape[-1])), axis=1)
                     for c in (calls if bias_calls is None else bias_calls))
        sq = sq + jnp.sum(bias_i * bias_i, axis=1)

    def sums(c, keep=None):
        c = c.astype(_F32)
        if per is not None:
            kernel = jnp.tensordot(c, _kept(per, keep), axes=1)
        else:
            kernel = jnp.einsum("plgi,plgo->gio", _kept(x, keep), _scaled(c, _kept(y, keep)))
        out = {id(kernel_var): to_kernel(kernel)}
        if bias_i is not None:
            out[id(bias_var)] = jnp.tensordot(c, _kept(bias_i, keep), axes=1)
        return out

    return sq, sums


def conv_rule(layer, calls):
    """``Conv1D``/``Conv2D`` (exact types), channels last, ``groups`` = 1: see the module docstring."""
    if type(layer) not in _CONV[:2] or layer.groups != 1:
        return None
    return _conv(layer, calls)


def grouped_conv_rule(layer, calls):
    """``Conv1D``/``Conv2D`` (exact types), channels last, ``groups`` > 1: the plain convolution's
    form on each group's input channels and filters."""
    if type(layer) not in _CONV[:2] or layer.groups == 1:
        return None
    return _conv(layer, calls)


def conv3d_rule(layer, calls):
    """``Conv3D`` (exact type), channels last, any ``groups``."""
    if type(layer) is not keras.layers.Conv3D:
        return None
    return _conv(layer, calls)


def _conv(layer, calls):
    """``Conv1D``/``Conv2D``/``Conv3D`` (exact types), channels last, ``groups`` ≥ 1: the shared
    analysis of :func:`conv_rule`, :func:`grouped_conv_rule` and :func:`conv3d_rule`."""
    if not _ruled(layer, _CONV, calls):
        return None
    groups, taps = layer.groups, len(layer.kernel_size)
    filters, c_group = layer.filters, layer.kernel.shape[-2]

    def to_kernel(kernel):  # (G, c_group·K, filters/G) -> (*kernel_size, c_group, filters)
        kernel = jnp.reshape(kernel, (groups, c_group, -1, filters // groups))  # (G, c, K, o)
        kernel = jnp.transpose(kernel, (2, 1, 0, 3))  # (K, c, G, o): filter index γ·(filters/G) + o
        return jnp.reshape(kernel, (*layer.kernel_size[:taps], c_group, filters))

    return _analyse(layer, calls, groups, to_kernel)


def depthwise_rule(layer, calls):
    """``DepthwiseConv1D``/``DepthwiseConv2D`` (exact types), channels last: G = c_in groups of
    K taps × ``depth_multiplier`` outputs (output channel c·M + m)."""
    if not _ruled(layer, _DEPTHWISE, calls):
        return None
    channels, multiplier = layer.kernel.shape[-2], layer.kernel.shape[-1]
    if any(c["a"].shape[-1] != channels or c["g"].shape[-1] != channels * multiplier for c in calls):
        return None

    def to_kernel(kernel):  # (C, K, M) -> (*kernel_size, C, M)
        return jnp.reshape(jnp.transpose(kernel, (1, 0, 2)), (*layer.kernel_size, channels, multiplier))

    return _analyse(layer, calls, channels, to_kernel)


def depthwise_output(a, kernel, *, out_shape, strides, dilation_rate, padding):
    """The depthwise stage of a channels-last separable convolution, recomputed: ``a`` (P, *spatial, C),
    ``kernel`` (*kernel_size, C, M) -> ``d`` (P, *out_shape, C·M), ``d[i, l, c·M + m] =
    Σ_t a_pad[i, l·s + t·dil, c]·kernel[t, c, m]`` (one ``conv_general_dilated`` with C feature groups,
    the padding of :func:`explicit_padding`); ``None`` for an unknown padding."""
    kernel_size, channels = kernel.shape[:-2], kernel.shape[-2]
    pads = [explicit_padding(n, o, k, s, d, padding)
            for n, o, k, s, d in zip(a.shape[1:-1], out_shape, kernel_size, strides, dilation_rate)]
    if any(pad is None for pad in pads):
        return None
    spec = _SPECS[a.ndim - 2]
    return jax.lax.conv_general_dilated(
        a, jnp.reshape(kernel, (*kernel_size, 1, -1)), window_strides=tuple(strides), padding=pads,
        rhs_dilation=tuple(dilation_rate), dimension_numbers=spec, feature_group_count=channels,
        precision=jax.lax.Precision.HIGHEST)


def separable_rule(layer, calls):
    """``SeparableConv1D``/``SeparableConv2D`` (exact types), channels last: ``z = pointwise(d) + b``,
    ``d = depthwise(a)`` (P, *out, C·M), pointwise kernel W_p (1…, C·M, F) as a matrix P_w (C·M, F).

    * pointwise kernel: a Dense map of the positions, ``∂W_p,i = Σ_l d_il ⊗ g_il`` (Gram form or
      materialised, :func:`grouped_sq_norms` with one group), ``d`` recomputed from ``a`` and the
      step's depthwise kernel (:func:`depthwise_output`);
    * depthwise kernel: the depthwise rule on ``(a, g_d)``, ``g_d = g·P_wᵀ`` (P, *out, C·M), the
      gradient at ``d`` (the output channel c·M + m of the depthwise stage is row c·M + m of P_w);
    * bias: ``Σ_l g_il``.

    ``‖∇_i‖² = ‖∂W_d,i‖² + ‖∂W_p,i‖² + ‖∂b_i‖²``. The kernels' values are the step's (the engine's
    stateless scope)."""
    if not _ruled(layer, _SEPARABLE, calls):
        return None
    channels, multiplier = layer.depthwise_kernel.shape[-2], layer.depthwise_kernel.shape[-1]
    filters = layer.pointwise_kernel.shape[-1]
    if any(c["a"].shape[-1] != channels or c["g"].shape[-1] != filters for c in calls):
        return None
    p = calls[0]["g"].shape[0]
    depthwise = jnp.asarray(layer.depthwise_kernel.value, _F32)  # the step's traced values (engine scope)
    pointwise = jnp.reshape(jnp.asarray(layer.pointwise_kernel.value, _F32), (channels * multiplier, filters))
    geometry = dict(strides=layer.strides, dilation_rate=layer.dilation_rate, padding=layer.padding)
    xs, ys, inner = [], [], []
    for c in calls:
        a, g = c["a"].astype(_F32), c["g"].astype(_F32)
        d = depthwise_output(a, depthwise, out_shape=g.shape[1:-1], **geometry)
        if d is None:
            return None
        xs.append(jnp.reshape(d, (p, -1, 1, channels * multiplier)))
        ys.append(jnp.reshape(g, (p, -1, 1, filters)))
        inner.append({"a": a, "g": jnp.einsum("p...f,jf->p...j", g, pointwise,
                                              precision=jax.lax.Precision.HIGHEST)})

    def to_depthwise(kernel):  # (C, K, M) -> (*kernel_size, C, M)
        return jnp.reshape(jnp.transpose(kernel, (1, 0, 2)), (*layer.kernel_size, channels, multiplier))

    stage = _analyse(layer, inner, channels, to_depthwise, layer.depthwise_kernel, None)
    if stage is None:
        return None
    depthwise_sq, depthwise_sums = stage
    x = xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=1)
    y = ys[0] if len(ys) == 1 else jnp.concatenate(ys, axis=1)
    pointwise_sq, per = grouped_sq_norms(x, y)
    sq = depthwise_sq + pointwise_sq
    bias_i = None
    if layer.use_bias:
        bias_i = jnp.sum(y[:, :, 0], axis=1)
        sq = sq + jnp.sum(bias_i * bias_i, axis=1)
    shape = layer.pointwise_kernel.shape

    def sums(c, keep=None):
        out = depthwise_sums(c, keep)
        c = c.astype(_F32)
        if per is not None:
            kernel = jnp.tensordot(c, _kept(per, keep), axes=1)
        else:
            kernel = jnp.einsum("plgi,plgo->gio", _kept(x, keep), _scaled(c, _kept(y, keep)))
        out[id(layer.pointwise_kernel)] = jnp.reshape(kernel, shape)
        if bias_i is not None:
            out[id(layer.bias)] = jnp.tensordot(c, _kept(bias_i, keep), axes=1)
        return out

    return sq, sums


def _transposed_length(size, kernel, stride, dilation, padding):
    """Output length of a transposed convolution with ``output_padding=None`` (Keras's convention):
    ``size·stride`` for ``"same"``, ``(size − 1)·stride + max((kernel − 1)·dilation + 1, stride)``
    for ``"valid"``; ``None`` for any other padding."""
    if padding == "same":
        return size * stride
    if padding == "valid":
        return (size - 1) * stride + max((kernel - 1) * dilation + 1, stride)
    return None


def conv_transpose_rule(layer, calls):
    """``Conv1DTranspose``/``Conv2DTranspose``/``Conv3DTranspose`` (exact types), channels last,
    ``output_padding=None``: kernel W (*kernel_size, F, C) for an input ``a`` (P, *N, C) and an
    output ``z`` (P, *N_out, F). The layer is the input gradient of a convolution of stride s,
    dilation d and the layer's padding taking (P, *N_out, F) to (P, *N, C), so the kernel
    gradient is that convolution's filter gradient with the roles swapped:

        ∂W_i[t, f, c] = Σ_l g_i[l·s + t·d − before, f] · a_i[l, c]

    over the N input positions l (``before`` of :func:`explicit_padding` with the output as the
    "input": (k_eff − s)//2 zeros for ``"same"``, none for ``"valid"``), i.e. the conv rule with
    x = the windows of ``g`` and y = ``a`` (G = 1, d_in = F·K, d_out = C); bias ``Σ_l g_il`` over
    the output positions. An ``output_padding``, or an output whose size is not Keras's, is left
    to the fallback (``None``)."""
    if not _ruled(layer, _TRANSPOSE, calls) or layer.output_padding is not None:
        return None
    filters, channels = layer.kernel.shape[-2], layer.kernel.shape[-1]
    for c in calls:
        if c["a"].shape[-1] != channels or c["g"].shape[-1] != filters:
            return None
        lengths = [_transposed_length(n, k, s, d, layer.padding) for n, k, s, d in
                   zip(c["a"].shape[1:-1], layer.kernel_size, layer.strides, layer.dilation_rate)]
        if tuple(lengths) != tuple(c["g"].shape[1:-1]):
            return None
    swapped = [{"a": c["g"], "g": c["a"]} for c in calls]

    def to_kernel(kernel):  # (1, F·K, C), features (filter, tap) -> (*kernel_size, F, C)
        kernel = jnp.transpose(jnp.reshape(kernel, (filters, -1, channels)), (1, 0, 2))
        return jnp.reshape(kernel, (*layer.kernel_size, filters, channels))

    return _analyse(layer, swapped, 1, to_kernel, bias_calls=calls)
