"""Toeplitz-family mixing strategies: banded Toeplitz, BLT and BISR.

numpy/scipy only. Each class is a ``keras_noisecurve.mixing.strategies_base.Strategy``
(the registry is ``keras_noisecurve.mixing.strategies``):

============  =====================================  ==================  ===================
kind          C                                      noise state         parameters
============  =====================================  ==================  ===================
``toeplitz``  b-banded Toeplitz, ``C[t, s] = c_{t−s}``  b − 1 buffers     b
``blt``       Toeplitz, c_k = α·Σ_i ω_i θ_i^{k−1}       d buffers         2d
``bisr``      C⁻¹ p-banded Toeplitz, (1 − x)^{1/2}      p − 1 buffers     none (closed form)
============  =====================================  ==================  ===================

Normalisation: every strategy's largest column norm is exactly 1 (column 0; later
columns are truncated copies and have norm ≤ 1), so one participation has L2
sensitivity 1 and the optimizer's noise ``ζ·σ·z̃`` has the noise multiplier σ that the
accountant sees. ``sensitivity(participations=k, separation=s)`` gives the L2
sensitivity of k participations s steps apart: ``√k`` for the banded Toeplitz kind
when s ≥ b (their columns do not overlap), and ``‖Σ_{i<k} C[:, i·s]‖`` otherwise (BLT
and BISR, whose coefficients are non-negative so the first start (p = 0) is the worst:
a later start only truncates non-negative terms). BLT and BISR are not banded: their
accounting allows fixed-epoch sampling only.

Files: ``save`` writes ``.npz`` without pickle (format ``keras-noisecurve/mixing-strategy``),
with the kind, the parameters, a JSON metadata string and a SHA-256 digest;
``keras_noisecurve.mixing.load_mixing`` reads every kind and re-validates it.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping

import numpy as np
import scipy.signal

from keras_noisecurve._validation import check_int
from keras_noisecurve.mixing.errors import COLUMN_NORM_TOLERANCE, InvalidMixingMatrixError
from keras_noisecurve.mixing.kernels import binomial_coefficients
from keras_noisecurve.mixing.stream import BLTStream, FIRStream, ToeplitzStream
from keras_noisecurve.mixing.strategies_base import Strategy
from keras_noisecurve.mixing.toeplitz_loss import participation_sensitivity

__all__ = [
    "STRATEGY_FORMAT",
    "STRATEGY_FORMAT_VERSION",
    "BISRMixing",
    "BLTMixing",
    "ToeplitzFamily",
    "ToeplitzMixing",
    "bisr_coefficients",
    "save_strategy_file",
    "strategy_digest",
]

STRATEGY_FORMAT = "keras-noisecurve/mixing-strategy"
STRATEGY_FORMAT_VERSION = 1


def strategy_digest(kind: str, steps: int, parameters: Mapping[str, np.ndarray]) -> str:
    """SHA-256 of a strategy file's content: kind, steps (int64) and each named parameter (float64)."""
    h = hashlib.sha256(kind.encode())
    h.update(np.asarray([steps], dtype=np.int64).tobytes())
    for name, value in sorted(parameters.items()):
        h.update(name.encode())
        h.update(np.ascontiguousarray(value, dtype=np.float64).tobytes())
    return h.hexdigest()


def save_strategy_file(path, *, kind: str, steps: int, parameters: Mapping[str, np.ndarray], metadata: dict,
                       digest: str) -> None:
    """Write the ``keras-noisecurve/mixing-strategy`` ``.npz`` (no pickle). Overwrites ``path``."""
    with open(path, "wb") as f:
        np.savez(f, format=np.array(STRATEGY_FORMAT), format_version=np.array(STRATEGY_FORMAT_VERSION),
                 kind=np.array(kind), steps=np.array(steps),
                 metadata=np.array(json.dumps(metadata, sort_keys=True)),
                 digest=np.array(digest),
                 **{f"param_{k}": v for k, v in parameters.items()})


def _array(name, value, *, ndim=1):
    arr = np.array(value, dtype=np.float64, copy=True)
    if arr.ndim != ndim or arr.size == 0:
        raise InvalidMixingMatrixError(f"{name} must be a non-empty {ndim}-d array, got shape {arr.shape}.")
    if not np.all(np.isfinite(arr)):
        raise InvalidMixingMatrixError(f"{name} must be finite; got {arr.tolist()[:8]}.")
    arr.setflags(write=False)
    return arr


