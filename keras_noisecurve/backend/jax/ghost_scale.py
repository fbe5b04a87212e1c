"""Ghost-norm rule of the JAX engine for layers recognised by what they compute (RMS-type norms),
in ``jax.numpy``.
Each rule is ``rule(layer, calls) -> (sq, sums)`` or ``None``, the contract of
:mod:`~keras_noisecurve.backend.jax.ghost_rules` (which lists the rules, in order).
Its ``calls`` also carry ``"args"`` and it runs under the step's weight values (see
:mod:`~keras_noisecurve.backend.jax.ghost_rules`).

* RMS-type norms, recognised by computation (:func:`probe_affine_scale`): a layer whose one
  weight w (d,) enters as ``y = u(x) ⊙ (α + w)`` along the last axis, ``u`` independent of w
  (Keras's RMSNormalization, LayerNormalization(rms_scaling=True), KerasHub's Gemma, Llama,
  Mistral, Qwen, Phi-3, T5 norms, a custom layer written the same way). Per step,
  ``u = ∂y/∂w`` is the JVP of the layer's call at the recorded input with tangent 1 on w
  (exact since ``y_k`` depends on w only through ``w_k``); ``G_i = Σ_positions g_i ⊙ u_i`` (d,).
  The norms known by class (``affine_scale.known_rms_norm``: Keras's RMSNormalization, KerasHub's
  Llama, Gemma and Mistral norms) take the same computation under the name "RMS scale"
  (:func:`diagonal_scale_rule`), as on TensorFlow.

The TensorFlow engine's rule: ``keras_noisecurve/backend/tensorflow/ghost_scale.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_noisecurve.backend.common import affine_scale
from keras_noisecurve.backend.jax.ghost_forms import F32, call_args, kept, single

__all__ = ["diagonal_scale_rule", "probe_affine_scale", "rms_scale_rule"]


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
    :func:`keras_noisecurve.backend.common.affine_scale.affine_in_weight`, shared with the TensorFlow engine.
    """
    return _PROBE(layer)


def rms_scale_rule(layer, calls):
    """A layer recognised by :func:`probe_affine_scale`, called on its input alone:
    ``G_i = Σ_positions g_i ⊙ u_i`` with ``u`` the JVP of the call with tangent 1 on w."""
    if not single(calls) or any(len(call_args(c)[0]) != 1 or call_args(c)[1] for c in calls):
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
        per = per + jnp.sum(jnp.reshape(c["g"].astype(F32) * slope.astype(F32), (p, -1, d)), axis=1)
    sq = jnp.sum(per * per, axis=1)

    def sums(c, keep=None):
        return {id(weight): jnp.tensordot(c.astype(F32), kept(per, keep), axes=1)}

    return sq, sums


def diagonal_scale_rule(layer, calls):
    """An RMS norm known by class (``affine_scale.known_rms_norm``) normalising the last axis:
    :func:`rms_scale_rule`'s computation (its probe confirms the form)."""
    axis = getattr(layer, "axis", -1)
    if not affine_scale.known_rms_norm(layer) or list(axis if isinstance(axis, (list, tuple)) else [axis]) != [-1]:
        return None
    return rms_scale_rule(layer, calls)
