"""Region switches of context parallelism, one autograd Function each, forward and backward the
two halves of one idea (as tensor_parallel/mappings.py). Sequence-first; C = CP size.

    gather_kv           fwd all-gather dim 0 (every rank's tokens)   bwd reduce-scatter dim 0
    sequence_to_heads   fwd all-to-all: [S/C, B, C, n, d] -> [S, B, n, d]   bwd the inverse
    heads_to_sequence   fwd all-to-all: [S, B, n, d] -> [S/C, B, C, n, d]   bwd the inverse

After a gather or an all-to-all the sequence is every rank's tokens in rank order (each rank's
chunks, see layout.py), not in position order: attention masks by chunk, so no reordering is
needed.
"""
from __future__ import annotations

import torch

from ..distributed import comm


class _GatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather_dim0(x, group)                  # [S/C, ...] -> [S, ...]

    @staticmethod
    def backward(ctx, grad):
        # every rank's queries read every rank's keys: sum their grads, keep this rank's tokens
        return comm.reduce_scatter_dim0(grad, ctx.group), None


def _to_heads(x, group):
    # [S/C, B, C, n, d] -> [C, S/C, B, n, d]: part c goes to rank c
    out = comm.all_to_all_dim0(x.permute(2, 0, 1, 3, 4), group)  # [C (source), S/C, B, n, d]
    return out.flatten(0, 1)                                   # [S, B, n, d]


def _to_sequence(x, group):
    c = comm.group_size(group)
    parts = x.unflatten(0, (c, -1))                            # [C (owner), S/C, B, n, d]
    out = comm.all_to_all_dim0(parts, group)                   # [C (head group), S/C, B, n, d]
    return out.permute(1, 2, 0, 3, 4)                          # [S/C, B, C, n, d]


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _to_sequence(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _to_heads(grad, ctx.group), None


def gather_kv(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherKV.apply(x, group) if comm.group_size(group) > 1 else x


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[S/C, B, C, n, d] (head group c for rank c) -> [S, B, n, d] (this rank's head group)."""
    return _SequenceToHeads.apply(x, group) if comm.group_size(group) > 1 else x.squeeze(2)


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[S, B, n, d] (this rank's head group) -> [S/C, B, C, n, d] (every head group)."""
    return _HeadsToSequence.apply(x, group) if comm.group_size(group) > 1 else x.unsqueeze(2)
