"""Recognising an RMS-type norm by what it computes (numpy; no framework import).

Both ghost-clipping engines give a closed-form rule to a layer with ONE weight ``w`` of
shape (d,) whose output is ``y = u(x) ⊙ (α + w)`` along the last axis (α = 0 or 1) with
``u`` not depending on ``w`` — every RMS normalisation whatever its class name — and
recognise it by probing its call (the kernel ``computed_scale`` of
:mod:`keras_noisecurve.backend.common.ghost_scale`; each backend's ``ghost.probe_affine_scale``
runs the probe). The decision is the
same on both; only running the layer differs. :class:`AffineScaleProbe` holds the shared
part: which layers qualify (:func:`single_weight`), the probing input and weight values,
the affinity test (:func:`affine_in_weight`) and the per-layer cache; each engine passes
how to run the layer's call with a substituted weight and the scope that makes the call
concrete (eager) even inside a traced step.

The RMS norms known by class (:data:`KNOWN_RMS_NORMS`, :func:`known_rms_norm`) take the
"RMS scale" rule on both engines, before any probing.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from keras_noisecurve import _compat
from keras_noisecurve.backend.common import layer_classes

__all__ = ["KNOWN_RMS_NORMS", "PROBE_SHAPE", "TOLERANCE", "AffineScaleProbe", "affine_in_weight", "known_rms_norm",
           "single_weight"]

#: RMS norms known by class, ``(module, class name)`` (``layer_classes.loaded_class``): Keras's, and KerasHub's
#: Llama, Gemma and Mistral norms (``y = x̂ ⊙ s`` or ``x̂ ⊙ (1 + s)``, one weight ``scale`` (d,))
KNOWN_RMS_NORMS = (
    ("keras", "layers.RMSNormalization"),
    ("keras_hub.src.models.llama.llama_layernorm", "LlamaLayerNorm"),
    ("keras_hub.src.models.gemma.rms_normalization", "RMSNormalization"),
    ("keras_hub.src.models.mistral.mistral_layer_norm", "MistralLayerNormalization"),
)

#: the probing input: PROBE_SHAPE + (d,), P = 2 examples of 3 positions
PROBE_SHAPE = (2, 3)
#: relative tolerance of the affinity check, by the layer's compute dtype (float64 layers
#: may compute in float32 inside, e.g. Gemma's norm; what is not affine misses by O(1));
#: another dtype gets 3e-2
TOLERANCE = {"float64": 1e-4, "float32": 1e-4, "float16": 3e-2, "bfloat16": 3e-2}


def single_weight(layer):
    """The layer's one weight if it has exactly one in all (own and sublayers', trainable or
    not), trainable, of shape (d,) with d known; else ``None``."""
    weights = list(layer.weights)
    own = list(_compat.own_trainable_variables(layer))
    if len(weights) != 1 or len(own) != 1 or weights[0] is not own[0]:
        return None
    w = own[0]
    if len(w.shape) != 1 or w.shape[0] is None or not w.trainable:
        return None
    return w


def known_rms_norm(layer) -> bool:
    """Whether ``layer`` is an instance of a class of :data:`KNOWN_RMS_NORMS` and runs that
    class's own ``call`` (a subclass that overrides it computes something else)."""
    return any(layer_classes.is_loaded_instance(layer, module, name) for module, name in KNOWN_RMS_NORMS)


