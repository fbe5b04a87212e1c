"""The per-layer fallback of ghost clipping: any layer that owns trainable weights.

A layer without a ghost-norm rule (a custom layer with its own weight, KerasHub's
``PositionEmbedding``, a ``TimeDistributed`` wrapper, a quantized or reconfigured
built-in layer) still needs, for every example i, the gradient of ITS OWN weights W:

    G_i = ∂(w_i·loss_i)/∂W = J_i(W)ᵀ g_i,

where ``g_i`` is example i's rows of the gradient at the layer's output (the engine
computes it for every recorded layer in its one backward pass) and ``J_i`` the
Jacobian of the layer's output rows for example i. That vector–Jacobian product
needs the layer alone, not the model: :class:`GenericRule` records the inputs of
each call and, after the backward pass, re-runs the ONE layer call on each example's
rows (inputs and every argument with the batch as its leading axis, e.g. masks) under
a ``GradientTape`` seeded with ``g_i``. The examples are visited by a
``tf.while_loop`` (no ``tf.vectorized_map``: pfor over arbitrary layer code can fail
or crash the process, e.g. through attention), so memory is O(P × |W|) for the
stacked ``G_i`` and time is P small calls of that layer.

The norms and the clipped sum then come from the same ``G_i``:
``‖G_i‖²`` and ``Σ_i c_i·G_i`` (see :mod:`keras_noisecurve.backend.tensorflow.ghost`).

A rule with ``covers_sublayers = True`` (used here for ``TimeDistributed``) also takes
the weights of the layer's sublayers: they are not recorded separately, so a wrapper
that folds another axis into the batch (TimeDistributed's (P·T, ...) rows) is still
attributed to examples correctly.

Randomness inside the layer's own call (e.g. dropout written in a custom layer) is
drawn again by the re-run: ``G_i`` is then the gradient of another draw. The clipping
bound still holds exactly, since the norms and the sum use the same ``G_i``.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_noisecurve import _compat
from keras_noisecurve.backend.tensorflow.engine_forms import Rule, norm_dtype, per_example_sq, weighted_sum

__all__ = ["CallerRule", "GenericRule", "RNNFallbackRule", "TimeDistributedRule", "outside_outputs", "owned_trainable"]


def owned_trainable(layer, trainable_ids) -> list:
    """The trainable variables ``layer`` itself owns (not its sublayers'), among ``trainable_ids``."""
    return [v for v in _compat.own_trainable_variables(layer) if id(v) in trainable_ids]


def _tape_variable(v):
    """The ``tf.Variable`` a ``GradientTape`` differentiates for a Keras variable."""
    return v.value if isinstance(v, keras.Variable) else v


def _batched(t, batch) -> bool:
    """Whether ``t`` has the example axis first: a tensor of rank ≥ 1 whose leading size
    equals the batch size ``batch`` (static int) or, both unknown, is unknown too."""
    if not isinstance(t, (tf.Tensor, tf.Variable)) or isinstance(t, tf.Variable):
        return False
    if t.shape.rank is None or t.shape.rank == 0:
        return False
    return t.shape[0] == batch


def outside_outputs(out):
    """``out`` with each differentiable tensor replaced by ``tf.identity`` of it (its Keras
    mask kept): the seeds of the layer's per-example VJP.

    The VJP re-runs the layer and differentiates ALL its outputs, internal paths
    included, so it must be seeded with ``∂L/∂out_k`` from OUTSIDE the layer only. The
    gradient at a tensor the layer also used inside (T5's attention returns the
    ``position_bias`` it added to its scores) would otherwise carry that internal path
    a second time. A fresh identity made after the call has no consumer inside it.
    A later call of the same layer that consumes this output is outside code: its
    contribution is part of the seed, as the chain rule wants.
    """

    def leaf(t):
        if not isinstance(t, tf.Tensor) or not (t.dtype.is_floating or t.dtype.is_complex):
            return t
        return _compat.copy_keras_mask(t, tf.identity(t))

    return tf.nest.map_structure(leaf, out)


def _seed(g, i, p, batch, out_i, unit_rows=1):
    """Example i's rows of the output gradient ``g``, shaped as the re-run's output ``out_i``.

    ``g`` has one row per example (row i) or k·P rows in example-major order (rows
    i·k … i·k + k − 1, as a reshape of (P, k, ...) to rows lays them out); ``p`` is P
    (a scalar tensor), ``batch`` its static value or ``None``. With ``unit_rows`` u > 1, i is a
    unit of u consecutive examples and ``p`` the number of units."""
    if unit_rows > 1:
        m = tf.shape(g)[0] // p  # rows of g per unit: u, or u·k of an output with k rows per example
        return tf.cast(tf.reshape(g[i * m : (i + 1) * m], tf.shape(out_i)), out_i.dtype)
    if batch is not None and g.shape.rank and g.shape[0] == batch:
        return tf.cast(tf.expand_dims(g[i], 0), out_i.dtype)
    k = tf.shape(g)[0] // p
    rows = g[i * k : (i + 1) * k]
    return tf.cast(tf.reshape(rows, tf.shape(out_i)), out_i.dtype)


class GenericRule(Rule):
    """Per-example gradients of one layer's own weights by a VJP of its own call.

    Matches every layer (it is the fallback, never in the registry's search order).
    """

    kind = "generic"

    def matches(self, layer) -> bool:
        return True

    def check(self, layer):
        return None

    def expected_variables(self, layer):
        return list(_compat.own_trainable_variables(layer))

    def forward(self, layer, original_call, record, inputs, *args, **kwargs):
        # Every differentiable output leaves the call through a fresh identity: only code
        # OUTSIDE the layer consumes it, so the engine's gradient at it is the gradient that
        # flows in from outside (see :func:`outside_outputs`).
        out = outside_outputs(original_call(inputs, *args, **kwargs))
        record(out=out, call=(original_call, inputs, args, kwargs))
        return out

    def analyse(self, layer, calls, variables, unit_rows=1):
        """Per-example squared norms (P,) and ``grads(scale)`` for ``variables``; with
        ``unit_rows`` k > 1, per unit of k consecutive rows (U,): the sum of its rows' gradients.

        ``calls``: the recorded calls, each with ``"out"`` (any structure), ``"g"``
        (the list of gradients aligned with ``tf.nest.flatten(out)``, ``None`` where an
        output is not differentiable) and ``"call"``.
        """
        per_call = [self._per_example(c, variables, unit_rows) for c in calls]
        stacked = [tf.add_n(list(parts)) if len(parts) > 1 else parts[0] for parts in zip(*per_call)]
        dtype = norm_dtype(stacked[0].dtype)
        total = tf.add_n([per_example_sq(tf.cast(s, dtype)) for s in stacked])

        def grads(scale):
            return [(v, tf.cast(weighted_sum(tf.cast(s, scale.dtype), scale), v.dtype)) for v, s in zip(variables, stacked)]

        return total, grads

    def _per_example(self, call, variables, unit_rows=1):
        """``[G_v]`` with ``G_v`` (P, *v.shape): example i's gradient of each variable; with
        ``unit_rows`` u > 1, (P/u, *v.shape): unit i's (its u rows re-run as one batch of u)."""
        original_call, inputs, args, kwargs = call["call"]
        outs = tf.nest.flatten(call["out"])
        gs = call["g"]
        keep = [k for k, g in enumerate(gs) if g is not None]
        # a model called eagerly on numpy arrays gets them as they are (a Functional's call
        # converts nothing): as tensors, their rows are taken per example like any input's
        arguments = tf.nest.map_structure(lambda t: tf.convert_to_tensor(t) if isinstance(t, np.ndarray) else t,
                                          (inputs, args, kwargs))
        first = tf.nest.flatten(arguments[0])[0]
        batch = first.shape[0]
        u = int(unit_rows)
        p = tf.shape(first)[0] // u
        targets = [_tape_variable(v) for v in variables]

        def example(i):
            def take(t):
                # t[i][None], not t[i:i+1]: the row keeps a static leading 1, so the layer's
                # shape arithmetic sees Python ints as in its recorded call (T5 under a float64
                # policy mixes int64 aranges of static sizes with int32 dynamic ones otherwise)
                if not _batched(t, batch):
                    return t
                if u > 1:  # the unit's u rows, with a static leading u
                    return tf.ensure_shape(t[i * u : (i + 1) * u], [u, *t.shape[1:]])
                return tf.expand_dims(t[i], 0)

            x_i, args_i, kwargs_i = tf.nest.map_structure(take, arguments)
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(targets)
                out_i = tf.nest.flatten(original_call(x_i, *args_i, **kwargs_i))
            return tape.gradient(
                [out_i[k] for k in keep],
                targets,
                output_gradients=[_seed(gs[k], i, p, batch, out_i[k], u) for k in keep],
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )

        if not keep:  # no differentiable output: every G_i is 0
            return [tf.zeros(tf.concat([[p], tf.shape(v)], 0), v.dtype) for v in targets]
        del outs
        arrays = [tf.TensorArray(v.dtype, size=p, element_shape=v.shape) for v in targets]

        def body(i, arrays):
            return i + 1, [a.write(i, tf.convert_to_tensor(g)) for a, g in zip(arrays, example(i))]

        _, arrays = tf.while_loop(lambda i, _: i < p, body, (tf.constant(0), arrays))
        return [a.stack() for a in arrays]


class CallerRule(GenericRule):
    """A layer that calls others on rows that are not examples (a broadcast row, P·L token
    rows: :mod:`keras_noisecurve.backend.tensorflow.engine_rows`) while its own call takes one row per
    example: its weights and all its sublayers' are clipped through its own call, re-run
    per example. Never matched by class: the engine's plan assigns it."""

    kind = "generic"
    covers_sublayers = True

    def matches(self, layer) -> bool:
        return False

    def expected_variables(self, layer):
        return list(layer.trainable_variables)


class TimeDistributedRule(GenericRule):
    """``keras.layers.TimeDistributed``: the wrapped layer sees (P·T, ...) rows, so its
    weights are attributed to examples through the wrapper's own call."""

    kind = "TimeDistributed"
    covers_sublayers = True

    def matches(self, layer) -> bool:
        return isinstance(layer, keras.layers.TimeDistributed)

    def expected_variables(self, layer):
        return list(layer.trainable_variables)


class RNNFallbackRule(GenericRule):
    """Any ``keras.layers.RNN`` the recurrent kernel (``backend/common/ghost_rnn``) does not take (a custom or
    stacked cell, dropout, ...): the cell runs inside a ``tf.while_loop``, so its weights
    are attributed to examples through the RNN layer's own call, re-run per example."""

    kind = "generic"
    covers_sublayers = True

    def matches(self, layer) -> bool:
        return isinstance(layer, keras.layers.RNN)

    def expected_variables(self, layer):
        return list(layer.trainable_variables)
