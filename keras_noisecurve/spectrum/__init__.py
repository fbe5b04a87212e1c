"""Curvature spectrum of a Hessian upper bound, estimated on public data (paper §4).

``Spectrum`` (numpy only) is importable without a framework; the estimators that
differentiate a model (HVP, ``estimate_spectrum``, ``clipping_scale``) load the Keras
backend's derivatives on first use (``keras_noisecurve.backend``: TensorFlow or JAX).
"""

from __future__ import annotations

import importlib

from keras_noisecurve.spectrum.artifact import Spectrum

# name -> submodule, loaded lazily (some import Keras and its backend)
_LAZY = {
    # numpy / scipy only
    "lanczos_top_k": "keras_noisecurve.spectrum.lanczos",
    "LanczosResult": "keras_noisecurve.spectrum.lanczos",
    "slq_count": "keras_noisecurve.spectrum.slq",
    "SLQResult": "keras_noisecurve.spectrum.slq",
    "fit_tail": "keras_noisecurve.spectrum.tail",
    "tail_pairs": "keras_noisecurve.spectrum.tail",
    "TailFit": "keras_noisecurve.spectrum.tail",
    "dominance_ratio": "keras_noisecurve.spectrum.certificate",
    "exact_eigenvalues": "keras_noisecurve.spectrum.dense",
    # Keras (TensorFlow or JAX backend)
    "HessianOperator": "keras_noisecurve.spectrum.hvp",
    "dense_hessian": "keras_noisecurve.spectrum.dense",
    "exact_moments": "keras_noisecurve.spectrum.moments",
    "moment_layers": "keras_noisecurve.spectrum.moments",
    "estimate_spectrum": "keras_noisecurve.spectrum.estimate",
    "upper_bound_hessian": "keras_noisecurve.spectrum.estimate",
    "clipping_scale": "keras_noisecurve.spectrum.clip_scale",
    "DominanceCertificate": "keras_noisecurve.spectrum.dominance",
}

__all__ = ["Spectrum"] + sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'keras_noisecurve.spectrum' has no attribute {name!r}")
