"""Building a parallel model from dense weights, and the one training step (train, the
benchmark's ranks, the memory model, the profiler; validate runs its parts, comparing grads
between backward and the optimizer): the microbatch
schedule, gradient finalisation (TP sums of partial grads, tied embeddings across pipeline
stages, DP under PP), the optimizer; DDP wrapping is `data_parallel`'s.

A step: forward/backward through the schedule (autocast around forwards under mixed
precision), `finalize_grads`, unscaling (float16 loss scale), the global grad norm and
clipping, the finiteness check, AdamW (skipped when a float16 step overflowed or something was
not finite), zero grads. What the step sums and divides to make the loss the mean over every
target token of the global batch is `loss_normalisation`'s; on real rows the replicas hold
different numbers of targets, and `token_weighted_dp` weighs each replica's backward by its
share (`loss_normalisation.dp_loss_share`: D * n_r / n, 1 with equal counts).

The benchmark, the memory model and the profiler run the plain step: equal rows on every
replica, no grad norm, no finiteness check, no count exchanged (the tensors the memory model
counts one by one). The train task turns on all of it.

Finiteness (as Megatron-LM checks the loss and the grad norm for NaN/inf before it steps): the
loss of every replica and the global grad norm are tested once per step on every rank together
(one all-reduce of two flags over the world), so every rank skips or steps alike. Under a float16
loss scaler a grad norm that is not finite is an overflow, handled by the scaler (the step is
skipped, the scale halved); otherwise it is reported in `StepStats.nonfinite`, as is a loss that is
not finite, and the optimizer does not step: the parameters stay those of the last finite step.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..config import MiniMindConfig, ParallelConfig
from ..data.batches import split_microbatches
from ..data_parallel import is_expert_parameter, reduction_group, unwrap
from ..distributed import comm
from ..distributed.loaded_types import is_dtensor
from ..distributed.ranges import span
from ..groups import ProcessGroups
from ..loss_normalisation import dp_loss_share, grad_divisor
from ..parallel_model import ParallelMiniMindForCausalLM
from ..pipeline_parallel import Schedule, StepResult, forward_backward
from ..sharding import shard_state_dict
from .grad_clip import clip_grad_norm_, grads_of
from ..zero import DEFAULT_BUCKET_MB, DistributedOptimizer, bucket_numel
from ..zero.fully_shard import is_fully_sharded, local
from .mixed_precision import LossScaler, Precision


def build_parallel_model(config: MiniMindConfig, par: ParallelConfig, groups: ProcessGroups, dense_state: dict,
                         *, dtype=torch.float32, device="cpu") -> nn.Module:
    """This rank's shard of its pipeline stage of the dense model (strict load: every key accounted for)."""
    model = ParallelMiniMindForCausalLM(config, par, groups)
    model.load_state_dict(shard_state_dict(dense_state, par, groups.tp_rank, groups.pp_rank, groups.ep_rank), strict=True)
    return model.to(device=device, dtype=dtype)


def finalize_grads(model: nn.Module, groups: ProcessGroups, optimizer=None) -> None:
    """After the last microbatch's backward, in this order (under --zero, `optimizer` a
    `zero.DistributedOptimizer`: the same sums, on the slices it owns, `reduce_grads`):
    1. TP: sum the grads of replicated parameters that saw only this rank's part of the data
       (norms on sequence shards, q_norm/k_norm on this rank's heads);
    2. PP with tied embeddings: sum the first stage's embedding grad and the last stage's
       lm_head grad over the embedding group, so both copies take the same step;
    3. DP x CP when not done by DDP (pipelines): average every grad over the DP x CP group (the
       CP ranks' losses were scaled by C in backward, so this sums over CP and averages over DP;
       `loss_normalisation.grad_divisor`); an expert's weights (never DDP's) over its EDP group
       (`data_parallel.reduction_group`), by the same divisor: every token of the DP x CP ranks
       reached its expert on one rank of that group. Under --zero 1/2 the distributed optimizer
       does all of this over its buffers; under --zero 3 FSDP2 reduces over DP x CP (and the experts
       over their EDP mesh under expert parallelism)."""
    if isinstance(optimizer, DistributedOptimizer):
        optimizer.reduce_grads()
        return
    _zero_unrouted_expert_grads(model)
    params = [p for p in unwrap(model).parameters() if p.grad is not None]
    _all_reduce_grads([p for p in params if getattr(p, "tp_partial_grad", False)], groups.tp)
    _all_reduce_grads([p for p in params if getattr(p, "shared_embedding", False)], groups.embed)
    if is_fully_sharded(model):   # FSDP2 reduced its DTensors; the experts it leaves alone (ep = dp x cp) below
        params = [p for p in params if not is_dtensor(p)]
    ddp = isinstance(model, DistributedDataParallel)
    replicas = grad_divisor(groups.par)
    for p in params:  # in place, one grad at a time: no flat copy of every grad at the peak
        group = reduction_group(groups, p)
        if group is not None and not (ddp and not is_expert_parameter(p)):
            comm.all_reduce(p.grad, group).div_(replicas)
        elif group is None and is_expert_parameter(p) and replicas > 1:   # ep = dp x cp: no replica to sum with
            p.grad.div_(replicas)


