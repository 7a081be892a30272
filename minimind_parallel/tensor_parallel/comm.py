"""The raw collectives of the tensor-parallel group. Every TP collective in the library goes
through one of these (the autograd mappings and the async linear call them; layers never call
`torch.distributed` themselves). `group=None` means a one-rank group: nothing to communicate.

Sequence collectives act on dim 0 because activations are sequence-first [S, B, H].
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.13 names the single-tensor collectives *_single; older releases *_into_tensor / *_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Done:
    """Handle of a collective that had nothing to do (one-rank group)."""

    def wait(self):
        return True


class _Started:
    """A collective started with async_op=True. Its wait() lives here, so every wait of a TP
    collective runs inside this module (the memory tracker tells a backend's own buffers, e.g.
    gloo's reduce-scatter copy, from ours by that)."""

    def __init__(self, work):
        self._work = work

    def wait(self):
        return self._work.wait()


def world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def rank_in(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group, *, async_op: bool = False, op=dist.ReduceOp.SUM):
    """In place on `x` (callers pass a tensor they own, e.g. a fresh GEMM output)."""
    if group is None:
        return (x, _Done()) if async_op else x
    work = dist.all_reduce(x, op=op, group=group, async_op=async_op)
    return (x, _Started(work)) if async_op else x


def all_gather_dim0(x: torch.Tensor, group, *, async_op: bool = False):
    """[S/T, ...] -> [S, ...], rank order along dim 0."""
    t = world(group)
    if t == 1:
        return (x, _Done()) if async_op else x
    x = x.contiguous()
    out = torch.empty((x.shape[0] * t, *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = _all_gather_single(out, x, group=group, async_op=async_op)
    return (out, _Started(work)) if async_op else out


def reduce_scatter_dim0(x: torch.Tensor, group, *, async_op: bool = False):
    """[S, ...] -> [S/T, ...]: sum over ranks, keep this rank's chunk of dim 0."""
    t = world(group)
    if t == 1:
        return (x, _Done()) if async_op else x
    x = x.contiguous()
    out = torch.empty((x.shape[0] // t, *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = _reduce_scatter_single(out, x, group=group, async_op=async_op)
    return (out, _Started(work)) if async_op else out


def all_gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """[..., N/T] -> [..., N], rank order along the last dim."""
    t = world(group)
    if t == 1:
        return x
    stacked = all_gather_dim0(x.unsqueeze(0), group)           # [T, ..., N/T]
    return torch.cat(stacked.unbind(0), dim=-1).contiguous()  # [..., N]


def split_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's chunk of `dim`, as a fresh tensor: a view would pin the whole input alive."""
    t = world(group)
    if t == 1:
        return x
    return x.chunk(t, dim=dim)[rank_in(group)].clone(memory_format=torch.contiguous_format)
