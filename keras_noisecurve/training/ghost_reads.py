"""Every weight is read inside its own layer's call, or the step is refused.

Ghost clipping attributes a weight's per-example gradient to the layer that owns it,
from that layer's recorded calls. A weight that another piece of code reads directly
(a custom layer using ``other_layer.kernel``, a model whose ``call`` multiplies by a
sublayer's weight) would contribute to the update without entering the norms: the
clipping bound, and so the privacy guarantee, would be wrong. This module finds such
reads in the traced graph of the forward pass.

While a step is traced, the engine notes the graph's op counter around each call of a
planned layer; TensorFlow numbers ops in creation order. A read of variable ``v`` is an
op consuming ``v``'s resource handle inside the graph (``ReadVariableOp``,
``ResourceGather``, a ``While`` capturing it, ...). Every such op created during the
forward pass must fall inside a call of the layer that ``v`` is planned with. In eager
mode the engine traces the model's forward pass once per model (without running it)
to make the same check.
"""

from __future__ import annotations

__all__ = ["check_reads"]


def _handle(variable):
    value = getattr(variable, "value", variable)  # a keras.Variable -> its tf.Variable
    try:
        return value.handle
    except (AttributeError, ValueError, TypeError):
        return None


def check_reads(entries, spans, graph, start: int, end: int) -> None:
    """Refuse a weight read outside the calls of the layer it is planned with.

    Args:
      entries: the engine's plan, ``[(layer, rule, variables)]``.
      spans: ``id(layer) -> [(graph, first, last)]``: the graph's op counter before and
        after each recorded call of the layer.
      graph: the graph being traced; ``start``/``end`` its op counter before and
        after the forward pass.

    Raises:
      ValueError: naming the weight, its layer and the op that reads it elsewhere.
    """
    internal = {}
    for external, inside in getattr(graph, "captures", ()):
        internal[id(external)] = inside
    positions = None
    for layer, _, variables in entries:
        windows = [(a, b) for g, a, b in spans.get(id(layer), []) if g is graph]
        for variable in variables:
            handle = _handle(variable)
            inside = internal.get(id(handle)) if handle is not None else None
            if inside is None:  # not captured here (e.g. a distributed variable): unchecked
                continue
            for op in inside.consumers():
                if positions is None:
                    positions = {o.name: k + 1 for k, o in enumerate(graph.get_operations())}
                where = positions.get(op.name)
                if where is None or not start < where <= end:
                    continue  # not part of the forward pass
                if not any(a < where <= b for a, b in windows):
                    raise ValueError(
                        f"weight {variable.path!r} of {type(layer).__name__} layer '{layer.name}' is read "
                        f"outside that layer's own call (by op {op.name!r}): a weight used by another layer "
                        "(e.g. tied weights read directly) would escape per-example clipping. Read it "
                        "through its layer's call, or make the layer that uses it own it"
                    )
