"""Tensor-parallel layers: column/row-parallel linears and the vocab-parallel embedding.

The communication is in `mappings` (region switches) and `async_linear`; these modules only
decide which switch sits where. Weights are created at shard size and filled by sharding a
dense state dict (`minimind_parallel.sharding`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import comm
from .async_linear import linear_with_async_communication
from .deferred_wgrad import linear
from .mappings import (copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                       reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region)


def mark_partial_grad(param: nn.Parameter) -> nn.Parameter:
    """This replicated parameter sees only this rank's part of the data (a sequence shard or a
    head slice): its gradient must be summed over the TP group after backward."""
    param.tp_partial_grad = True
    return param


class ColumnParallelLinear(nn.Module):
    """Y = X W^T with W split along the output dim: each rank computes Y[..., N/T].

    Entering the TP region: plain TP -> f (copy; backward all-reduce); SP -> all-gather of the
    sequence shard (backward reduce-scatter); --async_communication -> LinearWithAsyncCommunication.
    With `shared_input` (--shared_sp_gather) the linears that read one input (`column_parallel`)
    enter the region once for all of them.
    """

    def __init__(self, in_features, out_features, *, group=None, bias=False, sequence_parallel=False,
                 async_communication=False, shared_input=False, dtype=None):
        super().__init__()
        t = comm.group_size(group)
        assert out_features % t == 0, f"out_features {out_features} not divisible by TP size {t}"
        self.group, self.sequence_parallel, self.async_communication = group, sequence_parallel, async_communication
        self.shared_input = shared_input
        self.weight_grad_store = None   # a zero-bubble schedule's (deferred_wgrad.WeightGradStore)
        self.weight = nn.Parameter(torch.empty(out_features // t, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features // t, dtype=dtype)) if bias else None

    def forward(self, x):
        (y,) = column_parallel([self], x)
        return y


def column_parallel(linears: list[ColumnParallelLinear], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Run column-parallel linears that read the same input: entering the TP region once for all
    of them when they share it (`shared_input` of the first), else once each.

    x: [S/T, B, H] under SP, else [S, B, H] (replicated) -> one [S, B, N_i/T] per linear.
    """
    first = linears[0]
    if len(linears) > 1 and not first.shared_input:
        return tuple(y for l in linears for y in column_parallel([l], x))
    group, sp, store = first.group, first.sequence_parallel, first.weight_grad_store
    if first.async_communication and comm.group_size(group) > 1:
        return linear_with_async_communication(x, [l.weight for l in linears], [l.bias for l in linears], group, sp,
                                               store)
    if sp:
        x = gather_from_sequence_parallel_region(x, group)  # [S/T, B, H] -> [S, B, H]; bwd reduce-scatter
    else:
        x = copy_to_tensor_parallel_region(x, group)        # identity; bwd all-reduce
    return tuple(linear(x, l.weight, l.bias, l.weight_grad_store) for l in linears)


class RowParallelLinear(nn.Module):
    """Y = X W^T with W split along the input dim: each rank holds X[..., N/T] and a partial Y.

    Leaving the TP region: plain TP -> g (all-reduce); SP -> reduce-scatter to the sequence shard.
    """

    def __init__(self, in_features, out_features, *, group=None, bias=False, sequence_parallel=False,
                 dtype=None):
        super().__init__()
        t = comm.group_size(group)
        assert in_features % t == 0, f"in_features {in_features} not divisible by TP size {t}"
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight_grad_store = None   # a zero-bubble schedule's (deferred_wgrad.WeightGradStore)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // t, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        if self.bias is not None and sequence_parallel:
            mark_partial_grad(self.bias)  # added on the sequence shard

    def forward(self, x):
        """x: [..., N/T], this rank's slice of the input -> the summed output."""
        return self.leave_region(linear(x, self.weight, None, self.weight_grad_store))   # partial sum over ranks

    def leave_region(self, y):
        """This rank's partial product y = X W^T (made here, or by a fused Function such as
        `recompute.swiglu_linear`) -> the summed output (+ bias)."""
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.group)  # [S, B, H] -> [S/T, B, H]
        else:
            y = reduce_from_tensor_parallel_region(y, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split across TP ranks: rank r holds rows [r*V/T, (r+1)*V/T).

    Ids outside this rank's range look up row 0 and are zeroed; the sum over ranks (all-reduce,
    or reduce-scatter straight into the SP layout) gives every id its one real row.
    """

    def __init__(self, num_embeddings, embedding_dim, *, group=None, sequence_parallel=False, dtype=None):
        super().__init__()
        t, r = comm.group_size(group), comm.rank_in(group)
        assert num_embeddings % t == 0, f"vocab {num_embeddings} not divisible by TP size {t}"
        self.group, self.sequence_parallel = group, sequence_parallel
        self.per_rank = num_embeddings // t
        self.start = r * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim, dtype=dtype))

    def forward(self, ids):
        """ids: [S, B] -> [S, B, H] (or [S/T, B, H] under SP)."""
        if comm.group_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.start + self.per_rank)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.group)  # [S,B,H] -> [S/T,B,H]
        return reduce_from_tensor_parallel_region(out, self.group)
