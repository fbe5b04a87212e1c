"""The online noise recurrences z̃ = C⁻¹z of every strategy: one spec, one numpy reference.

numpy only. A :class:`NoiseStream` is everything an online noise generator needs to
produce z̃_t from the fresh draw z_t and a state of ``buffers`` arrays the size of a
model variable; :func:`stream_apply` runs it in numpy (the reference the TensorFlow
generator in ``keras_noisecurve.training.noise`` is tested against, draw for draw).

The four recurrences (steps t = 0 … T−1, state initialised to zeros):

``"banded"`` — a b-banded lower-triangular C with rows ``V[t] = (C[t,t], …, C[t,t−b+1])``::

    z̃_t = (z_t − Σ_{j=1}^{b−1} V[t, j] · z̃_{t−j}) / V[t, 0]

  state: the last b − 1 values z̃ (a ring buffer).
``"toeplitz"`` — the same with constant rows ``V[t] = c`` (b coefficients); state as banded.
``"fir"`` — C⁻¹ is a p-banded Toeplitz matrix with first column ``f``::

    z̃_t = Σ_{j=0}^{p−1} f_j · z_{t−j}

  state: the last p − 1 draws z (not z̃).
``"blt"`` — C = α·Toeplitz(1, c₁, c₂, …) with c_k = Σ_i ω_i θ_i^{k−1} (d buffers)::

    y_t = z_t − Σ_i ω_i S_i,    z̃_t = y_t / α,    S_i ← θ_i S_i + y_t

  state: the d accumulators S_i = Σ_{k≥1} θ_i^{k−1} y_{t−k}.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

__all__ = ["NoiseStream", "STREAM_KINDS", "stream_apply"]

STREAM_KINDS = ("banded", "toeplitz", "fir", "blt")


@dataclasses.dataclass(frozen=True, eq=False)
class NoiseStream:
    """The online recurrence of one strategy (see the module docstring).

    Attributes:
      kind: one of ``STREAM_KINDS``.
      steps: T, the number of steps the recurrence is defined for.
      coefficients: ``"banded"``: the (T, b) table V; ``"toeplitz"``: c, shape (b,);
        ``"fir"``: f, shape (p,); ``"blt"``: ω, shape (d,).
      theta: θ, shape (d,) for ``"blt"``; None otherwise.
      scale: 1/α for ``"blt"`` (z̃_t = y_t · scale); 1.0 otherwise.
    """

    kind: str
    steps: int
    coefficients: np.ndarray
    theta: Optional[np.ndarray] = None
    scale: float = 1.0

    @property
    def buffers(self) -> int:
        """Number of state arrays the size of the noise (of a model variable)."""
        if self.kind == "banded":
            return self.coefficients.shape[1] - 1
        if self.kind in ("toeplitz", "fir"):
            return self.coefficients.shape[0] - 1
        return self.coefficients.shape[0]

    def state_bytes(self, num_parameters: int, dtype_size: int = 4) -> int:
        """Bytes of noise state for a model of ``num_parameters`` (float32 by default)."""
        return int(self.buffers) * int(num_parameters) * int(dtype_size)


def stream_apply(stream: NoiseStream, z) -> np.ndarray:
    """z̃ = C⁻¹z by the online recurrence of ``stream`` (float64 numpy reference).

    Args:
      stream: a ``NoiseStream``.
      z: array of shape (T', ...) with T' ≤ ``stream.steps``; row t is the draw z_t.

    Returns:
      array of the same shape: row t is z̃_t. Cost O(T'·buffers·p), memory O(T'·p).
    """
    z = np.asarray(z, dtype=np.float64)
    if z.ndim < 1 or z.shape[0] > stream.steps:
        raise ValueError(f"z must have at most {stream.steps} rows (one per step), got shape {z.shape}.")
    steps = z.shape[0]
    out = np.empty_like(z)
    if stream.kind in ("banded", "toeplitz"):
        table = stream.coefficients
        width = table.shape[-1]
        for t in range(steps):
            row = table[t] if stream.kind == "banded" else table
            acc = z[t].copy()
            for j in range(1, min(width, t + 1)):
                acc -= row[j] * out[t - j]
            out[t] = acc / row[0]
    elif stream.kind == "fir":
        f = stream.coefficients
        for t in range(steps):
            acc = f[0] * z[t]
            for j in range(1, min(f.shape[0], t + 1)):
                acc = acc + f[j] * z[t - j]
            out[t] = acc
    elif stream.kind == "blt":
        omega, theta = stream.coefficients, stream.theta
        state = np.zeros((omega.shape[0],) + z.shape[1:])
        shape = (-1,) + (1,) * (z.ndim - 1)
        for t in range(steps):
            y = z[t] - np.tensordot(omega, state, axes=1)
            out[t] = y * stream.scale
            state = theta.reshape(shape) * state + y[None]
    else:
        raise ValueError(f"unknown stream kind {stream.kind!r}; expected one of {STREAM_KINDS}.")
    return out
