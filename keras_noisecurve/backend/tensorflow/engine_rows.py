"""Layers whose rows are not examples, found before training and clipped through a caller.

Ghost clipping attributes a layer's gradient to examples by the leading axis of the
tensors it sees. Some layers see other rows:

* a **broadcast** input of one row, shared by every example (ViT's position
  ``Embedding`` on constant ids of shape (1, L); DeBERTa-v3's ``LayerNormalization``
  of its relative embeddings): the gradient at its output is already the sum over
  examples and cannot be split;
* **rows that are tokens**: examples reshaped to P·L rows (Mixtral's MoE router
  ``Dense`` and expert bank, any layer after a ``Reshape`` to rows).

Both are exact when clipped through the innermost CALLER whose own call takes one row
per example: a layer that owns the broadcast or reshaping code (ViT's
``ViTPatchingAndEmbedding``, DeBERTa's ``RelativeEmbedding``, Mixtral's sparse MoE
block), re-run per example by the per-layer fallback
(:class:`~keras_noisecurve.backend.tensorflow.engine_fallback.GenericRule`) with every weight of its
sublayers: example i's rows go in, example i's outputs come out, broadcast and
reshape included. An output of that caller with k·P rows (Mixtral's router logits) is
split into P groups of k rows in example-major order (rows i·k … i·k + k − 1 are
example i's, as a reshape of (P, k, ...) lays them out).

:func:`probe` finds these layers before any step (so ``make_private``, ``supports`` and
``describe`` know): it traces the model once (never runs it) on a batch of
``PROBE_BATCH`` examples built from the model's input specs, noting for every layer call
the rows of its first input and of its outputs and the chain of calls enclosing it.
A model without input specs (a ``Sequential``, a subclassed model never called
symbolically), or whose trace fails at that length (an input of unknown length that must
have a fixed one: SigLIP's text embedding adds position embeddings of exactly
``max_sequence_length`` rows), is probed when its step is traced, at the lengths of that
batch (``like``); a layer with other rows and no caller that takes one row per example is
then refused there. The same trace notes where every trainable weight is read (the layer
calls enclosing each op that reads it, :func:`reads`), for the weights that other code
reads outside their own layer's call (:mod:`keras_noisecurve.backend.tensorflow.engine_reads`).
"""

from __future__ import annotations

import threading
import weakref

import tensorflow as tf

from keras_noisecurve import _compat
from keras_noisecurve.backend.common.calls import wrapped_calls

__all__ = ["PROBE_BATCH", "callers", "per_example", "probe", "reads", "variable_handle"]

#: the batch size of the probing trace (not 1, so that broadcast rows stand out)
PROBE_BATCH = 3
#: the size given to the other unknown input dimensions (e.g. a sequence length)
_PROBE_LENGTH = 4

_LOCK = threading.Lock()
_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _spec(t):
    """The TensorSpec of ``PROBE_BATCH`` examples shaped like ``t`` (a KerasTensor, a tensor
    or an array with a leading batch axis); unknown lengths become ``_PROBE_LENGTH``."""
    shape = list(t.shape)
    return tf.TensorSpec([PROBE_BATCH] + [_PROBE_LENGTH if d is None else d for d in shape[1:]],
                         tf.as_dtype(t.dtype))


def _input_specs(model, like=None):
    """TensorSpecs of one batch of ``PROBE_BATCH`` examples for ``model`` (shaped like the
    batch ``like`` when given, else from the model's input specs), or ``None``."""
    import keras

    if like is not None:
        try:
            return tf.nest.map_structure(_spec, like)
        except (AttributeError, TypeError, ValueError):  # not a structure of arrays: not probed
            return None
    for layer in _compat.flatten_layers(model):
        if not isinstance(layer, keras.Model) or not getattr(layer, "inputs", None):
            continue
        try:
            inputs = layer.input
        except (AttributeError, ValueError):  # e.g. a Sequential never called
            continue
        return tf.nest.map_structure(_spec, inputs)
    return None


def _rows(t):
    return t.shape[0] if isinstance(t, tf.Tensor) and t.shape.rank else None


def variable_handle(variable):
    """The resource handle of ``variable`` (a keras.Variable or a tf.Variable), or ``None``."""
    value = getattr(variable, "value", variable)  # a keras.Variable -> its tf.Variable
    try:
        return value.handle
    except (AttributeError, ValueError, TypeError):
        return None


def _read_chains(graph, variables, spans):
    """``{id(variable): [chain]}``: for every op of ``graph`` that consumes a variable's
    captured handle (``ReadVariableOp``, ``ResourceGather``, a ``While`` capturing it, ...),
    the layer calls enclosing it, outermost first (``spans``: ``(graph, first, last, chain)``
    per call, the graph's op counter before and after it; TensorFlow numbers ops in
    creation order, so an op made during a call falls inside its span)."""
    internal = {id(external): inside for external, inside in getattr(graph, "captures", ())}
    positions = {op.name: k + 1 for k, op in enumerate(graph.get_operations())}
    mine = [(a, b, chain) for g, a, b, chain in spans if g is graph]
    out = {}
    for variable in variables:
        handle = variable_handle(variable)
        inside = internal.get(id(handle)) if handle is not None else None
        if inside is None:
            continue
        for op in inside.consumers():
            where = positions.get(op.name)
            if where is None:
                continue
            around = [(a, -b, chain) for a, b, chain in mine if a < where <= b]  # the innermost: last start
            out.setdefault(id(variable), []).append(max(around, key=lambda s: s[:2])[2] if around else [])
    return out


