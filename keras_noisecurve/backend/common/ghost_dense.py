"""Ghost-norm kernels of the layers that multiply by a matrix or gather rows of one (``Dense``,
``EinsumDense``, ``Embedding``), in ``keras.ops``: one kernel for every backend (the contract of
:func:`~keras_noisecurve.backend.common.layer_rules.layer_kernel`).

Notation: P examples; a call's input ``a`` (P, ..., d_in), the gradient ``g`` (P, ..., d_out) at its
(pre-activation) output; ``c`` (P,) the clipping factors. A shared layer's calls are concatenated
along the positions.

* Dense: kernel gradient ``G_i = Σ_l a_il g_ilᵀ``, ``‖G_i‖² = ‖a_i‖²‖g_i‖²`` for one position, else
  the Gram form ``Σ_{l,l'} (a_il·a_il')(g_il·g_il')`` (memory P·L²) when L² < d_in·d_out, else
  ``G_i`` itself (memory P·d_in·d_out) (:func:`~keras_noisecurve.backend.common.norm_forms.sequence_sq_norms`);
  bias ``Σ_l g_il``. Sum: ``Σ_{i,l} a_il (c_i g_il)ᵀ``.
* EinsumDense: the same after bringing the equation to (examples, positions, contracted) ×
  (examples, positions, kernel outputs); an axis shared by input, kernel and output (per-head
  weights) makes ``G_i = einsum(input, output -> example, kernel)`` materialised.
* Embedding: row v of example i's gradient is ``Σ_{l: id_il = v} g_il``;
  ``‖G_i‖² = Σ_{l,l'} [id_il = id_il'] (g_il·g_il')`` (memory P·L²) when L² < vocabulary·d, else
  a segment sum per example (memory P·vocabulary·d).
"""

from __future__ import annotations

import keras
from keras import ops

from keras_noisecurve.backend.common.geometry import parse_einsum
from keras_noisecurve.backend.common.layer_rules import layer_kernel
from keras_noisecurve.backend.common.norm_forms import (
    arrange, cat, kept, scaled, sequence_sq_norms, sum_dtype, token_sq_norms, weighted_outer, weighted_sum)

__all__ = ["dense", "einsum_check", "einsum_dense", "einsum_reason", "embedding", "linear"]


def _flat(x, p, d, dtype):
    return ops.reshape(ops.cast(x, dtype), (p, -1, d))


def _with_bias(layer, sq, bias_i, kernel_sum):
    """``(sq, sums)`` of a kernel with the per-example bias gradients ``bias_i`` (P, n) or ``None``:
    ``kernel_sum(c, keep)`` the kernel's clipped sum."""
    if bias_i is not None:
        sq = sq + ops.sum(bias_i * bias_i, axis=1)

    def sums(c, keep=None):
        out = {id(layer.kernel): kernel_sum(c, keep)}
        if bias_i is not None:
            out[id(layer.bias)] = ops.reshape(weighted_sum(bias_i, c, keep), tuple(layer.bias.shape))
        return out

    return sq, sums


def linear(layer, x):
    """A Dense or EinsumDense layer's output before its activation, ``x·K + b`` (``layer.kernel``
    includes a LoRA update)."""
    if isinstance(layer, keras.layers.EinsumDense):
        z = ops.einsum(layer.equation, x, layer.kernel)
    else:
        z = ops.matmul(x, layer.kernel)
    return z if layer.bias is None else ops.add(z, layer.bias)


@layer_kernel(keras.layers.Dense, weights=("kernel", "bias"), pre_activation=linear)
def dense(layer, calls):
    """``keras.layers.Dense`` on inputs of any rank ≥ 2 (positions = middle axes)."""
    d_in, d_out = layer.kernel.shape
    dtype = sum_dtype(calls[0]["g"])
    p = ops.shape(calls[0]["g"])[0]
    a = cat([_flat(ops.stop_gradient(c["a"]), p, d_in, dtype) for c in calls])
    g = cat([_flat(c["g"], p, d_out, dtype) for c in calls])
    bias_i = ops.sum(g, axis=1) if layer.bias is not None else None
    return _with_bias(layer, sequence_sq_norms(a, g), bias_i, lambda c, keep: weighted_outer(a, g, c, keep))


