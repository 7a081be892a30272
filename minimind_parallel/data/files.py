"""Atomic file writing: a unique temporary name in the target's directory, then `os.replace`.

A writer that is killed or raises leaves the target as it was (absent or the previous version),
never half written; concurrent writers of the same target each use their own temporary file.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield a fresh temporary path next to `path`; on success it replaces `path`, on error it is removed."""
    directory, name = os.path.split(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    os.chmod(tmp, 0o644)  # mkstemp makes it private; the result is an ordinary data file
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
