"""Toeplitz-family mixing strategies: banded Toeplitz, BLT and BISR.

numpy/scipy only. A *strategy* is a lower-triangular T×T mixing matrix C with a
cheap online noise recurrence (``keras_noisecurve.mixing.stream``). Four kinds exist:

============  =====================================  ==================  ===================
kind          C                                      noise state         parameters
============  =====================================  ==================  ===================
``banded``    b-banded, any entries (``MixingMatrix``)  b − 1 buffers     T·b
``toeplitz``  b-banded Toeplitz, ``C[t, s] = c_{t−s}``  b − 1 buffers     b
``blt``       Toeplitz, c_k = α·Σ_i ω_i θ_i^{k−1}       d buffers         2d
``bisr``      C⁻¹ p-banded Toeplitz, (1 − x)^{1/2}      p − 1 buffers     none (closed form)
============  =====================================  ==================  ===================

Normalisation: every strategy's largest column norm is exactly 1 (column 0 for the
Toeplitz kinds; later columns are truncated copies and have norm ≤ 1), so one
participation has L2 sensitivity 1 and the optimizer's noise ``ζ·σ·z̃`` has the noise
multiplier σ that the accountant sees. ``sensitivity(participations=k,
separation=s)`` gives the L2 sensitivity of k participations s steps apart:
``√k`` for the banded kinds when s ≥ b (their columns do not overlap), and
``‖Σ_{i<k} C[:, i·s]‖`` for BLT and BISR, whose coefficients are non-negative so the
first start (p = 0) is the worst (a later start only truncates non-negative terms).

Files: ``save`` writes ``.npz`` without pickle, with the parameters, a JSON metadata
string and a SHA-256 digest; ``keras_noisecurve.mixing.load_mixing`` reads every kind
and re-validates it.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping

import numpy as np
import scipy.signal

from keras_noisecurve._npz import one_line, read_npz
from keras_noisecurve._validation import check_int
from keras_noisecurve.mixing.errors import COLUMN_NORM_TOLERANCE, InvalidMixingMatrixError
from keras_noisecurve.mixing.kernels import binomial_coefficients
from keras_noisecurve.mixing.stream import NoiseStream, stream_apply
from keras_noisecurve.mixing.toeplitz_loss import participation_sensitivity

__all__ = [
    "STRATEGIES",
    "BISRMixing",
    "BLTMixing",
    "ToeplitzMixing",
    "bisr_coefficients",
    "strategy_from_fields",
]

#: The kinds of mixing strategy (``MixingMatrix`` is ``"banded"``).
STRATEGIES = ("banded", "toeplitz", "blt", "bisr")

STRATEGY_FORMAT = "keras-noisecurve/mixing-strategy"
STRATEGY_FORMAT_VERSION = 1


def _array(name, value, *, ndim=1):
    arr = np.array(value, dtype=np.float64, copy=True)
    if arr.ndim != ndim or arr.size == 0:
        raise InvalidMixingMatrixError(f"{name} must be a non-empty {ndim}-d array, got shape {arr.shape}.")
    if not np.all(np.isfinite(arr)):
        raise InvalidMixingMatrixError(f"{name} must be finite; got {arr.tolist()[:8]}.")
    arr.setflags(write=False)
    return arr


class _ToeplitzFamily:
    """Shared behaviour of the Toeplitz kinds: first column, dense form, files, sensitivity."""

    kind = ""
    banded = False  # True when C is b-banded (b − 1 below the diagonal) with b < T possible

    def __init__(self, steps, metadata):
        self._steps = check_int("steps", steps, minimum=1)
        self._metadata = dict(metadata or {})
        json.dumps(self._metadata)

    # ------------------------------------------------------------- subclass API
    def _parameters(self) -> dict:  # name -> float64 array, saved verbatim
        raise NotImplementedError

    def first_column(self) -> np.ndarray:
        """C[:, 0], shape (T,): the Toeplitz coefficients c_0 … c_{T−1} (norm 1)."""
        raise NotImplementedError

    def stream(self) -> NoiseStream:
        """The online recurrence (``keras_noisecurve.mixing.stream``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ basics
    @property
    def steps(self) -> int:
        """Number of steps T."""
        return self._steps

    @property
    def buffers(self) -> int:
        """Noise-state arrays the size of the model that the optimizer keeps."""
        return self.stream().buffers

    @property
    def metadata(self) -> dict:
        return json.loads(json.dumps(self._metadata))

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

    def max_column_norm(self) -> float:
        return float(np.linalg.norm(self.first_column()))

    def inverse_apply(self, z) -> np.ndarray:
        """z̃ = C⁻¹z by the online recurrence (``stream_apply``); z of shape (T', …)."""
        return stream_apply(self.stream(), z)

    def sensitivity(self, *, participations: int = 1, separation: int | None = None) -> float:
        """L2 sensitivity of ``participations`` = k participations ``separation`` steps apart.

        k = 1: the largest column norm (1). Banded kinds with separation ≥ b: √k (the
        participations' columns do not overlap). Otherwise ‖Σ_{i<k} C[:, i·s]‖ (the
        coefficients are non-negative, so start 0 is the worst start).
        """
        k = check_int("participations", participations, minimum=1)
        if k == 1:
            return self.max_column_norm()
        s = check_int("separation", separation, minimum=1)
        if self.banded and s >= self.bands:
            return float(np.sqrt(k)) * self.max_column_norm()
        col = self.first_column()
        if np.any(col < 0):
            raise ValueError(
                f"the {self.kind} C has negative coefficients, so the worst participation pattern is not "
                f"known in closed form; refusing to account for {k} participations {s} steps apart."
            )
        return float(np.sqrt(participation_sensitivity(col, participations=k, separation=s, gradient=False)[0]))

    def digest(self) -> str:
        h = hashlib.sha256(self.kind.encode())
        h.update(np.asarray([self._steps], dtype=np.int64).tobytes())
        for name, value in sorted(self._parameters().items()):
            h.update(name.encode())
            h.update(np.ascontiguousarray(value, dtype=np.float64).tobytes())
        return h.hexdigest()

    def to_config(self) -> dict:
        """A JSON-serialisable dict that ``load_mixing`` turns back into this strategy."""
        cfg = {"kind": self.kind, "steps": self._steps, "metadata": self.metadata}
        cfg.update({k: np.asarray(v).tolist() for k, v in self._parameters().items()})
        return cfg

    def save(self, path: str | os.PathLike) -> None:
        """Write ``.npz`` (no pickle): kind, steps, parameters, metadata JSON, digest."""
        with open(path, "wb") as f:
            np.savez(f, format=np.array(STRATEGY_FORMAT), format_version=np.array(STRATEGY_FORMAT_VERSION),
                     kind=np.array(self.kind), steps=np.array(self._steps),
                     metadata=np.array(json.dumps(self._metadata, sort_keys=True)),
                     digest=np.array(self.digest()),
                     **{f"param_{k}": v for k, v in self._parameters().items()})

    def __eq__(self, other):
        if not isinstance(other, _ToeplitzFamily):
            return NotImplemented
        if other.kind != self.kind or other.steps != self.steps:
            return False
        mine, theirs = self._parameters(), other._parameters()
        return mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)

    __hash__ = None

    def __repr__(self):
        objective = self._metadata.get("objective", "?")
        return f"{type(self).__name__}(steps={self._steps}, buffers={self.buffers}, objective={objective!r})"


