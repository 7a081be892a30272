"""Gradient clipping by the global norm of the dense model's gradient, over every shard.

The dense model's `torch.nn.utils.clip_grad_norm_(params, max_norm)` takes the 2-norm of all its
grads together. Here every rank holds a part of them; the parallel plan (plan.py) says which
part, and each dense parameter is counted exactly once (Megatron-LM's clip_grad_norm_fp32 does
the same with its "is not a duplicate" test):

    TP-split parameter (column / row / vocab)   every TP rank counts its shard; summed over TP
    TP-replicated parameter (norms, a head       TP rank 0 counts it (after `finalize_grads` every
      without --vocab_parallel)                  TP rank holds the same full grad)
    layers of other pipeline stages             summed over PP
    tied embedding, two copies under PP          the first stage's copy only (equal after finalize_grads)
    DP / CP replicas                            not summed: their grads are equal after averaging
    --zero 1/2: the slices of the reduction      summed over that group (each rank owns a disjoint
      group (zero.reduction_group); --zero 3:    part of the averaged grad), then as above
      FSDP2's shards
    an expert's weights (mixture of experts)    each EP rank counts its own experts; summed over EP
                                                (under --zero 1/2 the slices, --zero 3 FSDP2's shards
                                                over EDP, then over EP)

Call after `training.finalize_grads` (and, under a float16 loss scaler, after unscaling).
Every rank gets the same norm, so every rank applies the same clip coefficient.
"""
from __future__ import annotations

import torch
from torch import nn

from ..data_parallel import is_expert_parameter, unwrap
from ..distributed import comm
from ..groups import ProcessGroups
from ..plan import grad_is_shared_over_stages, tp_split_dim
from ..zero import DistributedOptimizer, reduction_group
from ..zero.fully_shard import is_fully_sharded, local


def counted_here(name: str, model: nn.Module, groups: ProcessGroups) -> bool:
    """Whether this rank's grad of parameter `name` enters the global norm (each dense value once)."""
    if tp_split_dim(name, groups.par) is None and groups.tp_rank != 0:
        return False
    return not (grad_is_shared_over_stages(name, model.config, groups.par) and not groups.is_first_stage)


def global_grad_norm(model: nn.Module, groups: ProcessGroups, sharded: DistributedOptimizer | None = None
                     ) -> torch.Tensor:
    """The 2-norm of the dense model's whole gradient (0-dim, at least float32; the same on every
    rank), from the parameters' grads or, under --zero, from the slices `sharded` owns.
    Collective over EP, TP and PP (and the reduction groups under --zero)."""
    inner = unwrap(model)
    acc = torch.promote_types(next(inner.parameters()).dtype, torch.float32)
    device = next(inner.parameters()).device
    if sharded is None:
        named = [(name, p) for name, p in inner.named_parameters() if p.grad is not None]
        # --zero 3: FSDP2's grads are shards over the DP x CP mesh, disjoint like the slices
        fsdp = is_fully_sharded(model)
        dense = [(n, local(p.grad)) for n, p in named if not is_expert_parameter(p)]
        experts = [(n, local(p.grad)) for n, p in named if is_expert_parameter(p)]
        # + other EP ranks'; --zero 3: FSDP2's shards of the experts over their EDP group, then the other EP ranks'
        parts = [((reduction_group(groups, ""),) if fsdp else (), dense), ((groups.edp, groups.ep) if fsdp else (groups.ep,), experts)]
    else:
        parts = sharded.grads_by_group()
    squares = torch.zeros((), dtype=acc, device=device)
    for over, named in parts:
        part = torch.zeros((), dtype=acc, device=device)
        for name, g in named:
            if counted_here(name, inner, groups):
                part += g.detach().to(acc).pow(2).sum()
        for group in over:   # the slices of one reduction group (an expert's: then the other EP ranks' experts)
            comm.all_reduce(part, group)
        squares += part
    comm.all_reduce(squares, groups.tp)   # the shards of one stage
    comm.all_reduce(squares, groups.pp)   # the stages
    return squares.sqrt()


def clip_grads_(model: nn.Module, total_norm: torch.Tensor, max_norm: float,
                sharded: DistributedOptimizer | None = None) -> None:
    """Scale every grad (under --zero: every slice `sharded` owns) by min(1, max_norm / (total_norm
    + 1e-6)), as torch.nn.utils.clip_grad_norm_."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads_of(model, sharded):
        g.mul_(coef.to(g.dtype))


def grads_of(model: nn.Module, sharded: DistributedOptimizer | None = None) -> list[torch.Tensor]:
    """The grads the step applies: the parameters' own, or under --zero the slices `sharded` owns."""
    if sharded is not None:
        return sharded.main_grads()
    return [local(p.grad) for p in unwrap(model).parameters() if p.grad is not None]


def clip_grad_norm_(model: nn.Module, groups: ProcessGroups, max_norm: float,
                    sharded: DistributedOptimizer | None = None) -> torch.Tensor:
    """Clip by the global norm (max_norm <= 0: measure only); returns the norm before clipping."""
    total = global_grad_norm(model, groups, sharded)
    if max_norm > 0:
        clip_grads_(model, total, max_norm, sharded)
    return total
