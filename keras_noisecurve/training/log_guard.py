"""The training logs of a private ``fit`` are not private: say so, and refuse callbacks that act on them.

A private step releases one thing, the noisy update. The loss and the metrics ``fit`` logs
for the training batches (``loss``, ``accuracy``, ..., what the progress bar prints and
``History`` keeps) are computed on the private batch WITHOUT noise: one example can move
them, and whatever is decided from them carries that example out of the step. A callback
that steers the run by a training log (``ReduceLROnPlateau(monitor="loss")``,
``EarlyStopping`` on it, ``ModelCheckpoint(save_best_only=True)`` choosing the weights it
keeps) releases information the reported ε does not cover: two datasets that differ in
one label gave learning-rate sequences [0.5, 0.5, 0.5, 0.05, ...] and [0.5, 0.5, 0.05,
0.005, ...] at the same ε.

- :func:`check_callbacks` refuses such a callback before the first step; the same
  callbacks on a validation log (``val_*``, computed on held-out or public data given as
  ``validation_data``) are accepted.
- :func:`say_private_logs` warns once per private model that its training logs are not
  private (:class:`PrivateLogsWarning`).
"""

from __future__ import annotations

import warnings

import keras

__all__ = ["PrivateLogsWarning", "check_callbacks", "say_private_logs"]

#: the Keras callbacks that act on the log they monitor (``ModelCheckpoint`` only with ``save_best_only``)
STEERING = (keras.callbacks.ReduceLROnPlateau, keras.callbacks.EarlyStopping, keras.callbacks.ModelCheckpoint)


class PrivateLogsWarning(UserWarning):
    """The training logs of a private ``fit`` are computed without noise (not covered by ε)."""


def _steers(callback) -> bool:
    if not isinstance(callback, STEERING):
        return False
    if isinstance(callback, keras.callbacks.ModelCheckpoint) and not getattr(callback, "save_best_only", False):
        return False
    monitor = getattr(callback, "monitor", None)
    return isinstance(monitor, str) and not monitor.startswith("val_")


def check_callbacks(callbacks) -> None:
    """Refuse, before a private ``fit``'s first step, callbacks that act on a training log.

    Args:
      callbacks: the list given to ``fit`` (``None``: nothing to check).

    Raises:
      ValueError: naming each ``ReduceLROnPlateau``, ``EarlyStopping`` or
        ``ModelCheckpoint(save_best_only=True)`` whose ``monitor`` is not a validation log
        (``val_*``).
    """
    steering = [c for c in (callbacks or []) if _steers(c)]
    if steering:
        named = ", ".join(f"{type(c).__name__}(monitor={c.monitor!r})" for c in steering)
        raise ValueError(
            f"{named} acts on a training log: the training loss and metrics are computed on the private batches "
            "without noise, so the run's decisions (learning rate, when to stop, which weights to keep) would carry "
            "information about single examples that the reported epsilon does not cover. Monitor a validation log "
            "instead (monitor='val_loss' with validation_data=... on held-out or public data), or use a fixed "
            "schedule (keras.optimizers.schedules, LearningRateScheduler on the epoch).")


def say_private_logs(private) -> None:
    """Warn once per private model that its training logs are computed without noise."""
    if getattr(private, "_dp_logs_said", False):
        return
    object.__setattr__(private, "_dp_logs_said", True)
    warnings.warn(
        "the training logs of a private fit (loss and the compiled metrics on the training batches, as the progress "
        "bar prints them and History keeps them) are computed on the private examples without noise: they are not "
        "covered by the run's epsilon. Keep them to yourself; publish or act on validation logs (validation_data= "
        "on held-out or public data) instead.",
        PrivateLogsWarning, stacklevel=3)
