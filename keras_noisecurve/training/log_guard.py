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

from keras_noisecurve.training.plan_guard import callback_list

__all__ = ["PrivateLogsWarning", "check_callbacks", "say_private_logs"]

#: the Keras callbacks that act on the log they monitor (``ModelCheckpoint`` only with ``save_best_only``)
STEERING = (keras.callbacks.ReduceLROnPlateau, keras.callbacks.EarlyStopping, keras.callbacks.ModelCheckpoint)


class PrivateLogsWarning(UserWarning):
    """The training logs of a private ``fit`` are computed without noise (not covered by ε)."""


def _steers(callback, *, validation=False) -> bool:
    """Whether ``callback`` acts on a training log (``validation``: on any log)."""
    if not isinstance(callback, STEERING):
        return False
    if isinstance(callback, keras.callbacks.ModelCheckpoint) and not getattr(callback, "save_best_only", False):
        return False
    monitor = getattr(callback, "monitor", None)
    return isinstance(monitor, str) and (validation or not monitor.startswith("val_"))


def check_callbacks(callbacks, *, validation_split=0.0) -> None:
    """Refuse, before a private ``fit``'s first step, callbacks that act on a training log.

    Args:
      callbacks: the list (or ``keras.callbacks.CallbackList``) given to ``fit``; ``None``:
        nothing to check.
      validation_split: ``fit``'s: with a split, the ``val_*`` logs are computed on examples
        cut from the private ``x``, so they are training-set logs too.

    Raises:
      ValueError: naming each ``ReduceLROnPlateau``, ``EarlyStopping`` or
        ``ModelCheckpoint(save_best_only=True)`` whose ``monitor`` is not a validation log
        (``val_*``), or that monitors any log when ``validation_split`` is set.
    """
    callbacks = callback_list(callbacks)
    if validation_split:
        split = [c for c in callbacks if _steers(c, validation=True)]
        if split:
            named = ", ".join(f"{type(c).__name__}(monitor={c.monitor!r})" for c in split)
            raise ValueError(
                f"{named} with validation_split={validation_split!r}: the validation rows are cut from the private "
                "x, so the val_ logs are computed on private examples without noise and the run's decisions would "
                "carry them outside epsilon. Pass validation_data= with examples that are not the run's (public, or "
                "held out: decisions on them are not private for those examples).")
    steering = [c for c in callbacks if _steers(c)]
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
