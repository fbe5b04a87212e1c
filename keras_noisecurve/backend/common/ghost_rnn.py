"""Ghost-norm kernel of the recurrent layers, one for every backend, in ``keras.ops`` (the contract
of :func:`~keras_noisecurve.backend.common.layer_rules.layer_kernel`): ``LSTM``, ``GRU``
(``reset_after`` True and False), ``SimpleRNN`` and ``RNN`` wrapping one of their cells (exact
classes), with masks (``mask=`` or an ``Embedding(mask_zero=True)``), ``go_backwards``,
``initial_state``, ``return_sequences``, ``return_state`` and ``unroll``; each direction of a
``Bidirectional`` wrapper is a recurrent layer of its own, so it takes this kernel too.

A recurrent cell applies its dense maps at every step t = 1..L. With ``x_t`` (d,) the step input,
``h_{t-1}`` (n,) the state entering the step and ``m_t = x_t W + b_in`` (G·n,) the input
projection (G = 4 for LSTM, 3 for GRU, 1 for SimpleRNN), the recurrent kernel U enters through
one or two products ``q_k,t = a_k,t U_k`` (U_k a block of U's columns):

| cell | products ``a_k U_k`` | their output gradient ``γ_k`` |
|---|---|---|
| LSTM, SimpleRNN | ``h_{t-1} U`` (added to ``m_t``) | ``g`` |
| GRU, ``reset_after=True`` | ``h_{t-1} U + b_rec``; candidate ``act(m_c + r ⊙ q_c)`` | ``[g_u, g_r, r ⊙ g_c]`` |
| GRU, ``reset_after=False`` | ``h_{t-1} U[:, :2n]``; ``(r ⊙ h_{t-1}) U[:, 2n:]`` | ``g[:, :2n]``; ``g[:, 2n:]`` |

so one example's gradient is

    ∇W = Σ_t x_t g_tᵀ,   ∇U_k = Σ_t a_k,t γ_k,tᵀ,   ∇b_in = Σ_t g_t,   ∇b_rec = Σ_t γ_t,

with ``g_t = ∂(Σ_i w_i·loss_i)/∂m_t`` (each gate's pre-activation is ``m_t`` plus a recurrent
term, so γ follows from g and the reset gate r). The per-example squared norm is
``‖∇W‖² + Σ_k ‖∇U_k‖² + ‖∇b‖²``, each kernel term by
:func:`~keras_noisecurve.backend.common.norm_forms.sequence_sq_norms` (the Gram form
``Σ_{t,t'} (x_t·x_t')(g_t·g_t')`` when L² < d·G·n, else the materialised per-example gradient);
the clipped sum is ``Σ_{i,t} x_it (c_i g_it)ᵀ`` (book-keeping), and the same for each ``U_k``.

How ``g`` and the ``a_k`` are recorded (``forward``, which the engines run in place of the layer's
call): ``m = x W + b_in`` for all steps in one matmul is the recorded ``z`` (its gradient is g),
and the recurrence runs over it in Keras's own backend loop (``keras.src.backend.rnn``, so masks,
``go_backwards``, unknown lengths and the masked steps' outputs are each backend's own), with the
cell's equations of Keras 3 (``implementation`` 1 and 2 differ only in round-off). The states
entering each step are the initial state and the outputs of the steps before, unless a mask keeps
states apart from outputs: then the loop's first state and its output carry ``[h_t, h_{t-1}]``
side by side. A GRU's reset gates ``r_t`` follow from ``m`` and those states in one product after
the loop. Both are ``saved`` (in the input's order, also with ``go_backwards``); a masked step has
``g_t = 0``, so what its ``saved`` rows hold does not count.

Not taken (the engine's exact per-layer fallback clips the layer): ``stateful=True``, dropout or
recurrent dropout > 0, any other cell (a subclass, ``StackedRNNCells``, a custom cell), a subclass
of the layer classes (its ``call`` or loop may differ, and the forward replaces them), and a layer
with trainable weights other than the cell's kernel, recurrent kernel and bias. Shapes: P examples, L steps, d inputs, n units.
"""

from __future__ import annotations

import keras
from keras import ops

from keras_noisecurve import _compat
from keras_noisecurve.backend.common.layer_rules import layer_kernel
from keras_noisecurve.backend.common.norm_forms import cat, sequence_sq_norms, sum_dtype, weighted_outer, weighted_sum

__all__ = ["recurrent"]

