"""Reading ``.npz`` files that a user names: every failure is one ``ValueError`` line.

numpy only. A damaged (truncated, empty, not a zip), foreign (another program's
``.npz``, a pickled object array) or missing file gives ``ValueError("<path>: ...")``,
never a ``BadZipFile``, ``EOFError`` or ``zlib.error`` traceback.

Only the fields the caller names are read. The zip directory is checked before any
array is decompressed: a field the caller does not know is refused by name (it is never
decompressed), and a known field whose uncompressed size is over
``MAX_EXPANSION_FLOOR`` bytes and over ``MAX_EXPANSION_RATIO`` times its compressed size
(a "zip bomb": a few hundred KB that decompress to GBs) is refused before it is read, as
is a ``.npy`` header whose array is larger than the zip entry holds. What a file may
make this reader allocate is thus bounded by a small multiple of the file's size.
"""

from __future__ import annotations

import os
import zipfile

import numpy as np

__all__ = ["MAX_EXPANSION_FLOOR", "MAX_EXPANSION_RATIO", "one_line", "read_npz", "read_npz_field"]

#: A field may always decompress to this many bytes …
MAX_EXPANSION_FLOOR = 64 << 20
#: … and beyond it to at most this many times its compressed size (``np.savez`` stores
#: fields uncompressed, ratio 1; ``np.savez_compressed`` of float data compresses a few times).
MAX_EXPANSION_RATIO = 100

#: How many unknown field names a message lists (a crafted file may hold thousands).
_LISTED = 8


def one_line(exc) -> str:
    """``str(exc)`` on one line (numpy and zipfile messages may span several)."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _names(names, limit: int | None = None) -> str:
    names = sorted(names)
    shown = ", ".join(repr(n if len(n) <= 60 else n[:57] + "...") for n in names[:limit])
    return shown + (f", … ({len(names) - limit} more)" if limit is not None and len(names) > limit else "")


def _check_path(path, what: str) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"the {what} file must be a path (str or os.PathLike), got {type(path).__name__}.")
    if not os.path.exists(path):
        raise ValueError(f"{os.fspath(path)}: no such {what} file.")
    if os.path.isdir(path):
        raise ValueError(f"{os.fspath(path)}: is a directory, not a {what} .npz file.")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{os.fspath(path)}: not a readable {what} .npz file (the file is empty).")
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            npy = f.read(6) == b"\x93NUMPY"
        kind = "a single .npy array" if npy else "not a zip archive (damaged, truncated or another format)"
        raise ValueError(f"{os.fspath(path)}: not a readable {what} .npz file ({kind}).")


def _members(archive: zipfile.ZipFile) -> dict:
    """field name → ``ZipInfo`` (numpy's naming: ``"x.npy"`` holds field ``"x"``)."""
    return {(info.filename[:-4] if info.filename.endswith(".npy") else info.filename): info
            for info in archive.infolist()}


def _check_member(archive: zipfile.ZipFile, name: str, info: zipfile.ZipInfo) -> None:
    """Refuse ``info`` before numpy decompresses it: a zip bomb, or a ``.npy`` header
    declaring more data than the entry holds (numpy allocates the header's shape first)."""
    size, packed = info.file_size, max(info.compress_size, 1)
    if size > MAX_EXPANSION_FLOOR and size > MAX_EXPANSION_RATIO * packed:
        raise ValueError(
            f"field {name!r} would decompress to {size} bytes from {info.compress_size} "
            f"(over {MAX_EXPANSION_RATIO}x its compressed size and over {MAX_EXPANSION_FLOOR} bytes); refused unread")
    with archive.open(info) as member:
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(member)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(member)
        else:
            raise ValueError(f"field {name!r} is a .npy of format version {version}, which these files never use")
        header = member.tell()
    count = 1
    for dim in shape:
        count *= int(dim)
    if count * dtype.itemsize > size - header:
        raise ValueError(
            f"field {name!r} declares a {dtype} array of shape {tuple(shape)} ({count * dtype.itemsize} bytes) "
            f"but its entry holds {size - header} bytes")


def _checked_members(path, what: str, fields) -> dict:
    """The members of ``path`` (field name → ``ZipInfo``), every one known and checked."""
    allowed = set(fields)
    with zipfile.ZipFile(path) as archive:
        members = _members(archive)
        unknown = set(members) - allowed
        if unknown:
            raise ValueError(
                f"{os.fspath(path)}: not a keras-noisecurve {what} file: unknown field(s) {_names(unknown, _LISTED)} "
                f"(left unread); a {what} file holds only {_names(allowed)}.")
        for name, info in members.items():
            _check_member(archive, name, info)
    return members


def read_npz(path, *, what: str, fields) -> dict:
    """The arrays of the ``.npz`` file ``path``, read without pickle, as a dict.

    Args:
      path: a ``str`` or ``os.PathLike``.
      what: what the file should be, for messages (e.g. ``"mixing-matrix"``).
      fields: the field names a file of this kind may hold (all optional here: the
        caller says which it needs). Any other field refuses the file, unread.

    Raises:
      ValueError: one line naming ``path``: no such file, a directory, a file that is
        not a readable ``.npz`` (with the reason), a field not in ``fields`` (named, with
        the allowed ones), or a field that would decompress to far more than it stores.
    """
    _check_path(path, what)
    try:
        members = _checked_members(path, what, fields)
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in members}
    except ValueError as exc:
        message = one_line(exc)
        if message.startswith(os.fspath(path) + ":"):
            raise ValueError(message) from None
        raise ValueError(f"{os.fspath(path)}: not a readable {what} .npz file ({message}).") from None
    except Exception as exc:  # noqa: BLE001 - BadZipFile, EOFError, zlib.error, OSError, ...
        raise ValueError(f"{os.fspath(path)}: not a readable {what} .npz file ({one_line(exc)}).") from None


def read_npz_field(path, name: str, *, what: str, max_bytes: int = 1 << 20):
    """The one field ``name`` of the ``.npz`` file ``path`` (``None`` when it has none),
    read without pickle and only when its entry is at most ``max_bytes`` uncompressed;
    the other fields are left unread (e.g. a ``format`` string, to tell a file's kind).

    Raises:
      ValueError: one line naming ``path``, as :func:`read_npz`.
    """
    _check_path(path, what)
    try:
        with zipfile.ZipFile(path) as archive:
            info = _members(archive).get(name)
            if info is None:
                return None
            if info.file_size > max_bytes:
                raise ValueError(f"field {name!r} would decompress to {info.file_size} bytes (at most {max_bytes} "
                                 "read); refused unread")
            _check_member(archive, name, info)
        with np.load(path, allow_pickle=False) as data:
            return data[name]
    except Exception as exc:  # noqa: BLE001 - BadZipFile, EOFError, zlib.error, OSError, ValueError, ...
        raise ValueError(f"{os.fspath(path)}: not a readable {what} .npz file ({one_line(exc)}).") from None
