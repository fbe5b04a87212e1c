"""Wrapping the ``call`` of layer instances for a while (no framework import).

The ghost-clipping engines watch a model's forward pass by replacing, on each layer
INSTANCE (never its class), the ``call`` method with a wrapper, and putting everything
back afterwards: the JAX engine's recording (:mod:`keras_noisecurve.backend.jax.ghost`) and
its rows probe (:mod:`keras_noisecurve.backend.common.row_probe`), the TensorFlow engine's
recording (``keras_noisecurve/backend/tensorflow/ghost.py``, in the shared mode: the replica
threads of ``tf.distribute`` trace the same layers at once) and its rows probe
(``keras_noisecurve/backend/tensorflow/engine_rows.py``). :func:`wrapped_calls` is the one way
they do it. :func:`training_kwargs` is how they pass ``training`` to a ``call`` they run
themselves, as Keras's ``Layer.__call__`` does.
"""

from __future__ import annotations

import contextlib
import inspect
import threading

__all__ = ["training_kwargs", "wrapped_calls"]

_MISSING = object()
_SHARED_LOCK = threading.Lock()
_SHARED: dict[int, list] = {}  # id(layer) -> [its own instance `call` entry or _MISSING, blocks inside]


@contextlib.contextmanager
def wrapped_calls(layers, *, wrap, shared: bool = False):
    """Within the ``with`` block, each layer of ``layers`` has its instance ``call`` set to
    ``wrap(layer, original)``, ``original`` being what ``layer.call`` was just before (its
    bound method, or a ``call`` the instance already had, e.g. an enclosing wrapper).

    Args:
      layers: an iterable of Keras layers, wrapped in its order (a layer given twice is
        wrapped twice, the second wrapper around the first; in the shared mode once).
      wrap: ``wrap(layer, original) -> callable``, the callable that stands for the
        layer's ``call`` (called with the call's positional and keyword arguments).
      shared: for blocks that several threads run at once over the same layers (the
        replica threads of ``tf.distribute`` tracing one model): a layer is wrapped by the
        first shared block that enters, every later shared block (of any thread) runs
        inside that same wrapper, and the last to leave restores the layer; the
        bookkeeping is under a lock. The wrapper must therefore serve every thread (read
        per-thread state, as the TensorFlow engine's recorder does).

    On exit, normal or by an exception (also one raised by ``wrap`` part way), every
    wrapped layer's instance dictionary is restored exactly, in reverse order: a layer
    that had its own ``call`` entry gets that same object back, a layer that had none
    has the entry removed (its class's ``call`` shows through again). The entries are set
    and removed with ``object.__setattr__``/``object.__delattr__``, past Keras's
    attribute tracking. Yields nothing.

    Raises:
      TypeError: ``wrap`` is not callable, or it returned something that is not.
    """
    if not callable(wrap):
        raise TypeError(f"wrap must be a callable wrap(layer, original) -> callable, but got {wrap!r}")
    enter, leave = (_enter_shared, _leave_shared) if shared else (_enter, _restore)
    saved = []
    try:
        for layer in layers:
            saved.append((layer, enter(layer, wrap)))
        yield
    finally:
        for layer, own in reversed(saved):
            leave(layer, own)


def _enter(layer, wrap):
    """Wrap ``layer``'s call; returns its own instance ``call`` entry (or ``_MISSING``)."""
    own = vars(layer).get("call", _MISSING)
    replacement = wrap(layer, layer.call)
    if not callable(replacement):
        raise TypeError(
            f"wrap(layer, original) must return a callable to stand for the call of layer "
            f"{getattr(layer, 'name', layer)!r}, but it returned {replacement!r}"
        )
    object.__setattr__(layer, "call", replacement)
    return own


def _restore(layer, own):
    if own is _MISSING:
        object.__delattr__(layer, "call")
    else:
        object.__setattr__(layer, "call", own)


def _enter_shared(layer, wrap):
    with _SHARED_LOCK:
        entry = _SHARED.get(id(layer))
        if entry is None:
            _SHARED[id(layer)] = [_enter(layer, wrap), 1]
        else:
            entry[1] += 1


def _leave_shared(layer, _):
    with _SHARED_LOCK:
        entry = _SHARED[id(layer)]
        entry[1] -= 1
        if entry[1] == 0:
            del _SHARED[id(layer)]
            _restore(layer, entry[0])


def training_kwargs(layer, training) -> dict:
    """``{"training": training}`` when ``layer.call`` takes a ``training`` argument (by name or
    through ``**kwargs``), else ``{}``: what Keras's ``Layer.__call__`` passes, for code that runs
    ``call`` or ``stateless_call`` itself (which pass their keyword arguments on unchanged: a
    model whose ``call(self, x)`` has no ``training`` would raise a TypeError)."""
    try:
        parameters = inspect.signature(layer.call).parameters.values()
    except (TypeError, ValueError):  # no signature: pass it, as Keras would try
        return {"training": training}
    takes = any(p.name == "training" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    return {"training": training} if takes else {}

