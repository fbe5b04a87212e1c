"""Ghost-norm rules of the JAX engine for per-example normalisation layers (scale ``gamma``,
offset ``beta``), in ``jax.numpy``.
Each rule is ``rule(layer, calls) -> (sq, sums)`` or ``None``, the contract of
:mod:`~keras_noisecurve.backend.jax.ghost_rules` (which lists the rules, in order).

* LayerNormalization over the last axis (no RMS scaling): ``x̂ = (a − mean)/√(var + ε)``,
  gamma gradient ``Σ_l x̂_il ⊙ g_il``, beta ``Σ_l g_il``.
* GroupNormalization with channels last: the same, with mean and variance over the
  positions and the channels of each group.

x̂ and the per-example gradients from (x̂, g) are the shared ``keras.ops`` forms of
:mod:`~keras_noisecurve.backend.common.norm_forms`, as on TensorFlow; this engine computes x̂ from the
recorded input. RMS-type norms are recognised by what they compute (:mod:`~keras_noisecurve.backend.jax.ghost_scale`).
The TensorFlow engine's rules of the same layers: ``keras_noisecurve/backend/tensorflow/ghost_norm.py``.
"""

from __future__ import annotations

import jax.numpy as jnp
import keras

from keras_noisecurve.backend.common import norm_forms
from keras_noisecurve.backend.jax.ghost_forms import F32, cat, kept, single

__all__ = ["group_norm_rule", "grouped_norm_rule", "layer_norm_rule"]


def layer_norm_rule(layer, calls):
    if type(layer) is not keras.layers.LayerNormalization or getattr(layer, "rms_scaling", False):
        return None
    if not single(calls):
        return None
    axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    if any(len({ax % c["a"].ndim for ax in axes} ^ {c["a"].ndim - 1}) for c in calls):
        return None  # normalised over more than the last axis
    d = calls[0]["a"].shape[-1]
    p = calls[0]["g"].shape[0]
    xs, gs = [], []
    for c in calls:
        xs.append(jnp.reshape(norm_forms.layer_norm_hat(c["a"].astype(F32), (c["a"].ndim - 1,), layer.epsilon),
                              (p, -1, d)))
        gs.append(jnp.reshape(c["g"].astype(F32), (p, -1, d)))
    return _affine(layer, cat(xs), cat(gs))


def grouped_norm_rule(cls, *, name: str):
    """The rule of a group normalisation layer class ``cls`` (exact type): channels on the last
    axis (a ``layer.axis`` elsewhere is left to the fallback), ``layer.groups`` groups, mean and
    variance over the positions and each group's channels, ``layer.epsilon``, and
    ``gamma``/``beta`` per channel (either may be ``None``), as ``keras.layers.GroupNormalization``
    computes. ``name``: the rule's name (what ``describe`` reports); a rule for a layer of your
    own is registered with ``keras_noisecurve.training.register_rule``."""

    def rule(layer, calls):
        if type(layer) is not cls or not single(calls):
            return None
        if any(getattr(layer, "axis", -1) % c["a"].ndim != c["a"].ndim - 1 for c in calls):
            return None  # channels not on the last axis
        d = calls[0]["a"].shape[-1]
        p = calls[0]["g"].shape[0]
        xs, gs = [], []
        for c in calls:
            x_hat = norm_forms.group_norm_hat(c["a"].astype(F32), layer.groups, layer.epsilon)
            xs.append(jnp.reshape(x_hat, (p, -1, d)))
            gs.append(jnp.reshape(c["g"].astype(F32), (p, -1, d)))
        return _affine(layer, cat(xs), cat(gs))

    rule.__name__ = rule.__qualname__ = name
    rule.__doc__ = f"{cls.__name__} (channels last): gamma ``Σ_l x̂_l ⊙ g_l``, beta ``Σ_l g_l``."
    return rule


def _affine(layer, x_hat, g):
    """Per-example gradients of ``gamma ⊙ x̂ + beta`` over the last axis: ``Σ_l x̂_l ⊙ g_l``, ``Σ_l g_l``."""
    gamma, beta = norm_forms.scale_offset_grads(x_hat, g, (2,))
    per = {}
    if layer.gamma is not None:
        per[id(layer.gamma)] = gamma
    if layer.beta is not None:
        per[id(layer.beta)] = beta
    sq = sum(jnp.sum(v * v, axis=1) for v in per.values())

    def sums(c, keep=None):
        return {k: jnp.tensordot(c.astype(F32), kept(v, keep), axes=1) for k, v in per.items()}

    return sq, sums


group_norm_rule = grouped_norm_rule(keras.layers.GroupNormalization, name="group_norm_rule")
