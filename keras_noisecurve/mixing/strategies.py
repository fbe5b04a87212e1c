"""The registry of mixing strategies: kind string → class, and the one reader of every form.

numpy/scipy only. Every strategy is a ``keras_noisecurve.mixing.strategies_base.Strategy``:

============  =======================  =====================================  ===============
kind          class                    C                                      noise state
============  =======================  =====================================  ===============
``banded``    ``MixingMatrix``         b-banded, any entries                  b − 1 buffers
``toeplitz``  ``ToeplitzMixing``       b-banded Toeplitz, ``C[t, s] = c_{t−s}``  b − 1 buffers
``blt``       ``BLTMixing``            Toeplitz, c_k = α·Σ_i ω_i θ_i^{k−1}       d buffers
``bisr``      ``BISRMixing``           C⁻¹ p-banded Toeplitz, (1 − x)^{1/2}      p − 1 buffers
``dpsgd``     ``IdentityMixing``       C = I (no step limit unless ``steps``)    none
============  =======================  =====================================  ===============

This module (with ``strategies_base``, ``strategies_toeplitz``, ``strategies_identity``
and ``strategies_solve``) is the only place that maps a kind string to its class; the
rest of the library asks a strategy's attributes and methods. :func:`load_mixing` reads
every form a ``mixing=`` argument takes.
"""

from __future__ import annotations

import json
import os
import reprlib
from typing import Any, Mapping

import numpy as np

from keras_noisecurve._npz import one_line, read_npz
from keras_noisecurve.mixing.errors import InvalidMixingMatrixError
from keras_noisecurve.mixing.matrix import MixingMatrix, _file_format
from keras_noisecurve.mixing.strategies_base import Strategy
from keras_noisecurve.mixing.strategies_identity import IdentityMixing
from keras_noisecurve.mixing.strategies_toeplitz import (
    STRATEGY_FORMAT,
    STRATEGY_FORMAT_VERSION,
    BISRMixing,
    BLTMixing,
    ToeplitzFamily,
    ToeplitzMixing,
    bisr_coefficients,
)

__all__ = [
    "STRATEGIES",
    "STRATEGY_CLASSES",
    "STRATEGY_FORMAT",
    "BISRMixing",
    "BLTMixing",
    "IdentityMixing",
    "MixingMatrix",
    "Strategy",
    "ToeplitzFamily",
    "ToeplitzMixing",
    "bisr_coefficients",
    "is_mixing_matrix",
    "is_strategy",
    "load_mixing",
    "load_strategy",
    "strategy_class",
    "strategy_from_fields",
]

#: kind → class of every strategy.
STRATEGY_CLASSES = {cls.kind: cls for cls in (MixingMatrix, ToeplitzMixing, BLTMixing, BISRMixing, IdentityMixing)}

#: The kinds ``solve_mixing_matrix(strategy=...)`` optimises (``MixingMatrix`` is ``"banded"``).
STRATEGIES = ("banded", "toeplitz", "blt", "bisr")

#: The kinds stored in the ``keras-noisecurve/mixing-strategy`` file (``MixingMatrix`` has its own).
_STRATEGY_FILE_KINDS = tuple(kind for kind in STRATEGY_CLASSES if kind != MixingMatrix.kind)

#: The fields a ``mixing-strategy`` file may hold (``save_strategy_file``: every kind's
#: ``param_<name>``); a file with any other is refused unread.
STRATEGY_FILE_FIELDS = ("format", "format_version", "kind", "steps", "metadata", "digest") + tuple(sorted({
    f"param_{name}" for kind in _STRATEGY_FILE_KINDS
    for name in getattr(STRATEGY_CLASSES[kind], "parameter_names", ())
}))


def strategy_class(kind: str) -> type:
    """The class registered for ``kind`` (one of ``STRATEGY_CLASSES``)."""
    if not isinstance(kind, str) or kind not in STRATEGY_CLASSES:
        raise ValueError(f"unknown strategy kind {kind!r}; expected one of {tuple(STRATEGY_CLASSES)}.")
    return STRATEGY_CLASSES[kind]


def is_mixing_matrix(value) -> bool:
    """Whether ``value`` is a banded ``MixingMatrix`` (what the banded solver and the noise
    diagnostics read: a (T, b) table of band values)."""
    return isinstance(value, MixingMatrix)


def is_strategy(value) -> bool:
    """Whether ``value`` is a mixing strategy of any kind."""
    return isinstance(value, Strategy)


def strategy_from_fields(kind: str, *, steps, params: Mapping[str, Any], metadata=None) -> Strategy:
    """Build a strategy of a ``mixing-strategy`` file kind from its parameter arrays (validated)."""
    if kind not in _STRATEGY_FILE_KINDS:
        raise InvalidMixingMatrixError(f"unknown strategy kind {kind!r}; expected one of {_STRATEGY_FILE_KINDS}.")
    return STRATEGY_CLASSES[kind].from_fields(steps=steps, params=params, metadata=metadata)


def load_strategy(path) -> Strategy:
    """Read and re-validate a file written by a ``mixing-strategy`` ``save`` (every kind but banded)."""
    try:
        fields = read_npz(path, what="mixing-strategy", fields=STRATEGY_FILE_FIELDS)
    except ValueError as exc:
        raise InvalidMixingMatrixError(str(exc)) from None
    try:
        return _strategy_from_file_fields(path, fields)
    except InvalidMixingMatrixError:
        raise
    except Exception as exc:  # noqa: BLE001 - a foreign or damaged field: one line naming the file
        raise InvalidMixingMatrixError(f"{path}: a damaged mixing-strategy file ({one_line(exc)}).") from None


