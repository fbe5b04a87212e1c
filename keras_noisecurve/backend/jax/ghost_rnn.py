"""Ghost-norm rule for recurrent layers on the JAX backend, in ``jax.numpy`` (traced inside the jitted
train step): ``LSTM``, ``GRU`` (``reset_after`` True and False), ``SimpleRNN`` and ``RNN`` wrapping one
of their cells (exact classes), with masking, ``go_backwards``, ``initial_state`` and
``return_sequences`` either way; each direction of a ``Bidirectional`` wrapper is its own recurrent
layer (the engine records the wrapper's calls of its forward and backward layers), so it takes this
rule too. The rule contract is the one of :mod:`keras_noisecurve.backend.jax.ghost_rules`
(``rule(layer, calls) -> (sq, sums)`` or ``None``); the engine makes every Keras RNN layer one
target holding its cell's weights, and records the layer's output and the gradient ``g`` there.

A recurrent cell applies its dense maps at every step t = 1..L. With ``x_t`` (d,) the step input,
``h_{t-1}`` (n,) the state entering the step and ``m_t = x_t W + b_in`` (G·n,) the input
projection (G = 4 for LSTM, 3 for GRU, 1 for SimpleRNN), the recurrent kernel U enters through
one or two products ``q_k,t = a_k,t U_k`` (U_k a block of U's columns):

| cell | products ``a_k U_k`` |
|---|---|
| LSTM, SimpleRNN | ``h_{t-1} U`` (added to ``m_t``) |
| GRU, ``reset_after=True`` | ``h_{t-1} U + b_rec``; candidate ``act(m_c + r ⊙ q_c)`` |
| GRU, ``reset_after=False`` | ``h_{t-1} U[:, :2n]`` (update, reset gates); ``(r ⊙ h_{t-1}) U[:, 2n:]`` (candidate) |

so one example's gradient is

    ∇W = Σ_t x_t g_tᵀ,   ∇U_k = Σ_t a_k,t γ_k,tᵀ,   ∇b_in = Σ_t g_t,   ∇b_rec = Σ_t γ_t,

with ``g_t = ∂(Σ_i w_i·loss_i)/∂m_t`` and ``γ_k,t`` the same derivative at the product's output.
The per-example squared norm is ``‖∇W‖² + Σ_k ‖∇U_k‖² + ‖∇b‖²``, each kernel term by
:func:`~keras_noisecurve.backend.common.norm_forms.sequence_sq_norms` (the Gram form
``Σ_{t,t'} (x_t·x_t')(g_t·g_t')`` when L² < d·G·n, else the materialised per-example gradient);
the clipped sum is ``Σ_{i,t} x_it (c_i g_it)ᵀ`` (book-keeping), and the same for each ``U_k``.

The sequences ``g`` and ``γ``: the engine gives only ``g_out``, the gradient at the layer's output
(the sequence of outputs, or the last one). The rule recomputes the layer's recurrence from its
recorded input and the step's weights (:func:`recurrence`, ``jax.lax.scan`` over time, Keras 3's
cell equations; ``implementation`` 1 and 2 differ only in round-off) as a function of ``m`` and
of zero perturbations added to every product's output, and one ``jax.vjp`` of it seeded with
``g_out`` returns ``g`` and ``γ`` for every example and step at once (each example's recurrence
depends on its own rows only, so this batched VJP is per-example). No weight gradient is formed.
Keras's JAX masking semantics are reproduced (``keras.src.backend.jax.rnn``'s scan): at a masked
step the states are kept and the output is the previous state ``h_{t-1}``, or zero with
``zero_output_for_mask`` (``Bidirectional`` sets it for sequences); a masked step has
``g_t = γ_t = 0``. ``go_backwards`` reverses the input and the mask, and the outputs stay in
processing order, as Keras returns them. Everything runs in float32 (a bfloat16/float16 input or
gradient is cast first), under the engine's full-precision scope.

Not ruled (``None``: the engine's exact per-layer fallback clips the whole layer):
``stateful=True``, ``unroll=True``, ``return_state=True`` (several outputs), dropout or recurrent
dropout > 0, any other cell (a subclass, ``StackedRNNCells``, a custom cell), a subclass of the
layer classes, a mask that is not (P, L), an initial state that is not (P, n) per state, and a
layer with trainable weights other than the cell's kernel, recurrent kernel and bias.

Shapes: P examples, L steps, d inputs, n units.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras

from keras_noisecurve.backend.common.norm_forms import kept, sequence_sq_norms

__all__ = ["recurrence", "recurrent_rule"]

_F32 = jnp.float32
_LAYERS = (keras.layers.LSTM, keras.layers.GRU, keras.layers.SimpleRNN, keras.layers.RNN)


def _act(fn, t):
    return t if fn is None else fn(t)


# ----------------------------------------------------------------- one time step
# step(cell, w, m_t, states, e_t) -> (new states, product inputs): m_t (P, G·n) the input projection
# with its bias, states (P, n) arrays, e_t the zero perturbations added to each product's output;
# the product inputs are the a_k,t of the module docstring, in U's column order.


def _lstm_step(cell, w, m_t, states, e_t):
    h, c = states
    z = m_t + jnp.matmul(h, w["U"]) + e_t[0]
    i, f, cc, o = jnp.split(z, 4, axis=-1)
    act, rec = cell.activation, cell.recurrent_activation
    c_new = _act(rec, f) * c + _act(rec, i) * _act(act, cc)
    h_new = _act(rec, o) * _act(act, c_new)
    return (h_new, c_new), (h,)


def _gru_step(cell, w, m_t, states, e_t):
    (h,) = states
    n = cell.units
    act, rec = cell.activation, cell.recurrent_activation
    m_u, m_r, m_c = jnp.split(m_t, 3, axis=-1)
    if cell.reset_after:
        q = jnp.matmul(h, w["U"]) + e_t[0]
        if w.get("b_rec") is not None:
            q = q + w["b_rec"]
        q_u, q_r, q_c = jnp.split(q, 3, axis=-1)
        u = _act(rec, m_u + q_u)
        r = _act(rec, m_r + q_r)
        cand = _act(act, m_c + r * q_c)
        inputs = (h,)
    else:
        q_u, q_r = jnp.split(jnp.matmul(h, w["U"][:, : 2 * n]) + e_t[0], 2, axis=-1)
        u = _act(rec, m_u + q_u)
        r = _act(rec, m_r + q_r)
        rh = r * h
        cand = _act(act, m_c + jnp.matmul(rh, w["U"][:, 2 * n:]) + e_t[1])
        inputs = (h, rh)
    return (u * h + (1 - u) * cand,), inputs


def _simple_step(cell, w, m_t, states, e_t):
    (h,) = states
    return (_act(cell.activation, m_t + jnp.matmul(h, w["U"]) + e_t[0]),), (h,)


def _product_widths(cell):
    """Output widths of the recurrent products, in U's column order."""
    n = cell.units
    if type(cell) is keras.layers.GRUCell and not cell.reset_after:
        return (2 * n, n)
    return (cell.recurrent_kernel.shape[-1],)


