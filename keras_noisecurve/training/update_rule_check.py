"""The construction warning of ``NoiseCurveOptimizer``: does the update the optimizer
runs match the update rule its mixing matrix C was optimised for?

C records its update rule in ``mixing.metadata["update_rule"]`` (absent: plain SGD
with a constant learning rate; ``keras_noisecurve.UpdateRule``). The optimizer runs
``w ← w − η_t·ĝ_t`` without an inner optimizer, or the inner optimizer's update:
heavy-ball SGD (momentum β, Nesterov flag) for ``keras.optimizers.SGD``, anything
else for the others. :func:`update_rule_warning` compares the two over the T steps
of C (momentum, Nesterov flag, learning rates η_0 … η_{T−1}).
"""

from __future__ import annotations

from typing import Optional

import keras
import numpy as np

from keras_noisecurve import _compat
from keras_noisecurve.mixing.objectives import REGISTRY as OBJECTIVE_REGISTRY
from keras_noisecurve.mixing.update_rule import UpdateRule

__all__ = ["update_rule_warning"]


def update_rule_warning(mixing, inner, learning_rate) -> Optional[str]:
    """The warning (a string), or ``None`` when the optimizer runs the update rule C was
    optimised for.

    Args:
      mixing: the resolved strategy (C = I without a plan never warns).
      inner: the inner Keras optimizer or ``None`` (plain SGD).
      learning_rate: the outer learning rate (a float, variable or schedule), used
        when ``inner`` is ``None``.
    """
    if not mixing.has_plan:
        return None
    meta = mixing.metadata
    objective = meta.get("objective", "unknown")
    if objective in OBJECTIVE_REGISTRY and OBJECTIVE_REGISTRY[objective].any_update_rule:
        return None
    rule = UpdateRule.from_metadata(meta.get("update_rule"))
    planned = meta.get("learning_rate")
    steps = mixing.steps
    kind, momentum, nesterov, rates = _update_rule_run(inner, learning_rate, steps)
    if kind != "sgd":
        return (
            f"the mixing matrix ({objective}) was optimised for heavy-ball SGD ({rule.describe()}), but the "
            f"inner optimizer is {kind}: the privatized gradient it receives is as private as ever, but its "
            f"noise is no longer the one C was optimised for (no objective models {kind}'s update). Use "
            "inner=keras.optimizers.SGD(...) to follow C."
        )
    if rates is not None:
        rates = _float32_rates(rates, rule, steps)
    problems = rule.mismatches(momentum=momentum, nesterov=nesterov, learning_rates=rates,
                               base_learning_rate=planned)
    if rates is not None and not rates[0] > 0:
        problems.insert(0, f"the optimizer's learning rate at step 0 is {rates[0]:g}")
    if not problems:
        return None
    target = f"update rule ({rule.describe()})"
    if planned is not None:
        target = f"learning rate {float(planned):g} and {target}"
    return (
        f"the update this optimizer runs differs from the {target} the mixing matrix ({objective}) was "
        "optimised for: " + "; ".join(problems) + ". Its noise is still private but no longer optimal. "
        "Solve C for the update you run (solve_mixing_matrix(..., update_rule=UpdateRule(momentum=..., "
        "schedule=...))), or run C's: inner=keras.optimizers.SGD(learning_rate_schedule(rule, "
        "learning_rate=η, steps=T), momentum=rule.momentum) with "
        "rule = UpdateRule.from_metadata(C.metadata.get('update_rule'))."
    )


def _update_rule_run(inner, learning_rate, steps):
    """What the optimizer runs over ``steps`` steps: ``(kind, momentum, nesterov,
    learning_rates)``; kind is ``"sgd"`` or the inner optimizer's class name, and
    learning_rates (shape (steps,)) is ``None`` when it cannot be evaluated."""
    if inner is None:
        return "sgd", 0.0, False, _learning_rates(learning_rate, steps)
    if isinstance(inner, keras.optimizers.SGD):
        return "sgd", float(inner.momentum), bool(inner.nesterov), _learning_rates(_compat.learning_rate_value(inner), steps)
    return type(inner).__name__, None, None, None


def _learning_rates(learning_rate, steps):
    """η_t for t = 0 … steps − 1 (float64), from a float, a variable or a
    ``LearningRateSchedule``; ``None`` for a zero-argument callable (unknown)."""
    if isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule):
        step_dtype = _step_dtype()
        try:  # most schedules are elementwise: one call for all steps
            rates = np.asarray(_numpy(learning_rate(keras.ops.arange(steps, dtype=step_dtype))), dtype=np.float64)
        except Exception:  # noqa: BLE001 - e.g. a schedule with a tf.cond on the step
            rates = None
        if rates is None or rates.shape != (steps,):
            rates = np.array([float(_numpy(learning_rate(keras.ops.convert_to_tensor(t, dtype=step_dtype)))) for t in range(steps)])
        return rates
    if isinstance(learning_rate, keras.Variable) or _compat.is_backend_variable(learning_rate):
        return np.full(steps, float(_numpy(learning_rate)))
    if callable(learning_rate):
        return None
    return np.full(steps, float(learning_rate))


def _step_dtype() -> str:
    """The step's dtype given to a schedule: the optimizer's counter's, the backend's
    (int64 on TensorFlow; int32 on JAX, which has no int64 without x64)."""
    from keras_noisecurve import backend

    return backend.module("optimizer").STEP_DTYPE


def _numpy(value):
    """A tensor or variable as numpy, through ``.numpy()``: ``np.asarray`` on a Keras
    variable warns under numpy 2 (its ``__array__`` takes no ``copy`` argument)."""
    value = value.value if isinstance(value, keras.Variable) else value
    if hasattr(value, "numpy"):
        return value.numpy()
    return np.asarray(keras.ops.convert_to_numpy(value))


def _float32_rates(rates, rule, steps):
    """Keras evaluates schedules in float32, so small multipliers (a cosine near step T)
    carry relative errors far above ``UpdateRule``'s comparison tolerance. Rates that
    equal η·s_t to float32 precision (|η_t − η·s_t| ≤ 8 float32 ulps of η) are replaced
    by η·s_t, so only real differences are reported."""
    planned = rule.multipliers(steps)
    eta = rates[0] / planned[0]
    if eta > 0 and np.all(np.abs(rates - eta * planned) <= 8 * np.finfo(np.float32).eps * eta):
        return eta * planned
    return rates
