"""JAX's devices and logs: what the command line and the optimizers start with."""

from __future__ import annotations

import jax

__all__ = ["before_first_variable", "probe", "quiet_python_logs"]


def probe() -> None:
    """Let JAX find its devices (a missing CUDA plugin is reported here)."""
    jax.devices()


def quiet_python_logs() -> None:
    """Nothing to hold back: JAX's Python notices are warnings, shown once."""


def before_first_variable() -> None:
    """Nothing to do: JAX's first variable prints no start-up notices."""
