"""`LinearWithAsyncCommunication`: the column-parallel linear of the MiniMind Parallelism Book,
sections 4.3.1 and 4.3.2.

One Function serves one linear or several linears that read the same input (q/k/v, gate/up
with --shared_sp_gather): the input enters the TP region once, and backward sums their dgrads
into one collective.

Plain TP (4.3.1), backward:            SP recompute (4.3.2), backward:
  1. dgrad = dY @ W                       1. async all-gather of the saved local shard
  2. async all-reduce(dgrad)              2. dgrad = dY @ W
  3. wgrad = dY^T @ X   (overlaps 2)      3. async reduce-scatter(dgrad)
  4. bias grad                            4. wait all-gather
  5. wait all-reduce                      5. wgrad = dY^T @ X_full  (overlaps 3)
  6. return dgrad                         6. wait reduce-scatter
                                          7. return the local-sequence grad
Under SP the forward saves only the local shard [S/T, B, H]; the gathered [S, B, H] input dies
when the forward returns. On CUDA the overlap needs CUDA_DEVICE_MAX_CONNECTIONS=1 (the launcher
sets it) so the collective's kernel is queued before the wgrad GEMM.

Under a zero-bubble schedule's B (a collecting `deferred_wgrad.WeightGradStore`) the backward
keeps its order without the wgrad: 1./2. dgrad, 3. the async reduce-scatter (all-reduce) of
dgrad, 6. its wait -- no all-gather is issued, nothing overlaps the reduce -- and queues the W
half: re-gather the local shard (SP), the wgrad GEMMs, accumulated into the weights' .grad. The
input grad so reaches the previous stage after dgrad and one collective; W runs in the bubble.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from ..distributed import comm
from ..distributed.ranges import span
from .deferred_wgrad import accumulate, autocast_of as _autocast_of, defers, wgrad as _wgrad


def _deferred_wgrads(x, grads, weights, group, sequence_parallel: bool, autocast: dict) -> None:
    """The W half of a deferred backward: the input re-gathered (SP), each weight's wgrad."""
    with torch.autocast(**autocast), span("async_linear.wgrad"):
        full = comm.all_gather_dim0(x, group) if sequence_parallel else x   # [S/T,B,H] -> [S,B,H]
        for g, w in zip(grads, weights):
            if g is not None:
                accumulate(w, _wgrad(g, full))


class LinearWithAsyncCommunication(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sequence_parallel, n, store, *params):
        """x: [S/T, B, H] (SP) or [S, B, H]; params: n weights [N_i/T, H] then n biases (or None);
        store: a WeightGradStore that may defer the wgrads, or None."""
        weights, biases = params[:n], params[n:]
        full = comm.all_gather_dim0(x, group) if sequence_parallel else x  # [S/T,B,H] -> [S,B,H]
        ctx.save_for_backward(x, *weights)  # the local shard only, never `full`
        ctx.group, ctx.sequence_parallel, ctx.n = group, sequence_parallel, n
        ctx.has_bias = [b is not None for b in biases]
        ctx.store, ctx.params = store, weights
        ctx.autocast = _autocast_of(x)
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        with torch.autocast(**ctx.autocast):
            return LinearWithAsyncCommunication._backward(ctx, *grads)

    @staticmethod
    def _backward(ctx, *grads):
        x, *weights = ctx.saved_tensors                                          # grads: one per output (None if unused)
        if defers(ctx.store):
            return LinearWithAsyncCommunication._dgrad_only(ctx, x, weights, grads)
        if ctx.sequence_parallel:
            full, gather = comm.all_gather_dim0(x, ctx.group, async_op=True)   # 1. re-gather input
        else:
            full, gather = x, None
        with span("async_linear.dgrad"):
            dgrad = None
            for g, w in zip(grads, weights):                                     # dgrad: sum over linears
                if g is not None:
                    d = g.matmul(w)
                    dgrad = d if dgrad is None else dgrad + d
            if dgrad is None:
                dgrad = torch.zeros_like(full)
        if ctx.sequence_parallel:
            dgrad, reduce = comm.reduce_scatter_dim0(dgrad, ctx.group, async_op=True)  # 3. RS overlaps wgrad
            with span("wait:all_gather"):
                gather.wait()                                                    # 4. full input is back
        else:
            dgrad, reduce = comm.all_reduce(dgrad, ctx.group, async_op=True)     # AR overlaps wgrad
        with span("async_linear.wgrad"):
            wgrads = [_wgrad(g, full) if g is not None else None for g in grads]  # 5. wgrad GEMMs
        bgrads = [g.reshape(-1, g.shape[-1]).sum(0) if (g is not None and has) else None
                  for g, has in zip(grads, ctx.has_bias)]
        with span("wait:reduce_scatter" if ctx.sequence_parallel else "wait:all_reduce"):
            reduce.wait()                                                        # 6. dgrad is complete
        return (dgrad, None, None, None, None, *wgrads, *bgrads)

    @staticmethod
    def _dgrad_only(ctx, x, weights, grads):
        """B of a zero-bubble schedule: dgrad and its collective now, the wgrads queued for W."""
        with span("async_linear.dgrad"):
            dgrad = None
            for g, w in zip(grads, weights):
                if g is not None:
                    d = g.matmul(w)
                    dgrad = d if dgrad is None else dgrad + d
            if dgrad is None:
                dgrad = torch.zeros(x.shape[0] * comm.group_size(ctx.group) if ctx.sequence_parallel else x.shape[0],
                                    *x.shape[1:], dtype=x.dtype, device=x.device)
        if ctx.sequence_parallel:
            dgrad, reduce = comm.reduce_scatter_dim0(dgrad, ctx.group, async_op=True)
        else:
            dgrad, reduce = comm.all_reduce(dgrad, ctx.group, async_op=True)
        ctx.store.defer(partial(_deferred_wgrads, x, grads, ctx.params, ctx.group, ctx.sequence_parallel,
                                ctx.autocast))
        bgrads = [g.reshape(-1, g.shape[-1]).sum(0) if (g is not None and has) else None
                  for g, has in zip(grads, ctx.has_bias)]
        with span("wait:reduce_scatter" if ctx.sequence_parallel else "wait:all_reduce"):
            reduce.wait()
        return (dgrad, None, None, None, None, *[None] * ctx.n, *bgrads)


def linear_with_async_communication(x, weights, biases, group, sequence_parallel: bool, store=None):
    """Apply the linears `weights` (with `biases`, None allowed) to x; returns a tuple of outputs.
    `store`: a WeightGradStore that defers the wgrads while it collects (deferred_wgrad)."""
    return LinearWithAsyncCommunication.apply(x, group, sequence_parallel, len(weights), store, *weights, *biases)
