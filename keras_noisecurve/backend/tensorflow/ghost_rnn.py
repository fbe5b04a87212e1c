"""Ghost-clipping rule for recurrent layers: ``LSTM``, ``GRU``, ``SimpleRNN`` (and ``RNN`` of their cells).

A recurrent cell applies its dense maps at every time step t = 1..L. With ``x_t``
(d,) the step input, ``h_{t-1}`` (n,) the state entering the step and
``z_t = x_t W + b + h_{t-1} U`` (G·n,) the gate pre-activations (G = 4 for LSTM,
3 for GRU, 1 for SimpleRNN), the gradient of one example's loss is

    ∇W = Σ_t x_t g_tᵀ,   ∇U = Σ_t h_{t-1} g_tᵀ,   ∇b = Σ_t g_t,   g_t = ∂loss/∂z_t,

so the per-example squared norms follow from the ``(x, g)`` and ``(h, g)`` sequences
with :func:`sequence_sq_norms` (Gram form Σ_{t,t'} (x_t·x_t')(g_t·g_t') when L² is
smaller than the weight, else the materialised per-example gradient), and the
clipped sum from :func:`weighted_outer` (book-keeping).

GRU specifics (u = update, r = reset, c = candidate blocks of n units each):

- ``reset_after=True`` (bias (2, 3n) = [input bias; recurrent bias]):
  ``m_t = x_t W + b_in`` and ``q_t = h_{t-1} U + b_rec``; the candidate is
  ``act(m_c + r ⊙ q_c)``. Hence ∂loss/∂m = g (the recorded gradient), and
  ∂loss/∂q = g_q = [g_u, g_r, r ⊙ g_c]: ∇U = Σ_t h_{t-1} g_qᵀ, ∇b_rec = Σ_t g_q.
- ``reset_after=False`` (bias (3n,)): the candidate is
  ``act(m_c + (r ⊙ h_{t-1}) U_c)``: the columns U_{u,r} see h_{t-1} and U_c sees
  r ⊙ h_{t-1}, both with gradient g: ‖∇U‖² = ‖Σ h g_{u,r}ᵀ‖² + ‖Σ (r⊙h) g_cᵀ‖².

To obtain g_t the rule's ``forward`` computes ``m = x W + b_in`` for all steps in
one matmul, records it as ``out`` (its gradient is g: every later use of ``m_t``
adds it to the recurrent term), and runs the recurrence itself in a
``tf.while_loop`` over time from the cell's weights and activations (same math as
Keras 3.15's cells; ``implementation`` 1 and 2 differ only in round-off), with
``go_backwards``, masks (``mask=`` or an ``Embedding(mask_zero=True)``: a masked
step keeps the previous state; its output is the previous output, or zero with
``zero_output_for_mask`` as ``Bidirectional`` sets for sequences),
``initial_state``, ``return_sequences`` and ``return_state``. It returns what the
layer's own ``call`` returns. Masked steps have g_t = 0.

The sequence length may be unknown when tracing: the time loop is a ``tf.while_loop``
over one projection of all steps (why not an unrolled Python loop: docs/performance.md,
"Measurements behind design choices").

Refused (``check``): ``stateful=True``, dropout or recurrent dropout > 0, cells
other than the three Keras cells (including subclasses and ``StackedRNNCells``).

The weights live in the layer's ``cell`` sublayer: the rule sets
``covers_sublayers = True`` so the engine counts the cell's variables as the
layer's own. Shapes: P examples, L steps, d inputs, n units.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_noisecurve.backend.tensorflow.ghost_forms import (
    Rule,
    concat_positions,
    norm_dtype,
    per_example_sq,
    sequence_sq_norms,
    weighted_outer,
    weighted_sum,
)

_CELLS = {
    keras.layers.LSTMCell: ("lstm", 4),
    keras.layers.GRUCell: ("gru", 3),
    keras.layers.SimpleRNNCell: ("simple", 1),
}


def _cell_kind(cell):
    """("lstm" | "gru" | "simple", gates) for an exact Keras cell class, else (None, 0)."""
    return _CELLS.get(type(cell), (None, 0))


def _apply(activation, t):
    return t if activation is None else activation(t)


# ----------------------------------------------------------------- one time step
# Each step maps (m_t, states) -> (new states, extra recorded tensors); m_t (P, G·n)
# is the input projection with the input bias, states are (P, n) tensors.


def _lstm_step(cell, weights, m_t, states):
    h, c = states
    z = m_t + tf.matmul(h, weights["U"])
    i, f, cc, o = tf.split(z, 4, axis=-1)
    act, rec = cell.activation, cell.recurrent_activation
    c_new = _apply(rec, f) * c + _apply(rec, i) * _apply(act, cc)
    h_new = _apply(rec, o) * _apply(act, c_new)
    return [h_new, c_new], {}


def _gru_step(cell, weights, m_t, states):
    (h,) = states
    n = cell.units
    act, rec = cell.activation, cell.recurrent_activation
    m_u, m_r, m_c = tf.split(m_t, 3, axis=-1)
    if cell.reset_after:
        q = tf.matmul(h, weights["U"])
        if weights.get("b_rec") is not None:
            q = q + weights["b_rec"]
        q_u, q_r, q_c = tf.split(q, 3, axis=-1)
        u = _apply(rec, m_u + q_u)
        r = _apply(rec, m_r + q_r)
        cand = _apply(act, m_c + r * q_c)
    else:
        q = tf.matmul(h, weights["U"][:, : 2 * n])
        q_u, q_r = tf.split(q, 2, axis=-1)
        u = _apply(rec, m_u + q_u)
        r = _apply(rec, m_r + q_r)
        cand = _apply(act, m_c + tf.matmul(r * h, weights["U"][:, 2 * n :]))
    h_new = u * h + (1 - u) * cand
    return [h_new], {"r": r}


def _simple_step(cell, weights, m_t, states):
    (h,) = states
    return [_apply(cell.activation, m_t + tf.matmul(h, weights["U"]))], {}


_STEPS = {"lstm": _lstm_step, "gru": _gru_step, "simple": _simple_step}


# ---------------------------------------------------------- the recurrence itself

def _masked_step(layer, kind, weights, m_t, keep, states, output):
    """One step with Keras's masking: (states, output, extras) after step t.

    ``keep`` (P, 1) bool or None. A masked example keeps its states; its output is the
    previous output (zeros before the first step), or zeros with ``zero_output_for_mask``.
    """
    new_states, extras = _STEPS[kind](layer.cell, weights, m_t, states)
    if keep is None:
        return new_states, new_states[0], extras
    masked_output = tf.zeros_like(output) if layer.zero_output_for_mask else output
    output = tf.where(keep, new_states[0], masked_output)
    states = [tf.where(keep, new, old) for new, old in zip(new_states, states)]
    return states, output, extras


def _recurrence(layer, kind, weights, m, mask, states):
    """Run the cell over time in a ``tf.while_loop`` (any L, static or not).

    ``m`` (P, L, G·n) input projections, ``mask`` (P, L, 1) bool or None, ``states``
    the initial states. Returns (outputs (P, L, n) or None without
    ``return_sequences``, last output (P, n), final states, h_prev (P, L, n): the
    state entering each step, extras {"r": (P, L, n)} for GRU).
    """
    dtype = m.dtype
    length = tf.shape(m)[1]
    m_steps = tf.TensorArray(dtype, size=length).unstack(tf.transpose(m, [1, 0, 2]))
    keep_steps = None
    if mask is not None:
        keep_steps = tf.TensorArray(tf.bool, size=length).unstack(tf.transpose(mask, [1, 0, 2]))
    extra_names = ["r"] if kind == "gru" else []

    def body(t, output, states, h_ta, extra_tas, out_ta):
        keep = None if keep_steps is None else keep_steps.read(t)
        h_ta = h_ta.write(t, states[0])
        new_states, output, extra = _masked_step(layer, kind, weights, m_steps.read(t), keep, list(states), output)
        extra_tas = [ta.write(t, extra[name]) for ta, name in zip(extra_tas, extra_names)]
        if layer.return_sequences:
            out_ta = out_ta.write(t, output)
        return t + 1, output, new_states, h_ta, extra_tas, out_ta

    def empty():
        return tf.TensorArray(dtype, size=length)

    loop_vars = (
        tf.constant(0), tf.zeros_like(states[0]), list(states), empty(), [empty() for _ in extra_names], empty()
    )
    _, output, states, h_ta, extra_tas, out_ta = tf.while_loop(
        lambda t, *_: t < length, body, loop_vars, maximum_iterations=length
    )

    def batch_major(ta):
        return tf.transpose(ta.stack(), [1, 0, 2])

    sequence = batch_major(out_ta) if layer.return_sequences else None
    return sequence, output, list(states), batch_major(h_ta), {k: batch_major(ta) for k, ta in zip(extra_names, extra_tas)}


# ------------------------------------------------------------------------- rule


class RecurrentRule(Rule):
    """``LSTM``, ``GRU`` (both ``reset_after``), ``SimpleRNN`` and ``RNN`` wrapping one of their cells."""

    classes = (keras.layers.LSTM, keras.layers.GRU, keras.layers.SimpleRNN, keras.layers.RNN)
    kind = "Recurrent"
    covers_sublayers = True  # the weights are owned by layer.cell

    def expected_variables(self, layer):
        cell = layer.cell
        return [getattr(cell, name, None) for name in ("kernel", "recurrent_kernel", "bias")]

    def check(self, layer):
        cell = layer.cell
        kind, _ = _cell_kind(cell)
        if kind is None:
            return (
                f"its cell is a {type(cell).__name__}; only LSTMCell, GRUCell and SimpleRNNCell "
                "(exact classes) have a ghost rule"
            )
        if layer.stateful:
            return "stateful=True carries states across batches (not supported)"
        if cell.dropout > 0 or cell.recurrent_dropout > 0:
            return (
                f"dropout={cell.dropout}, recurrent_dropout={cell.recurrent_dropout}: "
                "recurrent dropout is not supported (use 0, or a Dropout layer between layers)"
            )
        expected = {id(v) for v in self.expected_variables(layer) if v is not None}
        extra = [v.path for v in layer.trainable_variables if id(v) not in expected]
        if extra:
            return f"unexpected trainable variables {extra}"
        return None

    # ------------------------------------------------------------------ forward

    @staticmethod
    def _arguments(layer, args, kwargs):
        names = ("initial_state", "mask", "training")
        if len(args) > len(names):
            raise TypeError(f"{type(layer).__name__}.call takes at most 4 positional arguments, got {1 + len(args)}.")
        bound = dict(zip(names, args))
        for key, value in kwargs.items():
            if key not in names or key in bound:
                raise TypeError(f"{type(layer).__name__}.call got an unexpected or repeated argument {key!r}.")
            bound[key] = value
        return bound.get("initial_state"), bound.get("mask")

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        initial_state, mask = self._arguments(layer, args, kwargs)
        cell = layer.cell
        kind, _ = _cell_kind(cell)
        if kind is None or layer.stateful or cell.dropout > 0 or cell.recurrent_dropout > 0:
            raise ValueError(f"{type(layer).__name__} layer '{layer.name}': {self.check(layer)}")
        dtype = cell.compute_dtype
        x = tf.cast(tf.convert_to_tensor(inputs), dtype)
        batch = tf.shape(x)[0]
        n = cell.units
        if initial_state is None:
            states = [tf.zeros([batch, n], dtype) for _ in range(2 if kind == "lstm" else 1)]
        else:
            states = list(initial_state) if isinstance(initial_state, (list, tuple)) else [initial_state]
            if kind != "lstm":
                states = states[:1]
            states = [tf.cast(tf.convert_to_tensor(s), dtype) for s in states]
        if mask is not None:
            if isinstance(mask, (list, tuple)):
                mask = mask[0]
            mask = tf.cast(tf.convert_to_tensor(mask), tf.bool)
            mask = tf.reshape(mask, [batch, -1, 1])
        if layer.go_backwards:
            x = tf.reverse(x, axis=[1])
            if mask is not None:
                mask = tf.reverse(mask, axis=[1])

        weights = {"U": keras.ops.convert_to_tensor(cell.recurrent_kernel)}
        b_in = None
        if cell.use_bias:
            bias = keras.ops.convert_to_tensor(cell.bias)
            if kind == "gru" and cell.reset_after:
                b_in, weights["b_rec"] = bias[0], bias[1]
            else:
                b_in = bias
        m = keras.ops.matmul(x, cell.kernel)  # (P, L, G·n): every step's input projection
        if b_in is not None:
            m = m + b_in

        sequence, output, states, h_prev, extras = _recurrence(layer, kind, weights, m, mask, states)
        record(
            out=m,
            x=tf.stop_gradient(x),
            h=tf.stop_gradient(h_prev),
            **{key: tf.stop_gradient(value) for key, value in extras.items()},
        )
        result = sequence if layer.return_sequences else output
        result = tf.cast(result, layer.compute_dtype)
        if layer.return_state:
            return (result, *[tf.cast(s, layer.compute_dtype) for s in states])
        return result

    # ------------------------------------------------------------------ analyse

    def analyse(self, layer, calls):
        cell = layer.cell
        kind, _ = _cell_kind(cell)
        n = cell.units
        dtype = norm_dtype(calls[0]["g"].dtype)

        def gather(key):
            return concat_positions([tf.cast(c[key], dtype) for c in calls])

        x, h, g = gather("x"), gather("h"), gather("g")
        # (input, output gradient) pairs of the recurrent kernel's column blocks, in column order
        if kind == "gru" and cell.reset_after:
            r = gather("r")
            g_rec = tf.concat([g[..., : 2 * n], r * g[..., 2 * n :]], axis=-1)
            recurrent = [(h, g_rec)]
        elif kind == "gru":
            r = gather("r")
            g_rec = g
            recurrent = [(h, g[..., : 2 * n]), (r * h, g[..., 2 * n :])]
        else:
            g_rec = g
            recurrent = [(h, g)]
        total = sequence_sq_norms(x, g)
        for a, b in recurrent:
            total += sequence_sq_norms(a, b)
        bias_grads = None
        if cell.use_bias:
            if kind == "gru" and cell.reset_after:
                bias_grads = tf.stack([tf.reduce_sum(g, axis=1), tf.reduce_sum(g_rec, axis=1)], axis=1)
            else:
                bias_grads = tf.reduce_sum(g, axis=1)
            total += per_example_sq(bias_grads)

        def grads(scale):
            out = [
                (cell.kernel, weighted_outer(x, g, scale)),
                (cell.recurrent_kernel, tf.concat([weighted_outer(a, b, scale) for a, b in recurrent], axis=-1)),
            ]
            if bias_grads is not None:
                out.append((cell.bias, weighted_sum(bias_grads, scale)))
            return out

        return total, grads
