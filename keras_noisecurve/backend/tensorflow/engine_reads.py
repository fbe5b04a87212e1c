"""Weights read outside their own layer's call: clipped through a caller, or refused.

Ghost clipping attributes a weight's per-example gradient to the layer that owns it,
from that layer's recorded calls. A weight that another piece of code reads directly
(a custom layer computing ``ops.matmul(x, self.inner.kernel)`` instead of calling
``self.inner``, a model whose ``call`` multiplies by a sublayer's weight, KerasHub's
Gemma4 decoder block on its feed-forward kernels and Gemma3n's on its AltUp layer's
``correct_output_scale``) would contribute to the update without entering that layer's
norms: the clipping bound, and so the privacy guarantee, would be wrong.

Such a read is exact when clipped through the innermost CALLER enclosing both the read
and every call of the owning layer, whose every call takes one row per example (the
model itself at worst, when its outputs are per example), that tracks the weight and
inside whose calls every weight under it is read: the per-layer fallback
(:class:`~keras_noisecurve.backend.tensorflow.engine_fallback.CallerRule`) re-runs that caller per
example and differentiates ALL the weights under it, so the read's share of the gradient
and the owner's own share are both in example i's ``G_i``, once. The caller replaces the
layers under it in the plan (their own rules are dropped: nothing is counted twice), as
for layers whose rows are not examples (:mod:`keras_noisecurve.backend.tensorflow.engine_rows`, the
same probe). :func:`callers` finds these callers before any step, from the reads that the
probe's traced forward pass saw (:func:`engine_rows.reads`); a read with no such caller
is refused there, naming the weight and the code that reads it.

While a step is traced, :func:`check_reads` checks the plan once more in the step's own
graph: the engine notes the graph's op counter around each call of a planned layer
(TensorFlow numbers ops in creation order), and every op consuming a planned variable's
resource handle during the forward pass (``ReadVariableOp``, ``ResourceGather``, a
``While`` capturing it, ...) must fall inside a call of the layer that variable is planned
with. That covers what the probe could not see (a model without input specs probed only
at the step's lengths, a read only under ``training=True``). In eager mode the engine
traces the model's forward pass once per model (without running it) to make the same check.
"""

from __future__ import annotations

from keras_noisecurve.backend.tensorflow import engine_rows

__all__ = ["callers", "check_reads"]

_ADVICE = ("Read it through its layer's call, or put the code that reads it and the layer that owns it in one "
           "layer whose call takes and returns one row per example (both are then clipped through that layer)")


def _inside(layer, chain) -> bool:
    return any(c is layer for c in chain)


def callers(model, entries, like=None) -> dict:
    """``{id(layer): caller}`` for each planned layer a weight of which is read outside
    every call of that layer, from the probe of ``model`` (:func:`engine_rows.probe`; empty
    when it cannot be probed: the step's trace checks the reads then, :func:`check_reads`).

    ``caller`` is the innermost layer present in the enclosing chain of every such read and
    of every call of ``layer`` whose every call takes one row per example and returns P or
    k·P rows (P only for ``model`` itself: :func:`engine_rows.per_example`), whose trainable
    variables include ``layer``'s, and inside whose calls every read of each of its trainable
    variables happens (so its per-example re-run sees every use of every weight it clips).

    Args:
      model: the model being planned.
      entries: the engine's plan, ``[(layer, rule, variables)]``.
      like: a batch to probe at when the input specs cannot be traced.

    Raises:
      ValueError: a read with no such caller, naming the weight, its layer and the reader.
    """
    calls = engine_rows.probe(model, like)
    if not calls:
        return {}
    found = engine_rows.reads(model, like)
    out = {}
    for layer, _, variables in entries:
        outside = [(v, chain) for v in variables for chain in found.get(id(v), []) if not _inside(layer, chain)]
        if not outside:
            continue
        chains = [enclosing + [layer] for _, _, enclosing in calls.get(id(layer), [])] + [c for _, c in outside]
        common = [c for c in chains[0] if all(_inside(c, chain) for chain in chains[1:])]
        wanted = {id(v) for v in variables}

        def valid(c):
            tracked = c.trainable_variables
            return (wanted <= {id(v) for v in tracked}
                    and all(_inside(c, chain) for v in tracked for chain in found.get(id(v), []))
                    and all(engine_rows.per_example(i, o, c is model) for i, o, _ in calls.get(id(c), [])))

        good = [c for c in common if valid(c)]
        if not good:
            variable, chain = outside[0]
            reader = f"the call of {type(chain[-1]).__name__} layer '{chain[-1].name}'" if chain else "code outside any layer"
            raise ValueError(
                f"weight {variable.path!r} of {type(layer).__name__} layer '{layer.name}' is read outside that "
                f"layer's own call (in {reader}), and no layer enclosing both that read and every call of "
                f"'{layer.name}' takes one row per example (not even the model: its outputs are not one row per "
                "example), so that use of the weight cannot be attributed to examples and would escape "
                f"per-example clipping. {_ADVICE}"
            )
        out[id(layer)] = good[-1]
    return out


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
            handle = engine_rows.variable_handle(variable)
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
                        f"outside that layer's own call (by op {op.name!r}), where the model's probe before the "
                        "step did not see it (a model probed only now, or a read only in training mode): a "
                        "weight used by other code (e.g. tied weights read directly) would escape per-example "
                        f"clipping. {_ADVICE}"
                    )
