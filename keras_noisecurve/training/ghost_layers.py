"""Per-layer rules for ghost (per-example) gradient norms.

Each rule knows, for one Keras 3 layer type with its own trainable weights,

1. ``check(layer)``: why the layer's configuration is not supported (``None`` if it is);
2. ``forward(layer, original_call, record, inputs, *args, **kwargs)``: the layer's
   forward computation, recording the tensor ``out`` whose gradient ``g`` is needed
   (the *pre-activation* output for layers with a fused ``activation=``) and the
   auxiliary tensors (input activation, token ids, normalised input) of that call;
3. ``analyse(layer, calls) -> (sq_norms, grads)``: from the recorded calls (each a
   dict with the recorded tensors and ``"g"``, the gradient of ``Σ_i w_i·loss_i``
   w.r.t. ``out``), the per-example squared norm (P,) of the gradient of the layer's
   own weights, and a function ``grads(scale)`` returning ``[(variable,
   Σ_i scale_i·∇_variable(w_i·loss_i))]``: with ``scale = c`` (the clip factors) this is
   the layer's part of the clipped sum, assembled from the same ``(a, g)`` as the
   norms ("book-keeping", Bu et al. 2022) instead of a second backward pass.

No per-example gradient of a weight is materialised unless it is the cheaper form
(see :func:`sequence_sq_norms`). A layer called several times (shared weights) has
its calls concatenated along the position axis: the per-example gradient of a weight
is the sum over calls and positions of the same outer products.

Only TensorFlow and Keras are imported here.
"""

from __future__ import annotations

import string

import keras
import tensorflow as tf

from keras_noisecurve.models import GroupNorm as _PaperGroupNorm
from keras_noisecurve.training import kernels as _kernels

# --------------------------------------------------------------------------- math


def _norm_dtype(dtype) -> tf.DType:
    """float64 stays float64; everything else is computed in float32."""
    dtype = tf.as_dtype(dtype)
    return tf.float64 if dtype == tf.float64 else tf.float32


def sequence_sq_norms(a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """Per-example ``‖Σ_l a_il g_ilᵀ‖²_F`` without forming it when that is dearer.

    ``a``: (P, L, d_in) input activations, ``g``: (P, L, d_out) output gradients.
    Returns (P,). For L = 1 this is ``‖a_i‖²·‖g_i‖²``. Otherwise the Gram form
    ``Σ_{l,l'} (a_il·a_il')(g_il·g_il')`` (memory P·L²) is used when L² < d_in·d_out,
    else the per-example gradient ``a_iᵀ g_i`` (memory P·d_in·d_out) is formed and
    squared. The choice is static when L is known, a ``tf.cond`` otherwise.
    """
    d_in, d_out = a.shape[-1], g.shape[-1]
    length = a.shape[1]
    if length == 1:
        return tf.reduce_sum(tf.square(a), axis=[1, 2]) * tf.reduce_sum(tf.square(g), axis=[1, 2])

    def gram():
        aa = tf.matmul(a, a, transpose_b=True)
        gg = tf.matmul(g, g, transpose_b=True)
        return tf.reduce_sum(aa * gg, axis=[1, 2])

    def materialise():
        per_example = tf.einsum("pli,plj->pij", a, g)  # faster than matmul(transpose_a) on CPU
        return tf.reduce_sum(tf.square(per_example), axis=[1, 2])

    if d_in is None or d_out is None:
        return gram()
    if length is not None:
        return gram() if length * length < d_in * d_out else materialise()
    dyn = tf.shape(a)[1]
    return tf.cond(dyn * dyn < d_in * d_out, gram, materialise)


def token_sq_norms(ids: tf.Tensor, g: tf.Tensor, vocabulary: int) -> tf.Tensor:
    """Per-example squared norm of an embedding table's gradient.

    ``ids``: (P, L) integer token ids, ``g``: (P, L, d) gradients of the looked-up rows.
    The per-example gradient of row v is ``Σ_{l: id_l = v} g_l``, so its squared norm is
    ``Σ_{l,l'} [id_l = id_l'] (g_l·g_l')`` (Gram form, memory P·L²), used when
    L² < vocabulary·d; else the rows are summed per example with a segment sum
    (memory P·vocabulary·d). Returns (P,).
    """
    d = g.shape[-1]
    length = ids.shape[1]

    def gram():
        same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), g.dtype)
        gg = tf.matmul(g, g, transpose_b=True)
        return tf.reduce_sum(same * gg, axis=[1, 2])

    def materialise():
        p = tf.shape(ids)[0]
        seg = ids + tf.range(p, dtype=ids.dtype)[:, None] * vocabulary
        rows = tf.math.unsorted_segment_sum(
            tf.reshape(g, [-1, d]), tf.reshape(seg, [-1]), p * vocabulary
        )
        return tf.reduce_sum(tf.square(tf.reshape(rows, [p, vocabulary * d])), axis=1)

    if length is not None:
        return gram() if length * length < vocabulary * d else materialise()
    dyn = tf.shape(ids)[1]
    return tf.cond(dyn * dyn < vocabulary * d, gram, materialise)


