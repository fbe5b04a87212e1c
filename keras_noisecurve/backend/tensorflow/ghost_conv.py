"""Ghost-clipping rule for ``Conv1D`` / ``Conv2D`` and per-example conv kernel norms.

Which formulation of the per-example kernel gradients runs depends on the kernels
TensorFlow executes in this process (:mod:`keras_noisecurve.backend.tensorflow.kernels`).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_noisecurve import _compat
from keras_noisecurve.backend.tensorflow import kernels as _kernels
from keras_noisecurve.backend.tensorflow.ghost_forms import (
    Rule,
    concat_positions,
    dims,
    norm_dtype,
    per_example_sq,
    scale_smaller,
    sequence_sq_norms,
    weighted_outer,
    weighted_sum,
)


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

    def weighted_sum(self, scale) -> tf.Tensor:
        """(k_h·k_w·c_in, c_out): ``Σ_i scale_i ∂K_i`` for ``scale`` (P,); an example with
        ``scale_i = 0`` contributes exactly 0 even when its ``∂K_i`` is not finite."""
        n, chunk = tf.shape(self.blocks)[0], self.blocks.shape[2]
        scale = tf.reshape(tf.pad(scale, [[0, n * chunk - tf.shape(scale)[0]]]), [n, chunk])
        keep = tf.not_equal(scale, tf.zeros_like(scale))
        blocks = tf.cond(  # no pass over the blocks when no example is dropped
            tf.reduce_all(keep),
            lambda: tf.identity(self.blocks),
            lambda: tf.where(keep[:, None, :, None], self.blocks, tf.zeros_like(self.blocks)),
        )
        return tf.einsum("nkcm,nc->km", blocks, tf.cast(scale, self.blocks.dtype))


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

    static_p = images[0][0].shape[0]
    filled = static_p is not None and static_p % chunk == 0  # every chunk full: no padding

    def take(t, i):
        """Examples i·chunk … i·chunk + chunk − 1 of t, zero-padded to ``chunk`` rows."""
        part = t[i * chunk : (i + 1) * chunk]
        if filled:
            return part
        return tf.pad(part, [[0, chunk - tf.shape(part)[0]]] + [[0, 0]] * (t.shape.rank - 1))

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


def materialise_conv(length, d_in, d_out) -> bool:
    """Whether :class:`ConvRule` forms a conv layer's per-example kernel gradients.

    ``length``: L output positions per example (summed over the layer's calls; ``None``
    when not static), ``d_in`` = k²·c_in, ``d_out`` = c_out. True when L² ≥ d_in·d_out:
    the Gram matrices (P·L² numbers, P·L²·(d_in + d_out) multiply-adds) would be at
    least as large as the per-example gradients. Counting multiply-adds alone would
    favour the per-example gradients more often, but they run as many small
    ``Conv2DBackpropFilter`` calls at a fraction of the batched kernel's speed; on the
    benchmark CNN's third conv (L = 64, d_in = 288, d_out = 64) the Gram form plus the
    batched weight-gradient step was the faster (bench_step, docs/performance.md).
    ``None`` length: False (the Gram form).
    """
    return length is not None and length * length >= d_in * d_out


class ConvRule(Rule):
    """``keras.layers.Conv1D`` / ``Conv2D`` with ``groups=1``.

    Two forms, chosen per layer by :func:`materialise_conv` (dilation 1, L positions,
    d_in = k²·c_in, d_out = c_out):

    - *materialised*: the per-example kernel gradients ∂K_i are formed directly,
      without patches, by :func:`conv_example_grads` (one ``Conv2DBackpropFilter`` per
      example, or one grouped call per chunk of examples where the kernels run that):
      P·L·d_in·d_out multiply-adds, the cost of the weight-gradient step of an ordinary
      backward pass. The norms are ``‖∂K_i‖²`` and the clipped sum is ``Σ_i c_i ∂K_i``
      (P·d_in·d_out), so no second weight-gradient step is run.
    - *Gram*: input patches (same padding, strides and dilation as the layer) are
      unfolded with ``tf.image.extract_patches``, or, for fewer than 8 input channels,
      by the faster convolution with a one-hot kernel, to (P, L, d_in), and the Gram
      form of :func:`sequence_sq_norms` gives the norms (P·L²·(d_in + d_out)); the
      clipped sum is the weight-gradient step of an ordinary backward pass on
      ``(a, c ⊙ g)`` (P·L·d_in·d_out).

    Per layer, the materialised form runs when L² ≥ d_in·d_out (:func:`materialise_conv`).
    A 1×1 kernel takes neither: it is a ``Dense`` map of the input pixels taken at the
    strides (:meth:`_pointwise`: ``‖a_i‖²‖g_i‖²`` on a 1×1 map, else the Gram or per-example
    form of :func:`sequence_sq_norms`, and one matmul for the clipped sum). On EfficientNetB0's
    1×1 and squeeze-and-excitation convolutions (8×8 to 1×1 maps, B = 32) this takes
    0.1–0.5 ms per layer where the grouped filter gradients took 1–2.7 ms.
    """

    classes = (keras.layers.Conv1D, keras.layers.Conv2D)
    kind = "Conv"

    def matches(self, layer) -> bool:
        # exactly Conv1D/Conv2D (not the transposed, separable or depthwise classes,
        # nor subclasses that may change the convolution).
        return type(layer) in self.classes

    def expected_variables(self, layer):
        return [layer.kernel, layer.bias if layer.use_bias else None]

    def check(self, layer):
        reason = super().check(layer)
        if reason:
            return reason
        if layer.groups != 1:
            return f"groups={layer.groups} (only groups=1 is supported)"
        if layer.padding not in ("valid", "same", "causal"):
            return f"padding={layer.padding!r}"
        return None

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        x, padding = inputs, layer.padding
        if padding == "causal":
            x, padding = keras.ops.pad(x, _compat.causal_padding(layer)), "valid"
        z = keras.ops.conv(
            x,
            layer.kernel,
            strides=list(layer.strides),
            padding=padding,
            dilation_rate=layer.dilation_rate,
            data_format=layer.data_format,
        )
        if layer.use_bias:
            if layer.data_format == "channels_last":
                shape = (1,) * (layer.rank + 1) + (layer.filters,)
            else:
                shape = (1, layer.filters) + (1,) * layer.rank
            z = keras.ops.add(z, keras.ops.reshape(layer.bias, shape))
        record(out=z, a=inputs)
        return layer.activation(z) if layer.activation is not None else z

    def _as_2d(self, layer, a):
        """Input as channels-last 2-D images (Conv1D: height 1, causal padding applied),
        with the 2-D kernel size, strides, dilation and TF padding name."""
        if layer.data_format == "channels_first":
            a = tf.transpose(a, [0, *range(2, layer.rank + 2), 1])
        ks, st, dr = list(layer.kernel_size), list(layer.strides), list(layer.dilation_rate)
        padding = layer.padding
        if layer.rank == 1:
            if padding == "causal":
                a = tf.pad(a, [[0, 0], [dr[0] * (ks[0] - 1), 0], [0, 0]])
                padding = "valid"
            a = a[:, None]
            ks, st, dr = [1, *ks], [1, *st], [1, *dr]
        return a, ks, st, dr, padding.upper()

    def _patches(self, a, ks, st, dr, padding):
        c_in = a.shape[-1]
        width = ks[0] * ks[1] * c_in
        if c_in < 8:
            # Few channels: a convolution with a one-hot kernel gives the same windows
            # (order k_h, k_w, c_in) and is several times faster on CPU than
            # tf.image.extract_patches; with many channels its cost (width² per
            # position) loses to extract_patches.
            eye = tf.reshape(tf.eye(width, dtype=a.dtype), [ks[0], ks[1], c_in, width])
            patches = tf.nn.conv2d(a, eye, strides=[1, *st, 1], padding=padding, dilations=[1, *dr, 1])
        else:
            patches = tf.image.extract_patches(
                a, sizes=[1, *ks, 1], strides=[1, *st, 1], rates=[1, *dr, 1], padding=padding
            )
        return tf.reshape(patches, [tf.shape(a)[0], -1, width])

    def _pointwise(self, layer, images, strides, rows):
        """A 1×1 convolution is a ``Dense`` map of every output position's input pixel (the
        input taken at the strides: a 1×1 window never reaches the padding): the norms by
        :func:`sequence_sq_norms` (‖a_i‖²‖g_i‖² on a 1×1 map, the Gram or the per-example
        form otherwise), the clipped sum one matmul over (examples, positions)."""
        pixels = []
        for a, _ in images:
            if strides != [1, 1]:
                a = a[:, :: strides[0], :: strides[1]]
            pixels.append(tf.reshape(a, [tf.shape(a)[0], -1, a.shape[-1]]))
        pixels = concat_positions(pixels)  # (P, L, c_in)
        total = sequence_sq_norms(pixels, rows)
        bias_grads = None
        if layer.use_bias:
            bias_grads = tf.reduce_sum(rows, axis=1)
            total += per_example_sq(bias_grads)

        def grads(scale):
            out = [(layer.kernel, tf.reshape(weighted_outer(pixels, rows, scale), layer.kernel.shape))]
            if bias_grads is not None:
                out.append((layer.bias, weighted_sum(bias_grads, scale)))
            return out

        return total, grads

    def analyse(self, layer, calls):
        dtype = norm_dtype(calls[0]["g"].dtype)
        images, gg = [], []
        for c in calls:
            g = tf.cast(c["g"], dtype)
            if layer.data_format == "channels_first":
                g = tf.transpose(g, [0, *range(2, layer.rank + 2), 1])
            if layer.rank == 1:
                g = g[:, None]
            a, ks, st, dr, padding = self._as_2d(layer, tf.cast(tf.stop_gradient(c["a"]), dtype))
            images.append((a, g))
            gg.append(tf.reshape(g, [tf.shape(g)[0], -1, layer.filters]))
        rows = concat_positions(gg)
        length, d_in = rows.shape[1], ks[0] * ks[1] * images[0][0].shape[-1]
        if ks == [1, 1]:
            return self._pointwise(layer, images, st, rows)
        patches = example_grads = None
        if max(dr) == 1 and materialise_conv(length, d_in, layer.filters):
            example_grads = conv_example_grads(images, ks, st, padding)
            total = example_grads.sq_norms()
        else:
            patches = concat_positions([self._patches(a, ks, st, dr, padding) for a, _ in images])
            total = sequence_sq_norms(patches, rows)
        bias_grads = None
        if layer.use_bias:
            bias_grads = tf.reduce_sum(rows, axis=1)
            total += per_example_sq(bias_grads)

        def grads(scale):
            if example_grads is not None:
                # Σ_i c_i ∂K_i from the per-example kernel gradients already formed
                kernel = example_grads.weighted_sum(scale)
            elif max(dr) > 1:
                # TF's CPU Conv2DBackpropFilter refuses dilation > 1: use the patches
                # (order k_h, k_w, c_in = the kernel's leading axes).
                kernel = weighted_outer(patches, rows, scale)
            else:
                # The weight-gradient step of an ordinary backward pass, on (a, c ⊙ g):
                # the patches need not stay alive until here.
                kernel = tf.add_n(
                    [
                        tf.compat.v1.nn.conv2d_backprop_filter(
                            a_scaled,
                            [ks[0], ks[1], a.shape[-1], layer.filters],
                            g_scaled,
                            strides=[1, *st, 1],
                            padding=padding,
                            dilations=[1, *dr, 1],
                        )
                        for a, g in images
                        for a_scaled, g_scaled in [scale_smaller(a, g, scale)]
                    ]
                )
            out = [(layer.kernel, tf.reshape(kernel, layer.kernel.shape))]
            if bias_grads is not None:
                out.append((layer.bias, weighted_sum(bias_grads, scale)))
            return out

        return total, grads


