"""Norm and sum forms shared by the JAX ghost-norm rules (the ``ghost_*`` rule modules listed in
:mod:`~keras_noisecurve.backend.jax.ghost_rules`), in ``jax.numpy``: the per-example squared norm of a
sum of outer products over positions and of an embedding table's gradient (re-exported from
``keras_noisecurve.backend.common.norm_forms``, the same forms as the TensorFlow engine's), the zeroing of dropped
examples' rows, the parsing of an EinsumDense equation, and the small helpers every rule uses
on its recorded calls.

Shapes: P examples, L positions.
"""

from __future__ import annotations

import jax.numpy as jnp

from keras_noisecurve.backend.common.geometry import parse_einsum
from keras_noisecurve.backend.common.norm_forms import sequence_sq_norms, token_sq_norms

__all__ = ["F32", "call_args", "cat", "kept", "parse_einsum", "plain", "scaled", "sequence_sq_norms", "single",
           "token_sq_norms"]

#: the dtype of the norms and sums
F32 = jnp.float32


def plain(layer) -> bool:
    """No LoRA, no quantization: the layer's ``call`` is the textbook one."""
    return not getattr(layer, "lora_enabled", False) and getattr(layer, "quantization_mode", None) is None


def single(calls) -> bool:
    """Every call has one array input and one array output with the examples first."""
    return all(hasattr(c["a"], "shape") and hasattr(c["g"], "shape") for c in calls)


def call_args(call):
    """``(args, kwargs)`` of a recorded call (``((a,), {})`` when the engine gave none)."""
    return call.get("args") or ((call["a"],), {})


def cat(parts):
    """The calls of a shared layer, concatenated along the positions (axis 1)."""
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def scaled(c, g):
    """``g`` with example i's rows multiplied by ``c[i]``; ``c`` (P,), ``g`` (P, ...)."""
    return g * jnp.reshape(c, (-1,) + (1,) * (g.ndim - 1)).astype(g.dtype)


def kept(x, keep):
    """``x`` (P, ...) with the rows of dropped examples (``keep`` (P,) bool false) set to 0, so that
    a non-finite example's 0 factor cannot give 0·inf = nan in a sum; ``keep=None``: ``x``."""
    if keep is None:
        return x
    return jnp.where(jnp.reshape(keep, (-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros_like(x))