def _concat_positions(tensors):
    return tensors[0] if len(tensors) == 1 else tf.concat(tensors, axis=1)


def _sum_over(t: tf.Tensor, keep_axes) -> tf.Tensor:
    """Sum ``t`` over every axis except 0 and ``keep_axes`` (sorted, positive)."""
    axes = [k for k in range(1, t.shape.rank) if k not in keep_axes]
    return tf.reduce_sum(t, axis=axes) if axes else t


def _sq(t: tf.Tensor) -> tf.Tensor:
    """Per-example sum of squares of a (P, ...) tensor."""
    return tf.reduce_sum(tf.square(tf.reshape(t, [tf.shape(t)[0], -1])), axis=1)


def _bias_grad(g: tf.Tensor, bias_shape) -> tf.Tensor:
    """Per-example gradient of a bias broadcast-added to an output with gradient ``g``.

    ``bias_shape`` is right-aligned against ``g.shape[1:]``; axes where the bias is
    absent or has size 1 are summed. Returns (P, ...) (kept axes in order).
    """
    rank = g.shape.rank
    offset = rank - len(bias_shape)
    keep = []
    for k in range(1, rank):
        j = k - offset
        if j >= 0 and bias_shape[j] != 1:
            keep.append(k)
    return _sum_over(g, keep)


def _scale_smaller(a: tf.Tensor, g: tf.Tensor, scale: tf.Tensor):
    """``(a, g)`` with the one of fewer entries per example multiplied by ``scale_i``.

    ``a`` (P, ...), ``g`` (P, ...), ``scale`` (P,). A bilinear weight gradient
    Σ_i (a_i ⊗ g_i) scaled per example is the same whichever factor carries the scale;
    scaling the smaller one is one cheaper pass (e.g. the first conv's 3-channel input
    rather than its 16-channel output gradient).
    """
    size_a, size_g = (t.shape[1:].num_elements() for t in (a, g))
    if size_a is not None and size_g is not None and size_a < size_g:
        return a * tf.reshape(scale, [-1] + [1] * (a.shape.rank - 1)), g
    return a, g * tf.reshape(scale, [-1] + [1] * (g.shape.rank - 1))


def _weighted_outer(a: tf.Tensor, g: tf.Tensor, scale: tf.Tensor) -> tf.Tensor:
    """``Σ_i scale_i Σ_l a_il g_ilᵀ`` (d_in, d_out) from a (P, L, d_in), g (P, L, d_out)."""
    d_in, d_out = a.shape[-1], g.shape[-1]
    a, g = _scale_smaller(a, g, scale)
    return tf.matmul(tf.reshape(a, [-1, d_in]), tf.reshape(g, [-1, d_out]), transpose_a=True)


def _weighted_sum(per_example: tf.Tensor, scale: tf.Tensor) -> tf.Tensor:
    """``Σ_i scale_i · per_example_i`` for a (P, ...) tensor."""
    return tf.tensordot(scale, per_example, axes=1)


# ---------------------------------------------------------------------- rules


class _Rule:
    classes: tuple = ()
    kind = ""

    def matches(self, layer) -> bool:
        return any(
            isinstance(layer, cls) and type(layer).call is cls.call for cls in self.classes
        )

    def expected_variables(self, layer):
        raise NotImplementedError

    def check(self, layer):
        if getattr(layer, "quantization_mode", None) is not None:
            return f"quantized ({layer.quantization_mode})"
        if getattr(layer, "lora_enabled", False):
            return "LoRA is enabled"
        expected = {id(v) for v in self.expected_variables(layer) if v is not None}
        extra = [v.path for v in layer._trainable_variables if id(v) not in expected]
        if extra:
            return f"unexpected own trainable variables {extra}"
        return None


