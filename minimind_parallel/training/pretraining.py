"""One optimizer step of pretraining on real rows, and the loss over the whole world.

Real text pads: rows, microbatches and data-parallel replicas hold different numbers of target
tokens. The loss is the mean over every target token of the global batch, as the dense model
computes it on all rows at once:

    loss = sum_r sum_tokens(r) / n          n = sum_r n_r   (n_r: targets of DP replica r)

The schedule already gives each replica's mean over its own targets (each microbatch weighted by
its share, pipeline_parallel.schedules). DDP (or `finalize_grads` under PP) then averages the D
replicas' grads, so the backward of replica r is scaled by D * n_r / n (`dp_loss_share`): the
average of the scaled grads is the gradient of the global mean. With equal counts the share is 1.

A step: the share, forward/backward through the schedule (autocast around forwards under mixed
precision), `finalize_grads`, unscaling (float16 loss scale), the global grad norm and clipping,
the finiteness check, AdamW (skipped when a float16 step overflowed or something was not finite),
zero grads.

Finiteness (as Megatron-LM checks the loss and the grad norm for NaN/inf before it steps): the
loss of every replica and the global grad norm are tested once per step on every rank together
(one all-reduce of two flags over the world), so every rank skips or steps alike. Under a float16
loss scaler a grad norm that is not finite is an overflow, handled by the scaler (the step is
skipped, the scale halved); otherwise it is reported in `StepStats.nonfinite`, as is a loss that is
not finite, and the optimizer does not step: the parameters stay those of the last finite step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..data.batches import Batch, count_targets, split_microbatches
from ..distributed import comm
from .grad_clip import clip_grad_norm_
from ..groups import ProcessGroups
from .mixed_precision import LossScaler, Precision
from ..pipeline_parallel import forward_backward
from .step import finalize_grads


@dataclass(frozen=True, kw_only=True)
class StepStats:
    loss: torch.Tensor | None   # this replica's mean over its targets, detached (last stage only)
    targets: torch.Tensor       # this replica's target tokens (0-dim int64)
    grad_norm: torch.Tensor     # global grad norm before clipping (the same on every rank)
    stepped: bool               # False when a float16 step overflowed, or something was not finite
    nonfinite: tuple[str, ...] = ()   # "loss", "grad norm": not finite (every rank); the step was not taken


def dp_loss_share(targets: torch.Tensor, groups: ProcessGroups) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (D * n_r / n as float64 0-dim, n_r): how much this replica's mean loss weighs in the
    average over D replicas that makes the global mean. `targets`: this rank's (under context
    parallelism its CP rank's tokens: the replica's count n_r sums them over CP). Collective over
    CP and DP."""
    mine = comm.all_reduce(count_targets(targets), groups.cp)
    total = comm.all_reduce(mine.clone(), groups.dp)
    return mine.double() * groups.par.dp / total.clamp(min=1), mine


def pretrain_step(model: nn.Module, optimizer: torch.optim.Optimizer, groups: ProcessGroups, batch: Batch, *,
                  num_microbatches: int, schedule: str, grad_clip: float, precision: Precision,
                  scaler: LossScaler | None = None) -> StepStats:
    """One optimizer step on this replica's rows `batch` [B, S] in `num_microbatches` microbatches.
    `grad_clip` <= 0: no clipping (the norm is measured all the same)."""
    share, mine = dp_loss_share(batch.targets, groups)
    loss_scale = share * (scaler.scale if scaler is not None else 1.0)
    result = forward_backward(model, groups, split_microbatches(*batch, num_microbatches), schedule=schedule,
                              loss_scale=loss_scale, forward_context=precision.forward_context)
    finalize_grads(model, groups)
    if scaler is not None:
        scaler.unscale_(model)
    norm = clip_grad_norm_(model, groups, grad_clip)
    bad = nonfinite_quantities(result.loss, norm, overflow_is_skipped=scaler is not None)
    stepped = not bad and (scaler is None or scaler.update(bool(torch.isfinite(norm))))
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepStats(loss=result.loss, targets=mine, grad_norm=norm, stepped=stepped, nonfinite=bad)


def nonfinite_quantities(loss: torch.Tensor | None, grad_norm: torch.Tensor, *,
                         overflow_is_skipped: bool) -> tuple[str, ...]:
    """Which of "loss" (any replica's; `loss` None off the last stage) and "grad norm" (global) is
    not finite, the same on every rank; the grad norm is left to the loss scaler when
    `overflow_is_skipped`. Collective over the world."""
    flags = torch.zeros(2, dtype=torch.float32, device=grad_norm.device)
    if loss is not None:
        flags[0] = (~torch.isfinite(loss.detach())).any().float()
    if not overflow_is_skipped:
        flags[1] = (~torch.isfinite(grad_norm.detach())).float()
    comm.all_reduce(flags, torch.distributed.group.WORLD, op=torch.distributed.ReduceOp.MAX)
    return tuple(name for name, flag in zip(("loss", "grad norm"), flags.tolist()) if flag)


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
    comm.all_reduce(both, torch.distributed.group.WORLD)
    total, n = both.tolist()
    return total / max(n, 1.0), int(n)
