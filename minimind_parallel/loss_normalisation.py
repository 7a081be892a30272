"""The loss normalisation of every layout, in one place: the loss is the mean over every target
token of the global batch, as the dense model computes it on all its rows at once (MiniMind's
`F.cross_entropy(..., ignore_index=-100)`, a mean over the targets):

    loss = (1 / n) sum_t l_t          t: every target token of the global batch, n of them

Each parallel group holds a part of those tokens, or a copy of them. Per group, what is summed
and what is divided, in the loss (forward) and in the grads (backward):

  group          a rank holds           the loss: summed / divided               the grads: scaled / reduced
  -------------  ---------------------  ---------------------------------------  -----------------------------------
  TP, vocab      V/T of every logit     each token's loss is whole on every TP   nothing: every TP rank has the same
  (--vocab_      row                    rank (max, target logit, sum of exps     loss (the layers sum their partial
   parallel)                            all-reduced); divided by the rank's      input grads)
                                        targets as the dense mean
                                        (tensor_parallel.cross_entropy,
                                        recompute.chunked_loss)
  TP, SP         1/T of every layer's   the head's input is whole again: every   nothing (the partial grads of
                 heads and features     TP rank has the loss of no TP            replicated params are summed over
                 (SP: S/T of each row)                                           TP by training.finalize_grads)
  CP             S/C tokens of a row    the rank's mean over its own targets     the loss x C before backward
                                        (`token_mean`: 0, not NaN, when it has   (`cp_loss_factor`): the grads are
                                        none) x its share of every CP rank's     averaged over DP x CP (below), so
                                        targets (`microbatch_weights`): its sum  over CP they add up
                                        over the replica's count; the CP parts
                                        add up (`replica_loss`: summed over CP)
  microbatches   b of a replica's B     loss_i x targets_i / the replica's       the same weights; the M backwards
  (M)            rows                   targets (`microbatch_weights`), summed   accumulate (sum) the grads
                                        over M: the replica's mean
  PP             L/P layers             only the last stage has the loss         nothing (grads flow back p2p)
  DP (D          B of the global        each replica's mean; the global mean     the loss x D n_r / n before
  replicas)      batch's rows           is sum_r mean_r n_r / n                  backward (`dp_loss_share`, when
                                        (`world_token_mean`; `token_sum` makes   replicas hold different numbers of
                                        mean_r n_r)                              targets; 1 when they hold as many);
                                                                                 summed over DP x CP, divided by
                                                                                 D x C (`grad_divisor`)
  DDP            (its averaging)        -                                        all-reduce SUM then / its group's
                                                                                 size, D x C (`grad_divisor`'s
                                                                                 divide, done by DDP without PP)
  held-out       this replica's rows    sum over batches and replicas of         no backward
                                        mean_r n_r (`token_sum`), / n
                                        (`world_token_mean`)
  MoE aux loss   a layer's routing of   E coef sum_e load_e mean_score_e of the  1/M per microbatch (`aux_loss_weight`,
  (load          one forward's tokens   per-expert token counts and score sums   MiniMind's (loss + aux) / accumulation
   balancing)    (a microbatch)         summed over the token-holding ranks      steps) x `aux_loss_factor` (D global,
                                        first (`expert_statistics`): global:     1 local), added to the LM loss before
                                        DP x CP (the dense model's whole         backward, then as it (x C, the DP
                                        batch); local (MiniMind's trainer):      share, averaged over DP x CP); each
                                        CP, each replica's own tokens; TP        rank's backward reaches its own
                                        under SP; summed over layers (every      tokens' scores only (the sums'
                                        stage's: on its own stage's backward);   backward is the identity): the grad
                                        reported: sum_i aux_i / M                reductions add the ranks' parts

The mean of the D replicas' means (no `dp_loss_share`; `equal_replicas_mean` for a reported
loss) is the global mean only when every replica holds as many targets: the benchmark's, the
memory model's and validation's batches do (`data.batches.random_batch`, `broadcast_batch`),
real padded rows do not.

Who calls what: the model (`parallel_model`: `token_mean` under CP; its MoE layers:
`expert_statistics`), the schedule
(`pipeline_parallel.schedules`: `microbatch_weights`, `cp_loss_factor`, `backward_loss`,
`replica_loss`), the step (`training.step`: `dp_loss_share`; `finalize_grads`: `grad_divisor`),
the held-out loss (`training.heldout`: `replica_targets`, `token_sum`, `world_token_mean`), the
train task's log lines (`token_sum`, `world_token_mean`) and validation's loss row
(`equal_replicas_mean`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .config import MoEAuxLoss, ParallelConfig
from .data.batches import count_targets
from .distributed import comm
from .groups import ProcessGroups
from .tensor_parallel.mappings import reduce_from_tensor_parallel_region


def token_mean(loss_sum: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A rank's mean over its own targets: `loss_sum` (the sum of its per-token losses) over
    their count, 0 when it holds none (a CP rank's tokens of a row may all be padding)."""
    return loss_sum / count_targets(targets).clamp(min=1)


def microbatch_weights(microbatches: list, dtype: torch.dtype, cp_group) -> torch.Tensor:
    """[M]: each microbatch's share of this replica's targets (under CP: of every CP rank's), by
    which its loss (a mean over its own targets) is multiplied; summed over M and CP ranks: 1.
    Kept on the device (no host sync; works on fake tensors too); at least float32 (`dtype`: the
    parameters', float64 runs get float64 weights). Collective over CP."""
    counts = torch.stack([count_targets(targets) for _, targets in microbatches])
    counts = counts.to(torch.promote_types(dtype, torch.float32))
    total = comm.all_reduce(counts.sum(), cp_group)                              # every CP rank's targets
    return counts / total.clamp(min=1)


