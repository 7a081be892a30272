"""What a training rank reads: its replica's rows of every optimizer step and of the held-out
batches, as `Batch(input_ids, targets)` (MiniMind's labels shifted once, `batches.shift_labels`):
pretraining rows of text (`data.pretrain`) or conversation rows (`data.sft`), by `DataFormat`.

Held-out rows come from their own jsonl, or are a fraction of the training file's rows set aside
by a permutation seeded with the run's seed (the same on every rank and every resume) and never
trained on. Held-out batches are taken in row order, each global batch split over the DP ranks
as the sampler splits training batches (contiguous shares).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..config import Choice
from .batches import Batch, shift_labels
from .pretrain import PretrainDataset
from .sft import SFTDataset
from .token_cache import build_token_cache
from .tokenizer import LoadedTokenizer

HELDOUT_STREAM = 7  # a second random stream beside the sampler's [seed, epoch]: [seed, 7, 7]


class DataFormat(Choice):
    """What a row of the jsonl is (`--data_format`)."""

    TEXT = "text"                    # {"text": ...}: MiniMind's pretraining rows (`data.pretrain`)
    CONVERSATIONS = "conversations"  # {"conversations": [...]}: MiniMind's SFT rows (`data.sft`)


def open_dataset(data_path: str, tok: LoadedTokenizer, max_seq_len: int,
                 data_format: DataFormat = DataFormat.TEXT) -> PretrainDataset | SFTDataset:
    """The rows of `data_path` (its token cache is built on first use, reused after)."""
    if data_format == DataFormat.CONVERSATIONS:
        return SFTDataset.open(data_path, tok, max_seq_len=max_seq_len)
    return PretrainDataset.from_tokenizer(build_token_cache(data_path, tok), tok, max_seq_len=max_seq_len)


def heldout_split(num_rows: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (training rows, held-out rows), both sorted; ceil(fraction * num_rows) rows held out."""
    order = np.random.default_rng([seed, HELDOUT_STREAM, HELDOUT_STREAM]).permutation(num_rows)
    k = math.ceil(fraction * num_rows) if fraction > 0 else 0
    return np.sort(order[k:]), np.sort(order[:k])


@dataclass(frozen=True)
class Rows:
    """Some rows of a dataset; position i is dataset row rows[i]."""

    dataset: PretrainDataset | SFTDataset
    rows: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, positions) -> Batch:
        """[len(positions), max_seq_len] ids and their next-token targets."""
        input_ids, labels = self.dataset.batch(self.rows[np.asarray(positions)])
        return Batch(input_ids, shift_labels(labels))


def heldout_batches(rows: Rows, *, rows_per_replica: int, dp_rank: int, dp: int, max_batches: int) -> list[Batch]:
    """This DP rank's share of the first `max_batches` held-out global batches (fewer if the rows end)."""
    per_global = rows_per_replica * dp
    count = min(max_batches, len(rows) // per_global)
    starts = [k * per_global + dp_rank * rows_per_replica for k in range(count)]
    return [rows.batch(np.arange(s, s + rows_per_replica)) for s in starts]