class ToeplitzFamily(Strategy):
    """Shared behaviour of the Toeplitz kinds: first column, dense form, files, sensitivity."""

    kind = ""
    banded = False  # True when C is b-banded (b − 1 below the diagonal) with b < T possible
    samplings = ("fixed_epochs",)

    def __init__(self, steps, metadata):
        self._steps = check_int("steps", steps, minimum=1)
        self._metadata = dict(metadata or {})
        json.dumps(self._metadata)

    #: The constructor's positional parameters, in order (the file's ``param_<name>`` fields).
    parameter_names: tuple = ()

    @classmethod
    def from_fields(cls, *, steps, params: Mapping[str, Any], metadata=None):
        """Build from a file's or config's fields (validated)."""
        missing = [n for n in cls.parameter_names if n not in params]
        if missing:
            raise InvalidMixingMatrixError(f"a {cls.kind} strategy needs {cls.parameter_names}; missing {missing}.")
        return cls(*(params[n] for n in cls.parameter_names), steps=int(steps), metadata=metadata)

    # ------------------------------------------------------------- subclass API
    def _parameters(self) -> dict:  # name -> float64 array, saved verbatim
        raise NotImplementedError

    def first_column(self) -> np.ndarray:
        """C[:, 0], shape (T,): the Toeplitz coefficients c_0 … c_{T−1} (norm 1)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ basics
    @property
    def steps(self) -> int:
        """Number of steps T."""
        return self._steps

    def with_metadata(self, **updates):
        """A new strategy with the same C and ``metadata`` updated by ``updates``."""
        meta = dict(self._metadata)
        meta.update(updates)
        return type(self)(**{k: v for k, v in self._parameters().items()}, steps=self._steps, metadata=meta)

    def to_dense(self) -> np.ndarray:
        """The dense (T, T) lower-triangular C (float64; O(T²) memory)."""
        col = self.first_column()
        idx = np.subtract.outer(np.arange(self._steps), np.arange(self._steps))
        return np.where(idx >= 0, col[np.clip(idx, 0, None)], 0.0)

    def column_norms(self) -> np.ndarray:
        """L2 norms of the columns of C, shape (T,): column s is c_0 … c_{T−1−s}."""
        col = self.first_column()
        return np.sqrt(np.cumsum((col**2)[::-1])[::-1])

    def leading_column_norm(self, steps: int) -> float:
        """Largest column norm of the leading ``steps``×``steps`` block: ‖c_0 … c_{steps−1}‖."""
        col = self.first_column()
        return float(np.linalg.norm(col if steps == self._steps else col[:steps]))

    def _overlapping_sensitivity(self, participations, separation, steps):
        """‖Σ_{i<k} C[:steps, i·s]‖ (the coefficients are non-negative: start 0 is the worst)."""
        col = self.first_column()[:steps]
        if np.any(col < 0):
            raise ValueError(
                f"the {self.kind} C has negative coefficients, so the worst participation pattern is not "
                f"known in closed form; refusing to account for {participations} participations {separation} "
                "steps apart."
            )
        return float(np.sqrt(participation_sensitivity(col, participations=participations, separation=separation,
                                                       gradient=False)[0]))

    def digest(self) -> str:
        return strategy_digest(self.kind, self._steps, self._parameters())

    def to_config(self) -> dict:
        """A JSON-serialisable dict that ``load_mixing`` turns back into this strategy."""
        cfg = {"kind": self.kind, "steps": self._steps, "metadata": self.metadata}
        cfg.update({k: np.asarray(v).tolist() for k, v in self._parameters().items()})
        return cfg

    def save(self, path: str | os.PathLike) -> None:
        """Write ``.npz`` (no pickle): kind, steps, parameters, metadata JSON, digest."""
        save_strategy_file(path, kind=self.kind, steps=self._steps, parameters=self._parameters(),
                           metadata=self._metadata, digest=self.digest())

    def _identity_key(self):
        params = self._parameters()
        return (self._steps, tuple(sorted(params)), *(params[k] for k in sorted(params)))

    def __repr__(self):
        objective = self._metadata.get("objective", "?")
        return f"{type(self).__name__}(steps={self._steps}, buffers={self.buffers}, objective={objective!r})"


class ToeplitzMixing(ToeplitzFamily):
    """A b-banded Toeplitz C: ``C[t, s] = c_{t−s}`` for 0 ≤ t − s < b, else 0.

    Args:
      coefficients: c, shape (b,), with c_0 > 0 and ‖c‖₂ = 1 (within
        ``COLUMN_NORM_TOLERANCE``); use :meth:`normalised` to scale raw coefficients.
      steps: T ≥ b.
      metadata: JSON-serialisable dict.

    The noise recurrence and the privacy accounting are those of a banded C (b − 1
    buffers; cyclic Poisson amplification with b partitions). The last b − 1 columns
    are truncated, with norms below 1, which only lowers the sensitivity.
    """

    kind = "toeplitz"
    parameter_names = ("coefficients",)
    banded = True
    samplings = ("cyclic_poisson", "fixed_epochs")

    def __init__(self, coefficients, *, steps, metadata: Mapping[str, Any] | None = None):
        super().__init__(steps, metadata)
        c = _array("coefficients", coefficients)
        if c.shape[0] > self._steps:
            raise InvalidMixingMatrixError(f"bands ({c.shape[0]}) cannot exceed steps ({self._steps}).")
        if c[0] <= 0:
            raise InvalidMixingMatrixError(f"C must have a positive diagonal; c_0 = {c[0]}.")
        norm = float(np.linalg.norm(c))
        if abs(norm - 1.0) > COLUMN_NORM_TOLERANCE:
            raise InvalidMixingMatrixError(
                f"the Toeplitz coefficients must have L2 norm 1 (within {COLUMN_NORM_TOLERANCE:g}); got "
                f"{norm!r}. Use ToeplitzMixing.normalised(c, steps=...) to scale them."
            )
        self._c = c

    @classmethod
    def normalised(cls, coefficients, *, steps, metadata=None) -> "ToeplitzMixing":
        """Scale ``coefficients`` to unit L2 norm and build the strategy."""
        c = np.asarray(coefficients, dtype=np.float64)
        norm = np.linalg.norm(c)
        if not norm > 0 or not np.isfinite(norm):
            raise InvalidMixingMatrixError(f"coefficients must have a finite, positive norm; got {norm!r}.")
        return cls(c / norm, steps=steps, metadata=metadata)

    @property
    def bands(self) -> int:
        return self._c.shape[0]

    @property
    def coefficients(self) -> np.ndarray:
        """c, shape (b,), read-only."""
        return self._c

    def _parameters(self):
        return {"coefficients": self._c}

    def leading_column_norm(self, steps: int) -> float:
        """‖c_0 … c_{min(b, steps)−1}‖: column 0 of the leading block is the longest."""
        return float(np.linalg.norm(self._c[:steps]))

    def first_column(self):
        col = np.zeros(self._steps)
        col[: self.bands] = self._c
        return col

    @property
    def band_values(self) -> np.ndarray:
        """The (T, b) table ``band_values[t, j] = C[t, t − j]`` (materialised: T·b floats)."""
        values = np.tile(self._c, (self._steps, 1))
        for j in range(1, self.bands):
            values[:j, j] = 0.0
        return values

    def stream(self):
        return ToeplitzStream(self._c, steps=self._steps)


def _blt_column(theta, omega, steps) -> np.ndarray:
    """Unnormalised BLT column (1, c_1, …, c_{T−1}), c_k = Σ_i ω_i θ_i^{k−1}."""
    col = np.ones(steps)
    if steps > 1:
        powers = theta[None, :] ** np.arange(steps - 1)[:, None]  # (T−1, d)
        col[1:] = powers @ omega
    return col


class BLTMixing(ToeplitzFamily):
    """A buffered linear Toeplitz (BLT) C with d buffers.

    ``C = α·Toeplitz(1, c_1, c_2, …)`` with ``c_k = Σ_{i<d} ω_i θ_i^{k−1}`` (k ≥ 1),
    α = 1/‖(1, c_1, …, c_{T−1})‖ so that the first column has norm 1. The noise
    recurrence keeps d accumulators (``keras_noisecurve.mixing.stream``, ``"blt"``).

    Args:
      theta: θ, shape (d,), each in [0, 1).
      omega: ω, shape (d,), each ≥ 0 (so every c_k ≥ 0 and the worst participation
        pattern starts at step 0).
      steps: T ≥ 1.
      metadata: JSON-serialisable dict.
    """

    kind = "blt"
    parameter_names = ("theta", "omega")

    def __init__(self, theta, omega, *, steps, metadata: Mapping[str, Any] | None = None):
        super().__init__(steps, metadata)
        theta = _array("theta", theta)
        omega = _array("omega", omega)
        if theta.shape != omega.shape:
            raise InvalidMixingMatrixError(f"theta and omega must have the same shape; got {theta.shape}, {omega.shape}.")
        if np.any(theta < 0) or np.any(theta >= 1):
            raise InvalidMixingMatrixError(f"every theta must lie in [0, 1); got {theta.tolist()}.")
        if np.any(omega < 0):
            raise InvalidMixingMatrixError(f"every omega must be >= 0; got {omega.tolist()}.")
        self._theta, self._omega = theta, omega
        self._raw_norm = float(np.linalg.norm(_blt_column(theta, omega, self._steps)))

    @property
    def theta(self) -> np.ndarray:
        return self._theta

    @property
    def omega(self) -> np.ndarray:
        return self._omega

    @property
    def bands(self) -> int:
        """C is full lower-triangular: T."""
        return self._steps

    def _parameters(self):
        return {"theta": self._theta, "omega": self._omega}

    def first_column(self):
        return _blt_column(self._theta, self._omega, self._steps) / self._raw_norm

    def stream(self):
        return BLTStream(self._omega, self._theta, steps=self._steps, scale=self._raw_norm)


def bisr_coefficients(bands: int) -> np.ndarray:
    """The first p coefficients of (1 − x)^{1/2}: f_0 = 1, f_k = f_{k−1}·(k − 3/2)/k."""
    return binomial_coefficients(0.5, check_int("bands", bands, minimum=1))


class BISRMixing(ToeplitzFamily):
    """Banded inverse square root (BISR): C⁻¹ is the p-banded Toeplitz matrix whose
    first column holds the first p coefficients of (1 − x)^{1/2}, scaled so that C's
    first column has norm 1. Closed form: no optimisation.

    Args:
      inverse_coefficients: f, shape (p,), the first column of C⁻¹ up to scale; f_0 > 0.
        :meth:`closed_form` gives the BISR choice.
      steps: T ≥ p.
      metadata: JSON-serialisable dict.

    C = (C⁻¹)⁻¹ is full lower-triangular Toeplitz; its coefficients must be ≥ 0 (true
    for BISR; checked), so the worst participation pattern starts at step 0.
    """

    kind = "bisr"
    parameter_names = ("inverse_coefficients",)

    def __init__(self, inverse_coefficients, *, steps, metadata: Mapping[str, Any] | None = None):
        super().__init__(steps, metadata)
        f = _array("inverse_coefficients", inverse_coefficients)
        if f.shape[0] > self._steps:
            raise InvalidMixingMatrixError(f"bands ({f.shape[0]}) cannot exceed steps ({self._steps}).")
        if f[0] <= 0:
            raise InvalidMixingMatrixError(f"inverse_coefficients[0] must be > 0; got {f[0]}.")
        impulse = np.zeros(self._steps)
        impulse[0] = 1.0
        raw = scipy.signal.lfilter([1.0], f, impulse)  # first column of (C⁻¹)⁻¹
        if np.any(raw < -1e-12 * abs(raw[0])):
            raise InvalidMixingMatrixError("C = inverse of the given banded C⁻¹ has negative coefficients; "
                                           "the sensitivity of several participations is not covered.")
        self._f = f
        self._raw_norm = float(np.linalg.norm(raw))
        self._column = np.clip(raw, 0.0, None) / self._raw_norm

    @classmethod
    def closed_form(cls, *, steps, bands, metadata=None) -> "BISRMixing":
        """The BISR strategy with p = ``bands`` coefficients of (1 − x)^{1/2}."""
        meta = {"objective": "bisr", "strategy": "bisr", "steps": int(steps), "bands": int(bands)}
        meta.update(metadata or {})
        return cls(bisr_coefficients(bands), steps=steps, metadata=meta)

    @property
    def bands(self) -> int:
        """C is full lower-triangular: T (C⁻¹ has p = ``inverse_bands`` bands)."""
        return self._steps

    @property
    def inverse_bands(self) -> int:
        return self._f.shape[0]

    @property
    def inverse_coefficients(self) -> np.ndarray:
        return self._f

    def _parameters(self):
        return {"inverse_coefficients": self._f}

    def first_column(self):
        return self._column.copy()

    def stream(self):
        return FIRStream(self._f * self._raw_norm, steps=self._steps)
