"""The backend seam: the parts of the library that depend on the Keras backend.

Keras 3 runs on several backends; this library supports two, TensorFlow and JAX. Everything
that touches a framework is in ``keras_noisecurve.backend.tensorflow`` or
``keras_noisecurve.backend.jax``. The backend is chosen here and nowhere else: :func:`name`
reads Keras's backend and :func:`module` imports a module of that backend's package. The
neutral code above asks :func:`module` for the modules of :data:`MODULES` and branches on no
backend name. A package's own ``MODULES`` lists the seam modules it has: all of them, but for
those of :data:`OPTIONAL` it leaves to ``backend.common.defaults``, where a module of the same
name does what a backend without the feature does (``devices``: nothing to quiet; ``ghost_conv``:
``keras.ops`` convolutions; ``pipeline``: the run's batches as a ``keras.utils.PyDataset``) or refuses it,
saying why (``distributed``: ``tf.distribute``; ``tf_privacy``: TensorFlow Privacy). A package
lists the public names it has not in ``REFUSED`` (asked through :func:`refuses`).

What every package exports: the modules of :data:`MODULES` (its own or the defaults), each with
the same public names (its ``__all__``) on every backend, but for the per-backend extras listed
with their reason in ``tests/backend/test_seam_contract.py``, which checks the contract (and that
neutral code asks only for these modules, names no backend and imports no backend package).
Besides them a package has the modules its engine is made of (the ghost-norm kernels, ...). The
numpy and ``keras.ops`` helpers both backends share are in ``backend.common`` (``philox``,
``calls``, ``layer_rules``, ``norm_forms``, ``messages``, ``model_checks``, ...).

The backend is Keras's: ``KERAS_BACKEND`` (or ``~/.keras/keras.json``), read when
``keras`` is first imported. Importing this package imports neither TensorFlow nor JAX.
"""

from __future__ import annotations

import importlib
import os

__all__ = ["MODULES", "OPTIONAL", "SUPPORTED", "missing_backend", "module", "name", "refuses", "supported"]

#: the Keras backends this library runs on
SUPPORTED = ("tensorflow", "jax")

#: the modules of a backend package that the neutral code asks :func:`module` for; a package's
#: own ``MODULES`` is this tuple, less any of :data:`OPTIONAL` it leaves to the defaults
MODULES = (
    "audit",  # the audits' independent references
    "clipping",  # the vectorized engine (and the TensorFlow engines' public objects)
    "devices",  # probing the devices, quieting the start-up
    "distributed",  # fit_distributed's loop (tf.distribute; refused on JAX)
    "dp_model",  # the private train step, TrainStepBackend
    "ghost",  # the per-layer engine: describe, register_rule
    "ghost_conv",  # the convolution kernels' windows and per-example filter gradients
    "hvp",  # Hessian-vector products
    "noise",  # the noise generator's array operations
    "optimizer",  # the optimizer's slot variables and update, its step counter
    "pipeline",  # the input pipeline of a run, tf.data inputs
    "tf_privacy",  # TensorFlow Privacy's DPQuery (refused on JAX)
)

#: the modules of :data:`MODULES` a package may leave out: ``backend.common.defaults`` has each,
#: for a backend with nothing to do (``devices``), whose ``keras.ops`` serve (``ghost_conv``), whose
#: Keras trainer takes a ``PyDataset`` in one process (``pipeline``), or without the feature (the
#: others refuse it)
OPTIONAL = ("devices", "distributed", "ghost_conv", "pipeline", "tf_privacy")


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


def supported() -> bool:
    """Whether Keras's backend is one of :data:`SUPPORTED` (no error for another)."""
    import keras

    return keras.backend.backend() in SUPPORTED


def refuses(public_name: str, *, configured: bool = False) -> bool:
    """Whether the backend in use has not ``public_name``, a public name of the library (its
    package's ``REFUSED``: JAX has no ``fit_distributed``, ...).

    Args:
      public_name: e.g. ``"fit_distributed"``.
      configured: ask of the backend ``KERAS_BACKEND`` names (Keras's default, TensorFlow, when
        it is unset), read from the environment without importing Keras (for
        ``keras_noisecurve.__all__``); a backend this library does not run on has none of the
        names some backend refuses.

    Raises:
      RuntimeError: as :func:`name`, for a name some backend refuses (``configured=False``).
    """
    packages = {b: importlib.import_module(f"keras_noisecurve.backend.{b}") for b in SUPPORTED}
    if not any(public_name in package.REFUSED for package in packages.values()):
        return False
    chosen = os.environ.get("KERAS_BACKEND", "tensorflow") if configured else name()
    return chosen not in packages or public_name in packages[chosen].REFUSED


def module(module_name: str):
    """The module ``module_name`` (one of :data:`MODULES`) of the backend in use, e.g.
    ``module("noise")`` is ``keras_noisecurve.backend.jax.noise`` under ``KERAS_BACKEND=jax``; a
    module of :data:`OPTIONAL` the backend's package has not is ``backend.common.defaults``' (JAX's
    ``module("tf_privacy")`` refuses TensorFlow Privacy).

    Raises:
      ValueError: for a name not in :data:`MODULES`.
      RuntimeError: as :func:`name`.
    """
    if module_name not in MODULES:
        raise ValueError(f"module_name must be one of {MODULES}, got {module_name!r}")
    backend = name()
    if module_name in importlib.import_module(f"keras_noisecurve.backend.{backend}").MODULES:
        return importlib.import_module(f"keras_noisecurve.backend.{backend}.{module_name}")
    return importlib.import_module(f"keras_noisecurve.backend.common.defaults.{module_name}")


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
