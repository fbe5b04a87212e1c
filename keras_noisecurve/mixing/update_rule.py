r"""The update rule a mixing matrix is optimised for: SGD with heavy-ball momentum and a
learning-rate schedule, written exactly as ``keras.optimizers.SGD`` runs it.

numpy only. At step t = 0 … T−1, with the privatized gradient ĝ_t (docs/design.md#update-rule)
and η_t = η·s_t (η the base learning rate, s_t the schedule's multiplier)::

    m_{t+1} = β·m_t − η_t·ĝ_t,        w_{t+1} = w_t + m_{t+1},        m_0 = 0

β = 0 with s_t = 1 is plain SGD, ``w ← w − η·ĝ_t``: the rule every objective assumed
before update rules existed, and what a mixing matrix without an ``update_rule`` record
means. Privacy never depends on the rule (it post-processes the privatized sum); only
which C is optimal does.

Schedules (``SCHEDULES``), multipliers s_t for t = 0 … T−1:

``constant``
    s_t = 1.
``cosine``
    s_t = ½(1 + cos(π t / T)): ``keras.optimizers.schedules.CosineDecay(η, decay_steps=T)``.
``linear-cooldown``
    s_t = 1 for t < T_c, then s_t = 1 − (t − T_c)/(T − T_c) (reaching 0 at t = T, one step
    after the last), with T − T_c = max(1, round(f·T)) cooldown steps, f =
    ``cooldown_fraction``: constant, then a linear cooldown, as DP-BandMF's experiments
    train (Choquette-Choo et al. 2023).
``custom``
    any positive multipliers given as an array of length T.
"""

from __future__ import annotations

import math

import numpy as np

from keras_noisecurve._validation import check_choice, check_float, check_int

__all__ = ["SCHEDULES", "UpdateRule"]

#: Names of the learning-rate schedules an ``UpdateRule`` knows.
SCHEDULES = ("constant", "cosine", "linear-cooldown", "custom")

#: Relative tolerance when an optimizer's learning rates are compared with a rule's
#: (Keras evaluates schedules in float32: a correct CosineDecay is off by ~1e-5 relative).
MATCH_RTOL = 1e-4


