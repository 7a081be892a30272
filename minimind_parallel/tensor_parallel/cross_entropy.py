"""Cross entropy over vocab-sharded logits, without ever building the full [.., V] logits.

Each rank holds logits[..., V/T] for its vocabulary slice. Three all-reduces over TP give the
global max (for stability), the target logit (only its owner contributes) and the sum of exps.
The input is never modified; the softmax saved for backward is this Function's own buffer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..data.batches import IGNORE_INDEX
from ..distributed import comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index):
        # logits: [N, V/T] (half precision computed in fp32), target: [N] global ids -> loss per token [N]
        r = comm.rank_in(group)
        per_rank = logits.shape[-1]
        start = r * per_rank
        # half precision is computed in fp32; fp32/fp64 as given. Always a copy: the caller's
        # logits are never written.
        x = logits.float() if logits.element_size() < 4 else logits.clone()
        row_max = comm.all_reduce(x.max(dim=-1).values, group, op=dist.ReduceOp.MAX)
        x.sub_(row_max.unsqueeze(-1))                       # stable: exp(x - max) <= 1
        ignored = target == ignore_index
        not_mine = (target < start) | (target >= start + per_rank) | ignored
        local_target = (target - start).masked_fill(not_mine, 0)
        target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(not_mine, 0.0)
        target_logit = comm.all_reduce(target_logit, group)
        exp = x.exp_()
        sum_exp = comm.all_reduce(exp.sum(dim=-1), group)
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, not_mine, ignored)
        ctx.out_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, not_mine, ignored = ctx.saved_tensors
        grad = softmax.clone()                              # d loss / d logit = softmax - onehot(target)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(~not_mine).to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.out_dtype), None, None, None


def vocab_parallel_cross_entropy(logits, target, group, ignore_index: int = IGNORE_INDEX):
    """Mean loss over non-ignored tokens. logits: [..., V/T] vocab-sharded; target: [...] global ids."""
    flat_logits = logits.reshape(-1, logits.shape[-1])
    losses = _VocabParallelCrossEntropy.apply(flat_logits, target.reshape(-1), group, ignore_index)
    count = (target != ignore_index).sum()
    return losses.sum() / count.clamp(min=1)
