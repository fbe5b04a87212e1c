"""Argument checks shared by every public function.

Each helper raises ``ValueError`` (or ``TypeError`` for a wrong type) with a
message that names the argument, what was received and what is allowed.
"""

from __future__ import annotations

import math
import numbers

import numpy as np


def check_int(name: str, value, *, minimum: int | None = None, maximum: int | None = None,
              secret: bool = False) -> int:
    """Return ``value`` as ``int`` after checking it is an integer in range.

    ``secret``: the messages say the type (and shape) received, never the value (a seed
    is its key; a key passed where a seed belongs would be printed otherwise).
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)):
        if secret:
            shape = getattr(value, "shape", None)
            got = f"a {type(value).__name__}" + (f" of shape {tuple(shape)}" if shape is not None else "")
            raise TypeError(f"{name} must be an integer, got {got} (its value is secret and not shown).")
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__}).")
    value = int(value)
    shown = "a value out of range (secret, not shown)" if secret else str(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {shown}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {shown}.")
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


def format_bytes(nbytes: float) -> str:
    """``nbytes`` as a short human-readable size (``"1.5 GiB"``)."""
    value = float(nbytes)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} PiB"  # pragma: no cover


def physical_memory() -> int:
    """Bytes of physical memory of this machine (a large number where unknown)."""
    import os

    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return 2**50


def check_memory(what: str, nbytes: float, *, hint: str = "") -> None:
    """Raise ``ValueError`` before allocating when ``what`` would need more than this
    machine's physical memory; the message names the bytes it would need."""
    total = physical_memory()
    if nbytes > total:
        raise ValueError(
            f"{what} would need about {format_bytes(nbytes)} of memory, more than this machine's "
            f"{format_bytes(total)}." + (f" {hint}" if hint else "")
        )
