"""The backend seam: the parts of the library that depend on the Keras backend.

Keras 3 runs on several backends; this library supports two, TensorFlow and JAX. The
code that depends on the framework — the noise generator's array operations, the
private model's train step and per-example clipping, the Hessian-vector product, the
input pipeline — has one implementation per backend, in ``keras_noisecurve.backend.
tensorflow`` and ``keras_noisecurve.backend.jax``, with the same module names in each
(as Keras's own ``keras/src/backend/{tensorflow,jax}/``). The neutral code above them
(the optimizer, ``make_private``, the spectrum) asks :func:`name` once and imports the
module of that backend through :func:`module`; the numpy parts (mixing, accounting,
the run spec, the sampler plan, the audit's statistics) import no framework.

The backend is Keras's: ``KERAS_BACKEND`` (or ``~/.keras/keras.json``), read when
``keras`` is first imported. Importing this package imports neither TensorFlow nor JAX.
A third backend is one more package beside these two with the same modules.
"""

from __future__ import annotations

import importlib

__all__ = ["SUPPORTED", "name", "module", "check"]

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


def check() -> str:
    """:func:`name`, for code that only needs the refusal of an unsupported backend."""
    return name()


def module(module_name: str):
    """The module ``module_name`` of the backend in use, e.g. ``module("noise")`` is
    ``keras_noisecurve.backend.jax.noise`` under ``KERAS_BACKEND=jax``."""
    return importlib.import_module(f"keras_noisecurve.backend.{name()}.{module_name}")
