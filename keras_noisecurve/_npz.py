"""Reading ``.npz`` files that a user names: every failure is one ``ValueError`` line.

numpy only. A damaged (truncated, empty, not a zip), foreign (another program's
``.npz``, a pickled object array) or missing file gives ``ValueError("<path>: ...")``,
never a ``BadZipFile``, ``EOFError`` or ``zlib.error`` traceback.
"""

from __future__ import annotations

import os
import zipfile

import numpy as np

__all__ = ["one_line", "read_npz"]


def one_line(exc) -> str:
    """``str(exc)`` on one line (numpy and zipfile messages may span several)."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def read_npz(path, *, what: str) -> dict:
    """All arrays of the ``.npz`` file ``path``, read without pickle, as a dict.

    Args:
      path: a ``str`` or ``os.PathLike``.
      what: what the file should be, for messages (e.g. ``"mixing-matrix"``).

    Raises:
      ValueError: one line naming ``path``: no such file, a directory, or a file that
        is not a readable ``.npz`` (with the reason).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"the {what} file must be a path (str or os.PathLike), got {type(path).__name__}.")
    if not os.path.exists(path):
        raise ValueError(f"{os.fspath(path)}: no such {what} file.")
    if os.path.isdir(path):
        raise ValueError(f"{os.fspath(path)}: is a directory, not a {what} .npz file.")
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"{os.fspath(path)}: not a readable {what} .npz file (the file is empty).")
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            npy = f.read(6) == b"\x93NUMPY"
        kind = "a single .npy array" if npy else "not a zip archive (damaged, truncated or another format)"
        raise ValueError(f"{os.fspath(path)}: not a readable {what} .npz file ({kind}).")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except Exception as exc:  # noqa: BLE001 - BadZipFile, EOFError, zlib.error, OSError, ValueError, ...
        raise ValueError(f"{os.fspath(path)}: not a readable {what} .npz file ({one_line(exc)}).") from None
