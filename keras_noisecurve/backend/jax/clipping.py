"""Per-example clipping on JAX by the whole model's per-example gradients: the
``clipping="vectorized"`` engine of a ``PrivateModel`` (and of ``clipping="auto"`` for a model the
ghost engine cannot attribute to examples), as ``backend/tensorflow/clipping.py`` is TensorFlow's.

    g_i = ∇_w (w_i·loss_i)(w)          jax.vmap of jax.grad of the model's stateless_call
    S   = Σ_i g_i·min(1, ζ/‖g_i‖₂)      ‖·‖ over ALL trainable variables; 0 for an example whose
                                        loss or norm is not finite (dropped, counted by the step)

``microbatch_size=m`` evaluates the g_i m examples at a time (``jax.lax.map`` over chunks; the
batch is padded with weight-0 rows to a multiple of m). Shapes: P examples.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from keras_noisecurve._losses import float32_outputs
from keras_noisecurve.backend.common.calls import training_kwargs
from keras_noisecurve.backend.common.clip import clip_factors
from keras_noisecurve.backend.common.units import check_rows, per_row, unit_losses

__all__ = ["clipped_sum", "per_example_grads"]


def per_example_grads(model, loss_fn, trainable, non_trainable, x, y, weights, *, training=True, unit_rows=1):
    """Per-example (per-unit) gradients of ``Σ_{i ∈ u} weights_i·loss_fn(y_i, model(x_i))``.

    Args:
      model: a Keras model (its ``stateless_call`` is differentiated).
      loss_fn: ``(y_true, y_pred) -> (P,)`` per-example losses.
      trainable, non_trainable: the values of ``model.trainable_variables`` and
        ``model.non_trainable_variables``.
      x, y: the batch (leading dimension P); weights: float32 (P,).
      unit_rows: k, the rows of one privacy unit (a user-level run's examples per user;
        1: every row is a unit): unit u is rows ``[u·k, (u+1)·k)``, called as one batch of k.

    Returns:
      ``(grads, losses, y_pred, non_trainable)``: a list with one (U, *shape) array
      per trainable variable (U = P/k units), the unweighted losses (P,), the predictions
      (P, ...) and the non-trainable values after the call of unit 0 (e.g. a dropout seed).
    """
    k = int(unit_rows)

    def units(a):
        return jnp.reshape(a, (-1, k) + a.shape[1:])

    def one(tv, xu, yu, wu):
        kwargs = training_kwargs(model, training)
        y_pred, new_ntv = model.stateless_call(tv, non_trainable, xu, **kwargs)
        y_pred32 = float32_outputs(y_pred)  # as Keras's Loss.__call__, each output keeping its Keras mask
        losses = jnp.reshape(loss_fn(yu, y_pred32), (-1,))
        return jnp.sum(losses * wu.astype(losses.dtype)), (losses, y_pred, new_ntv)

    grad_fn = jax.grad(one, has_aux=True)
    xs, ys = jax.tree_util.tree_map(units, x), jax.tree_util.tree_map(units, y)
    grads, (losses, y_pred, new_ntv) = jax.vmap(grad_fn, in_axes=(None, 0, 0, 0))(trainable, xs, ys, units(weights))
    rows = lambda a: jnp.reshape(a, (-1,) + a.shape[2:])  # noqa: E731  (U, k, ...) -> (P, ...)
    new_ntv = [v[0] for v in new_ntv]
    return list(grads), rows(losses), jax.tree_util.tree_map(rows, y_pred), new_ntv


def _clip_and_sum(grads, losses, l2_norm_clip, unit_rows=1):
    """``(Σ_u clip(g_u, ζ), norms (P,))`` with the global per-unit norm (on each of the unit's
    rows); a unit whose loss (one of its rows') or norm is not finite is dropped (factor 0, and
    its gradient replaced by zeros so that 0·inf = nan cannot reach the sum), as the TensorFlow
    engines do. ``grads`` (U, ...), ``losses`` (P,) per row."""
    losses = unit_losses(losses, unit_rows) if unit_rows > 1 else losses
    squares = sum(jnp.sum(jnp.reshape(g.astype(jnp.float32), (g.shape[0], -1)) ** 2, axis=1) for g in grads)
    norms = jnp.sqrt(squares)
    factor, keep = clip_factors(norms, losses, jnp.asarray(l2_norm_clip, jnp.float32))  # 0 when dropped

    def plain(grads):
        return [jnp.tensordot(factor.astype(g.dtype), g, axes=1) for g in grads]

    def masked(grads):  # only when an example was dropped (lax.cond: the usual step skips the pass)
        return plain([jnp.where(jnp.reshape(keep, (-1,) + (1,) * (g.ndim - 1)), g, jnp.zeros_like(g))
                      for g in grads])

    return jax.lax.cond(jnp.all(keep), plain, masked, list(grads)), per_row(norms, unit_rows)


def clipped_sum(model, loss_fn, trainable, non_trainable, x, y, weights, *, l2_norm_clip,
                microbatch_size=None, training=True, unit_rows=1):
    """``Σ_i clip(w_i·∇loss_i, ζ)`` by per-example gradients (see the module docstring).

    ``unit_rows`` k > 1 (user-level): the privacy unit is k consecutive rows, clipped as one,
    ``Σ_u clip(Σ_{i ∈ u} w_i·∇loss_i, ζ)`` (:mod:`keras_noisecurve.backend.common.units`); a
    ``microbatch_size`` is then rounded down to whole units (at least one).

    Returns ``(sums, norms, losses, y_pred, non_trainable)``: one array per trainable
    variable, the norms ‖w_i·∇loss_i‖ (P,) before clipping (a unit's on each of its rows), the
    unweighted per-example losses (P,), the predictions and the non-trainable values after the
    call. An example (unit) whose loss or norm is not finite contributes 0 to ``sums`` (the
    contract of every engine: ``train_step`` counts them from ``losses`` and ``norms``).
    """
    size = int(weights.shape[0])
    k = int(unit_rows)
    check_rows(size, k)
    if microbatch_size is None or microbatch_size >= size:
        grads, losses, y_pred, ntv = per_example_grads(model, loss_fn, trainable, non_trainable, x, y, weights,
                                                        training=training, unit_rows=k)
        sums, norms = _clip_and_sum(grads, losses, l2_norm_clip, k)
        return sums, norms, losses, y_pred, ntv
    m = max(1, int(microbatch_size) // k) * k
    chunks = -(-size // m)
    pad = chunks * m - size

    def chunked(a):  # rows padded with copies of row 0 (weight 0), then (chunks, m, ...)
        if pad:
            a = jnp.concatenate([a, jnp.repeat(a[:1], pad, axis=0)], axis=0)
        return jnp.reshape(a, (chunks, m) + a.shape[1:])

    xs, ys = jax.tree_util.tree_map(chunked, x), jax.tree_util.tree_map(chunked, y)
    ws = chunked(weights) if not pad else jnp.reshape(
        jnp.concatenate([weights, jnp.zeros((pad,), weights.dtype)]), (chunks, m))

    def chunk(args):
        xc, yc, wc = args
        grads, losses, y_pred, ntv = per_example_grads(model, loss_fn, trainable, non_trainable, xc, yc, wc,
                                                        training=training, unit_rows=k)
        sums, norms = _clip_and_sum(grads, losses, l2_norm_clip, k)
        return sums, norms, losses, y_pred, ntv

    sums, norms, losses, y_pred, ntv = jax.lax.map(chunk, (xs, ys, ws))
    unchunk = lambda a: jnp.reshape(a, (chunks * m,) + a.shape[2:])[:size]  # noqa: E731
    sums = [jnp.sum(s, axis=0) for s in sums]
    return (sums, unchunk(norms), unchunk(losses), jax.tree_util.tree_map(unchunk, y_pred),
            [v[0] for v in ntv])
