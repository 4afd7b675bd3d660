"""Files written whole or not at all: a temporary file beside the target, renamed onto it (a record's ``save``, the
tools' pictures, pages and JSON)."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["write_atomically"]


def write_atomically(target: Path, write: Callable[[BinaryIO], object]) -> Path:
    """``write(f)`` into a hidden temporary file beside ``target`` (a short random name with its extension, so a
    target name near the file system's limit still fits), then renamed onto it: a failure leaves nothing behind.

    Raises:
        IsADirectoryError: ``target`` is a folder.
        FileNotFoundError: the folder does not exist (naming ``target``).
        OSError: the folder cannot be written (naming ``target``, not the temporary file).
    """
    if target.is_dir():
        raise IsADirectoryError(errno.EISDIR, f"cannot write {str(target)!r}: it is a folder")
    folder = target.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise FileNotFoundError(errno.ENOENT, f"cannot write {str(target)!r}: the folder {str(folder)!r} {what}")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".", suffix=target.suffix, dir=folder)
    except OSError as e:  # the folder cannot be written: name the user's path, not the temporary one
        raise type(e)(e.errno, f"cannot write {str(target)!r}: {e.strerror}") from e
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; a plain open() would not
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
