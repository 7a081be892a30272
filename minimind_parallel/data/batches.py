"""Batches of token ids and their next-token targets, split over data-parallel ranks and microbatches.

A batch is `Batch(input_ids [B, S], targets [B, S])`: `targets[:, s]` is the token that follows
position s, IGNORE_INDEX where nothing is predicted (the last position of every row, and labels
that were ignored). The labels are shifted here, once, so the models compute their loss over all
S positions with no slicing, and any later split of the sequence (context parallelism) keeps
every position's target beside it: a chunk's last token keeps the first token of the next chunk
as its target.

The loss of every layout is the mean over every target token of the global batch: each
microbatch's mean is weighted by its share of the targets (`count_targets`, read by the pipeline
schedule), and the batch makers below give every row the same number of targets, so the mean
over DP replicas is the global mean too.

Where the rest plugs in: a real dataset hands MiniMind-style labels to `shift_labels` (or its own
targets) and its rows to `dp_rows`, then the rank's tokens to `cp_tokens` (context parallelism:
both tensors split alike along the sequence, so every target stays beside its position).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

IGNORE_INDEX = -100   # PyTorch's cross-entropy default, and MiniMind's padding label


class Batch(NamedTuple):
    input_ids: torch.Tensor   # [B, S] int64
    targets: torch.Tensor     # [B, S] int64: the next token of each position, IGNORE_INDEX where none


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """MiniMind-style labels [B, S] (the ids, IGNORE_INDEX at padding) -> targets [B, S]: the
    label of position s + 1 at s, IGNORE_INDEX at the last position."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    return targets


def count_targets(targets: torch.Tensor) -> torch.Tensor:
    """The number of target tokens (a 0-dim tensor on the targets' device: no host sync)."""
    return (targets != IGNORE_INDEX).sum()


def random_batch(seed: int, rows: int, seq_len: int, vocab: int, device="cpu") -> Batch:
    """Random ids from a seeded generator, the same on every rank. Label position 1 of every row
    is ignored (so target position 0), so the checks see an ignored label, and every row has
    seq_len - 2 targets: a mean over DP ranks equals the global mean."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq_len), generator=g)
    labels = ids.clone()
    labels[:, 1] = IGNORE_INDEX
    return Batch(ids.to(device), shift_labels(labels).to(device))


def broadcast_batch(rows: int, seq_len: int, vocab: int, seed: int, device) -> Batch:
    """Random ids made on global rank 0 and broadcast to every rank (collective over the world);
    every position but the last of each row is a target."""
    ids = torch.empty(rows, seq_len, dtype=torch.long, device=device)
    if dist.get_rank() == 0:
        g = torch.Generator().manual_seed(seed)
        ids.copy_(torch.randint(0, vocab, (rows, seq_len), generator=g))
    dist.broadcast(ids, src=0)
    return Batch(ids, shift_labels(ids))


def dp_rows(batch: Batch, dp_rank: int, dp: int) -> Batch:
    """Data-parallel rank `dp_rank`'s contiguous rows of a global batch [dp * b, S] -> [b, S],
    as their own tensors (a rank keeps only its rows, not the global batch behind a view)."""
    if batch.input_ids.shape[0] % dp:
        raise ValueError(f"global batch of {batch.input_ids.shape[0]} rows is not divisible by dp={dp}")
    return Batch(*(t.chunk(dp)[dp_rank].clone() for t in batch))


def split_microbatches(input_ids: torch.Tensor, targets: torch.Tensor, num_microbatches: int) -> list[Batch]:
    """[B, S] -> M batches of [B/M, S] (B % M == 0), views of the given rows."""
    if input_ids.shape[0] % num_microbatches:
        raise ValueError(f"batch {input_ids.shape[0]} is not divisible by num_microbatches={num_microbatches}")
    return [Batch(i, t) for i, t in zip(input_ids.chunk(num_microbatches), targets.chunk(num_microbatches))]


def cp_tokens(batch: Batch, layout, cp_rank: int) -> Batch:
    """Context-parallel rank `cp_rank`'s tokens of every row: [b, S] -> [b, S/C], ids and targets
    split alike by the `context_parallel.ContextLayout` (load-balanced: chunks i and 2C-1-i), as
    their own tensors. A chunk's last position keeps its target (the next chunk's first token)."""
    if layout.cp == 1:
        return batch
    return Batch(*(layout.split(t, cp_rank, dim=1) for t in batch))