def affine_in_weight(*, outputs, width: int, compute_dtype: str) -> bool:
    """Whether ``outputs`` is ``y = u(x) ⊙ (α + w)``, elementwise affine in the weight value
    ``w`` with a slope ``u`` that does not depend on ``w``, one row per example.

    Args:
      outputs: ``outputs(value, x) -> numpy float64 array``: the layer's output for the
        weight value ``value`` (float64, shape (width,)) on the input ``x`` (float64, shape
        ``(p, 3, width)``, p = 2 or 1); the caller casts both to the layer's dtypes. It may
        raise (the caller counts that as "no").
      width: d, the weight's length (≥ 1).
      compute_dtype: the layer's compute dtype, naming the tolerance (:data:`TOLERANCE`).

    With ``x`` (2, 3, d) standard normal and four weight vectors ``a, b, c, e`` far apart
    entry by entry (|a − b| ≥ 1, none near 0 or −1), all drawn from
    ``numpy.random.default_rng(0)`` (x first): with ``u = (y_a − y_b)/(a − b)`` elementwise,
    ``y_c`` and ``y_e`` must be ``y_a + u ⊙ (w − a)`` to ``tol`` = TOLERANCE × the largest
    |output|, every output must have x's shape and be finite, u and the outputs must not be
    all 0, and ``outputs(a, x[:1])`` (example 0 alone) must be ``y_a[:1]`` to ``tol``.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(*PROBE_SHAPE, width))
    # four weight vectors, far apart entry by entry (|a − b| ≥ 1), none near 0 or −1
    a = rng.uniform(0.5, 1.5, width)
    b = -rng.uniform(2.0, 3.0, width)
    c = rng.uniform(2.0, 3.0, width)
    e = -rng.uniform(0.2, 0.4, width)
    ys = [outputs(v, x) for v in (a, b, c, e)]
    if any(y.shape != x.shape or not np.all(np.isfinite(y)) for y in ys):
        return False
    ya, yb, yc, ye = ys
    u = (ya - yb) / (a - b)  # the slope, if y = u ⊙ (α + w)
    scale = max(float(np.max(np.abs(y))) for y in ys)
    if not scale > 0 or not float(np.max(np.abs(u))) > 0:
        return False
    tol = TOLERANCE.get(str(compute_dtype), 3e-2) * scale
    if any(np.max(np.abs(y - (ya + u * (v - a)))) > tol for y, v in ((yc, c), (ye, e))):
        return False
    # one row per example: example 0 alone gives the same rows
    first = outputs(a, x[:1])
    return bool(np.max(np.abs(first - ya[:1])) <= tol)


class AffineScaleProbe:
    """``probe(layer) -> bool``: whether ``layer`` computes ``y = u(x) ⊙ (α + w)`` with its one
    weight ``w`` (d,) (:func:`single_weight`; an unbuilt layer is "no") along the last axis,
    by :func:`affine_in_weight`, cached per layer and weight (a thread-safe, weak cache of
    this probe's own).

    Args:
      outputs: ``outputs(layer, weight, value, x) -> numpy float64 array``, the layer's
        output with ``weight`` substituted by ``value`` (float64 numpy, (d,)) on ``x``
        (float64 numpy), without assigning the variable.
      scope: a context manager factory entered around the whole probe (e.g. one that runs
        eagerly even inside a traced step).

    Any exception of ``outputs`` counts as "no" (the per-layer fallback).
    """

    def __init__(self, *, outputs, scope):
        if not callable(outputs) or not callable(scope):
            raise TypeError(f"outputs and scope must be callables, but got outputs={outputs!r}, scope={scope!r}")
        self._outputs = outputs
        self._scope = scope
        self._lock = threading.Lock()
        self._probed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # layer -> (id(weight), bool)

    def __call__(self, layer) -> bool:
        weight = single_weight(layer)
        if weight is None or not layer.built:
            return False
        with self._lock:
            cached = self._probed.get(layer)
            if cached is not None and cached[0] == id(weight):
                return cached[1]
            try:
                with self._scope():
                    result = affine_in_weight(
                        outputs=lambda value, x: self._outputs(layer, weight, value, x),
                        width=int(weight.shape[0]), compute_dtype=str(layer.compute_dtype),
                    )
            except Exception:  # noqa: BLE001 — a call the probe cannot run is left to the fallback
                result = False
            self._probed[layer] = (id(weight), result)
            return result
