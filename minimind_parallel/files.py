"""Atomic file writing: a unique temporary name in the target's directory, flushed to disk, then renamed.

A writer that is killed or raises leaves the target as it was (absent or the previous version),
never half written; concurrent writers of the same target each use their own temporary file.
`atomic_path` replaces the target; `new_file` never replaces anything (a log of an earlier run
stays): it takes the first free name of `path`, `path` with `.1`, `.2`, ... before the extension.

Every file written here ends with mode 0644 (`FILE_MODE`), also when the writer replaced the
temporary file with one of its own: safetensors' `save_file`, for one, writes a new file of mode
0600 in its place.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from .config import ConfigError

FILE_MODE = 0o644  # an ordinary data file: the owner writes, everyone reads


def temp_path(path: str) -> str:
    """A fresh, empty temporary file next to `path` (created, so no other writer gets the name)."""
    directory, name = os.path.split(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    os.chmod(tmp, FILE_MODE)  # mkstemp makes it private; the result is an ordinary data file
    return tmp


def check_directory(what: str, directory: str) -> None:
    """ConfigError (one line) unless `directory` exists or can be made: its nearest existing
    ancestor is a directory in which an entry can be made. Tried (an entry made and removed at
    once), not asked of `os.access`: root passes every permission check, yet cannot create files
    under /proc or /sys or on a read-only mount. Leaves nothing behind (a refused run makes no
    directory)."""
    here = os.path.abspath(directory)
    while not os.path.exists(here):   # the root exists: this ends
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        raise ConfigError(f"cannot create the directory of {what}: {here} is a file; got {directory}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=here))
    except OSError as e:
        raise ConfigError(f"cannot write {what}: nothing can be created in directory {here} ({e.strerror or e}); "
                          f"got {directory}") from None


def fsync(path: str) -> None:
    """Flush a file (or a directory's entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield a fresh temporary path next to `path`; on success it is flushed to disk and replaces
    `path`, on error it is removed."""
    tmp = temp_path(path)
    try:
        yield tmp
        os.chmod(tmp, FILE_MODE)  # the writer may have put a file of its own, with its own mode, in its place
        fsync(tmp)
        os.replace(tmp, path)
        fsync(os.path.dirname(os.path.abspath(path)))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@dataclass
class NewFile:
    tmp: str   # write here
    path: str  # where it went (the first free name); final once the `new_file` block has ended


def numbered(path: str) -> Iterator[str]:
    """`path`, then `stem.1.ext`, `stem.2.ext`, ..."""
    stem, ext = os.path.splitext(path)
    yield path
    for k in itertools.count(1):
        yield f"{stem}.{k}{ext}"


@contextlib.contextmanager
def new_file(path: str) -> Iterator[NewFile]:
    """Like atomic_path, but the file is kept (also when the block raises) under the first free
    name of `numbered(path)`: no file is ever replaced. The name is taken with a hard link, which
    fails if another writer took it first."""
    out = NewFile(tmp=temp_path(path), path=path)
    try:
        yield out
    finally:
        os.chmod(out.tmp, FILE_MODE)
        fsync(out.tmp)
        for candidate in numbered(path):
            try:
                os.link(out.tmp, candidate)
            except FileExistsError:
                continue
            out.path = candidate
            break
        os.remove(out.tmp)
        fsync(os.path.dirname(os.path.abspath(path)))
