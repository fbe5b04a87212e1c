"""Keras learning-rate schedules for the schedules of ``keras_noisecurve.mixing.UpdateRule``.

A mixing matrix C solved for an update rule (``solve_mixing_matrix(...,
update_rule=UpdateRule(momentum=β, schedule=...))``) records the rule in
``metadata["update_rule"]``. :func:`learning_rate_schedule` returns what a Keras
optimizer takes as its ``learning_rate`` to run exactly that schedule, η_t = η·s_t at
``optimizer.iterations == t``::

    rule = knc.UpdateRule.from_metadata(C.metadata.get("update_rule"))
    inner = keras.optimizers.SGD(
        knc.learning_rate_schedule(rule, learning_rate=eta, steps=C.steps),
        momentum=rule.momentum)
    opt = knc.NoiseCurveOptimizer(inner=inner, mixing=C, ...)

docs/training.md, "Any Keras optimizer (`inner=`)", has the whole recipe.
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

from keras_noisecurve._validation import check_float, check_int
from keras_noisecurve.mixing.update_rule import UpdateRule

__all__ = ["LinearCooldown", "MultiplierSchedule", "learning_rate_schedule"]

_PACKAGE = "keras_noisecurve"


def cooldown_steps(steps: int, cooldown_fraction: float) -> int:
    """T − T_c = max(1, round(f·T)), the number of cooldown steps (as ``UpdateRule``)."""
    return max(1, int(round(cooldown_fraction * steps)))


@keras.saving.register_keras_serializable(package=_PACKAGE)
class LinearCooldown(keras.optimizers.schedules.LearningRateSchedule):
    """Constant, then a linear cooldown: ``UpdateRule(schedule="linear-cooldown")``.

    At step t (``optimizer.iterations``), with T = ``decay_steps`` and
    T − T_c = max(1, round(f·T)) cooldown steps (f = ``cooldown_fraction``)::

        η_t = η                                 t < T_c
        η_t = η·(1 − (t − T_c)/(T − T_c))       T_c <= t <= T   (0 at t = T)
        η_t = 0                                 t > T

    Args:
      initial_learning_rate: η > 0.
      decay_steps: T >= 1, the number of steps of the run (a mixing matrix's ``steps``).
      cooldown_fraction: f ∈ (0, 1], the share of the T steps spent cooling down.
      name: name scope of the computation.
    """

    def __init__(self, initial_learning_rate, decay_steps, cooldown_fraction=0.25, name="LinearCooldown"):
        super().__init__()
        self.initial_learning_rate = check_float("initial_learning_rate", initial_learning_rate, positive=True)
        self.decay_steps = check_int("decay_steps", decay_steps, minimum=1)
        fraction = check_float("cooldown_fraction", cooldown_fraction)
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"cooldown_fraction must lie in (0, 1]; got {fraction}.")
        self.cooldown_fraction = fraction
        self.name = name

    @property
    def cooldown_start(self) -> int:
        """T_c, the first step of the cooldown."""
        return self.decay_steps - cooldown_steps(self.decay_steps, self.cooldown_fraction)

    def __call__(self, step):
        with keras.name_scope(self.name):
            rate = ops.convert_to_tensor(self.initial_learning_rate)
            dtype = rate.dtype
            step = ops.cast(step, dtype)
            start = self.cooldown_start
            cool = ops.cast(self.decay_steps - start, dtype)
            past = ops.maximum(ops.subtract(step, ops.cast(start, dtype)), ops.cast(0, dtype))
            multiplier = ops.maximum(ops.subtract(ops.cast(1, dtype), ops.divide(past, cool)), ops.cast(0, dtype))
            return ops.multiply(rate, multiplier)

    def get_config(self):
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "cooldown_fraction": self.cooldown_fraction,
            "name": self.name,
        }


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MultiplierSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """η_t = η·s_t from a table of T multipliers (``UpdateRule`` with a custom schedule).

    Piecewise constant with one piece per step: step t reads ``multipliers[t]``; steps
    past the table keep the last value. One ``gather`` per step, whatever T is
    (``keras.optimizers.schedules.PiecewiseConstantDecay`` with T − 1 boundaries would
    build about 3T operations into every step).

    Args:
      initial_learning_rate: η > 0.
      multipliers: the T > 0 multipliers s_0 … s_{T−1} (finite, > 0).
      name: name scope of the computation.
    """

    def __init__(self, initial_learning_rate, multipliers, name="MultiplierSchedule"):
        super().__init__()
        self.initial_learning_rate = check_float("initial_learning_rate", initial_learning_rate, positive=True)
        values = np.asarray(multipliers, dtype=np.float64).reshape(-1)
        if values.size == 0 or not np.all(np.isfinite(values)) or np.any(values <= 0):
            raise ValueError("multipliers must be a non-empty array of finite values > 0.")
        self.multipliers = values
        self.name = name

    def __call__(self, step):
        with keras.name_scope(self.name):
            rate = ops.convert_to_tensor(self.initial_learning_rate)
            # η·s_t in float64, then cast: the table holds the rates themselves
            dtype = keras.backend.standardize_dtype(rate.dtype)
            table = ops.convert_to_tensor((self.initial_learning_rate * self.multipliers).astype(dtype))
            index = ops.clip(ops.cast(step, "int32"), 0, self.multipliers.size - 1)
            return ops.take(table, index)

    def get_config(self):
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "multipliers": self.multipliers.tolist(),
            "name": self.name,
        }


def learning_rate_schedule(update_rule, *, learning_rate, steps):
    """The ``learning_rate`` argument of a Keras optimizer that runs ``update_rule``'s
    schedule: η_t = η·s_t at step t = 0 … T−1.

    Args:
      update_rule: an ``UpdateRule``, or its record (``MixingMatrix.metadata["update_rule"]``,
        ``None`` meaning constant).
      learning_rate: η > 0, the base learning rate (s_0 = 1 for every named schedule).
      steps: T, the number of steps of the run (``MixingMatrix.steps``).

    Returns:
      ``"constant"``: the float η. ``"cosine"``:
      ``keras.optimizers.schedules.CosineDecay(η, decay_steps=T)``.
      ``"linear-cooldown"``: :class:`LinearCooldown` (η, T, f). ``"custom"``:
      :class:`MultiplierSchedule` (η, s_0 … s_{T−1}).

    The momentum is not part of the schedule: pass ``momentum=update_rule.momentum``
    to ``keras.optimizers.SGD`` yourself.
    """
    rule = update_rule if isinstance(update_rule, UpdateRule) else UpdateRule.from_metadata(update_rule)
    eta = check_float("learning_rate", learning_rate, positive=True)
    steps = check_int("steps", steps, minimum=1)
    if rule.schedule == "constant":
        return eta
    if rule.schedule == "cosine":
        return keras.optimizers.schedules.CosineDecay(eta, decay_steps=steps)
    if rule.schedule == "linear-cooldown":
        return LinearCooldown(eta, steps, cooldown_fraction=rule.cooldown_fraction)
    return MultiplierSchedule(eta, rule.multipliers(steps))
