"""Ghost-clipping rules for the other convolutions: depthwise, separable, grouped, 3-D, transposed.

Every one of these layers has a kernel whose per-example gradient is a sum of outer
products over output positions, one per *group* of channels:

    ∂W_i[g] = Σ_l x_ilg ⊗ y_ilg          x (P, L, G, d_in), y (P, L, G, d_out)

with, per layer kind (K = the number of kernel taps, k_h·k_w, k or k_d·k_h·k_w):

| layer | x (patches of …) | y | G | d_in | d_out |
|---|---|---|---|---|---|
| DepthwiseConv1D/2D | the input a | g | c_in | K | depth multiplier |
| Conv1D/2D/3D, ``groups`` = G | the input a | g | G | K·c_in/G | c_out/G |
| Conv1D/2D/3DTranspose | the output gradient g | the input a | 1 | K·c_out | c_in |
| SeparableConv1D/2D, depthwise | the input a | g_u = g·Wₚᵀ | c_in | K | depth multiplier |
| SeparableConv1D/2D, pointwise | u (no patches) | g | 1 | c_in·mult | filters |

where *patches* are the windows of the layer's own convolution (same kernel size,
strides, dilation and padding; :func:`patches`), ``g`` is the gradient of
``Σ_i w_i·loss_i`` w.r.t. the layer's pre-activation output, and for a separable
convolution ``u`` is the depthwise stage's output (recorded in the forward pass) and
``g_u = g·Wₚᵀ`` its gradient (the pointwise kernel Wₚ is a 1×1 convolution: one matmul).
A transposed convolution's kernel gradient is the convolution's filter gradient with the
roles swapped: the output gradient is the "input" whose windows are taken, the input the
"output gradient" (its positions are exactly the windows of the output at the layer's
strides, for ``output_padding=None``).

:class:`GroupedGrads` takes the cheaper exact form per layer, as the plain conv rule
does: the per-example gradients (P·G·d_in·d_out numbers) when L² ≥ d_in·d_out, else the
Gram form ``Σ_g Σ_{l,l'} (x_ilg·x_il'g)(y_ilg·y_il'g)`` (P·G·L² numbers). The clipped sum
``Σ_i c_i ∂W_i`` comes from the same (x, y) (book-keeping): a weighted sum of the
per-example gradients, or one contraction over (examples, positions) with ``c ⊙ y``.

Refused by ``check`` (the exact per-layer fallback then clips the layer): ``causal``
padding on the depthwise/separable/grouped 1-D layers, ``output_padding`` on transposed
convolutions, and dilation > 1 on 3-D layers (``tf.extract_volume_patches`` has no rates).
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from keras_noisecurve.backend.tensorflow.ghost_forms import Rule, dims, norm_dtype, per_example_sq, weighted_sum
from keras_noisecurve.backend.tensorflow.ghost_forms import scale_smaller
from keras_noisecurve.backend.tensorflow import kernels as _kernels
from keras_noisecurve.backend.tensorflow.ghost_conv import ConvRule, conv_chunk, conv_example_grads, materialise_conv
from keras_noisecurve.backend.tensorflow.ghost_taps import LiveTapGrads, correlation_example_grads, tap_example_grads


# ------------------------------------------------------------------------ tensor math


def channels_last(t: tf.Tensor, layer) -> tf.Tensor:
    """``t`` (P, …) in the layer's data format, as channels-last."""
    if getattr(layer, "data_format", "channels_last") == "channels_first":
        return tf.transpose(t, [0, *range(2, t.shape.rank), 1])
    return t


def patches(x: tf.Tensor, *, kernel_size, strides, dilation_rate, padding: str) -> tf.Tensor:
    """Windows of a channels-last ``x`` (P, *spatial, C), rank 1, 2 or 3, as (P, L, K, C).

    The windows of the convolution with ``kernel_size`` (K = their product taps, in the
    kernel's order, e.g. (k_h, k_w)), ``strides``, ``dilation_rate`` and ``padding``
    (``"valid"``/``"same"``, TensorFlow's convention, the one Keras uses); L output
    positions in row-major order. Rank 3 needs dilation 1.
    """
    rank = len(kernel_size)
    ks, st, dr = list(kernel_size), list(strides), list(dilation_rate)
    c = x.shape[-1]
    if rank == 1:
        x, ks, st, dr = x[:, None], [1, *ks], [1, *st], [1, *dr]
    if rank <= 2:
        windows = tf.image.extract_patches(
            x, sizes=[1, *ks, 1], strides=[1, *st, 1], rates=[1, *dr, 1], padding=padding.upper()
        )
    else:
        if max(dr) != 1:
            raise ValueError(f"3-D patches need dilation_rate 1, got {tuple(dr)}")
        windows = tf.extract_volume_patches(x, ksizes=[1, *ks, 1], strides=[1, *st, 1], padding=padding.upper())
    return tf.reshape(windows, [tf.shape(x)[0], -1, math.prod(ks), c])