class DenseRule(_Rule):
    """``keras.layers.Dense`` on inputs of any rank ≥ 2 (positions = middle axes)."""

    classes = (keras.layers.Dense,)
    kind = "Dense"

    def expected_variables(self, layer):
        return [layer.kernel, layer.bias]

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        z = keras.ops.matmul(inputs, layer.kernel)
        if layer.bias is not None:
            z = keras.ops.add(z, layer.bias)
        record(out=z, a=inputs)
        return layer.activation(z) if layer.activation is not None else z

    def _sequence(self, layer, a, g):
        d_in, d_out = layer.kernel.shape
        p = tf.shape(a)[0]
        return tf.reshape(a, [p, -1, d_in]), tf.reshape(g, [p, -1, d_out])

    def _gathered(self, layer, calls):
        """(dtype, a, g): every call's input and output gradient as (P, positions, d) sequences."""
        dtype = _norm_dtype(calls[0]["g"].dtype)
        pairs = [
            self._sequence(layer, tf.cast(tf.stop_gradient(c["a"]), dtype), tf.cast(c["g"], dtype))
            for c in calls
        ]
        return dtype, _concat_positions([p[0] for p in pairs]), _concat_positions([p[1] for p in pairs])

    def analyse(self, layer, calls):
        dtype, a, g = self._gathered(layer, calls)
        total = sequence_sq_norms(a, g)
        bias_grads = None
        if layer.bias is not None:
            bias_grads = tf.reduce_sum(g, axis=1)
            total += _sq(bias_grads)

        def grads(scale):
            out = [(layer.kernel, _weighted_outer(a, g, scale))]
            if bias_grads is not None:
                out.append((layer.bias, _weighted_sum(bias_grads, scale)))
            return out

        return total, grads


def _parse_einsum(equation: str, input_rank: int):
    """Split an EinsumDense equation into (input, kernel, output) letter strings.

    ``...`` is replaced by fresh letters for the ``input_rank - len(spec)`` elided axes.
    """
    lhs, out = equation.replace(" ", "").split("->")
    inp, ker = lhs.split(",")
    if "..." in inp:
        used = set(equation)
        fresh = [c for c in string.ascii_letters if c not in used]
        n = input_rank - len(inp.replace("...", ""))
        if n < 0 or n > len(fresh):
            raise ValueError(f"cannot expand '...' of {equation!r} for input rank {input_rank}")
        filler = "".join(fresh[:n])
        inp = inp.replace("...", filler)
        out = out.replace("...", filler)
    return inp, ker, out


def einsum_structure(equation: str, input_rank: int):
    """Classify the axes of an EinsumDense equation, or say why it is unsupported.

    Returns ``(structure, reason)``: ``structure`` is a dict with the example letter,
    position letters (input & output, not kernel), contracted letters (input &
    kernel) and kernel-output letters (kernel & output); ``reason`` is ``None`` when
    the equation is a batched dense map of that form, else a message.
    """
    try:
        inp, ker, out = _parse_einsum(equation, input_rank)
    except ValueError as err:
        return None, str(err)
    example = inp[0]
    if not out or out[0] != example or example in ker:
        return None, f"equation {equation!r}: the first (example) axis must map to the first output axis"
    positions, contracted, kernel_out = [], [], []
    for c in inp[1:]:
        in_k, in_o = c in ker, c in out
        if in_k and not in_o:
            contracted.append(c)
        elif in_o and not in_k:
            positions.append(c)
        else:
            return None, f"equation {equation!r}: axis {c!r} is shared by input, kernel and output or summed away"
    for c in ker:
        if c in out and c not in inp:
            kernel_out.append(c)
        elif c not in inp:
            return None, f"equation {equation!r}: kernel axis {c!r} is summed away"
    return {
        "input": inp,
        "output": out,
        "example": example,
        "positions": positions,
        "contracted": contracted,
        "kernel_out": kernel_out,
    }, None


