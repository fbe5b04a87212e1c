"""The run's secrets said aloud: a fixed seed warns, a file that holds the keys says so.

A private run has two secrets: the noise key (every noise draw of every step is a
function of it and the step) and the sampling key (every batch). Whoever holds either can
regenerate it at any time later: the noise key subtracts the noise from a released model's
updates, the sampling key tells which examples each step used. Neither is ever in a
message, a repr, a config or a log. They ARE in the optimizer's variables, so in every file
that saves the optimizer (``model.save("m.keras")``, ``ModelCheckpoint``,
``BackupAndRestore``, ``tf.train.Checkpoint``, Orbax): :func:`warn_keys_written` says so when
Keras writes one. docs/privacy.md, "Publishing a model", shows how to release a model
without them.
"""

from __future__ import annotations

import os
import threading
import warnings

__all__ = ["FixedSeedWarning", "KeysWrittenWarning", "fixed_seed_warning", "warn_keys_written"]


class FixedSeedWarning(UserWarning):
    """A fixed seed was given: the noise or the batches are predictable (tests only)."""


class KeysWrittenWarning(UserWarning):
    """A file now holds the run's secret noise key (and sampling key)."""


_written = set()
_lock = threading.Lock()


def fixed_seed_warning(where: str, what: str) -> None:
    """Warn that ``where``'s ``seed`` makes its ``what`` predictable."""
    warnings.warn(
        f"{where}(seed=...) makes the {what} predictable: anyone who knows the seed can "
        f"{'subtract the noise' if what == 'noise' else 'tell which examples each step used'}, which voids "
        "the privacy guarantee. Use a seed for tests and reproducible experiments only; leave seed=None "
        "(a secret key from OS entropy) for a private release.",
        FixedSeedWarning,
        stacklevel=3,
    )


def _file_of(store) -> str:
    """The path Keras is writing ``store`` to (the ``.keras`` archive or the ``.weights.h5``
    file), or a description when it writes to memory."""
    archive = getattr(store, "archive", None)
    name = getattr(archive, "filename", None)
    if name:
        return os.fspath(name)
    path = getattr(store, "path_or_io", None)
    if isinstance(path, (str, os.PathLike)):
        return os.fspath(path)
    return "an in-memory Keras file"


def warn_keys_written(store, *, sampling: bool) -> None:
    """Warn once per file and process that Keras is writing the secret keys to ``store``'s file."""
    where = _file_of(store)
    with _lock:
        if where in _written:
            return
        _written.add(where)
    held = "noise key and sampling key" if sampling else "noise key"
    warnings.warn(
        f"{where} holds this run's secret {held} (the optimizer's variables): with it every noise draw "
        f"{'and every batch ' if sampling else ''}can be regenerated, at any time. Keep the file as secret as "
        "the training data, and publish the model without its optimizer: private_model.inner.save(...) or "
        ".save_weights(...), the wrapped model, holds no key (docs/privacy.md, 'Publishing a model').",
        KeysWrittenWarning,
        stacklevel=3,
    )
