"""Ghost-clipping rule for LoRA-enabled ``Dense`` and ``EinsumDense`` layers.

With LoRA (``layer.enable_lora(rank)``, KerasHub's ``backbone.enable_lora``) the kernel
is frozen and the layer computes with ``K + s·A·B``: ``A`` has the kernel's shape with
its last axis replaced by the rank r, ``B`` is (r, e), e the kernel's last axis, and
``s = lora_alpha / lora_rank``. Only ``A`` and ``B`` (and the bias, if trainable) train.

With the layer's input ``a`` (P, L, d_in) and output gradient ``g`` as a batched dense
map (:func:`~keras_noisecurve.backend.tensorflow.ghost_dense.einsum_structure`; kernel-output
axes O'' then e), example i's kernel gradient is ``∂K_i = Σ_l a_il ⊗ g_il`` and

    ∂A_i = s·∂K_i ×_e Bᵀ = s·Σ_l a_il ⊗ (g_il Bᵀ)         (d_in × |O''|·r)
    ∂B_i = s·Aᵀ ×_{d_in, O''} ∂K_i = s·Σ_{l, o} (a_il A)_o ⊗ g_ilo       (r × e)

Both are bilinear in per-position vectors, so their norms take the Gram or
materialised form of :func:`~keras_noisecurve.backend.tensorflow.ghost_forms.sequence_sq_norms`
(positions l for ∂A, positions (l, o) for ∂B): nothing of the kernel's size is
formed per example.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_noisecurve import _compat
from keras_noisecurve.backend.tensorflow.ghost_forms import (
    bias_grad,
    per_example_sq,
    sequence_sq_norms,
    weighted_outer,
    weighted_sum,
)
from keras_noisecurve.backend.tensorflow.ghost_dense import EinsumDenseRule, einsum_structure

__all__ = ["LoRARule"]


def _dense_equation(layer) -> str:
    return layer.equation if isinstance(layer, keras.layers.EinsumDense) else "...i,ij->...j"


class LoRARule(EinsumDenseRule):
    """``Dense`` / ``EinsumDense`` with LoRA enabled (not quantized): only the factors train."""

    classes = (keras.layers.Dense, keras.layers.EinsumDense)
    kind = "LoRA"

    def expected_variables(self, layer):
        return [layer.lora_kernel_a, layer.lora_kernel_b, layer.bias]

    def check(self, layer):
        if not getattr(layer, "lora_enabled", False):
            return "LoRA is not enabled"
        if getattr(layer, "quantization_mode", None) is not None:
            return f"quantized ({layer.quantization_mode})"
        expected = {id(v) for v in self.expected_variables(layer) if v is not None}
        extra = [v.path for v in _compat.own_trainable_variables(layer) if v.trainable and id(v) not in expected]
        if extra:
            return f"unexpected own trainable variables {extra}"
        if isinstance(layer, keras.layers.EinsumDense):
            ker = layer.equation.split("->")[0].split(",")[1]
            out = layer.equation.split("->")[1]
            if ker[-1] not in out:
                return f"equation {layer.equation!r}: LoRA's last kernel axis is contracted"
            return self.equation_reason(layer)
        return None

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        kernel = layer.kernel  # K + s·A·B, in the compute dtype
        if isinstance(layer, keras.layers.EinsumDense):
            z = keras.ops.einsum(layer.equation, inputs, kernel)
        else:
            z = keras.ops.matmul(inputs, kernel)
        if layer.bias is not None:
            z = keras.ops.add(z, layer.bias)
        record(out=z, a=inputs)
        return layer.activation(z) if layer.activation is not None else z

    def _structure(self, layer, rank):
        """(contracted letters, kernel-output letters, kernel letters) of the layer's map."""
        equation = _dense_equation(layer)
        if isinstance(layer, keras.layers.EinsumDense):
            st, reason = einsum_structure(equation, rank)
            if reason:
                raise ValueError(f"EinsumDense layer '{layer.name}' is not supported by ghost clipping: {reason}")
            return st["contracted"], st["kernel_out"], equation.split("->")[0].split(",")[1]
        return ["i"], ["j"], "ij"

    def _sequence(self, layer, a, g):
        if isinstance(layer, keras.layers.EinsumDense):
            return super()._sequence(layer, a, g)
        d_in, d_out = layer.kernel.shape
        p = tf.shape(a)[0]
        return tf.reshape(a, [p, -1, d_in]), tf.reshape(g, [p, -1, d_out])

    def analyse(self, layer, calls):
        dtype, a, g = self._gathered(layer, calls)  # (P, L, d_in), (P, L, d_out) in structure order
        contracted, kernel_out, ker = self._structure(layer, calls[0]["a"].shape.rank)
        sizes = dict(zip(ker, layer.kernel.shape))
        last = ker[-1]
        others = [c for c in kernel_out if c != last]  # O''
        rank = int(layer.lora_rank)
        s = tf.constant(layer.lora_alpha / layer.lora_rank, dtype)
        p = tf.shape(a)[0]
        # g as (P, L, O'', e): the kernel-output axes with e last
        g_axes = tf.reshape(g, [p, -1, *[sizes[c] for c in kernel_out]])
        g_axes = tf.transpose(g_axes, [0, 1, *[2 + kernel_out.index(c) for c in others], 2 + kernel_out.index(last)])
        n_other = 1
        for c in others:
            n_other *= sizes[c]
        g_oe = tf.reshape(g_axes, [p, -1, n_other, sizes[last]])
        lora_b = tf.cast(layer.lora_kernel_b, dtype)  # (r, e)
        # A as (d_in, O'', r) in the structure's order
        lora_a = tf.cast(layer.lora_kernel_a, dtype)
        a_order = [*contracted, *others]
        lora_a = tf.transpose(lora_a, [ker.index(c) for c in a_order] + [len(ker) - 1])
        lora_a = tf.reshape(lora_a, [-1, n_other, rank])
        u = s * tf.reshape(tf.einsum("ploe,re->plor", g_oe, lora_b), [p, -1, n_other * rank])
        v = s * tf.reshape(tf.einsum("pld,dor->plor", a, lora_a), [p, -1, rank])
        g_flat = tf.reshape(g_oe, [p, -1, sizes[last]])
        total = sequence_sq_norms(a, u) + sequence_sq_norms(v, g_flat)
        trainable_bias = layer.bias is not None and layer.bias.trainable
        bias_grads = None
        if trainable_bias:
            bias_grads = tf.add_n([bias_grad(tf.cast(c["g"], dtype), tuple(layer.bias.shape)) for c in calls])
            total += per_example_sq(bias_grads)
        a_shape = [sizes[c] for c in a_order] + [rank]
        back = [a_order.index(c) for c in ker[:-1]] + [len(a_order)]

        def grads(scale):
            scale = tf.cast(scale, dtype)
            grad_a = tf.transpose(tf.reshape(weighted_outer(a, u, scale), a_shape), back)
            out = [(layer.lora_kernel_a, grad_a), (layer.lora_kernel_b, weighted_outer(v, g_flat, scale))]
            if bias_grads is not None:
                out.append((layer.bias, weighted_sum(bias_grads, scale)))
            return out

        return total, grads