def cp_loss_factor(par: ParallelConfig) -> int:
    """What a CP rank's loss is multiplied by before backward: C. The grads are averaged over
    DP x CP (`grad_divisor`), but the CP ranks' losses add up to the replica's."""
    return par.cp


def aux_loss_weight(num_microbatches: int) -> float:
    """What a microbatch's MoE aux loss is multiplied by before it joins the LM loss: 1/M, as
    MiniMind's trainer divides (loss + aux_loss) by its accumulation steps."""
    return 1.0 / num_microbatches


def backward_loss(loss: torch.Tensor, loss_scale, cp_factor: int) -> torch.Tensor:
    """What backward runs on: a microbatch's weighted `loss` x `cp_factor` x `loss_scale` (a float,
    or a 0-dim tensor: the replica's `dp_loss_share`, a float16 loss scale). The reported loss is
    neither."""
    if isinstance(loss_scale, float):
        scale = loss_scale * cp_factor
        return loss if scale == 1.0 else loss * scale
    return loss * (loss_scale.to(loss.dtype) * cp_factor)


def replica_loss(weighted_losses: list, cp_group) -> torch.Tensor | None:
    """This replica's mean over its targets: the microbatches' weighted losses summed, and the
    CP ranks' parts of it. None off the last stage (no losses). Collective over CP."""
    if not weighted_losses:
        return None
    return comm.all_reduce(torch.stack(weighted_losses).sum(), cp_group)


def replica_targets(targets: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    """n_r: this replica's targets (0-dim int64), from this rank's `targets` (under CP: its CP
    rank's tokens, summed over CP). Collective over CP."""
    return comm.all_reduce(count_targets(targets), groups.cp)


def dp_loss_share(targets: torch.Tensor, groups: ProcessGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (D * n_r / n as float64 0-dim, n_r): how much this replica's mean loss weighs in the
    average over D replicas that makes the global mean. `targets`: this rank's (under context
    parallelism its CP rank's tokens: the replica's count n_r sums them over CP). Collective over
    CP and DP."""
    mine = replica_targets(targets, groups)
    total = comm.all_reduce(mine.clone(), groups.dp)
    return mine.double() * groups.par.dp / total.clamp(min=1), mine


def grad_divisor(par: ParallelConfig) -> int:
    """What the grads summed over DP x CP are divided by: D x C (DDP divides by its group's size,
    the same D x C; `training.finalize_grads` under PP)."""
    return par.dp * par.cp


def token_sum(mean: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A replica's sum of per-token losses (float64 0-dim) from its mean over `count` targets."""
    return mean.double() * count


def equal_replicas_mean(loss: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    """The mean of the D replicas' mean losses, in place on `loss` (this replica's): the global mean
    when every replica holds as many targets (validation's `random_batch`). Collective over DP."""
    if groups.dp is not None:
        comm.all_reduce(loss, groups.dp)
        loss /= groups.par.dp
    return loss


def world_token_mean(loss_sum: torch.Tensor | None, count: torch.Tensor, groups: ProcessGroups) -> tuple[float, int]:
    """Sum `loss_sum` (this replica's sum of per-token losses; None off the last stage) and `count`
    (its targets) over the DP replicas as seen by one rank each -- TP rank 0 of the last stage,
    which holds the loss -- and hand the result to every rank: -> (mean loss, targets).
    Collective over the world."""
    holder = (loss_sum is not None and groups.is_last_stage and groups.tp_rank == 0
              and groups.coords.get("cp", 0) == 0)
    both = torch.zeros(2, dtype=torch.float64, device=count.device)
    if holder:
        both = torch.stack([loss_sum.double(), count.double()])
    comm.all_reduce(both, dist.group.WORLD)
    total, n = both.tolist()
    return total / max(n, 1.0), int(n)


def expert_statistics(stats: torch.Tensor, groups: ProcessGroups) -> torch.Tensor:
    """A MoE layer's routing statistics of this rank's tokens (per-expert token counts and score
    sums, the token count: any tensor of sums) -> the sums over the ranks whose tokens the aux loss
    counts: global, every token of the batch (DP x CP); local, this replica's (CP); under SP the
    TP ranks' sequence shards too. Forward all-reduce, backward identity: each rank's backward
    reaches its own tokens' scores, the ranks' parts are added by the grad reductions
    (`aux_loss_factor`). Collective over those groups."""
    holders = groups.dp_cp if groups.par.moe_aux_loss == MoEAuxLoss.GLOBAL else groups.cp
    stats = reduce_from_tensor_parallel_region(stats, holders)
    if groups.par.sequence_parallel:
        stats = reduce_from_tensor_parallel_region(stats, groups.tp)
    return stats


def aux_loss_factor(par: ParallelConfig) -> int:
    """What a rank's MoE aux loss (one value on every rank its statistics were summed over) is
    multiplied by beside the LM loss's factors (x C, the DP share; the grads then averaged over
    D x C, `grad_divisor`): every rank's backward reaches only its own tokens' scores, so the
    ranks' parts must add up: D when the aux loss is the global batch's (summed over DP x CP;
    x C already), 1 when it is each replica's (local: summed over CP)."""
    return par.dp if par.moe_aux_loss == MoEAuxLoss.GLOBAL else 1