def positions(t: tf.Tensor) -> tf.Tensor:
    """A channels-last (P, *spatial, C) tensor as (P, L, C)."""
    return tf.reshape(t, [tf.shape(t)[0], -1, t.shape[-1]])


class GroupedGrads:
    """Per-example, per-group gradients ``∂W_i[g] = Σ_l x_ilg ⊗ y_ilg`` of a kernel, exact.

    ``pairs``: the layer's calls as ``(x, y)`` with x (P, L, G, d_in) and y (P, L, G, d_out)
    (calls are concatenated along L: a shared layer's gradient is the sum over its calls).
    The form is static: the per-example gradients (P, G, d_in, d_out) when L is known and
    L² ≥ d_in·d_out, else the Gram form (memory P·G·L²); ``materialise`` (a bool) forces one.
    """

    def __init__(self, pairs, materialise=None):
        if pairs is None:  # from_per_example
            return
        x = pairs[0][0] if len(pairs) == 1 else tf.concat([p[0] for p in pairs], axis=1)
        y = pairs[0][1] if len(pairs) == 1 else tf.concat([p[1] for p in pairs], axis=1)
        self.x, self.y = x, y
        length, d_in, d_out = x.shape[1], x.shape[-1], y.shape[-1]
        if materialise is None:
            materialise = length is not None and length * length >= d_in * d_out
        self.materialised = bool(materialise)
        self.single = x.shape[2] == 1  # one group: plain (batched) matmuls
        self.per_example = None
        if self.materialised:
            if self.single:
                self.per_example = tf.einsum("pli,plo->pio", x[:, :, 0], y[:, :, 0])[:, None]
            elif d_in * d_out <= 64:  # e.g. depthwise (K × M): TF's einsum makes P·G tiny matmuls
                self.per_example = tf.reduce_sum(x[..., None] * y[:, :, :, None, :], axis=1)
            else:
                self.per_example = tf.einsum("plgi,plgo->pgio", x, y)

    @classmethod
    def from_per_example(cls, per_example):
        """The materialised form from per-example gradients (P, G, d_in, d_out) made elsewhere."""
        grads = cls(None)
        grads.materialised, grads.per_example = True, per_example
        return grads

    def sq_norms(self) -> tf.Tensor:
        """(P,): Σ_g ‖∂W_i[g]‖²_F."""
        if self.materialised:
            return per_example_sq(self.per_example)
        if self.single:
            x, y = self.x[:, :, 0], self.y[:, :, 0]
            xx, yy = tf.matmul(x, x, transpose_b=True), tf.matmul(y, y, transpose_b=True)
            return tf.reduce_sum(xx * yy, axis=[1, 2])
        xx = tf.einsum("plgi,pmgi->pglm", self.x, self.x)
        yy = tf.einsum("plgo,pmgo->pglm", self.y, self.y)
        return tf.reduce_sum(xx * yy, axis=[1, 2, 3])

    def weighted_sum(self, scale) -> tf.Tensor:
        """(G, d_in, d_out): ``Σ_i scale_i ∂W_i``; an example with ``scale_i = 0`` contributes
        exactly 0 even when its rows are not finite."""
        if self.materialised:
            return weighted_sum(self.per_example, scale)
        x, y = scale_smaller(self.x, self.y, scale)
        if self.single:
            d_in, d_out = x.shape[-1], y.shape[-1]
            return tf.matmul(tf.reshape(x, [-1, d_in]), tf.reshape(y, [-1, d_out]), transpose_a=True)[None]
        return tf.einsum("plgi,plgo->gio", x, y)


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
    filled = a0.shape[0] is not None and a0.shape[0] % chunk == 0

    def take(t, i):
        """Examples i·chunk … i·chunk + chunk − 1 of t, zero-padded to ``chunk`` rows."""
        part = t[i * chunk : (i + 1) * chunk]
        if filled:
            return part
        return tf.pad(part, [[0, chunk - tf.shape(part)[0]]] + [[0, 0]] * (t.shape.rank - 1))

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


