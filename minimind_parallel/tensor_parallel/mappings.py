"""Region switches of tensor and sequence parallelism, one autograd Function each.

Each Function's forward and backward are the two halves of one idea (Megatron's f and g and
their sequence-parallel counterparts). Layouts: sequence-first [S, B, H]; T = TP size.

    f  copy_to_tensor_parallel_region        fwd identity          bwd all-reduce
    g  reduce_from_tensor_parallel_region    fwd all-reduce        bwd identity
       scatter_to_tensor_parallel_region     fwd split last dim    bwd all-gather last dim
       gather_from_tensor_parallel_region    fwd all-gather last   bwd split last dim
       scatter_to_sequence_parallel_region   fwd split dim 0       bwd all-gather dim 0
       gather_from_sequence_parallel_region  fwd all-gather dim 0  bwd reduce-scatter (or split)
       reduce_scatter_to_sequence_parallel_region  fwd reduce-scatter  bwd all-gather dim 0
"""
from __future__ import annotations

import torch

from ..distributed import comm


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # The replicated input fed T partial products: sum their input grads.
        return comm.all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce(x.contiguous(), group)  # x is a fresh partial GEMM output

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.split_dim(x, -1, group)             # [..., N] -> [..., N/T]

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather_last_dim(grad, ctx.group), None


class _GatherFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather_last_dim(x, group)       # [..., N/T] -> [..., N]

    @staticmethod
    def backward(ctx, grad):
        return comm.split_dim(grad, -1, ctx.group), None


class _ScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.split_dim(x, 0, group)              # [S, B, H] -> [S/T, B, H]

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather_dim0(grad, ctx.group), None


class _GatherFromSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return comm.all_gather_dim0(x, group)           # [S/T, B, H] -> [S, B, H]

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:  # consumers were TP-sharded: each rank holds a partial sum
            return comm.reduce_scatter_dim0(grad, ctx.group), None, None
        return comm.split_dim(grad, 0, ctx.group), None, None  # consumers replicated: grads equal


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.reduce_scatter_dim0(x, group)       # [S, B, H] partial -> [S/T, B, H] summed

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather_dim0(grad, ctx.group), None


def copy_to_tensor_parallel_region(x, group):
    return _CopyToTensorParallel.apply(x, group) if comm.group_size(group) > 1 else x


def reduce_from_tensor_parallel_region(x, group):
    return _ReduceFromTensorParallel.apply(x, group) if comm.group_size(group) > 1 else x


def scatter_to_tensor_parallel_region(x, group):
    return _ScatterToTensorParallel.apply(x, group) if comm.group_size(group) > 1 else x


def gather_from_tensor_parallel_region(x, group):
    return _GatherFromTensorParallel.apply(x, group) if comm.group_size(group) > 1 else x


def scatter_to_sequence_parallel_region(x, group):
    return _ScatterToSequenceParallel.apply(x, group) if comm.group_size(group) > 1 else x


def gather_from_sequence_parallel_region(x, group, grad_is_partial: bool = True):
    """`grad_is_partial=True` when the consumers are TP-sharded (column-parallel linears):
    backward reduce-scatters. False when they are replicated (e.g. a replicated lm_head):
    backward just keeps this rank's slice."""
    return _GatherFromSequenceParallel.apply(x, group, grad_is_partial) if comm.group_size(group) > 1 else x


def reduce_scatter_to_sequence_parallel_region(x, group):
    return _ReduceScatterToSequenceParallel.apply(x, group) if comm.group_size(group) > 1 else x
