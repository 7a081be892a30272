"""The load-balancing (auxiliary) loss of one MoE layer, from per-expert statistics of its batch.

MiniMind's `MOEFeedForward` (training mode, router_aux_loss_coef > 0):

    load_e       = (tokens routed to e over all k slots) / N     (one_hot(topk_idx).float().mean(0), summed over k)
    mean_score_e = sum_t scores[t, e] / N
    aux          = E * coef * sum_e load_e * mean_score_e

Both factors are sums over tokens divided by the token count N, so a layer's aux loss is a
function of three sums -- the counts [E], the score sums [E] and N -- which a layout that splits
the tokens over ranks (sequence, data, expert parallelism) can sum over its groups before
forming the loss (`RouterStats.reduce`): that is the aux loss of the whole batch, as the dense
model computes it on all its rows. The counts carry no gradient (top-k is piecewise constant);
the gradient reaches the router through the score sums only.

MiniMind forms the load in float32 (`.float()`); here it is in the scores' dtype (at least
float32): equal in float32 runs up to summation order, and sharper in float64.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..tensor_parallel import reduce_from_tensor_parallel_region


@dataclass
class RouterStats:
    counts: torch.Tensor       # [E] tokens routed to each expert (over all k slots), in the scores' dtype
    score_sums: torch.Tensor   # [E] the softmax scores of each expert summed over the tokens (has grad)
    tokens: torch.Tensor       # 0-dim: N, the tokens these sums ran over, in the scores' dtype

    @classmethod
    def of(cls, scores: torch.Tensor, counts: torch.Tensor) -> RouterStats:
        """scores [N, E], counts [E] (int) -> the layer's statistics over these N tokens."""
        dtype = torch.promote_types(scores.dtype, torch.float32)
        # a fill, not torch.tensor: under fake tensors (--estimate) torch.tensor also keeps a real
        # copy of the value, which a real run does not
        n = scores.new_full((), scores.shape[0], dtype=dtype)
        return cls(counts=counts.to(dtype), score_sums=scores.sum(0).to(dtype), tokens=n)

    def stacked(self) -> torch.Tensor:
        """[2E + 1]: counts, score sums and N in one tensor (one collective sums all three)."""
        return torch.cat([self.counts.detach(), self.score_sums, self.tokens.reshape(1)])

    @classmethod
    def unstack(cls, flat: torch.Tensor) -> RouterStats:
        e = (flat.shape[0] - 1) // 2
        return cls(counts=flat[:e].detach(), score_sums=flat[e:2 * e], tokens=flat[2 * e].detach())


# How a layer's statistics become those of the batch the aux loss runs over: the identity (the
# tokens this module saw are the batch), or a sum over the groups that split the batch's tokens.
StatsReduction = Callable[[RouterStats], RouterStats]


def local_stats(stats: RouterStats) -> RouterStats:
    """The identity reduction: the aux loss over the tokens this module saw (the dense model; MiniMind)."""
    return stats


def load_balancing_loss(stats: RouterStats, coef: float) -> torch.Tensor:
    """0-dim: E * coef * sum_e (counts_e / N) * (score_sums_e / N)."""
    num_experts = stats.counts.shape[0]
    n = stats.tokens.clamp(min=1)
    return (stats.counts / n * (stats.score_sums / n)).sum() * num_experts * coef


def summed_over(group) -> StatsReduction:
    """The statistics summed over the ranks of `group`, which hold disjoint tokens of the batch (the
    TP ranks under sequence parallelism): forward all-reduce, backward the identity -- every rank
    computes the same aux loss, and its backward reaches only this rank's score sums, so the
    router's grads are partial over the group (the plan's UNDER_SP rule)."""
    def reduce(stats: RouterStats) -> RouterStats:
        return RouterStats.unstack(reduce_from_tensor_parallel_region(stats.stacked(), group))
    return reduce