_LAYERS = (keras.layers.LSTM, keras.layers.GRU, keras.layers.SimpleRNN, keras.layers.RNN)
#: the cells taken (exact classes): their number of states
_CELLS = {keras.layers.LSTMCell: 2, keras.layers.GRUCell: 1, keras.layers.SimpleRNNCell: 1}


def _act(fn, t):
    return t if fn is None else fn(t)


def _is_gru(cell):
    return type(cell) is keras.layers.GRUCell


def _step(cell, u, b_rec, carry_h):
    """The cell's step for Keras's loop: ``(m_t (P, G·n), [wide, c]) -> (wide, [wide, c])``, ``wide``
    ``h_t`` (P, n), or ``[h_t, h_{t-1}]`` (P, 2n) where ``carry_h``; ``c`` an LSTM's carry."""
    n = cell.units
    act, rec = cell.activation, getattr(cell, "recurrent_activation", None)

    def step(m_t, states):
        h = states[0][:, :n] if carry_h else states[0]
        if type(cell) is keras.layers.LSTMCell:
            i, f, cc, o = ops.split(m_t + ops.matmul(h, u), 4, axis=-1)
            c = _act(rec, f) * states[1] + _act(rec, i) * _act(act, cc)
            new = [_act(rec, o) * _act(act, c), c]
        elif _is_gru(cell):
            m_u, m_r, m_c = ops.split(m_t, 3, axis=-1)
            if cell.reset_after:
                q = ops.matmul(h, u) if b_rec is None else ops.matmul(h, u) + b_rec
                q_u, q_r, q_c = ops.split(q, 3, axis=-1)
                r = _act(rec, m_r + q_r)
                cand = _act(act, m_c + r * q_c)
            else:
                q_u, q_r = ops.split(ops.matmul(h, u[:, : 2 * n]), 2, axis=-1)
                r = _act(rec, m_r + q_r)
                cand = _act(act, m_c + ops.matmul(r * h, u[:, 2 * n:]))
            z = _act(rec, m_u + q_u)
            new = [z * h + (1 - z) * cand]
        else:
            new = [_act(act, m_t + ops.matmul(h, u))]
        wide = ops.concatenate([new[0], ops.stop_gradient(h)], axis=-1) if carry_h else new[0]
        return wide, [wide, *new[1:]]

    return step


def _arguments(layer, args, kwargs):
    """``(initial_state, mask)`` of a call ``layer(sequences, initial_state, mask, training)``."""
    names = ("initial_state", "mask", "training")
    if len(args) > len(names):
        raise TypeError(f"{type(layer).__name__}.call takes at most 4 positional arguments, got {1 + len(args)}.")
    bound = dict(zip(names, args))
    for key, value in kwargs.items():
        if key not in names or key in bound:
            raise TypeError(f"{type(layer).__name__}.call got an unexpected or repeated argument {key!r}.")
        bound[key] = value
    return bound.get("initial_state"), bound.get("mask")


def _bias(cell, dtype):
    """``(b_in, b_rec)``: a GRU with ``reset_after`` has two rows of biases, the others one."""
    if not cell.use_bias:
        return None, None
    bias = ops.cast(cell.bias, dtype)
    return (bias[0], bias[1]) if _is_gru(cell) and cell.reset_after else (bias, None)