class ToeplitzMixing(_ToeplitzFamily):
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
    banded = True

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
        return NoiseStream("toeplitz", self._steps, self._c)


def _blt_column(theta, omega, steps) -> np.ndarray:
    """Unnormalised BLT column (1, c_1, …, c_{T−1}), c_k = Σ_i ω_i θ_i^{k−1}."""
    col = np.ones(steps)
    if steps > 1:
        powers = theta[None, :] ** np.arange(steps - 1)[:, None]  # (T−1, d)
        col[1:] = powers @ omega
    return col


class BLTMixing(_ToeplitzFamily):
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
        return NoiseStream("blt", self._steps, self._omega, theta=self._theta, scale=self._raw_norm)


def bisr_coefficients(bands: int) -> np.ndarray:
    """The first p coefficients of (1 − x)^{1/2}: f_0 = 1, f_k = f_{k−1}·(k − 3/2)/k."""
    return binomial_coefficients(0.5, check_int("bands", bands, minimum=1))


class BISRMixing(_ToeplitzFamily):
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
        return NoiseStream("fir", self._steps, self._f * self._raw_norm)


_CLASSES = {"toeplitz": (ToeplitzMixing, ("coefficients",)), "blt": (BLTMixing, ("theta", "omega")),
            "bisr": (BISRMixing, ("inverse_coefficients",))}


def strategy_from_fields(kind: str, *, steps, params: Mapping[str, Any], metadata=None):
    """Build a Toeplitz-family strategy from its kind and parameter arrays (validated)."""
    if kind not in _CLASSES:
        raise InvalidMixingMatrixError(f"unknown strategy kind {kind!r}; expected one of {tuple(_CLASSES)}.")
    cls, names = _CLASSES[kind]
    missing = [n for n in names if n not in params]
    if missing:
        raise InvalidMixingMatrixError(f"a {kind} strategy needs {names}; missing {missing}.")
    return cls(*(params[n] for n in names), steps=int(steps), metadata=metadata)


def load_strategy(path) -> _ToeplitzFamily:
    """Read and re-validate a file written by a Toeplitz-family ``save``."""
    try:
        fields = read_npz(path, what="mixing-strategy")
    except ValueError as exc:
        raise InvalidMixingMatrixError(str(exc)) from None
    try:
        return _strategy_from_file_fields(path, fields)
    except InvalidMixingMatrixError:
        raise
    except Exception as exc:  # noqa: BLE001 - a foreign or damaged field: one line naming the file
        raise InvalidMixingMatrixError(f"{path}: a damaged mixing-strategy file ({one_line(exc)}).") from None


def _strategy_from_file_fields(path, fields) -> _ToeplitzFamily:
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