def _strategy_from_file_fields(path, fields) -> Strategy:
    if str(fields.get("format", "")) != STRATEGY_FORMAT:
        raise InvalidMixingMatrixError(f"{path}: not a keras-noisecurve mixing-strategy file.")
    version = int(fields.get("format_version", -1))
    if version != STRATEGY_FORMAT_VERSION:
        raise InvalidMixingMatrixError(
            f"{path}: strategy format version {version} is not supported (this library reads "
            f"{STRATEGY_FORMAT_VERSION}).")
    for key in ("kind", "steps", "metadata", "digest"):
        if key not in fields:
            raise InvalidMixingMatrixError(f"{path}: missing field {key!r}.")
    params = {k[len("param_"):]: v for k, v in fields.items() if k.startswith("param_")}
    strategy = strategy_from_fields(str(fields["kind"]), steps=int(fields["steps"]), params=params,
                                    metadata=json.loads(str(fields["metadata"])))
    if strategy.digest() != str(fields["digest"]):
        raise InvalidMixingMatrixError(f"{path}: the stored digest does not match the parameters; the file was modified.")
    return strategy


def load_mixing(mixing) -> Strategy:
    """Resolve a ``mixing=`` argument to a strategy.

    ``NoiseCurveOptimizer(mixing=...)``, ``PrivateRun(mixing=...)`` and the TensorFlow
    Privacy query ``BandedMatrixFactorizationQuery(mixing=...)`` accept a mixing matrix
    in any of the forms below; this function is the one place that reads them. numpy only.

    Args:
      mixing: one of

        - a strategy (``MixingMatrix``, ``ToeplitzMixing``, ``BLTMixing``,
          ``BISRMixing``, ``IdentityMixing``): returned as it is;
        - the string ``"dpsgd"``: ``IdentityMixing()``, independent noise (C = I) with no
          step limit; ``MixingMatrix.identity(T)`` is the same noise for T steps;
        - a path (``str`` or ``os.PathLike``) of a ``.npz`` artifact written by a
          strategy's ``save`` or ``noisecurve solve``: loaded and re-validated;
        - a dict ``{"band_values": (T, b) array-like, "metadata": dict}`` (the form
          ``MixingMatrix.to_config()`` writes; ``metadata`` may be missing), or
          ``{"kind": <a kind of STRATEGY_CLASSES>, "steps": T, <parameters>, "metadata": …}``
          for the other strategies (their ``to_config()``).

    Returns:
      The strategy.

    Raises:
      ValueError: a path that is not a file or not a valid artifact, a dict without
        ``"band_values"``, a numpy array (ambiguous: band values (T, b) or a dense C;
        wrap it in ``MixingMatrix(band_values)`` or ``MixingMatrix.from_dense(C)``), or
        any other type. Each message names the value received and the forms allowed.
        Band values that break a constraint of C raise ``InvalidMixingMatrixError``, a
        ``ValueError``.
    """
    if is_strategy(mixing):
        return mixing
    if isinstance(mixing, str) and mixing == IdentityMixing.kind:
        return IdentityMixing()
    if isinstance(mixing, dict) and mixing.get("kind", MixingMatrix.kind) != MixingMatrix.kind:
        params = {k: v for k, v in mixing.items() if k not in ("kind", "steps", "metadata")}
        if "steps" not in mixing:
            raise ValueError(f"a {mixing['kind']!r} mixing dict needs 'steps'; got keys {sorted(mixing)}.")
        return strategy_from_fields(mixing["kind"], steps=mixing["steps"], params=params,
                                    metadata=mixing.get("metadata") or {})
    if isinstance(mixing, dict):
        if "band_values" not in mixing:
            raise ValueError(f"mixing dict must have 'band_values' (and 'metadata'), got keys {sorted(mixing)}.")
        return MixingMatrix(np.asarray(mixing["band_values"], dtype=np.float64), mixing.get("metadata") or {})
    if isinstance(mixing, (str, os.PathLike)):
        if not os.path.isfile(mixing):
            raise ValueError(
                f"mixing={str(mixing)!r}: no such file. Pass a MixingMatrix, the path of a .npz "
                "written by MixingMatrix.save / `noisecurve solve`, or 'dpsgd'."
            )
        try:
            if _file_format(mixing) == STRATEGY_FORMAT:
                return load_strategy(mixing)
            return MixingMatrix.load(mixing)
        except InvalidMixingMatrixError as exc:
            raise ValueError(f"mixing={str(mixing)!r} is not a valid mixing-matrix artifact: {exc}") from exc
    if isinstance(mixing, np.ndarray):
        raise ValueError(
            f"mixing must be a MixingMatrix, a path to a .npz artifact or 'dpsgd'; got a numpy array of shape "
            f"{mixing.shape}. Wrap band values (band_values[t, j] = C[t, t - j]) as MixingMatrix(band_values), "
            "or a dense lower-triangular C as MixingMatrix.from_dense(C)."
        )
    raise ValueError(
        f"mixing must be a MixingMatrix, a path to a .npz artifact or 'dpsgd'; got {reprlib.repr(mixing)} "
        f"({type(mixing).__name__})."
    )
