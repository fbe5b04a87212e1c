"""Online correlated noise z̃ = C⁻¹z for every mixing strategy (docs/design.md#notation),
shared by the Keras optimizer and the TensorFlow Privacy query, on every Keras backend.

Randomness is counter based: the standard normal draw z_t for variable k is made
from Philox bits keyed by ``seed = fold_in(fold_in(key, t), k)`` (``normal_from_seed``:
Box–Muller on 32-bit uniforms). It depends only on (key, step t, variable index k), so
it is identical on every replica and every backend (TensorFlow's Philox words, bit for
bit, and the same Box–Muller: ``keras_noisecurve.backend.common.philox`` computes them in uint32
arithmetic for JAX), and is reproduced exactly after restoring the key, the step
counter and the noise state from any checkpoint. The generator of the backend in use is
``keras_noisecurve.backend.module("noise")`` (``backend/tensorflow/noise.py``,
``backend/jax/noise.py``); its names (``normal_from_seed``, ``standard_normal``,
``step_seed``, ``variable_seed`` and, on TensorFlow, ``fold_in``, ``fused_ring_step``,
``fused_blt_step``, ``TensorFlowOps``) are importable from this module too. This module
imports no framework itself.

:class:`StreamNoise` runs the recurrence of a ``keras_noisecurve.mixing.stream.NoiseStream``
(``strategy.stream()``): the stream's ``init``/``coefficients``/``next`` are written once
against a tiny array namespace and run here with the backend's (``TensorFlowOps``,
``JaxOps``; the module docstring of ``keras_noisecurve.mixing.stream`` states the
recurrences; ``stream_apply`` runs the same code in float64 numpy, the reference). Each
variable keeps ONE state array of shape ``(buffers, *variable_shape)`` (none when
``buffers == 0``): a ring of the last b − 1 values z̃ (banded, Toeplitz; slot
``t mod (b − 1)``), a ring of the last p − 1 draws (BISR's FIR form), or the d
accumulators of BLT. With no state (b = 1, p = 1, or C = I) z̃_t is z_t times a scalar,
folded into the draw.

On TensorFlow the optimizer runs a step in place (:meth:`StreamNoise.advance_in_place`,
the stream's ``next_in_place``, which picks ``fused_ring_step`` or ``fused_blt_step``): one
XLA-compiled function per variable reads the state once (the Σ over the buffers is one
reduction fused with the rest of the arithmetic) and writes only what changes (a ring
slot, or the BLT accumulators) into the same buffer. The unfused form (:meth:`advance`
and a TensorFlow scatter) is kept as the reference and under ``tf.distribute``; it is
several times slower because a TensorFlow scatter puts the variable in copy-on-read
mode, so that every later read of the state copies all of it (docs/training.md,
"Performance"). On JAX the step is functional: :meth:`StreamNoise.advance` then
:meth:`StreamNoise.apply_write`, fused by ``jax.jit``.
"""

from __future__ import annotations

import secrets
from typing import Optional

import numpy as np

from keras_noisecurve import backend
from keras_noisecurve.backend.common import messages
from keras_noisecurve._validation import check_int
from keras_noisecurve.mixing.stream import (
    BandedStream,
    IdentityStream,
    NoiseStream,
    StateWrite,
    StepCoefficients,
    apply_write,
)
from keras_noisecurve.mixing.strategies import load_mixing

__all__ = [
    "StateWrite",
    "StepCoefficients",
    "StreamNoise",
    "key_from_seed",
    "normal_from_seed",
    "standard_normal",
    "step_seed",
    "variable_seed",
]

_SEED_LIMIT = 2**63 - 1


def key_from_seed(seed=None) -> np.ndarray:
    """The int64 noise key, shape (2,).

    Args:
      seed: ``None`` (default) draws 126 bits from the OS entropy pool
        (``secrets.randbits``): the noise is secret, as DP requires. An integer in
        [0, 2⁶³) gives a fixed key, for tests and reproducibility only: anyone who
        knows the seed can subtract the noise, which voids the privacy guarantee.

    Returns:
      ``np.ndarray`` of dtype int64 and shape (2,).
    """
    if seed is None:
        return np.array([secrets.randbits(63), secrets.randbits(63)], dtype=np.int64)
    seed = check_int("seed", seed, minimum=0, maximum=_SEED_LIMIT, secret=True)
    # A fixed, documented mixing of the seed into two words (no secret here).
    return np.array([seed, 0x5EED_C0DE], dtype=np.int64)