class UpdateRule:
    """SGD with heavy-ball momentum β and learning-rate multipliers s_t (Keras's SGD form).

    Args:
      momentum: β ∈ [0, 1); ``keras.optimizers.SGD(momentum=β, nesterov=False)``.
      schedule: ``"constant"`` (default), ``"cosine"``, ``"linear-cooldown"`` or an array
        of T positive multipliers s_t (then ``schedule == "custom"``).
      cooldown_fraction: f ∈ (0, 1], the share of the T steps spent cooling down
        (``"linear-cooldown"`` only; default 0.25).

    ``UpdateRule()`` is plain SGD with a constant learning rate (``is_plain``).

    Raises:
      ValueError / TypeError: an argument out of range; the message names it.
    """

    def __init__(self, *, momentum=0.0, schedule="constant", cooldown_fraction=None):
        momentum = check_float("momentum", momentum, nonnegative=True)
        if momentum >= 1.0:
            raise ValueError(f"momentum must lie in [0, 1) (heavy ball diverges at β >= 1); got {momentum}.")
        self.momentum = momentum
        self._custom = None
        if isinstance(schedule, str):
            check_choice("schedule", schedule, SCHEDULES[:-1])
            self.schedule = schedule
        else:
            values = np.asarray(schedule, dtype=np.float64)
            if values.ndim != 1 or values.size == 0:
                raise ValueError(
                    f"schedule must be one of {SCHEDULES[:-1]} or a 1-D array of T multipliers; "
                    f"got an array of shape {values.shape}."
                )
            if not np.all(np.isfinite(values)) or np.any(values <= 0):
                raise ValueError("custom schedule multipliers must be finite and > 0; got "
                                 f"min {np.nanmin(values):.6g}, max {np.nanmax(values):.6g}.")
            self.schedule = "custom"
            self._custom = values
        if self.schedule == "linear-cooldown":
            fraction = 0.25 if cooldown_fraction is None else check_float("cooldown_fraction", cooldown_fraction)
            if not 0.0 < fraction <= 1.0:
                raise ValueError(f"cooldown_fraction must lie in (0, 1]; got {fraction}.")
            self.cooldown_fraction = fraction
        else:
            if cooldown_fraction is not None:
                raise ValueError(
                    f"cooldown_fraction is only used by schedule='linear-cooldown'; got "
                    f"cooldown_fraction={cooldown_fraction!r} with schedule={self.schedule!r}."
                )
            self.cooldown_fraction = None

    # ------------------------------------------------------------------ queries
    @property
    def is_plain(self) -> bool:
        """True for plain SGD with a constant learning rate: β = 0 and every s_t equal
        (a constant custom schedule c is plain SGD at the rate η·c)."""
        if self.momentum != 0.0:
            return False
        if self.schedule == "custom":
            return bool(np.all(self._custom == self._custom[0]))
        return self.schedule == "constant"

    def multipliers(self, steps: int) -> np.ndarray:
        """The schedule's multipliers s_t for t = 0 … T−1, float64 of shape (T,), all > 0."""
        steps = check_int("steps", steps, minimum=1)
        t = np.arange(steps, dtype=np.float64)
        if self.schedule == "constant":
            return np.ones(steps)
        if self.schedule == "cosine":
            return 0.5 * (1.0 + np.cos(np.pi * t / steps))
        if self.schedule == "linear-cooldown":
            cool = max(1, int(round(self.cooldown_fraction * steps)))
            start = steps - cool
            return np.where(t < start, 1.0, 1.0 - (t - start) / cool)
        if self._custom.size != steps:
            raise ValueError(f"this custom schedule has {self._custom.size} multipliers; asked for steps={steps}.")
        return self._custom.copy()

    def max_stable_rate(self) -> float:
        """Largest η_t·μ for which heavy ball is stable on a quadratic: 2(1 + β)."""
        return 2.0 * (1.0 + self.momentum)

    def describe(self) -> str:
        """A short human-readable form, e.g. ``"SGD, momentum 0.9, cosine schedule"``."""
        parts = ["SGD", f"momentum {self.momentum:g}"]
        if self.schedule == "linear-cooldown":
            parts.append(f"linear cooldown over the last {self.cooldown_fraction:g} of the steps")
        else:
            parts.append(f"{self.schedule} learning rate")
        return ", ".join(parts)

    # -------------------------------------------------------------- comparison
    def mismatches(self, *, momentum, nesterov=False, learning_rates=None, base_learning_rate=None) -> list:
        """What differs between this rule and an optimizer that runs with ``momentum``,
        ``nesterov`` and per-step learning rates ``learning_rates`` (shape (T,), or None to
        skip the schedule check). ``base_learning_rate`` (η, or None when C does not depend
        on it) is checked against ``learning_rates[0] / s_0``. Returns a list of sentences,
        empty when they match."""
        out = []
        if nesterov:
            out.append("the optimizer uses Nesterov momentum; C assumes heavy-ball momentum")
        if not math.isclose(float(momentum), self.momentum, rel_tol=1e-9, abs_tol=1e-12):
            out.append(f"the optimizer's momentum is {float(momentum):g}; C was optimised for {self.momentum:g}")
        if learning_rates is not None:
            rates = np.asarray(learning_rates, dtype=np.float64).reshape(-1)
            planned = self.multipliers(rates.size)
            shape, planned_shape = (rates / rates[0], planned / planned[0]) if rates[0] > 0 else (rates, planned)
            relative = np.abs(shape - planned_shape) / np.abs(planned_shape)
            if rates[0] <= 0:
                out.append(f"the optimizer's learning rate at step 0 is {rates[0]:g}; C assumes a positive rate")
            elif np.any(relative > MATCH_RTOL):
                worst = int(np.argmax(relative))
                out.append(
                    f"the optimizer's learning-rate schedule differs from C's {self.schedule!r} schedule "
                    f"(at step {worst}: {rates[worst] / rates[0]:.6g} vs {planned[worst] / planned[0]:.6g} "
                    "of the first step's rate)"
                )
            if base_learning_rate is not None:
                eta = rates[0] / planned[0]
                if not math.isclose(eta, float(base_learning_rate), rel_tol=MATCH_RTOL):
                    out.append(f"the optimizer's learning rate is {eta:g}; C was optimised for {float(base_learning_rate):g}")
        return out

    # ------------------------------------------------------------- persistence
    def to_metadata(self) -> dict:
        """JSON-serialisable record (stored as ``MixingMatrix.metadata["update_rule"]``)."""
        record = {"optimizer": "sgd", "momentum": self.momentum, "nesterov": False, "schedule": self.schedule}
        if self.cooldown_fraction is not None:
            record["cooldown_fraction"] = self.cooldown_fraction
        if self._custom is not None:
            record["multipliers"] = self._custom.tolist()
        return record

    @classmethod
    def from_metadata(cls, record) -> "UpdateRule":
        """Inverse of ``to_metadata``; ``None`` (a C solved before update rules were
        recorded) is plain SGD with a constant learning rate."""
        if record is None:
            return cls()
        if not isinstance(record, dict):
            raise ValueError(f"an update_rule record must be a dict or None; got {type(record).__name__}.")
        if record.get("optimizer", "sgd") != "sgd" or record.get("nesterov", False):
            raise ValueError(f"unsupported update_rule record {record!r}: only heavy-ball SGD is known.")
        schedule = record.get("schedule", "constant")
        if schedule == "custom":
            schedule = record["multipliers"]
        return cls(momentum=record.get("momentum", 0.0), schedule=schedule,
                   cooldown_fraction=record.get("cooldown_fraction"))

    def __eq__(self, other):
        if not isinstance(other, UpdateRule):
            return NotImplemented
        return self.to_metadata() == other.to_metadata()

    def __hash__(self):
        return hash(repr(self.to_metadata()))

    def __repr__(self):
        args = [f"momentum={self.momentum!r}"]
        args.append(f"schedule={self.schedule!r}" if self._custom is None else f"schedule=<{self._custom.size} multipliers>")
        if self.cooldown_fraction is not None:
            args.append(f"cooldown_fraction={self.cooldown_fraction!r}")
        return f"UpdateRule({', '.join(args)})"
