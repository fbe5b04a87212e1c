"""Recognising a layer by its class without importing the class's package (no framework import).

The ghost-norm rules of both engines take some layers by class — Keras's and KerasHub's — and
a class of a package the model did not import cannot be the class of one of its layers, so it is
looked up in ``sys.modules`` only (:func:`loaded_class`). A subclass that overrides ``call``
computes something else, and is not taken (:func:`runs_call_of`).
"""

from __future__ import annotations

import sys

__all__ = ["is_loaded_instance", "loaded_class", "runs_call_of"]


def loaded_class(module: str, name: str):
    """The class ``name`` (an attribute path, e.g. ``"layers.RMSNormalization"``) of ``module`` if
    that module is already imported, else ``None`` (nothing is imported here: a model with a
    KerasHub layer has imported KerasHub)."""
    found = sys.modules.get(module)
    for part in name.split("."):
        found = getattr(found, part, None) if found is not None else None
    return found


def runs_call_of(layer, cls) -> bool:
    """Whether ``layer`` is an instance of ``cls`` (``None``: no) that runs ``cls``'s own ``call``."""
    return cls is not None and isinstance(layer, cls) and type(layer).call is cls.call


def is_loaded_instance(layer, module: str, name: str) -> bool:
    """:func:`runs_call_of` for the class :func:`loaded_class` finds (``False`` when it is not loaded)."""
    return runs_call_of(layer, loaded_class(module, name))
