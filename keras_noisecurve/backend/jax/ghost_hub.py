"""Ghost-norm rules of the JAX clipping engine for LoRA layers, RMS-type norms and KerasHub's
embeddings: the same contract as :mod:`keras_noisecurve.backend.jax.ghost_rules` (each rule is
``rule(layer, calls) -> (sq, sums)`` or ``None``; ``sq`` (P,) float32 per-example squared norms
of the layer's own weights' gradient, ``sums(c, keep=None)`` the dict ``{id(variable): Σ_i c_i·G_i}``),
registered in that module's ``RULES``. Here ``calls`` also carry ``"args"``, the call's
``(args, kwargs)`` as recorded, and a rule runs under a ``keras.StatelessScope`` mapping every
model variable to its traced value (``variable.value`` is the step's value, read at rule time).

Notation: P examples; ``a`` a call's input, ``g`` the gradient at its output (both with the
examples first); ``c`` (P,) the clipping factors.

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
* RMS-type norms, recognised by computation (:func:`probe_affine_scale`): a layer whose one
  weight w (d,) enters as ``y = u(x) ⊙ (α + w)`` along the last axis, ``u`` independent of w
  (Keras's RMSNormalization, LayerNormalization(rms_scaling=True), KerasHub's Gemma, Llama,
  Mistral, Qwen, Phi-3, T5 norms, a custom layer written the same way). Per step,
  ``u = ∂y/∂w`` is the JVP of the layer's call at the recorded input with tangent 1 on w
  (exact since ``y_k`` depends on w only through ``w_k``); ``G_i = Σ_positions g_i ⊙ u_i`` (d,).
* ReversibleEmbedding (Keras's and KerasHub's; lookup ``reverse=False``, logits ``h·Eᵀ`` with
  ``reverse=True``): the table's gradient of example i is the lookup part
  ``L_i = Σ_l e_{id_l} g_lᵀ`` plus, when tied, the projection part ``R_i = Σ_m g'_m h_mᵀ`` (V, d),
  summed over all calls of the layer; ``‖L_i + R_i‖² = ‖L_i‖² + ‖R_i‖² + 2⟨L_i, R_i⟩`` with
  ``⟨L_i, R_i⟩ = Σ_{l,m} g'_m[id_l]·(g_l·h_m)`` (a gather (P, M, L)). Untied: the reverse
  kernel (d, V) gets ``Σ_m h_m g'_mᵀ``. A soft-capped reverse call is left to the fallback.
* KerasHub's PositionEmbedding (``start_index`` 0, no ``positions``): the output is the
  table's first L rows broadcast over the batch, so example i's gradient is ``g_i`` summed over
  any axes before the L positions, in rows 0..L−1 of the table.

Recurrent layers have their own rule (:mod:`~keras_noisecurve.backend.jax.ghost_rnn`).
"""

from __future__ import annotations

import string
import sys

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_noisecurve.backend import affine_scale
from keras_noisecurve.backend.jax.ghost_forms import kept, parse_einsum, sequence_sq_norms, token_sq_norms

__all__ = ["HUB_RULES", "lora_rule", "position_embedding_rule", "probe_affine_scale", "reversible_embedding_rule",
           "rms_scale_rule"]

_F32 = jnp.float32


def _scaled(c, g):
    return g * jnp.reshape(c, (-1,) + (1,) * (g.ndim - 1)).astype(g.dtype)


def _cat(parts):
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _single(calls):
    return all(hasattr(c["a"], "shape") and hasattr(c["g"], "shape") for c in calls)


