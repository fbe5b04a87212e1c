"""Quiet start-up: hold back the backend's C++ start-up notices (TensorFlow's "failed call to
cuInit" on a machine without a GPU reads like a crash), replaying them only if the start fails.

No framework import here (the backend's ``devices`` module probes); used by the ``noisecurve``
command line and by the optimizers (whose first variables probe the devices).
"""

from __future__ import annotations

import os
import sys
import tempfile

__all__ = ["probe_devices_quietly", "quiet_startup"]

_probed = False


def quiet_startup(start, *, set_level: bool = True) -> bool:
    """Run ``start()`` with TensorFlow's C++ start-up logs silenced, unless the user chose.

    TensorFlow's C++ runtime writes notices to the process's standard error while it
    loads and probes devices (e.g. "failed call to cuInit" on a machine without a GPU,
    which reads like a crash). When ``TF_CPP_MIN_LOG_LEVEL`` is not set, this sets it
    to ``"2"`` (TensorFlow's errors still show afterwards) and runs ``start()`` with
    file descriptor 2 redirected to a temporary file; if ``start()`` raises, what was
    written there is replayed to standard error before the exception propagates.
    When the user set ``TF_CPP_MIN_LOG_LEVEL``, ``start()`` runs untouched. With
    ``set_level=False`` (library code, which must not change the process's settings)
    the variable is left unset and only the output of ``start()`` is held back.
    Returns whether the start-up output was silenced.
    """
    if "TF_CPP_MIN_LOG_LEVEL" in os.environ:
        start()
        return False
    if set_level:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        ok = False
        try:
            start()
            ok = True
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if not ok:
                log.seek(0)
                sys.stderr.write(log.read().decode("utf-8", "replace"))
                sys.stderr.flush()
    return True


def probe_devices_quietly() -> None:
    """Let the backend probe its devices once, with its start-up notices held back
    (``quiet_startup(..., set_level=False)``); later calls do nothing. The first
    variable a Keras optimizer creates would otherwise print them."""
    global _probed
    if _probed:
        return
    _probed = True
    from keras_noisecurve import backend

    quiet_startup(backend.module("devices").probe, set_level=False)