class StreamNoise:
    """The online recurrence z̃ = C⁻¹z of any ``NoiseStream``, run with a backend's arrays.

    The recurrence itself is the stream's (``init``/``coefficients``/``next``, written
    once in ``keras_noisecurve.mixing.stream`` and run here with the array namespace
    ``ops``: ``TensorFlowOps`` or ``JaxOps``); this class adds the plan limit, the state
    and, on TensorFlow, the fused in-place step on a state variable.

    Args:
      stream: a ``keras_noisecurve.mixing.stream.NoiseStream`` (``strategy.stream()``);
        an array (T, b) of band values ``band_values[t, j] == C[t, t − j]`` (a
        ``MixingMatrix.band_values``; a ``BandedStream``); or ``None`` for
        independent noise with no step limit (DP-SGD, C = I of unbounded size).
      fused: ``True`` (default): :meth:`advance_in_place` runs the XLA-compiled
        in-place step (the stream's ``next_in_place``: ``fused_ring_step`` /
        ``fused_blt_step``) outside ``tf.distribute``; ``False``: always the unfused
        reference (:meth:`advance` and a TensorFlow scatter). Both give the same noise up
        to float round-off (the order of the sum over the buffers).
      ops: the array namespace (keyword only): ``None`` (default) takes the one of the
        Keras backend in use (``keras_noisecurve.backend.module("noise")``: its
        ``TensorFlowOps`` or ``JaxOps``); or pass one of them (or any class with their
        methods) to run the recurrence with those arrays whatever the Keras backend.

    Attributes:
      stream: the ``NoiseStream``.
      kind: the stream's label (``stream.kind``).
      steps: T, or ``None`` when unlimited.
      buffers: state arrays per variable (0: no state).
      bands: width of the coefficient row for the rings (b, or p for FIR; 1 without
        state); T for BLT.
      state_name: suffix of the optimizer's state variables (``"noise_ring"`` for a
        banded C, whose checkpoints carry that name; ``"noise_state"`` otherwise).
      ops: the array namespace.
    """

    def __init__(self, stream=None, fused=True, *, ops=None):
        if not isinstance(fused, bool):
            raise ValueError(f"fused must be True or False, got {fused!r}.")
        self.fused = fused
        self.ops = _check_ops(ops)
        if stream is None:
            stream = IdentityStream(None)
        elif not isinstance(stream, NoiseStream):
            stream = BandedStream(stream)
        self.stream = stream
        self.kind = stream.kind
        self.steps = stream.steps
        self.buffers = int(stream.buffers)
        self.bands = int(stream.bands)
        self.state_name = stream.state_name

    @classmethod
    def from_mixing(cls, mixing, *, ops=None) -> "StreamNoise":
        """The generator of a strategy (anything ``load_mixing`` reads; ``"dpsgd"``: no plan),
        with the array namespace ``ops`` (``None``: the Keras backend's)."""
        return cls(load_mixing(mixing).stream(), ops=ops)

    # ------------------------------------------------------------------ helpers
    def state_shape(self, shape) -> tuple | None:
        """Shape of the noise state of a variable of ``shape``; ``None`` without state."""
        return self.stream.init(shape)

    def state_bytes(self, shapes, dtype_size: int = 4) -> int:
        """Bytes of the noise state of variables of ``shapes`` (buffers × parameters × size)."""
        total = 0
        for shape in shapes:
            ss = self.state_shape(shape)
            if ss is not None:
                total += int(np.prod(ss)) * dtype_size
        return total

    def row(self, step, dtype):
        """The coefficient vector used at step t: banded, row t of the table
        ``(C[t, t], C[t, t − 1], …)``; toeplitz, c; fir, f; blt, ω. ``None`` for C = I."""
        return self.stream.row(step, self.ops, dtype)

    def assert_in_plan(self, step):
        """An op that fails when ``step >= T`` (privacy plan used up); ``None`` if unlimited,
        and ``None`` under JAX (a traced step cannot raise: the caller checks on the host)."""
        if self.steps is None:
            return None
        return self.ops.assert_less(
            step,
            self.steps,
            messages.plan_spent(self.steps),
        )

    def slot(self, step):
        """Ring slot ``t mod (b − 1)`` that receives step t's value (int32 scalar); ring kinds
        with state only."""
        return self.ops.slot(step, self.buffers)

    # --------------------------------------------------------------- recurrence
    def step_coefficients(self, step, dtype) -> Optional[StepCoefficients]:
        """The :class:`StepCoefficients` of step t (shared by all variables of the step);
        ``None`` for C = I."""
        return self.stream.coefficients(step, self.ops, dtype)

    def folded_scale(self, std, coefficients):
        """The factor a stateless step applies to z_t, times ``std`` (folded into the
        draw): std (C = I), std / V[t, 0] (banded, toeplitz), std · f_0 (fir)."""
        return self.stream.fold(std, coefficients)

    def advance(self, z, step, state=None, coefficients=None):
        """One step of the recurrence: z̃_t from z_t and the state, and how the state changes.

        Args:
          z: fresh N(0, I) draw z_t, any shape.
          step: scalar integer tensor t.
          state: the variable's state, shape ``state_shape(z.shape)``; ``None`` without state.
          coefficients: ``step_coefficients(step, z.dtype)`` if already computed (shared
            by all variables of a step), else ``None``.

        Returns:
          ``(z_tilde, write)``: z̃_t and a :class:`StateWrite` (``None`` without state);
          apply it (:meth:`apply_write`, or an in-place slot update) before step t + 1.
        """
        if coefficients is None:
            coefficients = self.step_coefficients(step, z.dtype)
        return self.stream.next(z, state, coefficients, self.ops)

    def fuses(self, state) -> bool:
        """Whether :meth:`advance_in_place` takes the XLA-compiled path for ``state``:
        ``fused`` is set, the stream has state, the namespace can fuse it (TensorFlow: no
        ``tf.distribute`` strategy is active, a distributed variable is updated by the
        unfused reference; JAX: never), and :meth:`advance` is this class's (a subclass
        that redefines the recurrence gets the unfused path, which calls its ``advance``)."""
        return (self.fused and self.buffers > 0 and type(self).advance is StreamNoise.advance
                and self.ops.can_fuse(state))

    def advance_in_place(self, z, step, state, coefficients=None, scale=None):
        """One step of the recurrence that updates the state VARIABLE in place.

        Args:
          z: fresh N(0, I) draw z_t (the variable's shape).
          step: scalar integer tensor t.
          state: ``tf.Variable`` of shape ``state_shape(z.shape)`` (the stream must have state).
          coefficients: ``step_coefficients(step, z.dtype)`` if already computed.
          scale: optional scalar (e.g. the noise standard deviation ζσ) multiplying the
            result, folded into the fused step; the state holds the unscaled values.

        Returns:
          z̃_t, or scale·z̃_t. Afterwards the state is the one of step t + 1: the ring slot t mod (b − 1)
          holds z̃_t (banded, toeplitz) or z_t (fir); the BLT accumulators are
          θ_i S_i + y_t. Fused (:meth:`fuses`): the stream's ``next_in_place`` (one XLA
          function reads the state once and writes in place); otherwise :meth:`advance`
          and a scatter (or assign).
        """
        if self.buffers == 0:
            raise ValueError(f"advance_in_place needs a stream with state; this {self.kind} stream has none.")
        if not hasattr(self.ops, "write_in_place"):
            raise ValueError(f"advance_in_place needs a state variable; the {self.ops.name} array namespace has "
                             "immutable arrays: use advance() and apply_write().")
        if coefficients is None:
            coefficients = self.step_coefficients(step, z.dtype)
        if self.fuses(state):
            factor = self.ops.cast(1 if scale is None else scale, z.dtype)
            return self.stream.next_in_place(z, state.handle, coefficients, factor, self.ops)
        z_tilde, write = self.advance(z, step, state.read_value(), coefficients)
        self.ops.write_in_place(state, write)
        return z_tilde if scale is None else self.ops.cast(scale, z.dtype) * z_tilde

    def apply_write(self, state, write):
        """The new state after ``write`` (functional; ``state`` unchanged): ``state`` itself
        without a write, ``write.value`` (BLT), or ``state`` with ring slot ``write.slot``
        replaced by ``write.value``."""
        return apply_write(state, write, self.ops)

    def correlate(self, z, step, state=None):
        """One step of the recurrence, functional form.

        Returns:
          ``(z_tilde, new_state)``: z̃_t (shape of z) and the updated state, ``None``
          without state.
        """
        z_tilde, write = self.advance(z, step, state)
        if write is None:
            return z_tilde, None
        return z_tilde, self.apply_write(state, write)

    def sample(self, key, step, index, shape, dtype="float32", state=None):
        """z̃_t for variable ``index``: draw z_t (the namespace's ``standard_normal``) and
        ``correlate`` it.

        Returns ``(z_tilde, new_state)`` as ``correlate``.
        """
        z = self.ops.standard_normal(key, step, index, shape, dtype)
        return self.correlate(z, step, state)


