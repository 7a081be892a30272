"""MiniMind's supervised fine-tuning rows on the token cache (jingyaogong/minimind:
dataset/lm_dataset.py, `SFTDataset`).

Row i, from the token ids of conversation i rendered with the chat template (`data.chat`):

    input_ids = ids[:max_seq_len] + [pad] * (rest)                                         # [S]
    labels    = input_ids inside each assistant span, -100 everywhere else                  # [S]

An assistant span starts after `<|im_start|>assistant\\n` (the ids of bos + "assistant\\n") and runs
through the next `<|im_end|>\\n` (the ids of eos + "\\n"), both ends included in the loss as far as
the row reaches; a span that the truncation cuts runs to the end of the row. The spans are found
in the padded row, left to right, each search resuming after the end of the last span: MiniMind's
`generate_labels`. The rendered text is tokenised without special additions (MiniMind's tokenizer
adds no bos/eos): the template writes every special token itself.

Labels are unshifted, as MiniMind returns them; `batches.shift_labels` makes the targets.
"""
from __future__ import annotations

import numpy as np
import torch

from .batches import IGNORE_INDEX
from .chat import ChatTemplate, iter_conversation_texts
from .token_cache import TokenCache, build_token_cache
from .tokenizer import LoadedTokenizer

ASSISTANT_TURN = "assistant\n"   # after bos: where the loss starts
TURN_END = "\n"                  # after eos: where it ends


def span_markers(tok: LoadedTokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(ids of bos + "assistant\\n", ids of eos + "\\n"), as the tokenizer encodes them."""
    bos = tok.tokenizer.id_to_token(tok.bos_id)
    eos = tok.tokenizer.id_to_token(tok.eos_id)
    start = tok.tokenizer.encode(bos + ASSISTANT_TURN, add_special_tokens=False).ids
    end = tok.tokenizer.encode(eos + TURN_END, add_special_tokens=False).ids
    return np.asarray(start, dtype=np.int64), np.asarray(end, dtype=np.int64)


def _starts(row: np.ndarray, marker: np.ndarray) -> np.ndarray:
    """Every position where `marker` begins in `row` (sorted)."""
    if len(row) < len(marker):
        return np.zeros(0, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(row, len(marker))
    return np.flatnonzero((windows == marker).all(axis=1))


def assistant_mask(row: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """bool [S]: the positions of `row` [S] in the loss (the assistant spans, markers as above)."""
    mask = np.zeros(len(row), dtype=bool)
    starts, ends = _starts(row, start), _starts(row, end)
    position = 0          # where the next span may start
    for s in starts:
        if s < position:
            continue
        first = s + len(start)
        later = ends[ends >= first]
        stop = later[0] + len(end) if len(later) else len(row)
        mask[first:stop] = True
        position = stop
    return mask


class SFTDataset:
    """Fixed-length conversation rows from a TokenCache of rendered conversations."""

    def __init__(self, cache: TokenCache, *, max_seq_len: int, pad_id: int, start: np.ndarray, end: np.ndarray):
        self.cache, self.max_seq_len, self.pad_id = cache, max_seq_len, pad_id
        self.start, self.end = start, end

    @classmethod
    def open(cls, data_path: str, tok: LoadedTokenizer, *, max_seq_len: int) -> "SFTDataset":
        """The rows of `data_path` (a conversation jsonl); the cache is built on first use, keyed by the template."""
        template = ChatTemplate.of_tokenizer(tok.path)
        cache = build_token_cache(data_path, tok, texts=lambda path: iter_conversation_texts(path, template),
                                  rendering=template.source)
        start, end = span_markers(tok)
        return cls(cache, max_seq_len=max_seq_len, pad_id=tok.pad_id, start=start, end=end)

    def __len__(self) -> int:
        return len(self.cache)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, labels) int64 [max_seq_len] of row i."""
        ids = np.full(self.max_seq_len, self.pad_id, dtype=np.int64)
        text = self.cache.document(i)[:self.max_seq_len]
        ids[:len(text)] = text
        return ids, np.where(assistant_mask(ids, self.start, self.end), ids, IGNORE_INDEX)

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `indices` -> (input_ids, labels), both int64 [len(indices), max_seq_len]."""
        rows = [self.row(int(i)) for i in indices]
        return (torch.from_numpy(np.stack([r[0] for r in rows])), torch.from_numpy(np.stack([r[1] for r in rows])))
