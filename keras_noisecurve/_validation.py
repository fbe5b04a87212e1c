"""Argument checks shared by every public function.

Each helper raises ``ValueError`` (or ``TypeError`` for a wrong type) with a
message that names the argument, what was received and what is allowed.
"""

from __future__ import annotations

import math
import numbers

import numpy as np


def check_int(name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``value`` as ``int`` after checking it is an integer in range."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__}).")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}.")
    return value


def check_float(
    name: str,
    value,
    *,
    positive: bool = False,
    nonnegative: bool = False,
    open_unit: bool = False,
) -> float:
    """Return ``value`` as a finite ``float`` after checking the requested range.

    ``positive``: value > 0; ``nonnegative``: value >= 0; ``open_unit``: 0 < value < 1.
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__}).")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}.")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}.")
    if nonnegative and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}.")
    if open_unit and not 0.0 < value < 1.0:
        raise ValueError(f"{name} must lie strictly between 0 and 1, got {value}.")
    return value


def check_choice(name: str, value, choices) -> str:
    """Check that ``value`` is one of ``choices`` (strings)."""
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {allowed}; got {value!r}.")
    return value
