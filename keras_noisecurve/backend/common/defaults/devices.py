"""The devices and logs of a backend with nothing to do at start-up: its devices are listed
through Keras (``keras.distribution.list_devices``, where the backend has it), and it prints no
start-up notices to hold back."""

from __future__ import annotations

__all__ = ["before_first_variable", "probe", "quiet_python_logs"]


def probe() -> None:
    """Let the framework find its devices, through Keras where the backend lists them (a
    missing accelerator plugin is reported here); nothing where Keras lists none."""
    import keras

    try:
        keras.distribution.list_devices()
    except NotImplementedError:  # Keras has no device list for this backend
        pass


def quiet_python_logs() -> None:
    """Nothing to hold back: the framework's Python notices are warnings, shown once."""


def before_first_variable() -> None:
    """Nothing to do: the framework's first variable prints no start-up notices."""
