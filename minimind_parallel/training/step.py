"""Building a parallel model from dense weights, and the per-step glue every task shares:
the microbatch schedule, gradient finalisation (TP sums of partial grads, tied embeddings
across pipeline stages, DP under PP), the optimizer; DDP wrapping is `data_parallel`'s."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..config import MiniMindConfig, ParallelConfig
from ..data.batches import split_microbatches
from ..data_parallel import unwrap
from ..distributed import comm
from ..distributed.ranges import span
from ..groups import ProcessGroups
from ..parallel_model import ParallelMiniMindForCausalLM
from ..pipeline_parallel import StepResult, forward_backward
from ..sharding import shard_state_dict

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parallel_model(config: MiniMindConfig, par: ParallelConfig, groups: ProcessGroups, dense_state: dict,
                         *, dtype=torch.float32, device="cpu") -> nn.Module:
    """This rank's shard of its pipeline stage of the dense model (strict load: every key accounted for)."""
    model = ParallelMiniMindForCausalLM(config, par, groups)
    model.load_state_dict(shard_state_dict(dense_state, par, groups.tp_rank, groups.pp_rank), strict=True)
    return model.to(device=device, dtype=dtype)


def finalize_grads(model: nn.Module, groups: ProcessGroups) -> None:
    """After the last microbatch's backward, in this order:
    1. TP: sum the grads of replicated parameters that saw only this rank's part of the data
       (norms on sequence shards, q_norm/k_norm on this rank's heads);
    2. PP with tied embeddings: sum the first stage's embedding grad and the last stage's
       lm_head grad over the embedding group, so both copies take the same step;
    3. DP x CP when not done by DDP (pipelines): average every grad over the DP x CP group (the
       CP ranks' losses were scaled by C in backward, so this sums over CP and averages over DP)."""
    params = [p for p in unwrap(model).parameters() if p.grad is not None]
    _all_reduce_grads([p for p in params if getattr(p, "tp_partial_grad", False)], groups.tp)
    _all_reduce_grads([p for p in params if getattr(p, "shared_embedding", False)], groups.embed)
    if not isinstance(model, DistributedDataParallel) and groups.dp_cp is not None:
        replicas = groups.par.dp * groups.par.cp
        for p in params:  # in place, one grad at a time: no flat copy of every grad at the peak
            comm.all_reduce(p.grad, groups.dp_cp).div_(replicas)


def _all_reduce_grads(params: list, group) -> None:
    """Sum the grads of `params` over `group` in one flat buffer (small tensors: one collective)."""
    if not params or group is None:
        return
    if len(params) == 1:  # e.g. one tied embedding copy: in place, no flat copy
        comm.all_reduce(params[0].grad, group)
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    comm.all_reduce(flat, group)
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW as in MiniMind's trainer (foreach off: one update per tensor, easy to account)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, foreach=False)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, groups: ProcessGroups, input_ids, targets,
               *, num_microbatches: int = 1, schedule: str = "1f1b") -> torch.Tensor | None:
    """One optimizer step of any layout: the batch (ids, targets) [B, S] of this DP rank in M
    microbatches through the schedule (PP) or gradient accumulation, grad finalisation, AdamW,
    zero grads.
    Returns the detached mean loss; None on pipeline stages other than the last."""
    step = train_step_detailed(model, optimizer, groups, input_ids, targets, num_microbatches=num_microbatches,
                               schedule=schedule)
    return step.loss


def train_step_detailed(model, optimizer, groups, input_ids, targets, *, num_microbatches: int = 1,
                        schedule: str = "1f1b") -> StepResult:
    """train_step, returning the schedule's StepResult (in-flight microbatches, busy/wall time)."""
    result = forward_backward(model, groups, split_microbatches(input_ids, targets, num_microbatches),
                              schedule=schedule)
    with span("finalize_grads"):
        finalize_grads(model, groups)
    with span("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return result
