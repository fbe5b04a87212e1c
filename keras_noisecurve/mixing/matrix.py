"""The ``MixingMatrix`` artifact: a lower-triangular, b-banded C with unit columns.

Convention (docs/design.md#notation): steps t = 0 … T−1, ``C[t, s] = 0`` unless
``0 <= t − s < b``, and every column of C has L2 norm exactly 1 so that
``X = CᵀC`` has unit diagonal (the sensitivity of the factorization is 1 per
participation). C is stored compactly as ``band_values`` of shape (T, b) with
``band_values[t, j] == C[t, t − j]``; entries with ``t − j < 0`` are zero.

The artifact does not depend on a model's layers or shapes: one C serves every
variable. It is saved as ``.npz`` without pickle (metadata as a JSON string; the
fields are listed in docs/design.md#file-formats).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping

import numpy as np

from keras_noisecurve._npz import one_line, read_npz, read_npz_field
from keras_noisecurve._validation import check_int
from keras_noisecurve.mixing.errors import COLUMN_NORM_TOLERANCE, InvalidMixingMatrixError
from keras_noisecurve.mixing.stream import BandedStream
from keras_noisecurve.mixing.strategies_base import Strategy

__all__ = ["COLUMN_NORM_TOLERANCE", "InvalidMixingMatrixError", "MixingMatrix"]

_FORMAT = "keras-noisecurve/mixing-matrix"
_FORMAT_VERSION = 1
#: The fields of a mixing-matrix file (``MixingMatrix.save``); a file with any other is refused unread.
FILE_FIELDS = ("format", "format_version", "band_values", "metadata", "digest")


def _column_norms(band_values: np.ndarray) -> np.ndarray:
    """Column norms of C from its band values, shape (T,).

    Column s holds ``C[s + j, s] = band_values[s + j, j]`` for j < b, s + j < T.
    """
    steps, bands = band_values.shape
    sq = np.zeros(steps)
    for j in range(bands):
        # rows t = j … T−1 contribute to column t − j
        sq[: steps - j] += band_values[j:, j] ** 2
    return np.sqrt(sq)


class MixingMatrix(Strategy):
    """A lower-triangular, b-banded mixing matrix C with unit-norm columns.

    Args:
      band_values: array of shape (T, b), ``band_values[t, j] == C[t, t − j]``.
        Entries ``band_values[t, j]`` with ``j > t`` must be 0.
      metadata: JSON-serialisable dict (objective, learning rate, loss, solver
        statistics, …). Stored verbatim in the file.

    Raises:
      InvalidMixingMatrixError: if C is not finite, has a non-positive diagonal,
        non-zero entries above the first row, or a column norm that differs from 1
        by more than ``COLUMN_NORM_TOLERANCE``. A C that breaks these would
        silently break the privacy accounting, so it is never accepted.
    """

    def __init__(self, band_values, metadata: Mapping[str, Any] | None = None):
        values = np.array(band_values, dtype=np.float64, copy=True)
        if values.ndim != 2:
            raise InvalidMixingMatrixError(
                f"band_values must have shape (steps, bands), got an array of shape {values.shape}."
            )
        steps, bands = values.shape
        if steps < 1 or bands < 1:
            raise InvalidMixingMatrixError(f"band_values must be non-empty, got shape {values.shape}.")
        if bands > steps:
            raise InvalidMixingMatrixError(
                f"bands ({bands}) cannot exceed steps ({steps}): band_values has shape {values.shape}."
            )
        if not np.all(np.isfinite(values)):
            bad = np.argwhere(~np.isfinite(values))[0]
            raise InvalidMixingMatrixError(
                f"band_values must be finite; entry (t={bad[0]}, j={bad[1]}) is {values[tuple(bad)]}."
            )
        for j in range(1, bands):
            upper = values[:j, j]
            if np.any(upper != 0.0):
                t = int(np.flatnonzero(upper)[0])
                raise InvalidMixingMatrixError(
                    f"band_values[{t}, {j}] = {upper[t]} refers to C[{t}, {t - j}], above the first row; it must be 0."
                )
        diag = values[:, 0]
        if np.any(diag <= 0):
            t = int(np.flatnonzero(diag <= 0)[0])
            raise InvalidMixingMatrixError(
                f"C must have a positive diagonal; C[{t}, {t}] = {diag[t]}."
            )
        norms = _column_norms(values)
        dev = np.abs(norms - 1.0)
        if np.any(dev > COLUMN_NORM_TOLERANCE):
            s = int(np.argmax(dev))
            raise InvalidMixingMatrixError(
                f"every column of C must have L2 norm 1 (within {COLUMN_NORM_TOLERANCE:g}); "
                f"column {s} has norm {float(norms[s])!r}. Normalise the columns before building the "
                "artifact: the privacy accounting assumes unit column norms."
            )
        values.setflags(write=False)
        self._band_values = values
        self._metadata = dict(metadata or {})
        # Fail early, not at save time, if the metadata cannot be stored.
        json.dumps(self._metadata)

    #: The strategy kind (``keras_noisecurve.mixing.strategies.STRATEGY_CLASSES``).
    kind = "banded"
    #: C is b-banded: participations at least b steps apart touch disjoint rows.
    banded = True

    # ------------------------------------------------------------------ basics
    @property
    def steps(self) -> int:
        """Number of steps T."""
        return self._band_values.shape[0]

    @property
    def bands(self) -> int:
        """Band width b: ``C[t, s] == 0`` unless ``0 <= t − s < b``."""
        return self._band_values.shape[1]

    @property
    def band_values(self) -> np.ndarray:
        """Read-only (T, b) array with ``band_values[t, j] == C[t, t − j]``."""
        return self._band_values

    @property
    def metadata(self) -> dict:
        """The artifact's metadata (a copy; edit it through ``with_metadata``)."""
        return json.loads(json.dumps(self._metadata))

    def with_metadata(self, **updates) -> "MixingMatrix":
        """A new artifact with the same C and ``metadata`` updated by ``updates``."""
        meta = dict(self._metadata)
        meta.update(updates)
        return MixingMatrix(self._band_values, meta)

    def to_dense(self) -> np.ndarray:
        """The dense (T, T) lower-triangular matrix C (float64)."""
        steps, bands = self._band_values.shape
        dense = np.zeros((steps, steps))
        rows = np.arange(steps)
        for j in range(bands):
            dense[rows[j:], rows[j:] - j] = self._band_values[j:, j]
        return dense

    def column_norms(self) -> np.ndarray:
        """L2 norms of the columns of C, shape (T,). All 1 for a valid artifact."""
        return _column_norms(self._band_values)

    def leading_column_norm(self, steps: int) -> float:
        """Largest column norm of the leading ``steps``×``steps`` block of C."""
        return float(_column_norms(self._band_values[:steps]).max())

    def stream(self) -> BandedStream:
        """The online recurrence ``z̃_t = (z_t − Σ_{j=1}^{b−1} C[t, t−j] · z̃_{t−j}) / C[t, t]``
        (``keras_noisecurve.mixing.stream.BandedStream``; ``inverse_apply`` runs it in numpy)."""
        return BandedStream(self._band_values)

    def _identity_key(self):
        return (self._band_values,)

    def to_config(self) -> dict:
        """A JSON-serialisable dict that ``load_mixing`` turns back into this matrix."""
        return {"band_values": self._band_values.tolist(), "metadata": self.metadata}

    def digest(self) -> str:
        """SHA-256 of the band values (shape + float64 bytes), hex."""
        h = hashlib.sha256()
        h.update(np.asarray(self._band_values.shape, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(self._band_values).tobytes())
        return h.hexdigest()

    # ------------------------------------------------------------ constructors
    @classmethod
    def identity(cls, steps: int) -> "MixingMatrix":
        """C = I (b = 1): independent noise, i.e. DP-SGD."""
        steps = check_int("steps", steps, minimum=1)
        return cls(np.ones((steps, 1)), {"objective": "dpsgd", "steps": steps, "bands": 1})

    @classmethod
    def from_dense(cls, dense, *, bands: int | None = None, metadata=None) -> "MixingMatrix":
        """Build from a dense (T, T) lower-triangular C.

        Args:
          dense: (T, T) array. Entries outside the band must be exactly 0.
          bands: band width; inferred as the smallest b holding every non-zero if None.
        """
        dense = np.asarray(dense, dtype=np.float64)
        if dense.ndim != 2 or dense.shape[0] != dense.shape[1]:
            raise InvalidMixingMatrixError(f"C must be square, got shape {dense.shape}.")
        steps = dense.shape[0]
        offsets = np.subtract.outer(np.arange(steps), np.arange(steps))  # t − s
        if np.any(dense[offsets < 0] != 0):
            raise InvalidMixingMatrixError("C must be lower triangular; it has non-zeros above the diagonal.")
        nz = offsets[dense != 0]
        needed = int(nz.max()) + 1 if nz.size else 1
        if bands is None:
            bands = needed
        bands = check_int("bands", bands, minimum=1, maximum=steps)
        if needed > bands:
            raise InvalidMixingMatrixError(
                f"C has non-zeros {needed - 1} below the diagonal, outside a band of width {bands}."
            )
        values = np.zeros((steps, bands))
        rows = np.arange(steps)
        for j in range(bands):
            values[j:, j] = dense[rows[j:], rows[j:] - j]
        return cls(values, metadata)

    # -------------------------------------------------------------------- I/O
    def save(self, path: str | os.PathLike) -> None:
        """Write the artifact as ``.npz`` (no pickle). Overwrites ``path``."""
        with open(path, "wb") as f:
            np.savez(
                f,
                format=np.array(_FORMAT),
                format_version=np.array(_FORMAT_VERSION),
                band_values=self._band_values,
                metadata=np.array(json.dumps(self._metadata, sort_keys=True)),
                digest=np.array(self.digest()),
            )

    @classmethod
    def load(cls, path: str | os.PathLike) -> "MixingMatrix":
        """Read and re-validate an artifact written by ``save``.

        Raises:
          InvalidMixingMatrixError: if the file is not a mixing-matrix artifact, its
            digest does not match its values, or C breaks a constraint.
        """
        try:
            fields = read_npz(path, what="mixing-matrix", fields=FILE_FIELDS)
        except ValueError as exc:
            raise InvalidMixingMatrixError(str(exc)) from None
        try:
            return cls._from_fields(path, fields)
        except InvalidMixingMatrixError:
            raise
        except Exception as exc:  # noqa: BLE001 - a foreign or damaged field: one line naming the file
            raise InvalidMixingMatrixError(f"{path}: a damaged mixing-matrix file ({one_line(exc)}).") from None

    @classmethod
    def _from_fields(cls, path, fields):
        if fields.get("format") is None or str(fields["format"]) != _FORMAT:
            raise InvalidMixingMatrixError(f"{path}: not a keras-noisecurve mixing-matrix file.")
        version = int(fields.get("format_version", -1))
        if version != _FORMAT_VERSION:
            raise InvalidMixingMatrixError(
                f"{path}: format version {version} is not supported (this library reads {_FORMAT_VERSION})."
            )
        for key in ("band_values", "metadata", "digest"):
            if key not in fields:
                raise InvalidMixingMatrixError(f"{path}: missing field {key!r}.")
        matrix = cls(fields["band_values"], json.loads(str(fields["metadata"])))
        if matrix.digest() != str(fields["digest"]):
            raise InvalidMixingMatrixError(
                f"{path}: the stored digest does not match the band values; the file was modified."
            )
        return matrix

    def __repr__(self) -> str:
        objective = self._metadata.get("objective", "?")
        return f"MixingMatrix(steps={self.steps}, bands={self.bands}, objective={objective!r})"


def _file_format(path) -> str:
    """The ``format`` field of an ``.npz`` file ('' when there is none or it is unreadable);
    the other fields are left unread."""
    try:
        value = read_npz_field(path, "format", what="mixing")
        return "" if value is None else str(value)
    except Exception:  # noqa: BLE001 - unreadable: MixingMatrix.load then says why, in one line
        return ""
