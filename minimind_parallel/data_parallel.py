"""Data parallelism: DistributedDataParallel over the DP x CP group, and the model inside it.

An expert's weights (mixture of experts) are replicated only over the expert-data-parallel group
(EDP: the DP x CP ranks that hold the same experts; with --ep_size 1 all of DP x CP): DDP ignores
them and `training.finalize_grads` reduces them over EDP after backward. `reduction_group` is the
one place that says which group reduces (and would shard) a parameter's gradient.

Every parameter is replicated over DP and over CP, so its grads are reduced over both in one
group (as Megatron-LM and picotron do): DDP averages over the DP x CP ranks, and the schedule
scales the loss by C so the CP ranks' parts of one replica's loss add up. Gradients are reduced
by DDP during backward when there is no pipeline; under PP `training.finalize_grads` all-reduces
them once, after the last microbatch.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .groups import ProcessGroups
from .zero.fully_shard import shard_fully


def wrap_data_parallel(model: nn.Module, groups: ProcessGroups) -> nn.Module:
    """DDP over the DP x CP group (gradients averaged during backward); a no-op for dp = cp = 1.

    Under PP the model stays unwrapped: DDP reduces in the backward that follows a synced forward,
    but a pipeline interleaves forwards and backwards of different microbatches, so
    `finalize_grads` all-reduces the DP grads itself, once, after the last microbatch. Under
    --zero the distributed optimizer reduce-scatters them instead (`zero/`): no DDP either."""
    if groups.par.zero == 3:   # FSDP2 over DP x CP (zero/fully_shard.py): it reduces the grads itself
        return shard_fully(model, groups)
    if groups.dp_cp is None or groups.par.pp > 1 or groups.par.zero:
        return model
    # RoPE tables are identical everywhere: no need to broadcast buffers each step.
    no_sync = ({"forward_sync_buffers": False}
               if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
               else {"broadcast_buffers": False})
    experts = [name for name, p in model.named_parameters() if is_expert_parameter(p)]
    if experts:   # reduced over EDP by finalize_grads (DDP would mix different experts of one name slot)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
    return DistributedDataParallel(model, process_group=groups.dp_cp, **no_sync)


def mark_expert_parameter(param: nn.Parameter) -> nn.Parameter:
    """This parameter is one expert's weight: replicated over the EDP group only."""
    param.expert_parallel = True
    return param


def is_expert_parameter(param: torch.Tensor) -> bool:
    return getattr(param, "expert_parallel", False)


def reduction_group(groups: ProcessGroups, param: torch.Tensor):
    """The group over which `param`'s gradient is reduced: EDP for an expert's weight, DP x CP for
    every other parameter (None: one rank)."""
    return groups.edp if is_expert_parameter(param) else groups.dp_cp


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (the model itself when not wrapped)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
