"""Curvature spectrum of a Hessian upper bound, estimated on public data (paper §4).

``Spectrum`` (numpy only) is importable without TensorFlow; the estimators
(HVP, Lanczos, SLQ, tail fit, ``estimate_spectrum``) load TensorFlow on first use.
"""

from __future__ import annotations

import importlib

from keras_noisecurve.spectrum.artifact import Spectrum

# name -> submodule, loaded lazily (they import TensorFlow)
_LAZY = {}

__all__ = ["Spectrum"] + sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'keras_noisecurve.spectrum' has no attribute {name!r}")