def _bias_grads(layer, gs):
    """Per-example bias gradient (P, C) from the channels-last output gradients ``gs``."""
    if not layer.use_bias:
        return None
    return tf.add_n([tf.reduce_sum(positions(g), axis=1) for g in gs])


def _refuse_xla_channels_first(layer):
    """Keras runs a grouped or 3-D channels-first convolution through an XLA-compiled op on
    CPU; on this TensorFlow a bias added to its output is broadcast over the wrong axis for
    some shapes (the layer computes something else than its definition), so the rule, which
    differentiates the definition, is refused there: the per-layer fallback differentiates
    the layer as it runs."""
    if layer.data_format == "channels_first" and _kernels.device_type() == "CPU":
        return "channels_first on CPU (Keras runs it through XLA; the bias add is not the layer's definition)"
    return None


def _refuse_causal(layer):
    if layer.padding == "causal":
        return "padding='causal'"
    return None


def _add_bias(layer, z, channels):
    if not layer.use_bias:
        return z
    if layer.data_format == "channels_last":
        shape = (1,) * (layer.rank + 1) + (channels,)
    else:
        shape = (1, channels) + (1,) * layer.rank
    return keras.ops.add(z, keras.ops.reshape(layer.bias, shape))


def _activate(layer, z):
    return layer.activation(z) if layer.activation is not None else z


def _depthwise_pairs(layer, a, g, kernel_shape):
    """(x, y) of a depthwise kernel (*k, C, M): x (P, L, C, K) patches of ``a``, y (P, L, C, M)."""
    *ks, c, m = kernel_shape
    x = patches(a, kernel_size=ks, strides=layer.strides, dilation_rate=layer.dilation_rate, padding=layer.padding)
    x = tf.transpose(x, [0, 1, 3, 2])
    y = tf.reshape(g, [tf.shape(g)[0], -1, c, m])
    return x, y


def _native_depthwise(layer) -> bool:
    """Whether :func:`_depthwise_example_grads` runs: TensorFlow's depthwise filter gradient
    takes equal strides in both spatial axes and dilation 1 (a 1-D layer is an image of
    height 1, so only stride 1)."""
    strides = [1, *layer.strides] if len(layer.strides) == 1 else list(layer.strides)
    return max(layer.dilation_rate) == 1 and len(set(strides)) == 1


def _depthwise_example_grads(layer, images, kernel_shape):
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
        stride = layer.strides[0]
        kernel = tf.nn.depthwise_conv2d_backprop_filter(
            a_img, [*([1] * (2 - len(ks))), *ks, p * c, m], g_img, strides=[1, stride, stride, 1],
            padding=layer.padding.upper(),
        )
        total += tf.reshape(kernel, [k, p, c, m])
    return tf.transpose(total, [1, 2, 0, 3])


def _depthwise_grads(layer, a, g, kernel_shape):
    """:class:`GroupedGrads` (G = C, d_in = K, d_out = M) of a depthwise kernel.

    Four exact forms (measured on CPU at B = 32, docs/performance.md): TensorFlow's
    depthwise filter gradient over the P·C (example, channel) pairs for kernels of at most
    3 taps a side on inputs of at least 2 kernel sizes a side (1.1–1.9 ms on 8×8 to 32×32
    maps, but 50–450 ms on 4×4 and smaller maps, and with 5×5 kernels on 8×8 and 11×11
    inputs); else, for depth multiplier 1, dilation 1 and at least 2×2 output positions,
    one depthwise convolution of the input with the output gradient
    (:func:`correlation_example_grads`: 0.8–2.1 ms on EfficientNetB0's 11×11 to 2×2 maps
    where the taps took 1.3–3.9 ms); else one slice of the input per live tap
    (:func:`tap_example_grads`, 0.4–0.7 ms on 1×1 maps, where one tap of a 5×5 kernel is
    live); the windows (:func:`patches`) only when the spatial sizes are not static.
    """
    ks, m = kernel_shape[:-2], kernel_shape[-1]
    static = all(t.shape[1:-1].is_fully_defined() for t in (*a, *g))
    large = static and max(ks) <= 3 and all(all(n >= 2 * k for n, k in zip(ai.shape[1:-1], ks)) for ai in a)
    if _native_depthwise(layer) and large:
        return GroupedGrads.from_per_example(_depthwise_example_grads(layer, list(zip(a, g)), kernel_shape))
    if not static:
        return GroupedGrads([_depthwise_pairs(layer, ai, gi, kernel_shape) for ai, gi in zip(a, g)])
    if m == 1 and max(layer.dilation_rate) == 1 and all(gi.shape[1:-1].num_elements() >= 4 for gi in g):
        per_example = tf.add_n([correlation_example_grads(ai, gi, kernel_size=ks, strides=layer.strides,
                                                          padding=layer.padding) for ai, gi in zip(a, g)])
        return GroupedGrads.from_per_example(tf.transpose(per_example, [0, 2, 1])[..., None])  # (P, C, K, 1)
    taps = [tap_example_grads(ai, gi, kernel_size=ks, strides=layer.strides, dilation_rate=layer.dilation_rate,
                              padding=layer.padding, multiplier=m) for ai, gi in zip(a, g)]
    return LiveTapGrads(taps, math.prod(ks))