def _args(call):
    """``(args, kwargs)`` of a recorded call (``((a,), {})`` when the engine gave none)."""
    return call.get("args") or ((call["a"],), {})


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
        a = _cat([_flat(jnp.einsum(f"{inp}->{ex}{pos}{con}", x), ex + pos + con, ex, con) for x in a_parts])
        g = _cat([_flat(jnp.einsum(f"{out}->{ex}{pos}{kout}", y), ex + pos + kout, ex, kout) for y in g_parts])
        sq = sequence_sq_norms(a, g)

    def total(c, keep=None):
        return sum(jnp.einsum(f"{inp},{out}->{ker}", kept(x, keep), _scaled(c, kept(y, keep)))
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
    if getattr(layer, "quantization_mode", None) is not None or not _single(calls):
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
    lora_a = jnp.asarray(layer.lora_kernel_a.value, _F32)  # the step's traced values (engine scope)
    lora_b = jnp.asarray(layer.lora_kernel_b.value, _F32)
    a_parts = [c["a"].astype(_F32) for c in calls]
    g_parts = [c["g"].astype(_F32) for c in calls]
    u_parts = [s * jnp.einsum(f"{out},{r}{e}->{out_r}", g, lora_b) for g in g_parts]
    v_parts = [s * jnp.einsum(f"{inp},{ker_r}->{out_r}", a, lora_a) for a in a_parts]
    sq_a, total_a = _kernel_grad(inp, ker_r, out_r, a_parts, u_parts)
    v = _cat([_flat(x, out_r, ex, r) for x in v_parts])  # (P, positions, r)
    g = _cat([_flat(y, out, ex, e) for y in g_parts])  # (P, positions, e)
    sq = sq_a + sequence_sq_norms(v, g)
    bias_i, bias_shape = _bias(layer, out, g_parts)
    if bias_i is not None:
        sq = sq + jnp.sum(bias_i * bias_i, axis=1)

    def sums(c, keep=None):
        result = {id(layer.lora_kernel_a): total_a(c, keep),
                  id(layer.lora_kernel_b): jnp.einsum("plr,ple->re", kept(v, keep), _scaled(c, kept(g, keep)))}
        if bias_i is not None:
            result[id(layer.bias)] = jnp.reshape(jnp.tensordot(c.astype(_F32), kept(bias_i, keep), axes=1),
                                                 bias_shape)
        return result

    return sq, sums


# --- RMS-type norms, recognised by computation ---------------------------------------------

def _with_weight(layer, weight, value, x):
    with keras.StatelessScope(state_mapping=[(weight, value)]):
        return layer.call(x)


def _outputs(layer, weight, value, x):
    """The layer's output (float64 numpy) on ``x`` in its compute dtype, ``weight`` read as ``value``."""
    y = _with_weight(layer, weight, jnp.asarray(value, weight.dtype), jnp.asarray(x, layer.compute_dtype))
    if not hasattr(y, "shape"):
        raise TypeError("not one array output")
    return np.asarray(y, np.float64)


_PROBE = affine_scale.AffineScaleProbe(outputs=_outputs, scope=jax.ensure_compile_time_eval)


def probe_affine_scale(layer) -> bool:
    """Whether ``layer`` computes ``y = u(x) ⊙ (α + w)`` with its one weight ``w`` (d,) along
    the last axis and ``u`` independent of ``w`` (cached per layer and weight).

    Runs ``layer.call`` at compile time (``jax.ensure_compile_time_eval``, concrete arrays even
    inside a traced step) on a (2, 3, d) normal input with four random ``w`` (substituted by
    ``keras.StatelessScope``, the variable keeps its value): with ``u = (y_a − y_b)/(a − b)``
    elementwise, the other two outputs must be ``y_a + u ⊙ (w − a)`` to a tolerance of the
    compute dtype (relative 1e-4 float32/float64, 3e-2 float16/bfloat16, of the largest output),
    the output must have the input's shape, and example 0 alone must give the same rows. Any
    exception of the call counts as "no" (the per-layer fallback). The decision is
    :func:`keras_noisecurve.backend.affine_scale.affine_in_weight`, shared with the TensorFlow engine.
    """
    return _PROBE(layer)


def rms_scale_rule(layer, calls):
    """A layer recognised by :func:`probe_affine_scale`, called on its input alone:
    ``G_i = Σ_positions g_i ⊙ u_i`` with ``u`` the JVP of the call with tangent 1 on w."""
    if not _single(calls) or any(len(_args(c)[0]) != 1 or _args(c)[1] for c in calls):
        return None
    if not probe_affine_scale(layer):
        return None
    weight = affine_scale.single_weight(layer)
    d = int(weight.shape[0])
    value = jnp.asarray(weight.value)  # the step's traced value (engine scope)
    p = calls[0]["g"].shape[0]
    per = 0.0
    for c in calls:
        if c["a"].shape[-1] != d or tuple(c["g"].shape) != tuple(c["a"].shape):
            return None
        _, slope = jax.jvp(lambda w, x=c["a"]: _with_weight(layer, weight, w, x), (value,), (jnp.ones_like(value),))
        per = per + jnp.sum(jnp.reshape(c["g"].astype(_F32) * slope.astype(_F32), (p, -1, d)), axis=1)
    sq = jnp.sum(per * per, axis=1)

    def sums(c, keep=None):
        return {id(weight): jnp.tensordot(c.astype(_F32), kept(per, keep), axes=1)}

    return sq, sums


# --- KerasHub embeddings -----------------------------------------------------------------------

def _call_flag(call, name, position, default):
    args, kwargs = _args(call)
    return kwargs[name] if name in kwargs else (args[position] if len(args) > position else default)


def reversible_embedding_rule(layer, calls):
    """Keras's / KerasHub's ReversibleEmbedding, lookup and reverse calls (see the module docstring)."""
    cls = getattr(keras.layers, "ReversibleEmbedding", None)
    if cls is None or not isinstance(layer, cls) or type(layer).call is not cls.call:
        return None
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None) is not None:
        return None
    if not _single(calls):
        return None
    flags = [_call_flag(c, "reverse", 1, False) for c in calls]
    if any(not isinstance(f, bool) for f in flags):
        return None  # a traced or unusual flag
    if any(flags) and layer.logit_soft_cap is not None:
        return None  # the recorded g is after the soft cap
    vocabulary, d = layer.embeddings.shape
    p = calls[0]["g"].shape[0]
    look = [c for c, f in zip(calls, flags) if not f]
    back = [c for c, f in zip(calls, flags) if f]
    sq = jnp.zeros((p,), _F32)
    ids = ge = h = gr = None
    if look:
        ids = _cat([jnp.reshape(c["a"].astype(jnp.int32), (p, -1)) for c in look])
        ge = _cat([jnp.reshape(c["g"].astype(_F32), (p, -1, d)) for c in look])
        sq = sq + token_sq_norms(ids, ge, vocabulary)
    if back:
        h = _cat([jnp.reshape(c["a"].astype(_F32), (p, -1, d)) for c in back])
        gr = _cat([jnp.reshape(c["g"].astype(_F32), (p, -1, vocabulary)) for c in back])
        sq = sq + sequence_sq_norms(h, gr)
        if look and layer.tie_weights:  # 2⟨L_i, R_i⟩ = 2 Σ_{l,m} g'_m[id_l]·(g_l·h_m)
            at_ids = jnp.take_along_axis(gr, jnp.broadcast_to(ids[:, None, :], (p, gr.shape[1], ids.shape[1])), axis=2)
            sq = sq + 2.0 * jnp.sum(at_ids * jnp.einsum("pmd,pld->pml", h, ge), axis=(1, 2))

    def sums(c, keep=None):
        table = jnp.zeros((vocabulary, d), _F32)
        if look:
            table = table.at[jnp.reshape(ids, (-1,))].add(jnp.reshape(_scaled(c, kept(ge, keep)), (-1, d)))
        result = {}
        if back:
            projection = jnp.einsum("pmd,pmv->dv", kept(h, keep), _scaled(c, kept(gr, keep)))
            if layer.tie_weights:
                table = table + projection.T
            else:
                result[id(layer.reverse_embeddings)] = projection
        elif not layer.tie_weights:
            result[id(layer.reverse_embeddings)] = jnp.zeros(tuple(layer.reverse_embeddings.shape), _F32)
        result[id(layer.embeddings)] = table
        return result

    return sq, sums