#: the methods an array namespace needs to run a stream's recurrence in StreamNoise
_OPS_METHODS = ("constant", "cast", "gather", "slot", "slot_coefficients", "tensordot", "broadcast", "rank",
                "expand", "write_slot", "assert_less", "can_fuse", "standard_normal")

#: the names the backend's noise module lends this module (``from ... import normal_from_seed``)
_BACKEND_NAMES = frozenset({
    "TensorFlowOps", "JaxOps", "fold_in", "fused_ring_step", "fused_blt_step", "key_words", "normal_from_seed",
    "standard_normal", "step_seed", "variable_seed",
})


def _check_ops(ops):
    """The array namespace: the Keras backend's when ``ops`` is ``None``, else ``ops``
    once it has every method a recurrence needs."""
    if ops is None:
        return backend.module("noise").OPS
    missing = [name for name in _OPS_METHODS if not hasattr(ops, name)]
    if missing:
        raise ValueError(f"ops must be an array namespace such as TensorFlowOps or JaxOps, got {ops!r}, which lacks "
                         f"{', '.join(missing)}.")
    return ops


def __getattr__(name):
    """The backend generator's names (the Keras backend in use), imported on first use:
    this module itself imports no framework."""
    if name in _BACKEND_NAMES or (name.startswith("_") and not name.startswith("__")):
        module = backend.module("noise")
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(f"{name!r} is not part of the backend's noise generator "
                                 f"({module.__name__}).") from None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