def _depthwise_kernel(summed, kernel_shape):
    """(C, K, M) per-channel sums as the depthwise kernel (*k, C, M)."""
    return tf.reshape(tf.transpose(summed, [1, 0, 2]), kernel_shape)


def _finish(total, bias_grads, terms, layer):
    """The rule's ``(sq_norms, grads)`` from ``terms`` = [(variable, GroupedGrads, to_kernel)]."""
    for _, grads, _ in terms:
        total = grads.sq_norms() if total is None else total + grads.sq_norms()
    if bias_grads is not None:
        total += per_example_sq(bias_grads)

    def grads(scale):
        out = [(variable, to_kernel(g.weighted_sum(scale))) for variable, g, to_kernel in terms]
        if bias_grads is not None:
            out.append((layer.bias, weighted_sum(bias_grads, scale)))
        return out

    return total, grads


def _inputs(layer, calls, key="a"):
    dtype = norm_dtype(calls[0]["g"].dtype)
    a = [channels_last(tf.cast(tf.stop_gradient(c[key]), dtype), layer) for c in calls]
    g = [channels_last(tf.cast(c["g"], dtype), layer) for c in calls]
    return a, g


# ------------------------------------------------------------------------ rules


class _ExactClassRule(Rule):
    def matches(self, layer) -> bool:
        # exactly these classes: a subclass may change the convolution
        return type(layer) in self.classes