class EinsumDenseRule(DenseRule):
    """``keras.layers.EinsumDense`` whose equation is a batched dense map.

    Every input axis other than the first (examples) is either contracted with the
    kernel or carried to the output (a position); every kernel axis is contracted or
    an output axis. The MultiHeadAttention projections are of this form.
    """

    classes = (keras.layers.EinsumDense,)
    kind = "EinsumDense"

    def check(self, layer):
        reason = super().check(layer)
        if reason:
            return reason
        rank = getattr(layer, "_ghost_input_rank", None)
        if rank is None:
            try:
                rank = len(layer.input.shape)
            except Exception:  # unbuilt graph, shared layer, ...
                rank = None
        if rank is None:
            inp = layer.equation.split(",")[0]
            if "..." in inp:
                return None  # checked again at call time
            rank = len(inp)
        _, reason = einsum_structure(layer.equation, rank)
        return reason

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        z = keras.ops.einsum(layer.equation, inputs, layer.kernel)
        if layer.bias is not None:
            z = keras.ops.add(z, layer.bias)
        record(out=z, a=inputs)
        return layer.activation(z) if layer.activation is not None else z

    def _sequence(self, layer, a, g):
        st, reason = einsum_structure(layer.equation, a.shape.rank)
        if reason:
            raise ValueError(f"EinsumDense layer '{layer.name}' is not supported by ghost clipping: {reason}")
        inp, out = st["input"], st["output"]
        a_perm = [inp.index(c) for c in [st["example"], *st["positions"], *st["contracted"]]]
        g_perm = [out.index(c) for c in [st["example"], *st["positions"], *st["kernel_out"]]]
        a = tf.transpose(a, a_perm)
        g = tf.transpose(g, g_perm)
        kshape = dict(zip(layer.equation.split("->")[0].split(",")[1], layer.kernel.shape))
        d_in = 1
        for c in st["contracted"]:
            d_in *= kshape[c]
        d_out = 1
        for c in st["kernel_out"]:
            d_out *= kshape[c]
        p = tf.shape(a)[0]
        return tf.reshape(a, [p, -1, d_in]), tf.reshape(g, [p, -1, d_out])

    def analyse(self, layer, calls):
        dtype, a, g = self._gathered(layer, calls)
        total = sequence_sq_norms(a, g)
        bias_grads = None
        if layer.bias is not None:
            bias_grads = tf.add_n(
                [_bias_grad(tf.cast(c["g"], dtype), tuple(layer.bias.shape)) for c in calls]
            )
            total += _sq(bias_grads)

        def grads(scale):
            st, _ = einsum_structure(layer.equation, calls[0]["a"].shape.rank)
            ker_spec = layer.equation.split("->")[0].split(",")[1]
            order = [*st["contracted"], *st["kernel_out"]]
            sizes = dict(zip(ker_spec, layer.kernel.shape))
            kernel = tf.reshape(_weighted_outer(a, g, scale), [sizes[c] for c in order])
            out = [(layer.kernel, tf.transpose(kernel, [order.index(c) for c in ker_spec]))]
            if bias_grads is not None:
                out.append((layer.bias, _weighted_sum(bias_grads, scale)))
            return out

        return total, grads


class EmbeddingRule(_Rule):
    """``keras.layers.Embedding``: rows of the table are gathered by token id."""

    classes = (keras.layers.Embedding,)
    kind = "Embedding"

    def expected_variables(self, layer):
        return [layer.embeddings]

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        out = original_call(inputs, *args, **kwargs)
        record(out=out, ids=inputs)
        return out

    def analyse(self, layer, calls):
        dtype = _norm_dtype(calls[0]["g"].dtype)
        vocabulary, d = layer.embeddings.shape
        ids, gs = [], []
        for c in calls:
            p = tf.shape(c["g"])[0]
            ids.append(tf.reshape(tf.cast(c["ids"], tf.int64), [p, -1]))
            gs.append(tf.reshape(tf.cast(c["g"], dtype), [p, -1, d]))
        ids, g = _concat_positions(ids), _concat_positions(gs)
        total = token_sq_norms(ids, g, int(vocabulary))

        def grads(scale):
            rows = tf.reshape(g * scale[:, None, None], [-1, d])
            table = tf.math.unsorted_segment_sum(rows, tf.reshape(ids, [-1]), int(vocabulary))
            return [(layer.embeddings, table)]

        return total, grads


def _dims(t: tf.Tensor) -> list:
    """The shape of ``t``: static sizes where known, scalar tensors elsewhere."""
    dynamic = tf.shape(t)
    return [dynamic[k] if d is None else d for k, d in enumerate(t.shape.as_list())]


#: examples per grouped Conv2DBackpropFilter in :func:`conv_sq_norms` where that kernel
#: runs; 4 was the fastest of 1, 4, 8, 16 for each conv of the benchmark CNN (oneDNN CPU).
CONV_CHUNK = 4