def _trace(model, specs):
    """One traced forward pass of ``model`` on ``specs`` with every layer's call wrapped:
    ``(calls, reads)`` as :func:`probe` and :func:`reads` give them (``({}, {})`` when the
    trace fails)."""
    layers = list(_compat.flatten_layers(model))
    stack, found, spans = [], {}, []

    def wrap(layer, original):
        def call(*args, **kwargs):
            first = next((t for t in tf.nest.flatten((args, kwargs)) if isinstance(t, tf.Tensor)), None)
            graph = tf.compat.v1.get_default_graph()
            before, enclosing = graph.version, list(stack)
            stack.append(layer)
            try:
                out = original(*args, **kwargs)
            finally:
                stack.pop()
            spans.append((graph, before, graph.version, enclosing + [layer]))
            outs = [_rows(t) for t in tf.nest.flatten(out) if isinstance(t, tf.Tensor)]
            found.setdefault(id(layer), []).append((_rows(first), outs, enclosing))
            return out

        return call

    with _LOCK:
        try:
            with wrapped_calls(layers, wrap=wrap):
                traced = tf.function(lambda x: tf.nest.flatten(model(x, training=False))).get_concrete_function(specs)
        except Exception:  # noqa: BLE001 — a model that cannot be traced here is checked at step time
            return {}, {}
    try:
        return found, _read_chains(traced.graph, model.trainable_variables, spans)
    except Exception:  # noqa: BLE001 — reads not found here are checked when the step is traced
        return found, {}


def _probe(model, like=None):
    """``(calls, reads)`` of :func:`_trace` (cached per model, see :func:`probe`)."""
    cached = _CACHE.get(model)
    if cached is not None and (cached[0] or like is None):
        return _strong(cached)
    specs = _input_specs(model, like if cached is not None else None)
    calls, reads_ = _trace(model, specs) if specs is not None else ({}, {})
    # The cache holds the enclosing layers by weak reference: a strong one would keep the
    # model (its own key, the outermost enclosing layer) and its variables alive for good.
    _CACHE[model] = ({key: [(i, o, [weakref.ref(c) for c in enclosing]) for i, o, enclosing in seen]
                      for key, seen in calls.items()},
                     {key: [[weakref.ref(c) for c in chain] for chain in chains] for key, chains in reads_.items()})
    return calls, reads_


def probe(model, like=None):
    """``{id(layer): [(rows_in, rows_out, enclosing)]}`` for every call of every layer of
    ``model`` in one traced forward pass on ``PROBE_BATCH`` examples (cached per model).

    ``like``: a batch of the model's inputs (any leading size), used only when the probe
    from the input specs failed: the model is then traced again at that batch's lengths.

    ``rows_in``: the leading size of the call's first input tensor (``None``: none);
    ``rows_out``: those of its output tensors; ``enclosing``: the layers whose calls
    enclose this one, outermost first (the model itself first). ``None`` when the model
    cannot be probed (no input specs, or the symbolic call fails: the engine then checks
    rows and reads at trace time).
    """
    return _probe(model, like)[0] or None


def reads(model, like=None) -> dict:
    """``{id(variable): [chain]}`` for every read of a trainable variable of ``model`` in the
    same traced forward pass as :func:`probe`: ``chain`` the layers whose calls enclose the
    op that reads it, outermost first (``model`` first; the variable's own layer last when it
    reads its weight in its own call). Empty when the model cannot be probed."""
    calls, found = _probe(model, like)
    return found if calls else {}


def _strong(cached):
    """The probe result held weakly in ``_CACHE``, with its layers dereferenced."""
    calls, found = cached
    return ({key: [(i, o, [r() for r in enclosing]) for i, o, enclosing in seen] for key, seen in calls.items()},
            {key: [[r() for r in chain] for chain in chains] for key, chains in found.items()})


def per_example(rows_in, rows_out, root=False) -> bool:
    """A call with one row per example in, and P or k·P rows per output (P only for the
    model itself: its outputs go to the per-example loss)."""
    if rows_in != PROBE_BATCH:
        return False
    if root:
        return all(r is None or r == PROBE_BATCH for r in rows_out)
    return all(r is None or (r >= PROBE_BATCH and r % PROBE_BATCH == 0) for r in rows_out)


def callers(model, layers, like=None) -> dict:
    """``{id(layer): caller}`` for each of ``layers`` some call of which sees rows that are
    not examples: the innermost layer enclosing ALL its calls (or the layer itself, when
    only its outputs have k·P rows) whose every call takes one row per example
    (``model`` itself at worst). Empty when ``model`` cannot be probed (``like``: a batch
    to probe it at when its input specs fail, :func:`probe`).

    Raises:
      ValueError: no such caller (``model``'s own outputs are not per example), naming the layer.
    """
    calls = probe(model, like)
    if not calls:
        return {}
    out = {}
    for layer in layers:
        seen = calls.get(id(layer), [])
        if all(rows_in == PROBE_BATCH and all(r == PROBE_BATCH or r is None for r in rows_out)
               for rows_in, rows_out, _ in seen):
            continue
        chains = [enclosing + [layer] for _, _, enclosing in seen]  # the layer itself may do
        common = [c for c in chains[0] if all(any(c is e for e in chain) for chain in chains[1:])]
        good = [c for c in common if all(per_example(i, o, c is model) for i, o, _ in calls.get(id(c), []))]
        if not good:
            rows = sorted({rows_in for rows_in, _, _ in seen if rows_in != PROBE_BATCH}, key=str)
            raise ValueError(
                f"{type(layer).__name__} layer '{layer.name}' sees rows that are not examples (for a batch of "
                f"{PROBE_BATCH} examples its input has {rows} rows) and no layer calling it takes one row per "
                "example, so its gradient cannot be attributed to examples. Put the code that broadcasts or "
                "reshapes the batch and the layers it feeds in one layer whose call takes and returns one row "
                "per example (its weights are then clipped through that layer)"
            )
        out[id(layer)] = good[-1]
    return out
