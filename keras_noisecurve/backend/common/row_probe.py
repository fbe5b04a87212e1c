"""Layers whose rows are not examples, clipped through a caller by an engine that plans its targets
from a shape pass of the traced step (JAX's, :mod:`keras_noisecurve.backend.jax.ghost`; written in
Keras, no framework import; the TensorFlow engine does the same in
``keras_noisecurve/backend/tensorflow/engine_rows.py``).

Ghost clipping attributes a layer's gradient to examples by the leading axis of the
arrays its call sees. Some weighted layers cannot be attributed that way:

* a **broadcast** input of one row shared by every example (ViT's position ``Embedding``
  on constant ids of shape (1, L); DeBERTa-v3's ``LayerNormalization`` of its relative
  embeddings): the gradient at its output is already the sum over examples;
* **rows that are tokens**: examples reshaped to P·L rows (Mixtral's MoE router ``Dense``
  and expert bank, any layer after a ``Reshape`` to rows);
* a weighted layer called inside a control-flow body (``keras.ops.fori_loop``, ``scan``) of a
  custom layer, whose calls cannot be recorded one by one (JAX reports a leaked tracer);
* a weight read outside its own layer's call (a tied head reading an embedding table).

Each is exact when clipped through the innermost CALLER whose own call takes one row per
example: a layer enclosing every call of the problem layer (and, for a read, the read
itself) whose first array argument has P rows and whose floating outputs have P or k·P
rows, and which tracks the problem layer's weights. The engine then records that caller
instead of the layers under it and clips it as ONE target of the per-layer fallback
(on JAX ``jax.vmap`` over examples of the VJP of the caller's call with respect to every
trainable weight under it): example i's rows go in, example i's outputs come out,
broadcast, reshape and loop included. An output of the caller with k·P rows (Mixtral's
router logits) is split into P groups of k rows, example-major (rows i·k … i·k + k − 1
are example i's, as a reshape of (P, k, ...) lays them out).

:class:`Probe` watches the engine's shape pass (on JAX ``jax.eval_shape`` of the recorded
forward pass, run anyway before every traced step): every layer of the model has its
instance's ``call`` wrapped to note the rows of its first array argument and of its
floating outputs and the chain of layer calls enclosing it, and the innermost layer call
through which an error the backend's ``is_leak`` recognises passes (a recorded call inside a
control-flow body).
:meth:`Probe.caller` picks the caller from those notes. The model itself is never a
caller: when only it encloses the problem, the problem stands (``clipping="auto"`` uses
the vectorized engine, ``"ghost"`` refuses).
"""

from __future__ import annotations

import contextlib

import keras

from keras_noisecurve import _compat
from keras_noisecurve.backend.common.calls import wrapped_calls

__all__ = ["Probe", "rows_ok"]


def _rows(leaf):
    return leaf.shape[0] if len(leaf.shape) else None


def _array(x):
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _floating(leaf) -> bool:
    """Whether ``leaf`` is an array of a floating dtype (one Keras does not list, such as the float8
    kinds, by its name)."""
    if not _array(leaf):
        return False
    try:
        return keras.backend.is_float_dtype(keras.backend.standardize_dtype(leaf.dtype))
    except ValueError:  # a dtype Keras does not list (float8 kinds, a JAX key): read its name
        return str(getattr(leaf.dtype, "name", leaf.dtype)).startswith(("float", "bfloat"))


def rows_ok(rows_in, rows_out, size, *, grouped) -> bool:
    """Whether a call is attributable to the ``size`` examples: ``rows_in`` (the leading
    size of its first array argument) is ``size`` and every floating output has ``size``
    rows, or (``grouped``: a caller clipped whole) ``k·size`` rows for some k ≥ 1."""
    if rows_in != size or not rows_out:
        return False
    if grouped:
        return all(r is not None and r >= size and r % size == 0 for r in rows_out)
    return all(r == size for r in rows_out)


class Probe:
    """Rows and enclosing calls of every layer call of one traced forward pass of ``model``.

    ``calls``: per completed call, ``(layer, rows_in, rows_out, enclosing)`` with
    ``enclosing`` the tuple of layers whose calls enclose it, outermost first (the model
    itself is left out). ``leak``: the enclosing chain, innermost last, of the innermost
    call through which an error passed that ``is_leak(error) -> bool`` recognises as a
    recorded value leaked out of a control-flow body (``None``: none). ``stack``: the chain
    of the calls running now (read by the engine when a weight is read). ``flatten(tree) ->
    list`` gives the leaves of a call's arguments and outputs and ``floating(leaf) -> bool`` tells
    a floating array (the engine's own, so that the probe counts the outputs the engine records;
    Keras's ``keras.tree.flatten`` and dtypes by default)."""

    def __init__(self, model, *, is_leak=lambda error: False, flatten=keras.tree.flatten, floating=_floating):
        self.is_leak, self.flatten, self.floating = is_leak, flatten, floating
        self.layers = list(_compat.flatten_layers(model, include_self=False, recursive=True))
        self.stack = []
        self.calls = []
        self.leak = None

    @contextlib.contextmanager
    def installed(self):
        """Wrap the ``call`` of every layer instance (trace time only; restored on exit).
        Enter it before the engine's own recording, which then wraps these wrappers."""
        def wrap(layer, original):
            def wrapped(*args, **kwargs):
                return self.around(layer, lambda: original(*args, **kwargs), args, kwargs)

            wrapped.unprobed = original  # for a recording that runs its own code in place of the call
            return wrapped

        with wrapped_calls(self.layers, wrap=wrap):
            yield self

    def around(self, layer, run, args, kwargs):
        """``run()`` as ``layer``'s call on ``(args, kwargs)``: on the stack while it runs, its rows
        recorded when it returns."""
        first = next((a for a in self.flatten((args, kwargs)) if _array(a) and len(a.shape)), None)
        enclosing = tuple(self.stack)
        self.stack.append(layer)
        try:
            out = run()
        except Exception as err:
            if self.leak is None and self.is_leak(err):
                self.leak = tuple(self.stack)
            raise
        finally:
            self.stack.pop()
        outs = [_rows(leaf) for leaf in self.flatten(out) if self.floating(leaf)]
        self.calls.append((layer, None if first is None else first.shape[0], outs, enclosing))
        return out

    def chains(self, layer):
        """The chains ``enclosing + (layer,)`` of every completed call of ``layer``."""
        return [enclosing + (layer,) for seen, _, _, enclosing in self.calls if seen is layer]

    def caller(self, chains, variables, size, *, exclude=()):
        """The innermost layer present in every chain of ``chains`` (so enclosing every
        call and read they describe) whose every completed call takes ``size`` rows and
        returns ``size`` or ``k·size`` rows (:func:`rows_ok`, grouped), that tracks every
        variable of ``variables`` among its trainable variables, and is not in ``exclude``;
        ``None`` when only the model itself encloses them all."""
        if not chains:
            return None
        wanted = {id(v) for v in variables}
        common = [c for c in chains[0] if all(any(c is e for e in chain) for chain in chains[1:])]
        for candidate in reversed(common):
            if any(candidate is e for e in exclude):
                continue
            if not wanted <= {id(v) for v in candidate.trainable_variables}:
                continue
            if all(rows_ok(rows_in, rows_out, size, grouped=True)
                   for seen, rows_in, rows_out, _ in self.calls if seen is candidate):
                return candidate
        return None
