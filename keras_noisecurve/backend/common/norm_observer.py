"""What the audit sees of a clipping engine: each layer's per-example squared norms, as its
rule computed them. Imports no framework; both ghost engines (TensorFlow's and JAX's) report
here, and :mod:`keras_noisecurve.audit.mechanism_clipping` reads it."""

from __future__ import annotations

import contextlib
import threading

__all__ = ["observe_layer_norms", "observer"]

_LOCAL = threading.local()


@contextlib.contextmanager
def observe_layer_norms():
    """Context manager: the per-layer terms of every ghost-engine step run in this thread
    inside it (for the audit's clipping check).

    Yields a list that each step extends with ``(layer, rule, variables, sq)``: ``rule`` the
    layer's rule (TensorFlow: its rule object; JAX: the rule's kind, ``"generic"`` for the
    per-layer VJP, ``"caller"`` for a layer clipped whole through it), ``sq`` (P,) the squared
    norms of the per-example gradients of that layer's ``variables`` as the rule computed them
    (their sum over layers is the squared norm the step clips with). Run the engine outside a
    compiled step to read them as numbers.
    """
    seen = []
    previous = getattr(_LOCAL, "seen", None)
    _LOCAL.seen = seen
    try:
        yield seen
    finally:
        _LOCAL.seen = previous


def observer():
    """The list of the innermost :func:`observe_layer_norms` of this thread, else ``None``."""
    return getattr(_LOCAL, "seen", None)
