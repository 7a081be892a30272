"""Building a parallel model from dense weights, and the per-step glue every task shares:
gradient finalisation (TP sums of partial grads), DDP wrapping, the optimizer."""
from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .config import MiniMindConfig, ParallelConfig
from .groups import ProcessGroups
from .parallel_model import ParallelMiniMindForCausalLM
from .profiling.ranges import span
from .sharding import shard_state_dict
from .tensor_parallel import comm

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parallel_model(config: MiniMindConfig, par: ParallelConfig, groups: ProcessGroups, dense_state: dict,
                         *, dtype=torch.float32, device="cpu") -> nn.Module:
    """This rank's shard of the dense model (strict load: every key accounted for)."""
    model = ParallelMiniMindForCausalLM(config, par, groups)
    model.load_state_dict(shard_state_dict(dense_state, par, groups.tp_rank), strict=True)
    return model.to(device=device, dtype=dtype)


def wrap_data_parallel(model: nn.Module, groups: ProcessGroups) -> nn.Module:
    """DDP over the DP group (gradients averaged during backward); a no-op for dp = 1."""
    if groups.dp is None:
        return model
    # RoPE tables are identical everywhere: no need to broadcast buffers each step.
    no_sync = ({"forward_sync_buffers": False}
               if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
               else {"broadcast_buffers": False})
    return DistributedDataParallel(model, process_group=groups.dp, **no_sync)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def finalize_grads(model: nn.Module, groups: ProcessGroups) -> None:
    """Sum over TP the grads of replicated parameters that saw only this rank's part of the data
    (norms on sequence shards, q_norm/k_norm on this rank's heads): one coalesced all-reduce."""
    partial = [p for p in unwrap(model).parameters() if getattr(p, "tp_partial_grad", False) and p.grad is not None]
    if not partial or groups.tp is None:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in partial])
    comm.all_reduce(flat, groups.tp)
    offset = 0
    for p in partial:
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW as in MiniMind's trainer (foreach off: one update per tensor, easy to account)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, foreach=False)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, groups: ProcessGroups, input_ids, labels):
    """One optimizer step of the non-pipelined layouts: forward, backward, TP sums, AdamW, zero grads.
    Returns the detached loss of this rank's batch."""
    with span("forward"):
        loss = model(input_ids, labels).loss
    with span("backward"):
        loss.backward()
    with span("finalize_grads"):
        finalize_grads(model, groups)
    with span("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.detach()
