"""Ghost-norm kernel of LoRA-enabled ``Dense`` and ``EinsumDense`` layers, in ``keras.ops`` (the
contract of :func:`~keras_noisecurve.backend.common.layer_rules.layer_kernel`).

``layer.enable_lora(r)``: kernel K frozen, the layer computes with ``K + s·A·B``,
``s = lora_alpha / lora_rank``, A of K's shape with its last axis e replaced by r, B (r, e). With the
layer's equation ``inp,ker->out`` (Dense: ``...i,ij->...j``), the kernel gradient of example i is
``∂K_i = einsum(inp,out->ker)(a_i, g_i)`` and

    ∂A_i = s·∂K_i ×_e Bᵀ = einsum(inp,out_r->ker_r)(a_i, u_i),   u = s·einsum(out,re->out_r)(g, B)
    ∂B_i = s·Aᵀ ×_{ker∖e} ∂K_i = Σ_{out∖(example, e)} v_i ⊗ g_i, v = s·einsum(inp,ker_r->out_r)(a, A)

(``ker_r``/``out_r``: e replaced by r): both are the kernel gradient of a map whose output width is
r or whose input width is r, so their norms take the Gram or materialised forms of
:func:`~keras_noisecurve.backend.common.norm_forms.sequence_sq_norms` and nothing of K's size is
formed per example. A trainable bias as in ``ghost_dense``: ``Σ_positions g_i``. The engines
record the output before the fused activation (pre-activation ``g``).
"""

from __future__ import annotations

import math
import string

import keras
from keras import ops

from keras_noisecurve.backend.common.geometry import parse_einsum
from keras_noisecurve.backend.common.ghost_dense import einsum_check, linear
from keras_noisecurve.backend.common.layer_rules import layer_kernel
from keras_noisecurve.backend.common.norm_forms import (
    arrange, cat, kept, scaled, sequence_sq_norms, sum_dtype, weighted_outer, weighted_sum)

__all__ = ["lora"]


def _flat(x, letters, lead, last):
    """``x`` (with axis letters ``letters``) as (P, positions, |last|): ``lead`` (the example
    letter) first, every other letter not in ``last`` as positions, then ``last``."""
    rest = "".join(ch for ch in letters if ch != lead and ch not in last)
    width = math.prod(x.shape[letters.index(ch)] for ch in last)
    return ops.reshape(arrange(x, letters, lead + rest + last), (ops.shape(x)[letters.index(lead)], -1, width))


def _kernel_grad(inp, ker, out, a_parts, g_parts):
    """The per-example kernel gradient ``einsum(inp,out->ker)(a_i, g_i)`` of a batched dense map,
    summed over calls: ``(sq (P,), sum(c, keep) -> Σ_i c_i·∂K_i)`` without forming ∂K_i unless a
    kernel axis is also in the input and the output (per-head weights)."""
    ex = inp[0]
    if any(ch in inp and ch in out for ch in ker):
        per = sum(ops.einsum(f"{inp},{out}->{ex}{ker}", a, g) for a, g in zip(a_parts, g_parts))
        per = ops.reshape(per, (ops.shape(per)[0], -1))
        sq = ops.sum(per * per, axis=1)
    else:
        pos = "".join(ch for ch in inp[1:] if ch in out and ch not in ker)  # one order for a and g
        con = "".join(ch for ch in inp[1:] if ch in ker)
        kout = "".join(ch for ch in out[1:] if ch in ker)
        a = cat([_flat(arrange(x, inp, ex + pos + con), ex + pos + con, ex, con) for x in a_parts])
        g = cat([_flat(arrange(y, out, ex + pos + kout), ex + pos + kout, ex, kout) for y in g_parts])
        sq = sequence_sq_norms(a, g)

    def total(c, keep=None):
        return sum(ops.einsum(f"{inp},{out}->{ker}", kept(x, keep), scaled(c, kept(y, keep)))
                   for x, y in zip(a_parts, g_parts))

    return sq, total


def _equation(layer):
    return layer.equation if isinstance(layer, keras.layers.EinsumDense) else "...i,ij->...j"


def _check(layer):
    ker, out = _equation(layer).split("->")[0].split(",")[1], _equation(layer).split("->")[1]
    if ker[-1] not in out:
        return f"equation {_equation(layer)!r}: LoRA's last kernel axis is contracted"
    return einsum_check(layer) if isinstance(layer, keras.layers.EinsumDense) else None


@layer_kernel(keras.layers.Dense, keras.layers.EinsumDense, weights=("lora_kernel_a", "lora_kernel_b", "bias"),
              pre_activation=linear, lora=True, check=_check)
def lora(layer, calls):
    """``Dense`` / ``EinsumDense`` with LoRA enabled (not quantized): gradients of ``lora_kernel_a``,
    ``lora_kernel_b`` and a trainable bias (only the factors train)."""
    structures = {parse_einsum(_equation(layer), len(c["a"].shape)) for c in calls}
    if len(structures) != 1:
        return None
    inp, ker, out = structures.pop()
    ex, e = inp[0], ker[-1]
    if out[:1] != ex or ex in ker or any(ch not in inp and ch not in out for ch in ker):
        return None  # the examples are not the leading axis, or a kernel axis is broadcast
    if e not in out or e in inp:
        return None  # LoRA's last kernel axis is contracted
    r = next(ch for ch in string.ascii_letters if ch not in inp + ker + out)
    ker_r, out_r = ker[:-1] + r, out.replace(e, r)
    dtype = sum_dtype(calls[0]["g"])
    s = float(layer.lora_alpha) / float(layer.lora_rank)
    lora_a = ops.cast(layer.lora_kernel_a.value, dtype)  # the step's values
    lora_b = ops.cast(layer.lora_kernel_b.value, dtype)
    a_parts = [ops.cast(ops.stop_gradient(c["a"]), dtype) for c in calls]
    g_parts = [ops.cast(c["g"], dtype) for c in calls]
    u_parts = [s * ops.einsum(f"{out},{r}{e}->{out_r}", g, lora_b) for g in g_parts]
    v_parts = [s * ops.einsum(f"{inp},{ker_r}->{out_r}", a, lora_a) for a in a_parts]
    sq_a, total_a = _kernel_grad(inp, ker_r, out_r, a_parts, u_parts)
    v = cat([_flat(x, out_r, ex, r) for x in v_parts])  # (P, positions, r)
    g = cat([_flat(y, out, ex, e) for y in g_parts])  # (P, positions, e)
    sq = sq_a + sequence_sq_norms(v, g)
    bias_i = None
    if layer.bias is not None and layer.bias.trainable:
        axes = layer.bias_axes if isinstance(layer, keras.layers.EinsumDense) else out[-1]
        first = min(out.index(ch) for ch in axes)
        letters = "".join(ch for ch in out[first:] if ch in axes)
        bias_i = sum(ops.reshape(arrange(y, out, ex + letters), (ops.shape(y)[0], -1)) for y in g_parts)
        sq = sq + ops.sum(bias_i * bias_i, axis=1)

    def sums(c, keep=None):
        result = {id(layer.lora_kernel_a): total_a(c, keep), id(layer.lora_kernel_b): weighted_outer(v, g, c, keep)}
        if bias_i is not None:
            result[id(layer.bias)] = ops.reshape(weighted_sum(bias_i, c, keep), tuple(layer.bias.shape))
        return result

    return sq, sums