def _zero_unrouted_expert_grads(model: nn.Module) -> None:
    """An expert no token reached this step has no grad: zeros, so that the EDP reduction and the
    optimizer see every expert on every rank alike."""
    for p in unwrap(model).parameters():
        if p.grad is None and p.requires_grad and is_expert_parameter(p):
            p.grad = torch.zeros_like(p)


def _all_reduce_grads(params: list, group) -> None:
    """Sum the grads of `params` over `group` in one flat buffer (small tensors: one collective)."""
    if not params or group is None:
        return
    grads = [local(p.grad) for p in params]   # --zero 3: this rank's rows of FSDP2's reduce-scattered grad
    if len(grads) == 1:  # e.g. one tied embedding copy: in place, no flat copy
        comm.all_reduce(grads[0], group)
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def make_optimizer(model: nn.Module, lr: float, groups: ProcessGroups | None = None,
                   bucket_size_mb: float = DEFAULT_BUCKET_MB, schedule: Schedule = Schedule.ONE_F_ONE_B
                   ) -> torch.optim.Optimizer | DistributedOptimizer:
    """AdamW as in MiniMind's trainer (foreach off: one update per tensor, easy to account); under
    --zero 1/2 (`groups.par.zero`) over this rank's slices only (`zero.DistributedOptimizer`, its
    buckets of `bucket_size_mb` MiB; `schedule`: the pipeline's, whose W steps (zb) --zero 2's
    staging buffers are made for)."""
    if groups is not None and groups.par.zero in (1, 2):
        return DistributedOptimizer(unwrap(model), groups, lr=lr, weight_decay=0.01,
                                    bucket_numel=bucket_numel(bucket_size_mb, next(model.parameters()).dtype),
                                    weight_steps=groups.par.pp > 1 and Schedule(schedule) is Schedule.ZERO_BUBBLE)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, foreach=False)



@dataclass(frozen=True, kw_only=True)
class StepStats:
    schedule: StepResult        # the schedule's: this replica's mean loss (last stage), in-flight, busy/wall time
    targets: torch.Tensor | None = None    # this replica's target tokens (0-dim int64), with token_weighted_dp
    grad_norm: torch.Tensor | None = None  # global grad norm before clipping (the same on every rank), with grad_clip
    stepped: bool = True        # False when a float16 step overflowed, or something was not finite
    nonfinite: tuple[str, ...] = ()   # "loss", "grad norm": not finite (every rank); the step was not taken

    @property
    def loss(self) -> torch.Tensor | None:
        """This replica's mean over its targets, detached (last stage only)."""
        return self.schedule.loss


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, groups: ProcessGroups, input_ids, targets, *,
               num_microbatches: int = 1, schedule: Schedule = Schedule.ONE_F_ONE_B, token_weighted_dp: bool = False,
               grad_clip: float | None = None, precision: Precision | None = None,
               scaler: LossScaler | None = None) -> StepStats:
    """One optimizer step of any layout on this replica's rows (ids, targets) [B, S] in
    `num_microbatches` microbatches through the schedule (PP) or gradient accumulation.
    `token_weighted_dp`: weigh the replica's backward by its share of the global batch's targets
    (rows of different lengths). `grad_clip`: measure the global grad norm, clip by it when > 0,
    and check the loss and the norm for finiteness (None: none of it). `precision`: autocast
    around the forwards (None: compute in the parameters' dtype). `scaler` (float16): scales the
    loss, unscales the grads; needs `grad_clip` (its overflow test is the grad norm)."""
    if scaler is not None and grad_clip is None:
        raise ValueError("a loss scaler needs the grad norm: pass grad_clip (0: measure, do not clip)")
    share, mine = dp_loss_share(targets, groups) if token_weighted_dp else (1.0, None)
    loss_scale = share * (scaler.scale if scaler is not None else 1.0)
    result = forward_backward(model, groups, split_microbatches(input_ids, targets, num_microbatches),
                              schedule=schedule, loss_scale=loss_scale,
                              forward_context=precision.forward_context if precision is not None else nullcontext)
    with span("finalize_grads"):
        finalize_grads(model, groups, optimizer)
    sharded = optimizer if isinstance(optimizer, DistributedOptimizer) else None
    norm, bad = None, ()
    if grad_clip is not None:
        if scaler is not None:
            scaler.unscale_(grads_of(model, sharded))
        norm = clip_grad_norm_(model, groups, grad_clip, sharded)
        bad = nonfinite_quantities(result.loss, norm, overflow_is_skipped=scaler is not None)
    stepped = not bad and (scaler is None or scaler.update(bool(torch.isfinite(norm))))
    with span("optimizer"):
        if stepped:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return StepStats(schedule=result, targets=mine, grad_norm=norm, stepped=stepped, nonfinite=bad)


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
