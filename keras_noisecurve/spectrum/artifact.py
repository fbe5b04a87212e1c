"""The ``Spectrum`` artifact: eigenvalues of a Hessian upper bound, compressed.

numpy only (no TensorFlow), so the mixing-matrix solver can consume it cheaply.

A spectrum is stored as K distinct (eigenvalue, multiplicity) pairs; the
curvature workload of the solver costs O(K·T) from them (a Hankel matrix, see
docs/design.md#notation). The
multiplicities may be non-integer where a fitted tail spreads mass (paper eq. 3);
they must be positive and finite.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping

import numpy as np

_FORMAT = "keras-noisecurve/spectrum"
_FORMAT_VERSION = 1


class Spectrum:
    """Eigenvalues μ_i ≥ 0 of a Hessian upper bound Ĥ with multiplicities m_i.

    Args:
      eigenvalues: 1-D array of eigenvalues (any order). Negative values are
        clamped to 0 (an upper bound has no use for negative curvature, paper §4.1)
        and the number clamped is recorded in ``metadata["clamped_negative"]``.
      multiplicities: 1-D array of positive weights, same length; default all 1.
      dimension: the number of parameters p the spectrum describes. Defaults to
        ``sum(multiplicities)``; if larger, the missing ``p − Σm`` eigenvalues are
        taken to be 0 (they contribute nothing to the NoiseCurve workload).
      metadata: JSON-serialisable provenance (model, data, method, fit quality, …).

    Attributes:
      eigenvalues: (K,) float64, distinct values, descending.
      multiplicities: (K,) float64, positive.
      dimension: int p.
    """

    def __init__(self, eigenvalues, multiplicities=None, dimension=None, metadata: Mapping[str, Any] | None = None):
        values = np.asarray(eigenvalues, dtype=np.float64).reshape(-1)
        if values.size == 0:
            raise ValueError("eigenvalues must contain at least one value, got an empty array.")
        if not np.all(np.isfinite(values)):
            raise ValueError(f"eigenvalues must be finite; got {values[~np.isfinite(values)][:5]}.")
        if multiplicities is None:
            mult = np.ones_like(values)
        else:
            mult = np.asarray(multiplicities, dtype=np.float64).reshape(-1)
            if mult.shape != values.shape:
                raise ValueError(
                    f"multiplicities must have the same length as eigenvalues ({values.size}), got {mult.size}."
                )
            if not np.all(np.isfinite(mult)) or np.any(mult <= 0):
                raise ValueError("multiplicities must be finite and > 0.")
        meta = dict(metadata or {})
        clamped = int(np.count_nonzero(values < 0))
        if clamped:
            meta["clamped_negative"] = meta.get("clamped_negative", 0) + clamped
            values = np.maximum(values, 0.0)
        # Merge equal values, sort descending.
        uniq, inverse = np.unique(values, return_inverse=True)
        merged = np.zeros(uniq.shape)
        np.add.at(merged, inverse, mult)
        order = np.argsort(-uniq, kind="stable")
        self._eigenvalues = uniq[order]
        self._multiplicities = merged[order]
        self._eigenvalues.setflags(write=False)
        self._multiplicities.setflags(write=False)
        total = float(self._multiplicities.sum())
        if dimension is None:
            dimension = int(round(total))
        else:
            dimension = int(dimension)
            if dimension < total - 1e-6 * max(1.0, total):
                raise ValueError(
                    f"dimension ({dimension}) is smaller than the total multiplicity ({total:g})."
                )
        self._dimension = dimension
        self._metadata = meta
        json.dumps(self._metadata)

    @property
    def eigenvalues(self) -> np.ndarray:
        """(K,) distinct eigenvalues, descending, float64, all ≥ 0."""
        return self._eigenvalues

    @property
    def multiplicities(self) -> np.ndarray:
        """(K,) positive multiplicities aligned with ``eigenvalues``."""
        return self._multiplicities

    @property
    def dimension(self) -> int:
        """Number of parameters p."""
        return self._dimension

    @property
    def metadata(self) -> dict:
        """Provenance metadata (a copy)."""
        return json.loads(json.dumps(self._metadata))

    @property
    def max_eigenvalue(self) -> float:
        """μ_max, the largest eigenvalue."""
        return float(self._eigenvalues[0])

    def trace(self) -> float:
        """Σ m_i μ_i = Tr(Ĥ)."""
        return float(np.dot(self._eigenvalues, self._multiplicities))

    def expanded(self) -> np.ndarray:
        """All eigenvalues with integer multiplicities, descending (needs integer m_i)."""
        mult = self._multiplicities
        if not np.allclose(mult, np.round(mult)):
            raise ValueError("expanded() needs integer multiplicities; this spectrum has fractional ones.")
        return np.repeat(self._eigenvalues, np.round(mult).astype(np.int64))

    def scaled(self, factor: float) -> "Spectrum":
        """A spectrum with every eigenvalue multiplied by ``factor`` > 0 (same multiplicities).

        Used for clipping-aware curvature: with per-example clipping the mean clipped
        gradient is ≈ s·∇L, so GD sees s·H (``clipping_scale``). The factor is recorded in
        ``metadata["scale_factors"]`` (a list, in order of application).
        """
        if isinstance(factor, bool) or not isinstance(factor, (int, float, np.integer, np.floating)):
            raise TypeError(f"factor must be a real number, got {factor!r} ({type(factor).__name__}).")
        factor = float(factor)
        if not np.isfinite(factor) or factor <= 0:
            raise ValueError(f"factor must be finite and > 0, got {factor}.")
        meta = self.metadata
        meta["scale_factors"] = list(meta.get("scale_factors", [])) + [factor]
        return Spectrum(self._eigenvalues * factor, self._multiplicities, self._dimension, meta)

    def tail_info(self) -> dict | None:
        """Summary of the fitted tail (paper eq. 3), or ``None`` when there is none.

        Returns a dict with the fit (``C``, ``alpha``, ``p_plus``, ``mu_min``, ``k``,
        ``r2``, ``max_log_residual``, ``bins``, ``first_index``) plus ``tail_mass``
        (Σ multiplicities of the tail bins) and ``tail_trace_fraction``
        (the tail's share of Tr Ĥ), all from the metadata and the stored pairs.
        """
        tail = self._metadata.get("tail")
        if not tail:
            return None
        info = dict(tail)
        first = int(tail.get("first_index", 0))
        # Tail pairs are the ones beyond the first (first_index − 1) unit-multiplicity values.
        cum = np.cumsum(self._multiplicities)
        in_tail = cum > first - 1 + 1e-9
        info["tail_mass"] = float(self._multiplicities[in_tail].sum())
        total = self.trace()
        info["tail_trace_fraction"] = (
            float(np.dot(self._eigenvalues[in_tail], self._multiplicities[in_tail]) / total) if total > 0 else 0.0
        )
        return info

    def digest(self) -> str:
        """SHA-256 of (eigenvalues, multiplicities, dimension), hex."""
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(self._eigenvalues).tobytes())
        h.update(np.ascontiguousarray(self._multiplicities).tobytes())
        h.update(np.int64(self._dimension).tobytes())
        return h.hexdigest()

    def save(self, path: str | os.PathLike) -> None:
        """Write as ``.npz`` without pickle (fields: docs/design.md#file-formats)."""
        with open(path, "wb") as f:
            np.savez(
                f,
                format=np.array(_FORMAT),
                format_version=np.array(_FORMAT_VERSION),
                eigenvalues=self._eigenvalues,
                multiplicities=self._multiplicities,
                dimension=np.array(self._dimension),
                metadata=np.array(json.dumps(self._metadata, sort_keys=True)),
            )

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Spectrum":
        """Read a file written by ``save``; raises ``ValueError`` for anything else.

        The fields (docs/design.md#file-formats) are read without pickle and
        re-validated by the constructor.
        """
        from keras_noisecurve._npz import one_line, read_npz

        fields = read_npz(path, what="spectrum", fields=(
            "format", "format_version", "eigenvalues", "multiplicities", "dimension", "metadata"))
        try:
            return cls._from_fields(path, fields)
        except Exception as exc:  # noqa: BLE001 - a foreign or damaged field: one line naming the file
            message = one_line(exc)
            if not message.startswith(os.fspath(path)):
                message = f"{os.fspath(path)}: a damaged spectrum file ({message})."
            raise ValueError(message) from None

    @classmethod
    def _from_fields(cls, path, fields):
        if str(fields.get("format", "")) != _FORMAT:
            raise ValueError(f"{path}: not a keras-noisecurve spectrum file.")
        if int(fields.get("format_version", -1)) != _FORMAT_VERSION:
            raise ValueError(f"{path}: unsupported spectrum format version {fields.get('format_version')}.")
        for key in ("eigenvalues", "multiplicities", "dimension", "metadata"):
            if key not in fields:
                raise ValueError(f"{path}: missing field {key!r}.")
        return cls(
            fields["eigenvalues"],
            fields["multiplicities"],
            int(fields["dimension"]),
            json.loads(str(fields["metadata"])),
        )

    def __repr__(self) -> str:
        return (
            f"Spectrum(distinct={self._eigenvalues.size}, dimension={self._dimension}, "
            f"max={self.max_eigenvalue:.4g}, trace={self.trace():.4g})"
        )
