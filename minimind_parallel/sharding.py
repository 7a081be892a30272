"""Dense MiniMind state dict <-> per-rank shards (exact round trip).

Which dim of each parameter TP splits and which pipeline stage holds it are the parallel plan's
(`plan.tp_split_dim`, `plan.stage_of`); which EP rank holds an expert is `moe.placement`'s. Keys keep their global names on every rank
(`model.layers.{i}` with the global layer index), so sharding and gathering work by name for any
layout.
"""
from __future__ import annotations

import re

import torch

from .config import ParallelConfig
from .moe.placement import expert_of, holds
from .plan import stage_of, tp_split_dim


def num_layers_of(state: dict) -> int:
    return 1 + max((int(m.group(1)) for k in state if (m := re.match(r"model\.layers\.(\d+)\.", k))), default=-1)


def num_experts_of(state: dict) -> int:
    """The experts per MoE layer of a state dict (0: a dense model)."""
    return 1 + max((e for k in state if (e := expert_of(k)) is not None), default=-1)


def shard_state_dict(dense: dict, par: ParallelConfig, tp_rank: int, pp_rank: int = 0, ep_rank: int = 0) -> dict:
    """The shards (fresh contiguous tensors) of a dense state dict held by TP rank `tp_rank` of
    pipeline stage `pp_rank`, with the experts of EP rank `ep_rank`."""
    layers, experts = num_layers_of(dense), num_experts_of(dense)
    out = {}
    for key, value in dense.items():
        if par.pp > 1 and stage_of(key, layers, par.pp, par.virtual_stages) != pp_rank:
            continue
        if not holds(key, experts, par.ep, ep_rank):
            continue
        dim = tp_split_dim(key, par)
        out[key] = value.clone() if dim is None else value.chunk(par.tp, dim=dim)[tp_rank].clone()
    return out


def gather_state_dict(shards: list[dict], par: ParallelConfig) -> dict:
    """Inverse of shard_state_dict: shards[p * tp + t] is TP rank t of stage p (the global rank
    order of one pipeline's ranks, TP fastest); under expert parallelism, shards[(r * pp + p) * tp
    + t] that of EP rank r (each EP rank's pipeline in turn: its experts)."""
    out = {}
    for p in range(par.pp * par.ep):
        stage = shards[p * par.tp:(p + 1) * par.tp]
        for key in stage[0]:
            if key in out:          # a non-expert parameter: every EP rank holds the same
                continue
            dim = tp_split_dim(key, par)
            out[key] = stage[0][key].clone() if dim is None else torch.cat([s[key] for s in stage], dim=dim)
    return out
