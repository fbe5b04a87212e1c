"""The online noise recurrences z̃ = C⁻¹z of every strategy, written once.

numpy only. A :class:`NoiseStream` is one strategy's recurrence: ``init`` (the state
shape), ``coefficients`` (what every variable of step t shares) and ``next`` (z̃_t from
the fresh draw z_t and the state, and how the state changes). Each is written once
against a tiny array namespace ``xp`` (:class:`NumpyOps` here; the TensorFlow one is in
``keras_noisecurve.training.noise``), so the float64 numpy reference
:func:`stream_apply` and the optimizer's TensorFlow generator run the same code.

The recurrences (steps t = 0 … T−1, state initialised to zeros):

:class:`BandedStream` — a b-banded lower-triangular C with rows ``V[t] = (C[t,t], …, C[t,t−b+1])``::

    z̃_t = (z_t − Σ_{j=1}^{b−1} V[t, j] · z̃_{t−j}) / V[t, 0]

  state: the last b − 1 values z̃ (a ring: slot ``t mod (b − 1)`` receives z̃_t).
:class:`ToeplitzStream` — the same with constant rows ``V[t] = c`` (b coefficients).
:class:`FIRStream` — C⁻¹ is a p-banded Toeplitz matrix with first column ``f``::

    z̃_t = Σ_{j=0}^{p−1} f_j · z_{t−j}

  state: the last p − 1 draws z (not z̃), in the same ring slots.
:class:`BLTStream` — C = α·Toeplitz(1, c₁, c₂, …) with c_k = Σ_i ω_i θ_i^{k−1} (d buffers)::

    y_t = z_t − Σ_i ω_i S_i,    z̃_t = y_t / α,    S_i ← θ_i S_i + y_t

  state: the d accumulators S_i = Σ_{k≥1} θ_i^{k−1} y_{t−k}.
:class:`IdentityStream` — C = I (DP-SGD): z̃_t = z_t, no state, optionally no step limit.

Each stream also names the in-place step it runs in place (``next_in_place``: the
namespace's ``fused_ring_step`` or ``fused_blt_step``; the TensorFlow namespace
compiles them with XLA) and how a stateless step folds into the draw's scale.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np

__all__ = [
    "BLTStream",
    "BandedStream",
    "FIRStream",
    "IdentityStream",
    "NoiseStream",
    "NumpyOps",
    "StateWrite",
    "StepCoefficients",
    "ToeplitzStream",
    "stream_apply",
]


class StepCoefficients(NamedTuple):
    """What every variable of one step shares (arrays of the namespace, in the noise dtype).

    Attributes:
      lead: the rings' divisor V[t, 0] (banded, toeplitz) or f_0 (fir); BLT's ``scale``
        (1/α). A scalar.
      mix: the coefficients applied to the state, shape (buffers,) (``None`` without
        state): for the rings, the coefficient of SLOT s at step t (V[t, j], c_j or f_j
        with s = (t − j) mod (b − 1)); for BLT, ω.
      theta: θ, shape (d,), for BLT; ``None`` otherwise.
      slot: the ring slot ``t mod (b − 1)`` that receives this step's value (int32
        scalar); ``None`` for BLT and without state.
    """

    lead: Any
    mix: Optional[Any] = None
    theta: Optional[Any] = None
    slot: Optional[Any] = None


class StateWrite(NamedTuple):
    """How one step changes a variable's noise state.

    ``slot`` not ``None`` (rings): write ``value`` (the variable's shape) into
    ``state[slot]`` only. ``slot`` ``None`` (BLT): ``value`` is the whole new state.
    """

    slot: Optional[Any]
    value: Any


class NumpyOps:
    """The array namespace of the numpy reference (float64 by default)."""

    float64 = np.float64

    @staticmethod
    def constant(value, dtype):
        return np.asarray(value, dtype=dtype)

    @staticmethod
    def gather(table, index):
        return table[int(index)]

    @staticmethod
    def slot(step, buffers):
        return int(step) % buffers

    @staticmethod
    def slot_coefficients(tail, step, buffers):
        """(m,) vector whose entry s = (t − j) mod m is ``tail[j − 1]``, j = 1 … m."""
        mix = np.zeros(buffers, dtype=tail.dtype)
        mix[(int(step) - np.arange(1, buffers + 1)) % buffers] = tail
        return mix

    @staticmethod
    def tensordot(vector, state):
        return np.tensordot(vector, state, axes=1)

    @staticmethod
    def broadcast(vector, rank):
        return np.reshape(vector, (-1,) + (1,) * rank)

    @staticmethod
    def rank(x):
        return np.ndim(x)

    @staticmethod
    def expand(x):
        return np.asarray(x)[None]

    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, dtype=dtype)

    @staticmethod
    def write_slot(state, slot, value):
        """A copy of ``state`` with ``state[slot] = value``."""
        new = np.array(state, copy=True)
        new[slot] = value
        return new


class NoiseStream:
    """The online recurrence of one strategy (see the module docstring).

    Attributes:
      kind: a label for messages (``"banded"``, ``"toeplitz"``, ``"fir"``, ``"blt"``,
        ``"identity"``); no code branches on it.
      steps: T, the number of steps the recurrence is defined for (``None``: no limit).
      buffers: state arrays the size of a model variable.
      bands: width of the coefficient row (b; p for FIR; 1 without state); T for BLT.
      state_name: the suffix of the optimizer's state variables (checkpoint names).
    """

    kind = ""
    state_name = "noise_state"

    def __init__(self, steps: Optional[int]):
        self.steps = None if steps is None else int(steps)

    @property
    def buffers(self) -> int:
        raise NotImplementedError

    @property
    def bands(self) -> int:
        return self.buffers + 1

    def state_bytes(self, num_parameters: int, dtype_size: int = 4) -> int:
        """Bytes of noise state for a model of ``num_parameters`` (float32 by default)."""
        return int(self.buffers) * int(num_parameters) * int(dtype_size)

    def init(self, shape) -> Optional[tuple]:
        """Shape of the state of a variable of ``shape``: (buffers, *shape); ``None`` without state."""
        if self.buffers == 0:
            return None
        return (self.buffers,) + tuple(int(d) for d in shape)

    # ----------------------------------------------------------- the recurrence
    def row(self, step, xp, dtype):
        """The coefficient vector of step t (``None`` when there is none)."""
        raise NotImplementedError

    def coefficients(self, step, xp, dtype) -> Optional[StepCoefficients]:
        """The :class:`StepCoefficients` of step t (``None``: z̃_t = z_t)."""
        raise NotImplementedError

    def next(self, z, state, coefficients, xp):
        """One step: ``(z̃_t, StateWrite or None)`` from z_t, the state and the step's coefficients."""
        raise NotImplementedError

    def next_in_place(self, z, handle, coefficients, factor, xp):
        """One step that writes the state in place through ``handle`` (the namespace's
        fused kernel); returns ``factor · z̃_t``. Streams with state only."""
        raise NotImplementedError

    def fold(self, std, coefficients):
        """``std`` times the factor a stateless step applies to z_t (folded into the draw)."""
        if coefficients is None:
            return std
        if self.buffers != 0:
            raise ValueError(f"a {self.kind} stream with {self.buffers} buffers has state; use advance().")
        return self._fold(std, coefficients.lead)

    def _fold(self, std, lead):
        raise NotImplementedError


class BandedStream(NoiseStream):
    """The ring recurrence of a b-banded C from its (T, b) table V of band values."""

    kind = "banded"
    state_name = "noise_ring"

    def __init__(self, table):
        table = np.asarray(table, dtype=np.float64)
        if table.ndim != 2 or table.shape[0] < 1 or table.shape[1] < 1:
            raise ValueError(f"band_values must have shape (T, b), got {table.shape}.")
        super().__init__(table.shape[0])
        self.table = table

    @property
    def buffers(self) -> int:
        return self.table.shape[-1] - 1

    def row(self, step, xp, dtype):
        return xp.gather(xp.constant(self.table, dtype), step)

    def coefficients(self, step, xp, dtype):
        row = self.row(step, xp, dtype)
        if self.buffers == 0:
            return StepCoefficients(lead=row[0])
        mix = xp.slot_coefficients(row[1:], step, self.buffers)
        return StepCoefficients(lead=row[0], mix=mix, slot=xp.slot(step, self.buffers))

    def next(self, z, state, coefficients, xp):
        if self.buffers == 0:
            return z / coefficients.lead, None
        z_tilde = (z - xp.tensordot(coefficients.mix, state)) / coefficients.lead
        return z_tilde, StateWrite(coefficients.slot, z_tilde)

    def next_in_place(self, z, handle, coefficients, factor, xp):
        return xp.fused_ring_step(z, handle, coefficients.mix, coefficients.lead, coefficients.slot, False, factor)

    def _fold(self, std, lead):
        return std / lead


class ToeplitzStream(BandedStream):
    """The ring recurrence of a b-banded Toeplitz C: the constant row c, shape (b,)."""

    kind = "toeplitz"
    state_name = "noise_state"

    def __init__(self, coefficients, *, steps):
        c = np.asarray(coefficients, dtype=np.float64)
        if c.ndim != 1 or c.shape[0] < 1:
            raise ValueError(f"Toeplitz coefficients must have shape (b,), got {c.shape}.")
        NoiseStream.__init__(self, steps)
        self.table = c

    def row(self, step, xp, dtype):
        return xp.constant(self.table, dtype)


class FIRStream(NoiseStream):
    """A p-banded Toeplitz C⁻¹ with first column f, shape (p,): ring of the last p − 1 draws."""

    kind = "fir"

    def __init__(self, coefficients, *, steps):
        f = np.asarray(coefficients, dtype=np.float64)
        if f.ndim != 1 or f.shape[0] < 1:
            raise ValueError(f"FIR coefficients must have shape (p,), got {f.shape}.")
        super().__init__(steps)
        self.table = f

    @property
    def buffers(self) -> int:
        return self.table.shape[0] - 1

    row = ToeplitzStream.row
    coefficients = BandedStream.coefficients

    def next(self, z, state, coefficients, xp):
        if self.buffers == 0:
            return z * coefficients.lead, None
        return coefficients.lead * z + xp.tensordot(coefficients.mix, state), StateWrite(coefficients.slot, z)

    def next_in_place(self, z, handle, coefficients, factor, xp):
        return xp.fused_ring_step(z, handle, coefficients.mix, coefficients.lead, coefficients.slot, True, factor)

    def _fold(self, std, lead):
        return std * lead


class BLTStream(NoiseStream):
    """d accumulators: ω, θ of shape (d,) and ``scale`` = 1/α (z̃_t = scale · y_t)."""

    kind = "blt"

    def __init__(self, omega, theta, *, steps, scale):
        omega = np.asarray(omega, dtype=np.float64)
        theta = np.asarray(theta, dtype=np.float64)
        if omega.ndim != 1 or omega.shape != theta.shape or omega.shape[0] < 1:
            raise ValueError(f"omega and theta must have the same shape (d,), got {omega.shape} and {theta.shape}.")
        super().__init__(steps)
        self.omega, self.theta, self.scale = omega, theta, float(scale)

    @property
    def buffers(self) -> int:
        return self.omega.shape[0]

    @property
    def bands(self) -> int:
        return self.steps

    def row(self, step, xp, dtype):
        return xp.constant(self.omega, dtype)

    def coefficients(self, step, xp, dtype):
        return StepCoefficients(lead=xp.constant(self.scale, dtype), mix=self.row(step, xp, dtype),
                                theta=xp.constant(self.theta, dtype))

    def next(self, z, state, coefficients, xp):
        y = z - xp.tensordot(coefficients.mix, state)
        theta = xp.broadcast(coefficients.theta, xp.rank(z))
        return y * coefficients.lead, StateWrite(None, theta * state + xp.expand(y))

    def next_in_place(self, z, handle, coefficients, factor, xp):
        return xp.fused_blt_step(z, handle, coefficients.mix, coefficients.theta, coefficients.lead * factor)


class IdentityStream(NoiseStream):
    """C = I: z̃_t = z_t, no state; ``steps`` ``None`` means no step limit (DP-SGD)."""

    kind = "identity"

    @property
    def buffers(self) -> int:
        return 0

    def row(self, step, xp, dtype):
        return None

    def coefficients(self, step, xp, dtype):
        return None

    def next(self, z, state, coefficients, xp):
        return z, None


def apply_write(state, write, xp):
    """The state after a step's ``StateWrite`` (functional: ``state`` is unchanged), in the
    array namespace ``xp``: no write (C = I), the whole state replaced (BLT), or one ring
    slot written (banded, Toeplitz, FIR)."""
    if write is None:
        return state
    if write.slot is None:
        return write.value
    return xp.write_slot(state, write.slot, write.value)


def stream_apply(stream: NoiseStream, z) -> np.ndarray:
    """z̃ = C⁻¹z by the online recurrence of ``stream`` (float64 numpy reference).

    Runs ``stream.init``/``coefficients``/``next`` with :class:`NumpyOps`: the same code
    as the optimizer's TensorFlow generator.

    Args:
      stream: a ``NoiseStream`` (``strategy.stream()``).
      z: array of shape (T', ...) with T' ≤ ``stream.steps``; row t is the draw z_t.

    Returns:
      array of the same shape: row t is z̃_t. Cost O(T'·buffers·p), memory O(T'·p).
    """
    z = np.asarray(z, dtype=np.float64)
    if z.ndim < 1 or (stream.steps is not None and z.shape[0] > stream.steps):
        raise ValueError(f"z must have at most {stream.steps} rows (one per step), got shape {z.shape}.")
    xp = NumpyOps
    shape = stream.init(z.shape[1:])
    state = None if shape is None else xp.zeros(shape, np.float64)
    out = np.empty_like(z)
    for t in range(z.shape[0]):
        coefficients = stream.coefficients(t, xp, np.float64)
        out[t], write = stream.next(z[t], state, coefficients, xp)
        state = apply_write(state, write, xp)
    return out
