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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed import comm
from ..distributed.ranges import span


def _wgrad(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = dY^T X over all tokens: [S, B, N], [S, B, H] -> [N, H]."""
    return grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


class LinearWithAsyncCommunication(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sequence_parallel, n, *params):
        """x: [S/T, B, H] (SP) or [S, B, H]; params: n weights [N_i/T, H] then n biases (or None)."""
        weights, biases = params[:n], params[n:]
        full = comm.all_gather_dim0(x, group) if sequence_parallel else x  # [S/T,B,H] -> [S,B,H]
        ctx.save_for_backward(x, *weights)  # the local shard only, never `full`
        ctx.group, ctx.sequence_parallel, ctx.n = group, sequence_parallel, n
        ctx.has_bias = [b is not None for b in biases]
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors                                          # grads: one per output (None if unused)
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
        return (dgrad, None, None, None, *wgrads, *bgrads)


def linear_with_async_communication(x, weights, biases, group, sequence_parallel: bool):
    """Apply the linears `weights` (with `biases`, None allowed) to x; returns a tuple of outputs."""
    return LinearWithAsyncCommunication.apply(x, group, sequence_parallel, len(weights), *weights, *biases)
