"""The backend seam: the parts of the library that depend on the Keras backend.

Keras 3 runs on several backends; this library supports two, TensorFlow and JAX. The
code that depends on the framework has one implementation per backend, in
``keras_noisecurve.backend.tensorflow`` and ``keras_noisecurve.backend.jax``: the noise
generator's array operations (``noise``), the optimizer's slot variables and update
(``optimizer``), the Hessian-vector product (``hvp``), the audits' independent references
(``audit``). The neutral code above them asks :func:`name` once and imports the module of
that backend through :func:`module`; the numpy parts (mixing, accounting, the run spec,
the sampler plan, the example sources' numpy gather, the audit's statistics) import no
framework.

Not yet behind the seam: the TensorFlow train step and clipping engine live in
``keras_noisecurve.training`` (``dp_model_tf.py``, ``ghost*.py``, ``clipping.py``), while
their JAX counterparts are here (``backend/jax/dp_model.py``, ``ghost*.py``); the private
model picks its half by backend (``training/dp_model.py``).

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
