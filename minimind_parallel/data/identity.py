"""A data file's identity, saved with a checkpoint and checked before a resume: its size and a
SHA-256 of its head and tail (the whole file when it is small). Another file -- even one with the
same number of rows -- has another identity; reading it costs at most 2 x HEAD_TAIL_BYTES
whatever the file's size.
"""
from __future__ import annotations

import hashlib
import os

from ..config import ConfigError

HEAD_TAIL_BYTES = 2 ** 20


def file_identity(path: str) -> dict:
    """{"size": bytes, "sha256_head_tail": hex digest of the first and last HEAD_TAIL_BYTES bytes}."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(f.read(HEAD_TAIL_BYTES))
        if size > HEAD_TAIL_BYTES:
            f.seek(max(HEAD_TAIL_BYTES, size - HEAD_TAIL_BYTES))
            digest.update(f.read())
    return {"size": size, "sha256_head_tail": digest.hexdigest()}


def check_same_file(what: str, path: str, saved: dict) -> None:
    """ConfigError (one line) when `path` is not the file whose identity `saved` is."""
    now = file_identity(path)
    if now != {k: saved.get(k) for k in now}:
        raise ConfigError(f"{what} {path} is not the file the checkpoint was trained on: size {saved.get('size')} "
                          f"bytes, head/tail sha256 {str(saved.get('sha256_head_tail'))[:12]} in the checkpoint; "
                          f"size {now['size']} bytes, sha256 {now['sha256_head_tail'][:12]} now")
