"""Exact second derivatives through Keras normalisation layers.

Keras 3 (TensorFlow backend) computes ``keras.ops.moments`` with ``tf.nn.moments``,
whose variance is ``mean((x − stop_gradient(mean))²)``. Because Σ(x − mean) = 0, the
first derivative is unaffected, but second derivatives miss the mean's path: Hessian-
vector products through ``GroupNormalization`` and ``LayerNormalization`` (and
``BatchNormalization`` in training mode) are off by 1e-3 to 1e-2 relative
(docs/spectrum.md, "The GroupNormalization pitfall").

``exact_moments()`` is a context manager that, while active, replaces the backend's
``_compute_moments`` with ``mean`` and ``mean((x − mean)²)`` without any stop-gradient.
The replacement is read when a function is *traced*, so every ``tf.function`` whose
HVPs should be exact must be traced (first called) inside the context; the spectrum
code does that. ``moment_layers(model)`` lists the layers affected.

Only the TensorFlow backend has the pitfall: Keras's JAX ``moments`` computes the
variance with ``jnp.var``, whose derivatives follow the mean too, so under
``KERAS_BACKEND=jax`` the context patches nothing and is exact (and imports no
TensorFlow).
"""

from __future__ import annotations

import contextlib
import threading
import warnings

from keras_noisecurve import _compat, backend

_LOCK = threading.RLock()
_DEPTH = [0]
_ORIGINAL = [None]

AFFECTED_LAYERS = ("GroupNormalization", "LayerNormalization", "BatchNormalization")


def _exact_compute_moments(x, axes, keepdims):
    """``(mean, mean((x − mean)²))`` over ``axes``, the mean's path kept (``keras.ops``: called
    while Keras's TensorFlow backend computes ``keras.ops.moments``, so on TensorFlow tensors)."""
    from keras import ops

    axes = tuple(axes) if isinstance(axes, (list, tuple)) else (axes,)
    mean = ops.mean(x, axis=axes, keepdims=True)
    variance = ops.mean(ops.square(x - mean), axis=axes, keepdims=True)
    if not keepdims:
        mean = ops.squeeze(mean, axis=axes)
        variance = ops.squeeze(variance, axis=axes)
    return mean, variance


def _backend_module():
    return _compat.keras_tf_nn_module()


def _needs_patch() -> bool:
    """Whether the backend's moments stop the mean's gradient (TensorFlow does, JAX does not:
    ``hvp.EXACT_MOMENTS``)."""
    return not backend.module("hvp").EXACT_MOMENTS


def exact_moments_available() -> bool:
    """Whether HVPs through moments are exact: always on JAX; on TensorFlow when this Keras
    version can be patched (``_compute_moments``)."""
    return not _needs_patch() or _backend_module() is not None


@contextlib.contextmanager
def exact_moments():
    """Within the context, ``keras.ops.moments`` has exact second derivatives.

    Re-entrant and thread-safe (a lock is held while active). If this Keras version
    cannot be patched, a ``RuntimeWarning`` says so and the context does nothing. On
    JAX, nothing needs patching and the context yields True at once.
    """
    if not _needs_patch():
        yield True
        return
    module = _backend_module()
    if module is None:
        warnings.warn(
            "keras_noisecurve: cannot patch keras moments on this Keras version; Hessian-vector products "
            "through GroupNormalization/LayerNormalization will have ≈1e-3 relative error.",
            RuntimeWarning,
            stacklevel=3,
        )
        yield False
        return
    with _LOCK:
        if _DEPTH[0] == 0:
            _ORIGINAL[0] = _compat.swap_compute_moments(module, _exact_compute_moments)
        _DEPTH[0] += 1
        try:
            yield True
        finally:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                _compat.swap_compute_moments(module, _ORIGINAL[0])
                _ORIGINAL[0] = None


def moment_layers(model) -> list:
    """Names and classes of the layers of ``model`` (recursively) that compute moments.

    Returns a list of ``"name (ClassName)"`` strings for GroupNormalization,
    LayerNormalization and BatchNormalization layers (BatchNormalization only uses
    moments in training mode; HVPs run in inference mode, so it is listed but harmless).
    """
    found = []
    import keras

    layers = _compat.flatten_layers(model, include_self=False) if isinstance(model, keras.layers.Layer) else model.layers
    for layer in layers:
        cls = type(layer).__name__
        if cls in AFFECTED_LAYERS or any(base.__name__ in AFFECTED_LAYERS for base in type(layer).__mro__):
            found.append(f"{layer.name} ({cls})")
    return found