def position_embedding_rule(layer, calls):
    """KerasHub's PositionEmbedding called with ``start_index=0`` and no ``positions``."""
    module = sys.modules.get("keras_hub.src.layers.modeling.position_embedding")
    cls = getattr(module, "PositionEmbedding", None)
    if cls is None or not isinstance(layer, cls) or type(layer).call is not cls.call or not _single(calls):
        return None
    for c in calls:
        args, kwargs = _args(c)
        start = kwargs.get("start_index", args[1] if len(args) > 1 else 0)
        positions = kwargs.get("positions", args[2] if len(args) > 2 else None)
        if not (isinstance(start, int) and start == 0) or positions is not None:
            return None
        if c["a"].ndim < 3 or tuple(c["g"].shape) != tuple(c["a"].shape):
            return None
    table = layer.position_embeddings
    rows, d = table.shape
    per = {}
    for c in calls:
        g = c["g"].astype(_F32)
        length = g.shape[-2]
        g = jnp.sum(g, axis=tuple(range(1, g.ndim - 2))) if g.ndim > 3 else g  # (P, L, d)
        per[length] = per[length] + g if length in per else g
    sq = sum(jnp.sum(x * x, axis=(1, 2)) for x in _padded(per, rows))

    def sums(c, keep=None):
        total = jnp.zeros((rows, d), _F32)
        for length, x in per.items():
            total = total.at[:length].add(jnp.tensordot(c.astype(_F32), kept(x, keep), axes=1))
        return {id(table): total}

    return sq, sums


def _padded(per, rows):
    """The per-length gradients (P, L, d) summed into one (P, max L, d) (a single entry as is)."""
    if len(per) == 1:
        return list(per.values())
    longest = max(per)
    total = sum(jnp.pad(x, ((0, 0), (0, longest - x.shape[1]), (0, 0))) for x in per.values())
    return [total]


#: registered at the end of ``ghost_rules.RULES`` (after the exact-type rules)
HUB_RULES = (lora_rule, reversible_embedding_rule, position_embedding_rule, rms_scale_rule)