_STEPS = {keras.layers.LSTMCell: (_lstm_step, 2), keras.layers.GRUCell: (_gru_step, 1),
          keras.layers.SimpleRNNCell: (_simple_step, 1)}


def recurrence(layer, *, weights, m, perturbations, keep, states):
    """The layer's recurrence from its input projections, in processing order (already reversed
    for ``go_backwards``).

    Args:
      layer: the RNN layer (its cell's activations and kind, ``return_sequences``,
        ``zero_output_for_mask``).
      weights: ``{"U": (n, G·n), "b_rec": (G·n,) or None}`` float32.
      m: (P, L, G·n) input projections ``x_t W + b_in``.
      perturbations: one (P, L, width_k) array per recurrent product, added to its output.
      keep: (P, L) bool (False: masked step) or ``None``.
      states: the initial states, (P, n) each.

    Returns ``(output, inputs)``: ``output`` the layer's (P, L, n) outputs or its last (P, n)
    output, ``inputs`` the product inputs ``a_k`` (P, L, n) (the state entering each step, and
    ``r ⊙ h`` for a GRU with ``reset_after=False``).
    """
    step, _ = _STEPS[type(layer.cell)]
    cell = layer.cell
    zero = layer.zero_output_for_mask

    def body(carry, xs):
        m_t, e_t, keep_t = xs
        new, inputs = step(cell, weights, m_t, carry, e_t)
        if keep_t is None:
            return new, (new[0], inputs)
        k = keep_t[:, None]
        out = jnp.where(k, new[0], jnp.zeros_like(new[0]) if zero else carry[0])
        return tuple(jnp.where(k, s, old) for s, old in zip(new, carry)), (out, inputs)

    time_major = (jnp.swapaxes(m, 0, 1), [jnp.swapaxes(e, 0, 1) for e in perturbations],
                  None if keep is None else jnp.swapaxes(keep, 0, 1))
    _, (outputs, inputs) = jax.lax.scan(body, tuple(states), time_major)
    inputs = [jnp.swapaxes(a, 0, 1) for a in inputs]
    output = jnp.swapaxes(outputs, 0, 1) if layer.return_sequences else outputs[-1]
    return output, inputs


def _arguments(args, kwargs):
    """``(initial_state, mask)`` of a recorded ``RNN.call(sequences, initial_state, mask, training)``,
    or ``None`` for a call the rule does not know."""
    names = ("initial_state", "mask", "training")
    rest = args[1:]
    if len(rest) > len(names) or any(key not in names for key in kwargs):
        return None
    bound = dict(zip(names, rest))
    if any(key in bound for key in kwargs):
        return None
    bound.update(kwargs)
    return bound.get("initial_state"), bound.get("mask")