class DepthwiseConvRule(_ExactClassRule):
    """``keras.layers.DepthwiseConv1D`` / ``DepthwiseConv2D``: per channel c, the kernel
    gradient is ``Σ_l patch_il[:, c] ⊗ g_il[c, :]`` (K × M); the per-example gradients
    (P·C·K·M numbers, as small as the kernel times P) are formed in one contraction."""

    classes = (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
    kind = "DepthwiseConv"

    def expected_variables(self, layer):
        return [layer.kernel, layer.bias if layer.use_bias else None]

    def check(self, layer):
        return super().check(layer) or _refuse_causal(layer)

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        z = keras.ops.depthwise_conv(
            inputs, layer.kernel, strides=layer.strides, padding=layer.padding,
            dilation_rate=layer.dilation_rate, data_format=layer.data_format,
        )
        z = _add_bias(layer, z, layer.kernel.shape[-2] * layer.kernel.shape[-1])
        record(out=z, a=inputs)
        return _activate(layer, z)

    def analyse(self, layer, calls):
        a, g = _inputs(layer, calls)
        shape = tuple(layer.kernel.shape)
        terms = [(layer.kernel, _depthwise_grads(layer, a, g, shape), lambda s: _depthwise_kernel(s, shape))]
        return _finish(None, _bias_grads(layer, g), terms, layer)


class SeparableConvRule(_ExactClassRule):
    """``keras.layers.SeparableConv1D`` / ``SeparableConv2D``: the depthwise stage
    (kernel (*k, C, M)) then the pointwise 1×1 stage (kernel (1…, C·M, F)). The forward
    pass records the depthwise output u; its gradient is ``g_u = g·Wₚᵀ`` (one matmul), and
    the two kernels' per-example gradients are a depthwise one on (a, g_u) and a dense one
    on (u, g). Both are summed into each example's norm."""

    classes = (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)
    kind = "SeparableConv"

    def expected_variables(self, layer):
        return [layer.depthwise_kernel, layer.pointwise_kernel, layer.bias if layer.use_bias else None]

    def check(self, layer):
        return super().check(layer) or _refuse_causal(layer)

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        u = keras.ops.depthwise_conv(
            inputs, layer.depthwise_kernel, strides=layer.strides, padding=layer.padding,
            dilation_rate=layer.dilation_rate, data_format=layer.data_format,
        )
        # the 1×1 pointwise stage as a contraction over channels (TensorFlow's CPU conv
        # refuses channels-first; the layer's separable op transposes for it)
        if layer.data_format == "channels_first":
            pointwise = keras.ops.reshape(layer.pointwise_kernel, layer.pointwise_kernel.shape[-2:])
            z = keras.ops.einsum("bc...,cf->bf...", u, pointwise)
        else:
            z = keras.ops.conv(u, layer.pointwise_kernel, strides=1, padding="valid")
        z = _add_bias(layer, z, layer.filters)
        record(out=z, a=inputs, u=u)
        return _activate(layer, z)

    def analyse(self, layer, calls):
        a, g = _inputs(layer, calls)
        u, _ = _inputs(layer, calls, key="u")
        dw_shape, pw_shape = tuple(layer.depthwise_kernel.shape), tuple(layer.pointwise_kernel.shape)
        pointwise = tf.reshape(tf.cast(layer.pointwise_kernel, g[0].dtype), pw_shape[-2:])  # (C·M, F)
        gu, pw_pairs = [], []
        for gi, ui in zip(g, u):
            gz = positions(gi)  # (P, L, F)
            gu.append(tf.reshape(tf.matmul(gz, pointwise, transpose_b=True), tf.shape(ui)))
            pw_pairs.append((positions(ui)[:, :, None], gz[:, :, None]))
        terms = [
            (layer.depthwise_kernel, _depthwise_grads(layer, a, gu, dw_shape),
             lambda s: _depthwise_kernel(s, dw_shape)),
            (layer.pointwise_kernel, GroupedGrads(pw_pairs), lambda s: tf.reshape(s, pw_shape)),
        ]
        return _finish(None, _bias_grads(layer, g), terms, layer)


def _grouped_pairs(layer, a, g):
    """(x, y) of a grouped kernel (*k, C/G, F): x (P, L, G, K·C/G), y (P, L, G, F/G)."""
    groups, ks = layer.groups, list(layer.kernel_size)
    x = patches(a, kernel_size=ks, strides=layer.strides, dilation_rate=layer.dilation_rate, padding=layer.padding)
    p, k, c = tf.shape(x)[0], math.prod(ks), a.shape[-1] // groups
    x = tf.reshape(x, [p, -1, k, groups, c])
    x = tf.reshape(tf.transpose(x, [0, 1, 3, 2, 4]), [p, -1, groups, k * c])
    y = tf.reshape(g, [p, -1, groups, layer.filters // groups])
    return x, y


class GroupedConvRule(ConvRule):
    """``keras.layers.Conv1D`` / ``Conv2D`` with ``groups`` > 1: group g's kernel gradient
    is the plain conv's, on input channels and filters of group g only (the patches of the
    input, grouped)."""

    classes = (keras.layers.Conv1D, keras.layers.Conv2D)
    kind = "GroupedConv"

    def check(self, layer):
        reason = Rule.check(self, layer)
        if reason:
            return reason
        if layer.groups == 1:
            return "groups=1 (the plain Conv rule)"
        return _refuse_causal(layer) or _refuse_xla_channels_first(layer)

    def analyse(self, layer, calls):
        a, g = _inputs(layer, calls)
        shape, groups = tuple(layer.kernel.shape), layer.groups
        if layer.rank == 3 and groups == 1:
            per_example = example_grads_3d(list(zip(a, g)), layer.kernel_size, layer.strides, layer.padding)
            grads = GroupedGrads.from_per_example(per_example[:, None])
        else:
            grads = GroupedGrads([_grouped_pairs(layer, ai, gi) for ai, gi in zip(a, g)])

        def to_kernel(summed):  # (G, K·c, f) -> (*k, c, G·f)
            *ks, c, f = shape
            summed = tf.reshape(summed, [groups, math.prod(ks), c, f // groups])
            return tf.reshape(tf.transpose(summed, [1, 2, 0, 3]), shape)

        return _finish(None, _bias_grads(layer, g), [(layer.kernel, grads, to_kernel)], layer)


class Conv3DRule(GroupedConvRule):
    """``keras.layers.Conv3D`` (any ``groups``): windows from ``tf.extract_volume_patches``;
    dilation > 1 is refused (the fallback clips it)."""

    classes = (keras.layers.Conv3D,)
    kind = "Conv3D"

    def check(self, layer):
        reason = Rule.check(self, layer)
        if reason:
            return reason
        if max(layer.dilation_rate) != 1:
            return f"dilation_rate={tuple(layer.dilation_rate)} (3-D windows need dilation 1)"
        return _refuse_xla_channels_first(layer)


class ConvTransposeRule(_ExactClassRule):
    """``keras.layers.Conv1DTranspose`` / ``Conv2DTranspose`` / ``Conv3DTranspose``, kernel
    (*k, F, C): the gradient is the forward convolution's filter gradient with the roles
    swapped, ``∂W_i = Σ_l patch(g_i)_l ⊗ a_il`` over the input positions l (the windows of
    the output gradient at the layer's strides, dilation and padding)."""

    classes = (keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose, keras.layers.Conv3DTranspose)
    kind = "ConvTranspose"

    def expected_variables(self, layer):
        return [layer.kernel, layer.bias if layer.use_bias else None]

    def check(self, layer):
        reason = super().check(layer)
        if reason:
            return reason
        if layer.output_padding is not None:
            return f"output_padding={layer.output_padding}"
        if layer.rank == 3 and max(layer.dilation_rate) != 1:
            return f"dilation_rate={tuple(layer.dilation_rate)} (3-D windows need dilation 1)"
        return _refuse_causal(layer)

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        z = keras.ops.conv_transpose(
            inputs, layer.kernel, strides=list(layer.strides), padding=layer.padding, output_padding=None,
            dilation_rate=layer.dilation_rate, data_format=layer.data_format,
        )
        z = _add_bias(layer, z, layer.filters)
        record(out=z, a=inputs)
        return _activate(layer, z)

    def analyse(self, layer, calls):
        a, g = _inputs(layer, calls)
        shape = tuple(layer.kernel.shape)
        ks, dilated = list(layer.kernel_size), max(layer.dilation_rate) > 1
        length = sum(math.prod(ai.shape[1:-1]) for ai in a) if all(ai.shape[1:-1].is_fully_defined() for ai in a) else None
        if layer.rank == 3:  # roles swapped: g is the image, a the output gradient
            per_example = example_grads_3d(list(zip(g, a)), ks, layer.strides, layer.padding)
            grads = GroupedGrads.from_per_example(per_example[:, None])
            return _finish(None, _bias_grads(layer, g), [(layer.kernel, grads, lambda s: tf.reshape(s, shape))], layer)
        if not dilated and materialise_conv(length, math.prod(shape[:-1]), shape[-1]):
            # per-example filter gradients of the swapped convolution (ghost_conv), one
            # batched or grouped Conv2DBackpropFilter per chunk of examples
            images = [(gi, ai) if layer.rank == 2 else (gi[:, None], ai[:, None]) for ai, gi in zip(a, g)]
            filter_hw, strides = (ks, layer.strides) if layer.rank == 2 else ([1, *ks], [1, *layer.strides])
            grads = conv_example_grads(images, filter_hw, list(strides), layer.padding.upper())
            terms = [(layer.kernel, grads, lambda s: tf.reshape(s, shape))]
            return _finish(None, _bias_grads(layer, g), terms, layer)
        pairs = []
        for ai, gi in zip(a, g):
            x = patches(gi, kernel_size=layer.kernel_size, strides=layer.strides,
                        dilation_rate=layer.dilation_rate, padding=layer.padding)
            x = tf.reshape(x, [tf.shape(x)[0], -1, 1, math.prod(shape[:-1])])  # (P, L_in, 1, K·F)
            pairs.append((x, positions(ai)[:, :, None]))
        grads = GroupedGrads(pairs)
        terms = [(layer.kernel, grads, lambda s: tf.reshape(s, shape))]
        return _finish(None, _bias_grads(layer, g), terms, layer)


__all__ = [
    "Conv3DRule", "ConvTransposeRule", "DepthwiseConvRule", "GroupedConvRule", "GroupedGrads",
    "SeparableConvRule", "patches",
]