def einsum_reason(equation: str, rank):
    """Why an EinsumDense equation on inputs of rank ``rank`` (``None``: unknown) is not taken: the
    examples are not the leading axis of input and output, or a kernel axis is summed away; else
    ``None`` (an input axis summed away is summed in the recorded input)."""
    if rank is None:
        if "..." in equation.split(",")[0]:
            return None  # checked again at call time
        rank = len(equation.split(",")[0])
    try:
        inp, ker, out = parse_einsum(equation, rank)
    except ValueError as error:
        return str(error)
    if out[:1] != inp[:1] or inp[0] in ker:
        return f"equation {equation!r}: the first (example) axis must map to the first output axis"
    if any(ch not in inp and ch not in out for ch in ker):
        return f"equation {equation!r}: a kernel axis is summed away"
    return None


def einsum_check(layer):
    """:func:`einsum_reason` for an EinsumDense ``layer`` (the rank of its input where known)."""
    try:
        rank = len(layer.input.shape)
    except Exception:  # unbuilt graph, shared layer, ...
        rank = None
    return einsum_reason(layer.equation, rank)


def _size(x, letters, chosen):
    n = 1
    for ch in chosen:
        n *= x.shape[letters.index(ch)]
    return n


@layer_kernel(keras.layers.EinsumDense, weights=("kernel", "bias"), pre_activation=linear,
              check=einsum_check)
def einsum_dense(layer, calls):
    """``keras.layers.EinsumDense`` whose examples are the leading axis of input and output (the
    MultiHeadAttention projections, KerasHub's): every other input axis contracted with the kernel,
    a position, or shared by input, kernel and output (per-head weights, ``G_i`` materialised)."""
    if any(einsum_reason(layer.equation, len(c["a"].shape)) for c in calls):
        return None
    structures = {parse_einsum(layer.equation, len(c["a"].shape)) for c in calls}
    if len(structures) != 1:
        return None
    inp, ker, out = structures.pop()
    ex = inp[0]
    dtype = sum_dtype(calls[0]["g"])
    p = ops.shape(calls[0]["g"])[0]
    a_parts = [ops.cast(ops.stop_gradient(c["a"]), dtype) for c in calls]
    g_parts = [ops.cast(c["g"], dtype) for c in calls]
    if any(ch in inp and ch in out for ch in ker):  # per-head weights: materialise G_i
        per = sum(ops.einsum(f"{inp},{out}->{ex}{ker}", a, g) for a, g in zip(a_parts, g_parts))
        per = ops.reshape(per, (p, -1))
        sq = ops.sum(per * per, axis=1)

        def kernel_sum(c, keep):
            return sum(ops.einsum(f"{inp},{out}->{ker}", kept(x, keep), scaled(c, kept(y, keep)))
                       for x, y in zip(a_parts, g_parts))
    else:
        pos = "".join(ch for ch in inp[1:] if ch in out and ch not in ker)
        con = "".join(ch for ch in inp[1:] if ch in ker)
        kout = "".join(ch for ch in out[1:] if ch in ker)
        a = cat([_flat(arrange(x, inp, ex + pos + con), p, max(1, _size(x, inp, con)), dtype)
                 for x in a_parts])
        g = cat([_flat(arrange(y, out, ex + pos + kout), p, max(1, _size(y, out, kout)), dtype)
                 for y in g_parts])
        sq = sequence_sq_norms(a, g)
        sizes = dict(zip(ker, layer.kernel.shape))
        order = con + kout

        def kernel_sum(c, keep):
            grad = ops.reshape(weighted_outer(a, g, c, keep), [sizes[ch] for ch in order])
            return ops.transpose(grad, [order.index(ch) for ch in ker])
    bias_i = None
    if layer.bias is not None:
        first = min(out.index(ch) for ch in layer.bias_axes)
        letters = "".join(ch for ch in out[first:] if ch in layer.bias_axes)
        bias_i = ops.reshape(sum(arrange(y, out, ex + letters) for y in g_parts), (p, -1))
    return _with_bias(layer, sq, bias_i, kernel_sum)


@layer_kernel(keras.layers.Embedding, weights=("embeddings",))
def embedding(layer, calls):
    """``keras.layers.Embedding``: rows of the table gathered by token id."""
    vocabulary, d = layer.embeddings.shape
    dtype = sum_dtype(calls[0]["g"])
    p = ops.shape(calls[0]["g"])[0]
    ids = cat([ops.reshape(ops.cast(c["a"], "int32"), (p, -1)) for c in calls])
    g = cat([_flat(c["g"], p, d, dtype) for c in calls])
    sq = token_sq_norms(ids, g, int(vocabulary))

    def sums(c, keep=None):
        rows = ops.reshape(scaled(c, kept(g, keep)), (-1, d))
        return {id(layer.embeddings): ops.segment_sum(rows, ops.reshape(ids, (-1,)), num_segments=int(vocabulary))}

    return sq, sums
