"""Ghost-norm rule of the JAX engine for LoRA-enabled ``Dense`` and ``EinsumDense`` layers, in
``jax.numpy``.
Each rule is ``rule(layer, calls) -> (sq, sums)`` or ``None``, the contract of
:mod:`~keras_noisecurve.backend.jax.ghost_rules` (which lists the rules, in order).
Its ``calls`` also carry ``"args"`` and it runs under the step's weight values (see
:mod:`~keras_noisecurve.backend.jax.ghost_rules`).

* LoRA-enabled Dense and EinsumDense (``layer.enable_lora(r)``: kernel K frozen, the layer
  computes with ``K + s·A·B``, ``s = lora_alpha / lora_rank``, A of K's shape with its last
  axis e replaced by r, B (r, e)). With the layer's equation ``inp,ker->out`` (Dense:
  ``...i,ij->...j``), the kernel gradient of example i is ``∂K_i = einsum(inp,out->ker)(a_i, g_i)``
  and

      ∂A_i = s·∂K_i ×_e Bᵀ = einsum(inp,out_r->ker_r)(a_i, u_i),   u = s·einsum(out,re->out_r)(g, B)
      ∂B_i = s·Aᵀ ×_{ker∖e} ∂K_i = Σ_{out∖(example, e)} v_i ⊗ g_i, v = s·einsum(inp,ker_r->out_r)(a, A)

  (``ker_r``/``out_r``: e replaced by r): both are the kernel gradient of a map whose output
  width is r or whose input width is r, so their norms take the Gram or materialised forms
  of :func:`~keras_noisecurve.backend.jax.ghost_rules.sequence_sq_norms` and nothing of K's size
  is formed per example. The bias (if trainable) as in the plain rules: ``Σ_positions g_i``.
  The engine records the output before the fused activation (pre-activation ``g``).

The TensorFlow engine's rule: ``keras_noisecurve/backend/tensorflow/ghost_lora.py``.
"""

from __future__ import annotations

import string

import jax.numpy as jnp
import keras
import numpy as np

from keras_noisecurve.backend.jax.ghost_forms import F32, cat, kept, parse_einsum, scaled, sequence_sq_norms, single

__all__ = ["lora_rule"]


def _sizes(x, letters):
    return dict(zip(letters, x.shape))


def _flat(x, letters, lead, last):
    """``x`` (with axis letters ``letters``) as (P, positions, |last|): ``lead`` (the example
    letter) first, every other letter not in ``last`` as positions, then ``last``."""
    rest = "".join(ch for ch in letters if ch != lead and ch not in last)
    size = _sizes(x, letters)
    width = int(np.prod([size[ch] for ch in last])) if last else 1
    return jnp.reshape(jnp.einsum(f"{letters}->{lead}{rest}{last}", x), (x.shape[letters.index(lead)], -1, width))


def _kernel_grad(inp, ker, out, a_parts, g_parts):
    """The per-example kernel gradient ``einsum(inp,out->ker)(a_i, g_i)`` of a batched dense map,
    summed over calls: ``(sq (P,), sum(c, keep) -> Σ_i c_i·∂K_i)`` without forming ∂K_i unless a
    kernel axis is also in the input and the output (per-head weights)."""
    ex = inp[0]
    p = a_parts[0].shape[0]
    shared = [ch for ch in ker if ch in inp and ch in out]
    if shared:
        per = sum(jnp.einsum(f"{inp},{out}->{ex}{ker}", a, g) for a, g in zip(a_parts, g_parts))
        sq = jnp.sum(jnp.reshape(per * per, (p, -1)), axis=1)
    else:
        pos = "".join(ch for ch in inp[1:] if ch in out and ch not in ker)  # one order for a and g
        con = "".join(ch for ch in inp[1:] if ch in ker)
        kout = "".join(ch for ch in out[1:] if ch in ker)
        a = cat([_flat(jnp.einsum(f"{inp}->{ex}{pos}{con}", x), ex + pos + con, ex, con) for x in a_parts])
        g = cat([_flat(jnp.einsum(f"{out}->{ex}{pos}{kout}", y), ex + pos + kout, ex, kout) for y in g_parts])
        sq = sequence_sq_norms(a, g)

    def total(c, keep=None):
        return sum(jnp.einsum(f"{inp},{out}->{ker}", kept(x, keep), scaled(c, kept(y, keep)))
                   for x, y in zip(a_parts, g_parts))

    return sq, total


def _bias(layer, out, g_parts):
    """Per-example bias gradients (P, |bias|) and the bias shape, or ``(None, None)``."""
    if layer.bias is None or not layer.bias.trainable:
        return None, None
    axes = layer.bias_axes if isinstance(layer, keras.layers.EinsumDense) else out[-1]
    first = min(out.index(ch) for ch in axes)
    letters = "".join(ch for ch in out[first:] if ch in axes)
    p = g_parts[0].shape[0]
    per = sum(jnp.reshape(jnp.einsum(f"{out}->{out[0]}{letters}", y), (p, -1)) for y in g_parts)
    return per, tuple(layer.bias.shape)


def lora_rule(layer, calls):
    """LoRA-enabled Dense / EinsumDense (not quantized): gradients of ``lora_kernel_a``,
    ``lora_kernel_b`` and a trainable bias (see the module docstring)."""
    if type(layer) not in (keras.layers.Dense, keras.layers.EinsumDense) or not getattr(layer, "lora_enabled", False):
        return None
    if getattr(layer, "quantization_mode", None) is not None or not single(calls):
        return None
    equation = layer.equation if isinstance(layer, keras.layers.EinsumDense) else "...i,ij->...j"
    structures = {parse_einsum(equation, c["a"].ndim) for c in calls}
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
    s = float(layer.lora_alpha) / float(layer.lora_rank)
    lora_a = jnp.asarray(layer.lora_kernel_a.value, F32)  # the step's traced values (engine scope)
    lora_b = jnp.asarray(layer.lora_kernel_b.value, F32)
    a_parts = [c["a"].astype(F32) for c in calls]
    g_parts = [c["g"].astype(F32) for c in calls]
    u_parts = [s * jnp.einsum(f"{out},{r}{e}->{out_r}", g, lora_b) for g in g_parts]
    v_parts = [s * jnp.einsum(f"{inp},{ker_r}->{out_r}", a, lora_a) for a in a_parts]
    sq_a, total_a = _kernel_grad(inp, ker_r, out_r, a_parts, u_parts)
    v = cat([_flat(x, out_r, ex, r) for x in v_parts])  # (P, positions, r)
    g = cat([_flat(y, out, ex, e) for y in g_parts])  # (P, positions, e)
    sq = sq_a + sequence_sq_norms(v, g)
    bias_i, bias_shape = _bias(layer, out, g_parts)
    if bias_i is not None:
        sq = sq + jnp.sum(bias_i * bias_i, axis=1)

    def sums(c, keep=None):
        result = {id(layer.lora_kernel_a): total_a(c, keep),
                  id(layer.lora_kernel_b): jnp.einsum("plr,ple->re", kept(v, keep), scaled(c, kept(g, keep)))}
        if bias_i is not None:
            result[id(layer.bias)] = jnp.reshape(jnp.tensordot(c.astype(F32), kept(bias_i, keep), axes=1),
                                                 bias_shape)
        return result

    return sq, sums