def conv_chunk(dtype, device: str | None = None) -> int:
    """Examples per ``Conv2DBackpropFilter`` call that :func:`conv_sq_norms` uses by default.

    :data:`CONV_CHUNK` where a grouped ``Conv2DBackpropFilter`` runs on ``device``
    (a device type; default: where new ops go) in ``dtype`` (oneDNN CPU kernels,
    cuDNN), else 1: one example per plain ``Conv2DBackpropFilter``, the kernel of
    every ordinary backward pass, which runs wherever TensorFlow runs (Eigen CPU
    kernels, float64). Probed once per device type and dtype
    (:mod:`keras_noisecurve.training.kernels`).
    """
    device = device or _kernels.device_type()
    grouped = _kernels.grouped_conv_filter_gradient_runs(device, tf.as_dtype(dtype).name)
    return CONV_CHUNK if grouped else 1


def conv_sq_norms(images, filter_hw, strides, padding, chunk=None) -> tf.Tensor:
    """Per-example squared norm of a 2-D convolution's kernel gradient (groups = 1).

    ``images``: the layer's calls as pairs ``(a, g)`` of channels-last input images
    a (P, H, W, c_in) and output gradients g (P, H', W', c_out); ``filter_hw``,
    ``strides`` (2 ints each) and ``padding`` (``"SAME"``/``"VALID"``) as the layer,
    dilation 1. Returns (P,): ‖Σ_calls ∂K_i‖² per example.

    Examples are taken ``chunk`` at a time in a ``tf.map_fn``. With ``chunk = 1``
    each example's kernel gradient is one plain ``Conv2DBackpropFilter``. With
    ``chunk > 1`` the chunk's examples become the groups of ONE grouped
    ``Conv2DBackpropFilter`` (input (1, H, W, chunk·c_in), filter
    (kh, kw, c_in, chunk·c_out)), whose filter gradient is the chunk's per-example
    kernel gradients side by side, with no cross-example terms; only some kernels
    run that (:func:`conv_chunk`). Memory P·k²·c_in·c_out at most
    (chunk·k²·c_in·c_out per iteration). ``chunk`` defaults to :func:`conv_chunk`;
    an explicit ``chunk > 1`` where the grouped kernel does not run is a
    ``ValueError`` (raised while tracing, before any step runs).
    """
    dtype = images[0][0].dtype
    device = _kernels.device_type(images[0][0])
    if chunk is None:
        chunk = conv_chunk(dtype, device)
    elif chunk > 1 and conv_chunk(dtype, device) == 1:
        raise ValueError(
            f"conv_sq_norms(chunk={chunk}) needs a grouped Conv2DBackpropFilter, which TensorFlow's "
            f"{device} kernels do not run in {tf.as_dtype(dtype).name} in this process (on CPUs it needs "
            "oneDNN: TF_ENABLE_ONEDNN_OPTS=1); use chunk=1 or leave chunk=None to choose automatically."
        )
    p = tf.shape(images[0][0])[0]

    def take(t, i):
        """Examples i·chunk … i·chunk + chunk − 1 of t, zero-padded to ``chunk`` rows."""
        part = t[i * chunk : (i + 1) * chunk]
        return tf.pad(part, [[0, chunk - tf.shape(part)[0]]] + [[0, 0]] * (t.shape.rank - 1))

    def per_chunk(i):
        """Σ_calls per-example kernel gradient of chunk i, squared and summed: (chunk,)."""
        total = 0.0
        for a, g in images:
            a, g = take(a, i), take(g, i)  # a (chunk, H, W, c_in), g (chunk, H', W', c_out)
            c_in, c_out = a.shape[-1], g.shape[-1]
            a = tf.reshape(tf.transpose(a, [1, 2, 0, 3]), [1, *_dims(a)[1:3], chunk * c_in])
            g = tf.reshape(tf.transpose(g, [1, 2, 0, 3]), [1, *_dims(g)[1:3], chunk * c_out])
            kernel = tf.compat.v1.nn.conv2d_backprop_filter(
                a, [*filter_hw, c_in, chunk * c_out], g, strides=[1, *strides, 1], padding=padding
            )
            total += tf.reshape(kernel, [-1, chunk, c_out])  # (k²·c_in, chunk, c_out)
        return tf.reduce_sum(tf.square(total), axis=[0, 2])

    # slices are taken inside the loop: no copy of the whole batch (as map_fn's
    # unstacking of its inputs would make)
    sq = tf.map_fn(per_chunk, tf.range((p + chunk - 1) // chunk), fn_output_signature=tf.TensorSpec([chunk], dtype))
    return tf.reshape(sq, [-1])[:p]


class ConvRule(_Rule):
    """``keras.layers.Conv1D`` / ``Conv2D`` with ``groups=1``.

    When L² ≥ k²·c_in·c_out (and dilation 1) the per-example kernel gradients are
    formed directly, without patches, by :func:`conv_sq_norms` (one
    ``Conv2DBackpropFilter`` per example, or one grouped call per chunk of examples
    where the kernels run that). Otherwise input patches (same
    padding, strides and dilation as the layer) are unfolded with
    ``tf.image.extract_patches``, or, for fewer than 8 input channels, by the faster
    convolution with a one-hot kernel, to (P, L, k·k·c_in), and the Gram form of
    :func:`sequence_sq_norms` is applied with g (P, L, c_out).
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
            x, padding = keras.ops.pad(x, layer._compute_causal_padding()), "valid"
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

    def analyse(self, layer, calls):
        dtype = _norm_dtype(calls[0]["g"].dtype)
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
        rows = _concat_positions(gg)
        length, d_in = rows.shape[1], ks[0] * ks[1] * images[0][0].shape[-1]
        patches = None
        if max(dr) == 1 and length is not None and length * length >= d_in * layer.filters:
            total = conv_sq_norms(images, ks, st, padding)
        else:
            patches = _concat_positions([self._patches(a, ks, st, dr, padding) for a, _ in images])
            total = sequence_sq_norms(patches, rows)
        bias_grads = None
        if layer.use_bias:
            bias_grads = tf.reduce_sum(rows, axis=1)
            total += _sq(bias_grads)

        def grads(scale):
            if max(dr) > 1:
                # TF's CPU Conv2DBackpropFilter refuses dilation > 1: use the patches
                # (order k_h, k_w, c_in = the kernel's leading axes).
                kernel = _weighted_outer(patches, rows, scale)
                out = [(layer.kernel, tf.reshape(kernel, layer.kernel.shape))]
                if bias_grads is not None:
                    out.append((layer.bias, _weighted_sum(bias_grads, scale)))
                return out
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
                    for a_scaled, g_scaled in [_scale_smaller(a, g, scale)]
                ]
            )
            out = [(layer.kernel, tf.reshape(kernel, layer.kernel.shape))]
            if bias_grads is not None:
                out.append((layer.bias, _weighted_sum(bias_grads, scale)))
            return out

        return total, grads


class _NormalizationRule(_Rule):
    """Scale ``gamma`` and offset ``beta`` of a per-example normalisation.

    The per-example gradients are ``Σ_positions g ⊙ x̂`` (gamma) and ``Σ_positions g``
    (beta) per parameter entry, with x̂ the normalised input recomputed here.
    """

    def expected_variables(self, layer):
        return [layer.gamma, layer.beta]

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        # x̂ is computed once (differentiably) and reused by the norms: out = x̂·γ + β,
        # the layer's own output up to round-off (first derivatives identical).
        xhat = self.normalised(layer, inputs)
        rank = xhat.shape.rank
        shape = [1] * rank
        for axis in self.param_axes(layer, rank):
            shape[axis] = xhat.shape[axis]
        out = xhat
        if layer.gamma is not None:
            out = out * tf.reshape(tf.cast(layer.gamma, xhat.dtype), shape)
        if layer.beta is not None:
            out = out + tf.reshape(tf.cast(layer.beta, xhat.dtype), shape)
        out = tf.cast(out, layer.compute_dtype)
        record(out=out, xhat=tf.stop_gradient(xhat))
        return out

    def param_axes(self, layer, rank):
        raise NotImplementedError

    def analyse(self, layer, calls):
        dtype = _norm_dtype(calls[0]["g"].dtype)
        gamma_grads, beta_grads = [], []
        for c in calls:
            g = tf.cast(c["g"], dtype)
            keep = self.param_axes(layer, g.shape.rank)
            if layer.gamma is not None:
                gamma_grads.append(_sum_over(g * tf.cast(c["xhat"], dtype), keep))
            if layer.beta is not None:
                beta_grads.append(_sum_over(g, keep))
        total = 0.0
        per_example = []
        if gamma_grads:
            per_example.append((layer.gamma, tf.add_n(gamma_grads)))
        if beta_grads:
            per_example.append((layer.beta, tf.add_n(beta_grads)))
        for _, grad in per_example:
            total += _sq(grad)

        def grads(scale):
            return [(v, tf.reshape(_weighted_sum(grad, scale), v.shape)) for v, grad in per_example]

        return total, grads


def _positive_axes(axis, rank):
    axes = [axis] if isinstance(axis, int) else list(axis)
    return sorted(a % rank for a in axes)


class LayerNormalizationRule(_NormalizationRule):
    """``keras.layers.LayerNormalization`` (also ``rms_scaling=True``)."""

    classes = (keras.layers.LayerNormalization,)
    kind = "LayerNormalization"

    def check(self, layer):
        reason = super().check(layer)
        if reason:
            return reason
        axes = [layer.axis] if isinstance(layer.axis, int) else list(layer.axis)
        if any(a == 0 for a in axes):
            return "normalises over the example axis 0 (mixes examples)"
        return None

    def param_axes(self, layer, rank):
        return _positive_axes(layer.axis, rank)

    def normalised(self, layer, inputs):
        compute = tf.float64 if tf.as_dtype(inputs.dtype) == tf.float64 else tf.float32
        x = tf.cast(inputs, compute)
        axes = _positive_axes(layer.axis, x.shape.rank)
        if 0 in axes:
            raise ValueError(f"LayerNormalization '{layer.name}' normalises over the example axis.")
        mean, variance = tf.nn.moments(x, axes=axes, keepdims=True)
        inv = tf.math.rsqrt(variance + layer.epsilon)
        return x * inv if layer.rms_scaling else (x - mean) * inv


class _ChannelsLastGroupsRule(_NormalizationRule):
    """Group normalisation over the LAST axis (channels), with a cheaper forward/backward.

    The forward is ``out = x·s + t`` with ``s = γ·inv``, ``t = β − μ·s`` per example and
    group (inv = 1/√(var + ε)): two passes over x, as Keras' own layer, instead of
    forming x̂ = (x − μ)·inv differentiably (whose backward needs two more reductions
    over x). The norms do not need x̂ either: per example and channel c of group k,
    ``∇γ_c = Σ_s g_sc x̂_sc = inv_k·(Σ_s g_sc x_sc − μ_k·Σ_s g_sc)`` and ``∇β_c = Σ_s g_sc``
    (s: positions). Layers normalising another axis use the generic rule.
    """

    def channels_last(self, layer, rank) -> bool:
        return self.param_axes(layer, rank) == [rank - 1]

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        rank = inputs.shape.rank
        if rank is None or rank < 2 or not self.channels_last(layer, rank):
            return super().forward(layer, original_call, record, inputs, *args, **kwargs)
        compute = tf.float64 if tf.as_dtype(inputs.dtype) == tf.float64 else tf.float32
        grouped, mean, inv = self.group_stats(layer, tf.cast(inputs, compute))
        groups, width = grouped.shape[-2], grouped.shape[-1]
        scale = inv if layer.gamma is None else inv * tf.reshape(tf.cast(layer.gamma, compute), [groups, width])
        shift = -mean * scale
        if layer.beta is not None:
            shift += tf.reshape(tf.cast(layer.beta, compute), [groups, width])
        out = tf.reshape(grouped * scale + shift, tf.shape(inputs))
        out = tf.cast(out, layer.compute_dtype)
        record(out=out, x=tf.stop_gradient(grouped), mean=tf.stop_gradient(mean), inv=tf.stop_gradient(inv))
        return out

    def group_stats(self, layer, x):
        """x (P, ..., C) → grouped (P, ..., G, C/G), mean and inv (P, 1…1, G, 1)."""
        static = x.shape.as_list()
        channels = static[-1]
        spatial = [tf.shape(x)[k] if static[k] is None else static[k] for k in range(1, len(static) - 1)]
        grouped = tf.reshape(x, [-1, *spatial, layer.groups, channels // layer.groups])
        axes = [*range(1, len(spatial) + 1), len(spatial) + 2]
        mean, variance = self.moments(grouped, axes)
        return grouped, mean, tf.math.rsqrt(variance + layer.epsilon)

    def moments(self, grouped, axes):
        return tf.nn.moments(grouped, axes=axes, keepdims=True)

    def analyse(self, layer, calls):
        if "xhat" in calls[0]:
            return super().analyse(layer, calls)
        dtype = _norm_dtype(calls[0]["g"].dtype)
        gamma_grads, beta_grads = [], []
        for c in calls:
            x = tf.cast(c["x"], dtype)
            g = tf.reshape(tf.cast(c["g"], dtype), tf.shape(x))
            positions = list(range(1, x.shape.rank - 2))
            g_sum = tf.reduce_sum(g, axis=positions) if positions else g  # (P, G, C/G)
            beta_grads.append(g_sum)
            if layer.gamma is not None:
                gx = tf.reduce_sum(g * x, axis=positions) if positions else g * x
                mean = tf.reshape(tf.cast(c["mean"], dtype), [-1, x.shape[-2], 1])
                inv = tf.reshape(tf.cast(c["inv"], dtype), [-1, x.shape[-2], 1])
                gamma_grads.append(inv * (gx - mean * g_sum))
        per_example = []
        if layer.gamma is not None:
            per_example.append((layer.gamma, tf.reshape(tf.add_n(gamma_grads), [-1, layer.gamma.shape[0]])))
        if layer.beta is not None:
            per_example.append((layer.beta, tf.reshape(tf.add_n(beta_grads), [-1, layer.beta.shape[0]])))
        total = tf.add_n([_sq(grad) for _, grad in per_example]) if per_example else 0.0

        def grads(scale):
            return [(v, tf.reshape(_weighted_sum(grad, scale), v.shape)) for v, grad in per_example]

        return total, grads


class GroupNormalizationRule(_ChannelsLastGroupsRule):
    """``keras.layers.GroupNormalization`` (groups along ``axis``, one gamma per channel)."""

    classes = (keras.layers.GroupNormalization,)
    kind = "GroupNormalization"

    def param_axes(self, layer, rank):
        return [layer.axis % rank]

    def normalised(self, layer, inputs):
        compute = tf.float64 if tf.as_dtype(inputs.dtype) == tf.float64 else tf.float32
        x = tf.cast(inputs, compute)
        rank = x.shape.rank
        axis = layer.axis % rank
        if axis == 0:
            raise ValueError(f"GroupNormalization '{layer.name}' groups along the example axis.")
        shape = tf.shape(x)
        static = x.shape.as_list()
        group_shape = [shape[k] if static[k] is None else static[k] for k in range(rank)]
        channels = group_shape[axis]
        group_shape[0] = -1
        group_shape[axis] = channels // layer.groups
        group_shape.insert(axis, layer.groups)
        grouped = tf.reshape(x, group_shape)
        reduce_axes = [k for k in range(1, rank + 1) if k != axis]
        mean, variance = tf.nn.moments(grouped, axes=reduce_axes, keepdims=True)
        xhat = (grouped - mean) * tf.math.rsqrt(variance + layer.epsilon)
        return tf.reshape(xhat, shape)


class ChannelsLastGroupNormRule(_ChannelsLastGroupsRule):
    """``keras_noisecurve.models.GroupNorm`` (the paper CNN's GroupNorm, channels last).

    Same x̂ as its ``call``: ``(x − mean_g) / sqrt(var_g + ε)`` over the spatial axes
    and the channels of each group; ``gamma``/``beta`` per channel (last axis).
    """

    kind = "GroupNorm"
    classes = (_PaperGroupNorm,)

    def param_axes(self, layer, rank):
        return [rank - 1]

    def normalised(self, layer, inputs):
        compute = tf.float64 if tf.as_dtype(inputs.dtype) == tf.float64 else tf.float32
        x = tf.cast(inputs, compute)
        channels = x.shape[-1]
        spatial = x.shape[1:-1].as_list()
        grouped = tf.reshape(x, [-1, *spatial, layer.groups, channels // layer.groups])
        axes = list(range(1, len(spatial) + 1)) + [len(spatial) + 2]
        mean = tf.reduce_mean(grouped, axis=axes, keepdims=True)
        centred = grouped - mean
        var = tf.reduce_mean(centred * centred, axis=axes, keepdims=True)
        return tf.reshape(centred / tf.sqrt(var + layer.epsilon), tf.shape(x))


RULES = (
    EinsumDenseRule(),
    DenseRule(),
    EmbeddingRule(),
    ConvRule(),
    LayerNormalizationRule(),
    GroupNormalizationRule(),
    ChannelsLastGroupNormRule(),
)


def find_rule(layer):
    """The rule for ``layer``'s class, or ``None``."""
    for rule in RULES:
        if rule.matches(layer):
            return rule
    return None
