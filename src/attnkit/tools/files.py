"""The command line's files: the checks of what it reads and writes, made before any work starts, the readers of
weights and tokens, and a folder of pictures filled whole or not at all (single files are written by
:func:`attnkit._atomic.write_atomically`).

A mistake in a file or folder the command line was given is a :class:`UsageError`: one line, exit status 2.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch


class UsageError(Exception):
    """A mistake in how the command was called: one line on stderr, exit status 2."""


def cut(text: str) -> str:
    """``text`` cut short for an error message when it is long (a pasted number of a thousand digits)."""
    return text if len(text) <= 40 else text[:37] + "..."


def shown(text: str) -> str:
    return repr(cut(text))


def one_line(e: BaseException, limit: int = 300) -> str:
    """The whole message of ``e`` on one line (matplotlib's start with a blank line), its type when empty."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def require(command: str, *modules: str) -> None:
    """A one-line error naming the extra to install, before any work, when ``command`` needs a missing module."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            raise UsageError(f"{command} needs {module}: pip install -e '.[plot]' in attnkit's checkout") from None


def input_file(text: str, what: str) -> Path:
    """A file to read: it must exist and be a regular file (a folder or /dev/zero is a mistake, said at once)."""
    path = Path(text)
    try:
        if not text or not path.exists():
            raise UsageError(f"{text or repr(text)}: no such file")
        if path.is_dir():
            raise UsageError(f"{what} {text}: is a folder, not a file")
        if not path.is_file():
            raise UsageError(f"{what} {text}: is not a regular file")
    except OSError as e:  # a name too long, a folder that cannot be searched
        raise UsageError(f"{what} {shown(text)}: cannot be read ({e.strerror or e})") from None
    return path


def output_file(text: str, what: str, suffixes: Sequence[str]) -> Path:
    """Check, before any work starts, a file that the command will write (atomically, later).

    The same checks for every output: a name is given; it is not a folder, nor anything but a regular file; its
    extension is one of ``suffixes``; its folder exists, is a folder, and a probe file can be made in it (which
    also catches folders such as /proc, where even root cannot make a file). An existing file is replaced.
    """
    path = Path(text)
    try:
        if not text.strip():
            raise UsageError(f"{what}: the file name is empty")
        if path.is_dir() or text.endswith(os.sep):
            raise UsageError(f"{what} {text}: names a folder; name a file, such as {path / ('out' + suffixes[0])}")
        if path.exists() and not path.is_file():
            raise UsageError(f"{what} {text}: exists and is not a regular file")
        if path.suffix.lower() not in suffixes:
            kinds = ("one of " if len(suffixes) > 1 else "") + ", ".join(suffixes)
            raise UsageError(f"{what} {text}: the extension must be {kinds}")
        _writable_folder(path.parent, f"{what} {text}")
        _check_name_lengths(path, path.parent, f"{what} {shown(text)}")
    except OSError as e:
        raise UsageError(f"{what} {shown(text)}: cannot be written ({e.strerror or e})") from None
    return path


def output_folder(text: str, what: str) -> Path:
    """Check, before any work starts, a folder that the command will fill: an existing folder that can be written
    into, or a new one whose nearest existing parent can be. Nothing is made here (see :func:`filling`)."""
    path = Path(text)
    try:
        if not text.strip():
            raise UsageError(f"{what}: the folder name is empty")
        if path.exists() and not path.is_dir():
            raise UsageError(f"{what} {text}: cannot write there: it is a file, not a folder")
        nearest = path
        while not nearest.exists() and nearest != nearest.parent:
            if nearest.is_symlink():
                raise UsageError(f"{what} {text}: {str(nearest)!r} is a symbolic link to nothing")
            nearest = nearest.parent
        if not nearest.is_dir():
            raise UsageError(f"{what} {text}: cannot write there: {str(nearest)!r} is not a folder")
        _writable_folder(nearest, f"{what} {text}")
        _check_name_lengths(path, nearest, f"{what} {shown(text)}")
    except OSError as e:
        raise UsageError(f"{what} {shown(text)}: cannot write there ({e.strerror or e})") from None
    return path


def _check_name_lengths(path: Path, existing: Path, what: str) -> None:
    """Every name in ``path`` fits the file system of ``existing`` (its nearest existing folder): checked before any
    work, not found out when the output is written."""
    longest = os.pathconf(existing, "PC_NAME_MAX")
    for part in path.parts:
        if len(os.fsencode(part)) > longest:
            raise UsageError(f"{what}: the name {shown(part)} is longer than this file system allows ({longest} bytes)")


def _writable_folder(folder: Path, what: str) -> None:
    if not folder.exists():
        raise UsageError(f"{what}: folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise UsageError(f"{what}: {str(folder)!r} is not a folder")
    try:  # os.access says yes to root everywhere, /proc included: making a file is the honest test
        fd, probe = tempfile.mkstemp(prefix=".attnkit-", suffix=".probe", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{what}: cannot write into folder {str(folder)!r} ({e.strerror or e})") from None


@contextmanager
def filling(folder: Path) -> Iterator[Path]:
    """A fresh temporary folder to write into; when the block succeeds, what it holds moves into ``folder``.

    A missing ``folder`` (and its missing parents) is made only then, and appears whole: the temporary folder,
    made beside it, is renamed into place. An existing ``folder`` gets the files one by one, each renamed in from
    a temporary folder inside it. When the block fails, the temporary folder and any parent made here are removed,
    so a failed run leaves nothing new behind.
    """
    missing = [p for p in (folder, *folder.parents) if not p.exists()]  # innermost first
    made: list[Path] = []
    try:
        for parent in reversed(missing[1:]):
            parent.mkdir()
            made.append(parent)
        # a fresh name made with mkdir, so that it gets the mode the umask gives (mkdtemp's is private)
        staging = (folder.parent if missing else folder) / f".attnkit-{uuid.uuid4().hex[:12]}.part"
        staging.mkdir()
        try:
            yield staging
            if missing:
                os.replace(staging, folder)
            else:
                _move_all(staging, folder)
                staging.rmdir()
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    except BaseException:
        for parent in reversed(made):  # the innermost first; only folders still empty
            with suppress(OSError):
                parent.rmdir()
        raise


def taken_by_other_than_a_file(path: Path) -> bool:
    """A folder, a link to nothing or a device where a file is to go: replacing it would fail or do harm."""
    return (path.exists() or path.is_symlink()) and not path.is_file()


def _move_all(staging: Path, folder: Path) -> None:
    """Move what ``staging`` holds into ``folder``, all or nothing: names that exist there as anything but a file
    stop it before anything moves; files it replaces are kept aside and put back if a later move fails."""
    items = sorted(staging.iterdir())
    for item in items:
        target = folder / item.name
        if taken_by_other_than_a_file(target):
            raise UsageError(f"{target}: exists and is not a regular file; nothing was written into {str(folder)!r}")
    kept: list[tuple[Path, Path]] = []  # (target, its previous version, set aside in staging)
    moved: list[Path] = []
    try:
        for item in items:
            target = folder / item.name
            if target.exists():
                old = staging / f".old-{item.name}"
                os.replace(target, old)
                kept.append((target, old))
            os.replace(item, target)
            moved.append(target)
    except BaseException:
        for target in moved:
            with suppress(OSError):
                target.unlink()
        for target, old in kept:
            with suppress(OSError):
                os.replace(old, target)
        raise
    for _, old in kept:
        old.unlink()


def load_weights(path: Path, *, record: bool = False) -> Any:
    """The tensor in ``path`` (``.npy``, or anything else as ``torch.save``'s), as float32; with ``record``, also a
    record saved as ``{module name: tensor or list of tensors}`` or a list or tuple of tensors, one per layer
    (transformers' ``outputs.attentions``), each checked the same way."""
    try:
        if path.suffix == ".npy":
            import numpy as np

            array = np.load(path, allow_pickle=False)
            if array.dtype.byteorder not in ("=", "|"):  # a big-endian file: torch takes native byte order only
                array = array.astype(array.dtype.newbyteorder("="))
            data: Any = torch.from_numpy(array)
        else:
            with warnings.catch_warnings():  # the one line below says what is wrong; torch's warning would add two
                warnings.simplefilter("ignore")
                data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any reader failure is the file's fault here, said in one line
        raise UsageError(
            f"{path}: cannot read weights: not a tensor saved with torch.save or an array saved with numpy.save"
            f" ({type(e).__name__})"
        ) from None
    if record and isinstance(data, dict) and data.get("attnkit_stats") == 1:
        return data  # a statistics record (StatsRecord.save): the viewer checks it
    if record and isinstance(data, dict):
        if not data:
            raise UsageError(f"{path}: the record holds no layers (an empty dict)")
        loaded = {}
        for name, value in data.items():
            if not isinstance(name, str):
                raise UsageError(f"{path}: a record's keys are module names (strings), got {shown(repr(name))}")
            calls = value if isinstance(value, (list, tuple)) else [value]
            if not calls:
                raise UsageError(f"{path}: layer {shown(name)} has no calls (an empty list)")
            loaded[name] = [_weights_tensor(path, c, f"layer {shown(name)}: ") for c in calls]
        return loaded
    if record and isinstance(data, (list, tuple)) and _layers_or_calls(data):
        # one tensor per layer (transformers' outputs.attentions), or a tuple of calls of layers (generate's), saved
        # whole: each tensor checked here; the viewer reads the structure, and says what an empty one lacks
        return _checked_sequence(path, data, "")
    if not isinstance(data, torch.Tensor):
        wanted = "one tensor or array of weights" + (
            ", a dict {layer name: tensors}, or a list of (B, H, Lq, Lk) or (H, Lq, Lk) tensors, one per layer"
            if record
            else ""
        )
        raise UsageError(f"{path}: expected {wanted}, got an object of type {type(data).__name__}")
    return _weights_tensor(path, data, "")


def _layers_or_calls(data: list | tuple) -> bool:
    """A tuple of layers' tensors of 3 or more dims, or of such tuples (calls), empty ones included (transformers'
    sdpa gives ``()`` per step); not a nested list of numbers (one array written out)."""
    return all(
        (isinstance(t, torch.Tensor) and t.dim() >= 3)
        or (isinstance(t, (list, tuple)) and all(isinstance(u, torch.Tensor) and u.dim() >= 3 for u in t))
        for t in data
    )


def _checked_sequence(path: Path, data: list | tuple, where: str) -> list | tuple:
    return type(data)(
        _weights_tensor(path, t, f"{where}layer {i}: ")
        if isinstance(t, torch.Tensor)
        else _checked_sequence(path, t, f"{where}call {i}, ")
        for i, t in enumerate(data)
    )


def _weights_tensor(path: Path, data: Any, where: str) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise UsageError(f"{path}: {where}expected a tensor of weights, got an object of type {type(data).__name__}")
    if data.layout != torch.strided or data.device.type != "cpu":
        raise UsageError(
            f"{path}: {where}weights must be a dense tensor of numbers, got a {data.layout} tensor on {data.device} "
            f"(save weights.to_dense().cpu())"
        )
    if not (data.is_floating_point() or data.dtype in (torch.int32, torch.int64)):
        raise UsageError(f"{path}: {where}weights must be real numbers, got dtype {data.dtype}")
    if data.numel() == 0:
        raise UsageError(f"{path}: {where}the weights are empty, shape {tuple(data.shape)}")
    return data.float()


def read_tokens(text: str, option: str) -> list[str]:
    """Tokens from the command line: separated by white space, or ``@FILE``, one token per line (UTF-8)."""
    if not text.startswith("@"):
        return text.split()
    path = input_file(text[1:], option)
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{option} {shown(text)}: cannot be read as UTF-8 text ({type(e).__name__})") from None
