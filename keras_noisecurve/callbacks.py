"""Keras callbacks of keras-noisecurve.

- ``PrivacyBudget`` (privacy accounting): logs ε spent and stops training before
  the step plan or the target ε is exceeded.
- ``DominanceCertificate`` (spectrum): logs ρ(H_t, Ĥ) of paper Theorem 4.1.

Both are loaded on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "PrivacyBudget": "keras_noisecurve.privacy.budget",
    "DominanceCertificate": "keras_noisecurve.spectrum.dominance",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'keras_noisecurve.callbacks' has no attribute {name!r}")
