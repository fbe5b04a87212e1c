"""keras-noisecurve: curvature-aware correlated noise for private training in Keras 3.

Public names are loaded lazily, so ``import keras_noisecurve`` stays fast and the
numpy/scipy parts (mixing-matrix solver, privacy accounting) never import
TensorFlow. docs/api.md documents the public names, docs/design.md#notation the notation.
"""

from __future__ import annotations

import importlib
import importlib.util

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    # mixing matrices (numpy/scipy)
    "MixingMatrix": "keras_noisecurve.mixing",
    "ToeplitzMixing": "keras_noisecurve.mixing",
    "BLTMixing": "keras_noisecurve.mixing",
    "BISRMixing": "keras_noisecurve.mixing",
    "IdentityMixing": "keras_noisecurve.mixing",
    "STRATEGIES": "keras_noisecurve.mixing",
    "UpdateRule": "keras_noisecurve.mixing",
    "InvalidMixingMatrixError": "keras_noisecurve.mixing",
    "load_mixing": "keras_noisecurve.mixing",
    "solve_mixing_matrix": "keras_noisecurve.mixing",
    "objective_value": "keras_noisecurve.mixing",
    "DEFAULT_OBJECTIVE": "keras_noisecurve.mixing",
    "workload_matrix": "keras_noisecurve.mixing",
    "OBJECTIVES": "keras_noisecurve.mixing",
    "noise_diagnostics": "keras_noisecurve.mixing.diagnostics",
    "warn_if_excursive": "keras_noisecurve.mixing.diagnostics",
    "NoiseExcursionWarning": "keras_noisecurve.mixing.diagnostics",
    # privacy accounting (numpy/scipy + dp_accounting)
    "RunSpec": "keras_noisecurve.privacy",
    "dp_event": "keras_noisecurve.privacy",
    "compute_epsilon": "keras_noisecurve.privacy",
    "calibrate_noise_multiplier": "keras_noisecurve.privacy",
    "PrivateRun": "keras_noisecurve.privacy.run",
    "choose_mixing": "keras_noisecurve.privacy.choice",
    "MixingChoice": "keras_noisecurve.privacy.choice",
    "AdaptiveClip": "keras_noisecurve.privacy.adaptive_clip",
    "RunData": "keras_noisecurve.privacy.run_data",
    # TensorFlow / Keras parts
    "banded_poisson_dataset": "keras_noisecurve.privacy.sampler",
    "Spectrum": "keras_noisecurve.spectrum.artifact",
    "estimate_spectrum": "keras_noisecurve.spectrum",
    "NoiseCurveOptimizer": "keras_noisecurve.training",
    "make_private": "keras_noisecurve.training",
    "replace_batch_normalization": "keras_noisecurve.training",
    "fit_distributed": "keras_noisecurve.training",
    "PrivateModel": "keras_noisecurve.training",
    "LinearCooldown": "keras_noisecurve.training",
    "learning_rate_schedule": "keras_noisecurve.training",
    "BandedMatrixFactorizationQuery": "keras_noisecurve.integrations.tf_privacy",
}

_SUBMODULES = {"apps", "audit", "callbacks", "mixing", "privacy", "spectrum", "training", "integrations"}

#: exports that need an optional extra: left out of ``__all__`` (so ``import *`` works)
#: when the extra's package is not installed; accessing them then names the extra.
_OPTIONAL = {"BandedMatrixFactorizationQuery": "tensorflow_privacy"}



def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _exported(name: str) -> bool:
    """Whether ``name`` is in ``__all__``: not where its optional extra is missing, nor where the
    backend ``KERAS_BACKEND`` names has not it (``fit_distributed``, ``BandedMatrixFactorizationQuery``
    on JAX; read from the environment: importing keras here would import TensorFlow under its backend)."""
    from keras_noisecurve import backend

    if name in _OPTIONAL and not _installed(_OPTIONAL[name]):
        return False
    return not backend.refuses(name, configured=True)


__all__ = sorted(name for name in _EXPORTS if _exported(name)) + sorted(_SUBMODULES) + ["__version__"]


def __getattr__(name: str):
    try:
        return _load(name)
    except ImportError as error:  # the base install has neither TensorFlow nor JAX: name the extras
        from keras_noisecurve.backend import missing_backend

        better = missing_backend(error)
        if better is None:
            raise
        raise better from error


def _load(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        module = importlib.import_module(f"keras_noisecurve.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'keras_noisecurve' has no attribute {name!r}")


def __dir__():
    return __all__


def _register_saved_classes() -> None:
    """Keras finds a saved ``PrivateModel``, ``NoiseCurveOptimizer`` or schedule by its registered
    name, which exists once its module is imported. When Keras is already imported (the usual
    order: ``import keras``, then ``import keras_noisecurve``) the training package is imported
    now, so that ``keras.models.load_model`` of a private model works in a fresh process without
    touching ``knc.make_private`` first; code that never imports Keras (the command line's solver
    and accountant) stays free of it."""
    import sys

    if "keras" in sys.modules:
        for module in ("dp_model", "optimizer", "schedules"):  # the modules that register classes
            importlib.import_module(f"keras_noisecurve.training.{module}")


_register_saved_classes()