def _prepare(layer, call, p):
    """``(x, keep, states)`` of one call in processing order, float32; ``None`` when unsupported."""
    parsed = _arguments(*call["args"])
    if parsed is None:
        return None
    initial_state, mask = parsed
    x = call["a"]
    cell = layer.cell
    n, count = cell.units, _STEPS[type(cell)][1]
    if not hasattr(x, "shape") or x.ndim != 3 or x.shape[0] != p:
        return None
    x = x.astype(_F32)
    if isinstance(mask, (list, tuple)):
        mask = mask[0] if mask else None
    if mask is not None:
        if not hasattr(mask, "shape") or tuple(mask.shape) != tuple(x.shape[:2]):
            return None
        mask = mask.astype(bool)
    if initial_state is None:
        states = [jnp.zeros((p, n), _F32) for _ in range(count)]
    else:
        states = list(initial_state) if isinstance(initial_state, (list, tuple)) else [initial_state]
        states = states[:count]
        if len(states) != count or any(not hasattr(s, "shape") or tuple(s.shape) != (p, n) for s in states):
            return None
        states = [s.astype(_F32) for s in states]
    if layer.go_backwards:
        x = jnp.flip(x, axis=1)
        mask = None if mask is None else jnp.flip(mask, axis=1)
    return x, mask, states


def _ruled(layer):
    """Exact layer and cell classes, no state across batches, no unrolling, one output, no dropout,
    and no trainable weight but the cell's."""
    if type(layer) not in _LAYERS or type(layer.cell) not in _STEPS:
        return False
    cell = layer.cell
    if layer.stateful or layer.unroll or layer.return_state or cell.dropout or cell.recurrent_dropout:
        return False
    expected = {id(v) for v in (cell.kernel, cell.recurrent_kernel, cell.bias) if v is not None}
    return {id(v) for v in layer.trainable_variables} <= expected


def _scaled(c, g):
    return g * jnp.reshape(c, (-1,) + (1,) * (g.ndim - 1)).astype(g.dtype)


def _cat(parts):
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def recurrent_rule(layer, calls):
    """``LSTM``, ``GRU``, ``SimpleRNN`` and ``RNN`` of one of their cells: see the module docstring."""
    if not _ruled(layer) or not all(hasattr(c["g"], "shape") for c in calls):
        return None
    cell = layer.cell
    p = calls[0]["g"].shape[0]
    weights = {"U": jnp.asarray(cell.recurrent_kernel.value, _F32), "b_rec": None}
    kernel = jnp.asarray(cell.kernel.value, _F32)
    b_in = None
    split_bias = type(cell) is keras.layers.GRUCell and cell.reset_after
    if cell.use_bias:
        bias = jnp.asarray(cell.bias.value, _F32)
        b_in, weights["b_rec"] = (bias[0], bias[1]) if split_bias else (bias, None)
    widths = _product_widths(cell)
    xs, gs, products = [], [], [[] for _ in widths]  # products[k]: (a_k, γ_k) per call
    for call in calls:
        prepared = _prepare(layer, call, p)
        if prepared is None:
            return None
        x, keep, states = prepared
        g_out = call["g"].astype(_F32)
        m = jnp.matmul(x, kernel)
        if b_in is not None:
            m = m + b_in
        zeros = [jnp.zeros(x.shape[:2] + (w,), _F32) for w in widths]
        output, pull, inputs = jax.vjp(lambda m, e, keep=keep, states=states: recurrence(
            layer, weights=weights, m=m, perturbations=e, keep=keep, states=states), m, zeros, has_aux=True)
        if output.shape != g_out.shape:
            return None
        g_m, g_e = pull(g_out)
        xs.append(x)
        gs.append(g_m)
        for k in range(len(widths)):
            products[k].append((inputs[k], g_e[k]))
    x, g = _cat(xs), _cat(gs)
    pairs = [(_cat([a for a, _ in part]), _cat([b for _, b in part])) for part in products]
    sq = sequence_sq_norms(x, g) + sum(sequence_sq_norms(a, b) for a, b in pairs)
    bias_i = None
    if cell.use_bias:
        bias_i = jnp.sum(g, axis=1)
        if split_bias:
            bias_i = jnp.stack([bias_i, jnp.sum(pairs[0][1], axis=1)], axis=1)
        sq = sq + jnp.sum(jnp.reshape(bias_i * bias_i, (p, -1)), axis=1)

    def sums(c, keep=None):
        c = c.astype(_F32)
        out = {id(cell.kernel): jnp.einsum("pli,plj->ij", kept(x, keep), _scaled(c, kept(g, keep))),
               id(cell.recurrent_kernel): jnp.concatenate(
                   [jnp.einsum("pli,plj->ij", kept(a, keep), _scaled(c, kept(b, keep))) for a, b in pairs], axis=-1)}
        if bias_i is not None:
            out[id(cell.bias)] = jnp.tensordot(c, kept(bias_i, keep), axes=1)
        return out

    return sq, sums
