"""A jsonl corpus tokenised once into a memory-mapped token file, cached next to the data.

Two files beside `DATA.jsonl`, named by a key of the data file (size, modification time) and the
tokenizer (a hash of its tokenizer.json), so a changed data file or tokenizer is tokenised again
and an unchanged pair is reused by every later run and every rank:

    DATA.jsonl.<key>.tokens.u16   every document's token ids, concatenated (raw uint16)
    DATA.jsonl.<key>.index.npy    int64 [num_docs + 1]: document i is tokens[index[i]:index[i+1]]

Documents are stored whole (without bos/eos); truncation to a sequence length happens when a row
is read, so one cache serves every `max_seq_len`. Each file is written under a unique temporary
name and renamed; the index is renamed last and marks a complete cache, so a killed tokenisation
leaves nothing that a later run would read. Build it once before the ranks start; ranks that
build at the same time are safe (each writes the same bytes under its own temporary names) but
tokenise in vain.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice

import numpy as np

from ..config import ConfigError
from ..files import atomic_path
from .jsonl import iter_texts, open_data_file
from .tokenizer import LoadedTokenizer

TOKEN_DTYPE = np.uint16
CACHE_FORMAT = "minimind-token-cache-v1"  # part of the key: a new layout never reads an old cache
ENCODE_CHUNK_DOCS = 1024  # documents per encode_batch call (tokenizers encodes a batch on all cores)


@dataclass(frozen=True, kw_only=True)
class TokenCache:
    """The tokens of every document of a jsonl file, memory-mapped."""

    tokens: np.ndarray  # uint16 [total_tokens], a read-only memmap
    offsets: np.ndarray  # int64 [num_docs + 1]
    tokens_path: str
    index_path: str
    built: bool  # True when this call tokenised the data, False when it reused the cache

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def document(self, i: int) -> np.ndarray:
        """Token ids of document i (a view of the memmap)."""
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]


def check_vocab_fits(vocab_size: int) -> None:
    """The cache stores ids as uint16."""
    limit = np.iinfo(TOKEN_DTYPE).max + 1
    if vocab_size > limit:
        raise ConfigError(f"tokenizer vocab_size must be <= {limit} to store ids as uint16; "
                          f"got vocab_size={vocab_size}")


def cache_key(data_path: str, tokenizer_path: str, rendering: str = "") -> str:
    """Changes when the data file (size, mtime), the tokenizer.json (contents) or the `rendering` of
    a row into text (a chat template; "" for a text row) changes."""
    with open_data_file(data_path) as f:
        stat = os.fstat(f.fileno())
    digest = hashlib.sha256(f"{CACHE_FORMAT}|{stat.st_size}|{stat.st_mtime_ns}|".encode())
    if rendering:   # a text row's key is unchanged by it
        digest.update(f"{rendering}|".encode())
    with open(tokenizer_path, "rb") as f:
        digest.update(f.read())
    return digest.hexdigest()[:16]


def cache_paths(data_path: str, key: str) -> tuple[str, str]:
    """(tokens file, index file) of the cache with this key, next to the data file."""
    return f"{data_path}.{key}.tokens.u16", f"{data_path}.{key}.index.npy"


def _open_cache(tokens_path: str, index_path: str, built: bool) -> TokenCache | None:
    """The cache if both files are present and agree, else None."""
    if not (os.path.exists(tokens_path) and os.path.exists(index_path)):
        return None
    offsets = np.load(index_path)
    if os.path.getsize(tokens_path) != int(offsets[-1]) * TOKEN_DTYPE().itemsize:
        return None
    # np.memmap refuses an empty file; an all-empty corpus has no tokens to map
    tokens = (np.memmap(tokens_path, dtype=TOKEN_DTYPE, mode="r") if offsets[-1] > 0
              else np.zeros(0, dtype=TOKEN_DTYPE))
    return TokenCache(tokens=tokens, offsets=offsets, tokens_path=tokens_path, index_path=index_path, built=built)


def _encoded_chunks(texts: Iterator[str], tok: LoadedTokenizer) -> Iterator[list[np.ndarray]]:
    """The documents' token ids, ENCODE_CHUNK_DOCS documents per batch encode."""
    encode = getattr(tok.tokenizer, "encode_batch_fast", tok.tokenizer.encode_batch)  # fast: no offsets
    while chunk := list(islice(texts, ENCODE_CHUNK_DOCS)):
        yield [np.asarray(e.ids, dtype=TOKEN_DTYPE) for e in encode(chunk, add_special_tokens=False)]


def _tokenise(texts: Iterator[str], tok: LoadedTokenizer, tokens_file: str) -> np.ndarray:
    """Write all token ids to `tokens_file`; return the document offsets."""
    lengths = []
    with open(tokens_file, "wb") as out:
        for docs in _encoded_chunks(texts, tok):
            for ids in docs:
                ids.tofile(out)
            lengths.extend(len(ids) for ids in docs)
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)


def build_token_cache(data_path: str, tok: LoadedTokenizer, *, texts: Callable[[str], Iterator[str]] = iter_texts,
                      rendering: str = "") -> TokenCache:
    """The cache of `data_path` under `tok`: reused when present, else tokenised once and written
    atomically. `texts(data_path)`: each row's text (the "text" of a pretraining row; a rendered
    conversation, whose template is the `rendering` that keys the cache)."""
    check_vocab_fits(tok.vocab_size)
    tokens_path, index_path = cache_paths(data_path, cache_key(data_path, tok.path, rendering))
    cache = _open_cache(tokens_path, index_path, built=False)
    if cache is not None:
        return cache
    with atomic_path(index_path) as tmp_index:
        with atomic_path(tokens_path) as tmp_tokens:
            offsets = _tokenise(texts(data_path), tok, tmp_tokens)
        with open(tmp_index, "wb") as f:
            np.save(f, offsets)
    return _open_cache(tokens_path, index_path, built=True)