def _forward(layer, call, x, *args, **kwargs):
    initial_state, mask = _arguments(layer, args, kwargs)
    cell = layer.cell
    dtype, n = cell.compute_dtype, cell.units
    x = ops.cast(x, dtype)
    b_in, b_rec = _bias(cell, dtype)
    m = ops.matmul(x, ops.cast(cell.kernel, dtype))  # (P, L, G·n): every step's input projection
    if b_in is not None:
        m = m + b_in
    # without a mask the state entering step t is the output of step t − 1 (or the initial state),
    # so the loop carries it only where masked steps keep it apart from the outputs
    carry_h = mask is not None
    count, width = _CELLS[type(cell)], (1 + carry_h) * n

    def after(z):
        batch = ops.shape(z)[0]
        if initial_state is None:
            states = [ops.zeros((batch, n), dtype) for _ in range(count)]
        else:
            given = list(initial_state) if isinstance(initial_state, (list, tuple)) else [initial_state]
            states = [ops.cast(s, dtype) for s in given[:count]]
        wide = states[0] if width == n else ops.concatenate(
            [states[0], ops.zeros((ops.shape(states[0])[0], width - n), dtype)], axis=-1)
        u = ops.cast(cell.recurrent_kernel, dtype)
        step = _step(cell, u, b_rec, carry_h)
        keep = mask[0] if isinstance(mask, (list, tuple)) else mask
        last, outputs, final = _compat.rnn(
            step, z, [wide, *states[1:]], go_backwards=layer.go_backwards, mask=keep, unroll=layer.unroll,
            input_length=z.shape[1], zero_output_for_mask=layer.zero_output_for_mask)
        result = outputs[..., :n] if layer.return_sequences else last[..., :n]
        result = ops.cast(result, layer.compute_dtype)
        if carry_h:
            entering = outputs[..., n: 2 * n]
        else:  # h_0 (broadcast to the batch), then the outputs of steps 1 … L − 1
            first = states[0] + ops.zeros_like(outputs[:, 0, :n])
            entering = ops.concatenate([ops.expand_dims(first, 1), outputs[:, :-1, :n]], axis=1)
        if layer.go_backwards:  # the loop's order is reversed: back to the order of x and m
            entering = ops.flip(entering, axis=1)
        saved = {"h": entering}
        if _is_gru(cell):  # r_t = σ(m_r,t + h_{t-1} U_r (+ b_rec,r)) for all steps at once, after the loop
            q_r = ops.matmul(entering, u[:, n: 2 * n])
            q_r = q_r if b_rec is None else q_r + b_rec[n: 2 * n]
            saved["r"] = _act(cell.recurrent_activation, z[..., n: 2 * n] + q_r)
        if layer.return_state:
            final = [final[0][:, :n], *final[1:]]
            return (result, *(ops.cast(s, layer.compute_dtype) for s in final)), saved
        return result, saved

    return m, after


def _check(layer):
    cell = layer.cell
    if type(cell) not in _CELLS:
        return (f"its cell is a {type(cell).__name__}; only LSTMCell, GRUCell and SimpleRNNCell (exact classes) have "
                "a ghost kernel")
    if layer.stateful:
        return "stateful=True carries states across batches (not supported)"
    if cell.dropout > 0 or cell.recurrent_dropout > 0:
        return (f"dropout={cell.dropout}, recurrent_dropout={cell.recurrent_dropout}: recurrent dropout is not "
                "supported (use 0, or a Dropout layer between layers)")
    return None


def _weights(layer):
    return [getattr(layer.cell, name, None) for name in ("kernel", "recurrent_kernel", "bias")]


@layer_kernel(matches=lambda layer: type(layer) in _LAYERS, names=tuple(cls.__name__ for cls in _LAYERS),
              weights=_weights, forward=_forward, check=_check, sublayers=True)
def recurrent(layer, calls):
    """``LSTM``, ``GRU`` (both ``reset_after``), ``SimpleRNN`` and ``RNN`` wrapping one of their cells."""
    if any(c["saved"] is None for c in calls):  # g is the gradient at the output, not at m: the fallback
        return None
    cell = layer.cell
    n = cell.units
    dtype = sum_dtype(calls[0]["g"])

    def gather(key):
        return cat([ops.cast(c["a"] if key == "a" else c["saved"][key], dtype) for c in calls])

    x, h = gather("a"), gather("h")
    g = cat([ops.cast(c["g"], dtype) for c in calls])
    g_rec = g
    recurrent_pairs = [(h, g)]  # (input, output gradient) of the recurrent kernel's column blocks, in order
    if _is_gru(cell):
        r = gather("r")
        if cell.reset_after:
            g_rec = ops.concatenate([g[..., : 2 * n], r * g[..., 2 * n:]], axis=-1)
            recurrent_pairs = [(h, g_rec)]
        else:
            recurrent_pairs = [(h, g[..., : 2 * n]), (r * h, g[..., 2 * n:])]
    sq = sequence_sq_norms(x, g) + sum(sequence_sq_norms(a, b) for a, b in recurrent_pairs)
    bias = None
    if cell.use_bias:
        bias = ops.sum(g, axis=1)
        if _is_gru(cell) and cell.reset_after:
            bias = ops.stack([bias, ops.sum(g_rec, axis=1)], axis=1)
        sq = sq + ops.sum(ops.reshape(bias * bias, (ops.shape(bias)[0], -1)), axis=1)

    def sums(c, keep=None):
        out = {id(cell.kernel): weighted_outer(x, g, c, keep),
               id(cell.recurrent_kernel): ops.concatenate(
                   [weighted_outer(a, b, c, keep) for a, b in recurrent_pairs], axis=-1)}
        if bias is not None:
            out[id(cell.bias)] = weighted_sum(bias, c, keep)
        return out

    return sq, sums
