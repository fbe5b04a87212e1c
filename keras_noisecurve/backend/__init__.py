"""The backend seam: the parts of the library that depend on the Keras backend.

Keras 3 runs on several backends; this library supports two, TensorFlow and JAX. Everything
that touches a framework is in ``keras_noisecurve.backend.tensorflow`` or
``keras_noisecurve.backend.jax``, with the same module names in each: the private train step
(``dp_model``), the clipping engines (``clipping``, ``ghost`` with its rule registry
``ghost_rules`` and one ``ghost_<family>`` module per layer family), Keras's training features
(``features``), the input pipeline (``pipeline``), the noise generator's array operations
(``noise``), the optimizer's slot variables and update (``optimizer``), the Hessian-vector
product (``hvp``), the audits' independent references (``audit``), the devices (``devices``).
The neutral code above them asks :func:`name` once and imports the module of that backend
through :func:`module`; it imports no framework. The numpy helpers both backends share are
here (``philox``, ``calls``, ``affine_scale``, ``messages``, ``model_checks``,
``class_weight``, ``norm_observer``). ``tests/test_layout.py`` checks the seam: no framework
import outside its package, the same module names in both (the few one backend has alone
are listed there, with the reason).

The backend is Keras's: ``KERAS_BACKEND`` (or ``~/.keras/keras.json``), read when
``keras`` is first imported. Importing this package imports neither TensorFlow nor JAX.
A third backend is one more package beside these two with the same modules.
"""

from __future__ import annotations

import importlib

__all__ = ["SUPPORTED", "missing_backend", "name", "module"]

#: the Keras backends this library runs on
SUPPORTED = ("tensorflow", "jax")


def name() -> str:
    """The Keras backend in use, ``"tensorflow"`` or ``"jax"``.

    Raises:
      RuntimeError: for another backend (``"torch"``, ``"numpy"``, ``"openvino"``),
        naming the backends that work and how to choose one.
    """
    import keras

    backend = keras.backend.backend()
    if backend not in SUPPORTED:
        raise RuntimeError(
            f"keras_noisecurve runs on the Keras backends {' and '.join(SUPPORTED)}, but KERAS_BACKEND is "
            f"{backend!r}. Set the environment variable KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax before "
            "importing keras."
        )
    return backend


def module(module_name: str):
    """The module ``module_name`` of the backend in use, e.g. ``module("noise")`` is
    ``keras_noisecurve.backend.jax.noise`` under ``KERAS_BACKEND=jax``."""
    return importlib.import_module(f"keras_noisecurve.backend.{name()}.{module_name}")


def missing_backend(error: ImportError):
    """An ``ImportError`` that says how to install a backend, for ``error`` raised by
    ``import keras`` when the backend Keras was told to use is not installed (this
    package installs neither: ``pip install "keras-noisecurve[tensorflow]"`` or
    ``"keras-noisecurve[jax]"``); ``None`` for any other import error."""
    missing = getattr(error, "name", None) or ""
    if missing.split(".")[0] not in SUPPORTED:
        return None
    return ImportError(
        f"Keras's backend {missing.split('.')[0]!r} is not installed (KERAS_BACKEND, or ~/.keras/keras.json, "
        "chooses it; Keras's default is tensorflow). Install one with this library's extra: "
        'pip install "keras-noisecurve[tensorflow]", or pip install "keras-noisecurve[jax]" and set '
        "KERAS_BACKEND=jax."
    )
