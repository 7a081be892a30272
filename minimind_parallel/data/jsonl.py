"""Reading MiniMind-style jsonl (one `{"text": ...}` object per line), refusing bad input with one line,
and writing a corpus of such objects atomically.

Blank lines are skipped; anything else that is not a JSON object with a string "text" names its
1-based line number.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

from ..config import ConfigError
from ..files import atomic_path


def open_data_file(path: str):
    """The file opened for binary reading, or ConfigError naming why it cannot be."""
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise ConfigError(f"data file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"data file is not readable: {path} ({e.strerror})") from None


def _text_of(raw: bytes, path: str, lineno: int) -> str:
    try:
        record = json.loads(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ConfigError(f"{path}:{lineno}: malformed jsonl line ({e})") from None
    if not isinstance(record, dict) or "text" not in record:
        raise ConfigError(f"{path}:{lineno}: jsonl line has no \"text\" field; got {raw[:60]!r}")
    if not isinstance(record["text"], str):
        raise ConfigError(f"{path}:{lineno}: \"text\" must be a string; got {type(record['text']).__name__}")
    return record["text"]


def iter_texts(path: str) -> Iterator[str]:
    """The "text" of every document, in file order; ConfigError on bad input or an empty dataset."""
    count = 0
    with open_data_file(path) as f:
        for lineno, raw in enumerate(f, 1):
            if raw.strip():
                count += 1
                yield _text_of(raw, path, lineno)
    if count == 0:
        raise ConfigError(f"empty dataset: {path} has no documents")


def write_jsonl(path: str, records: Iterable[dict]) -> int:
    """Write one JSON object per line to `path` atomically (unique temporary, then rename); returns
    how many were written."""
    count = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count
