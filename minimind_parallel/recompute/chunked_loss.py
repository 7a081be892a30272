"""Chunked loss: lm_head and cross entropy over K token chunks, the logits never whole.

The head's logits [N, V(/T)] and the loss's fp32 softmax of them are the largest tensors of a
step at a small hidden size (V 6400 against H 768). This Function runs the head and the loss one
chunk of N/K tokens at a time and keeps, for backward, only its inputs (the head input [N, H],
the weight, the targets) and the log-sum-exp of every row (fp32 [N]). Backward recomputes each
chunk's logits, turns them into the softmax with the saved log-sum-exp, and accumulates the
weight's gradient chunk by chunk (Megatron-LM's and Liger-Kernel's fused linear cross entropy
follow the same idea).

Vocab-parallel heads (`group` = the TP group) hold a [V/T, H] slice: each chunk's row max,
target logit and sum of exps are all-reduced over TP (3 all-reduces per chunk in forward, as
`vocab_parallel_cross_entropy` does for the whole batch; none in backward, which reads the saved
log-sum-exp). The input gradient is then this rank's partial sum; the region switch in front of
the Function (copy / sequence gather) sums it over TP.

    loss = sum over non-ignored rows of (lse - logit[target]) / count
    dlogits = (softmax - onehot(target)) * dloss   (ignored rows: 0)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data.batches import IGNORE_INDEX
from ..distributed import comm


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """The loss's precision: half precision in fp32, fp32/fp64 as given (MiniMind's softmax)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _targets(target, start: int, per_rank: int, ignore_index: int):
    """(local index clamped into this rank's slice, whether this rank holds the target, ignored)."""
    ignored = target == ignore_index
    local = target - start
    mine = (local >= 0) & (local < per_rank) & ~ignored
    return local.masked_fill(~mine, 0), mine, ignored


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, target, chunks, group, ignore_index):
        # h: [N, H], weight: [V(/T), H], target: [N] global ids -> summed loss (fp32 scalar)
        start, per_rank = comm.rank_in(group) * weight.shape[0], weight.shape[0]
        total, lses = None, []
        for hc, yc in zip(h.tensor_split(chunks), target.tensor_split(chunks)):
            logits = _upcast(F.linear(hc, weight))                           # [N/K, V(/T)]
            local, mine, ignored = _targets(yc, start, per_rank, ignore_index)
            picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
            picked = comm.all_reduce(picked, group)                           # the target's logit
            row_max = comm.all_reduce(logits.max(dim=-1).values, group, op=dist.ReduceOp.MAX)
            sum_exp = comm.all_reduce(logits.sub_(row_max.unsqueeze(-1)).exp_().sum(dim=-1), group)
            lse = sum_exp.log_().add_(row_max)                                # [N/K] fp32
            loss = (lse - picked).masked_fill(ignored, 0.0).sum()
            total = loss if total is None else total + loss
            lses.append(lse)
        ctx.save_for_backward(h, weight, target, torch.cat(lses))
        ctx.chunks, ctx.group, ctx.ignore_index = chunks, group, ignore_index
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h, weight, target, lse = ctx.saved_tensors
        start, per_rank = comm.rank_in(ctx.group) * weight.shape[0], weight.shape[0]
        dh, dweight = torch.empty_like(h), torch.zeros_like(weight)
        splits = zip(h.tensor_split(ctx.chunks), target.tensor_split(ctx.chunks), lse.tensor_split(ctx.chunks),
                     dh.tensor_split(ctx.chunks))
        for hc, yc, lc, dhc in splits:
            softmax = _upcast(F.linear(hc, weight)).sub_(lc.unsqueeze(-1)).exp_()   # recomputed [N/K, V(/T)]
            local, mine, ignored = _targets(yc, start, per_rank, ctx.ignore_index)
            softmax.scatter_add_(-1, local.unsqueeze(-1), -mine.to(softmax.dtype).unsqueeze(-1))
            softmax.mul_((~ignored).to(softmax.dtype).mul_(grad_total).unsqueeze(-1))
            g = softmax.to(h.dtype)                                           # d loss / d logits
            del softmax
            torch.matmul(g, weight, out=dhc)                                  # [N/K, H] (partial over TP)
            dweight.addmm_(g.t(), hc)                                         # [V(/T), H]
        return dh, dweight, None, None, None, None


def chunked_head_loss(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, chunks: int, group=None,
                      ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross entropy of the logits h W^T over the non-ignored targets, in `chunks` token chunks.
    h: [..., H] (every token of this rank's head); weight: [V, H], or this rank's [V/T, H] slice
    with `group` the TP group; target: [...] global ids."""
    flat, y = h.reshape(-1, h.shape[-1]), target.reshape(-1)                 # [N, H], [N]
    total = _ChunkedHeadLoss.apply(flat, weight, y, chunks, group, ignore_index)
    return total / (y != ignore_index).sum().clamp(min=1)
