"""Dense MiniMind state dict <-> per-rank shards (exact round trip).

Two tables: which dim of each parameter TP splits (None = replicated), and which pipeline
stage holds it. Keys keep their global names on every rank (`model.layers.{i}` with the global
layer index), so sharding and gathering work by name for any layout.
"""
from __future__ import annotations

import re

import torch

from .config import ParallelConfig

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split the output dim (0)
ROW = ("o_proj", "down_proj")                                      # split the input dim (1)
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")            # split rows with --vocab_parallel
LAST_STAGE = ("model.norm.weight", "lm_head.weight")               # first stage: embedding (and the rest)


def tp_split_dim(key: str, par: ParallelConfig) -> int | None:
    """The dim of `key` that TP splits, or None if every TP rank holds all of it."""
    if key in VOCAB:
        return 0 if par.vocab_parallel else None
    m = re.search(r"\.(\w+_proj)\.(weight|bias)$", key)
    if m and m.group(1) in COLUMN:
        return 0
    if m and m.group(1) in ROW:
        return 1 if m.group(2) == "weight" else None
    return None


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """The contiguous global layer indices of stage `pp_rank` (num_layers % pp == 0, see check_layout)."""
    per_stage = num_layers // pp
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def stage_of(key: str, num_layers: int, pp: int) -> int:
    """The pipeline stage holding `key`: layers by index, final norm and lm_head on the last stage,
    the embedding (and any other name) on the first. A tied lm_head is the last stage's copy."""
    m = re.match(r"model\.layers\.(\d+)\.", key)
    if m:
        return int(m.group(1)) // (num_layers // pp)
    return pp - 1 if key in LAST_STAGE else 0


def num_layers_of(state: dict) -> int:
    return 1 + max((int(m.group(1)) for k in state if (m := re.match(r"model\.layers\.(\d+)\.", k))), default=-1)


def shard_state_dict(dense: dict, par: ParallelConfig, tp_rank: int, pp_rank: int = 0) -> dict:
    """The shards (fresh contiguous tensors) of a dense state dict held by TP rank `tp_rank` of
    pipeline stage `pp_rank`."""
    layers = num_layers_of(dense)
    out = {}
    for key, value in dense.items():
        if par.pp > 1 and stage_of(key, layers, par.pp) != pp_rank:
            continue
        dim = tp_split_dim(key, par)
        out[key] = value.clone() if dim is None else value.chunk(par.tp, dim=dim)[tp_rank].clone()
    return out


def gather_state_dict(shards: list[dict], par: ParallelConfig) -> dict:
    """Inverse of shard_state_dict: shards[p * tp + t] is TP rank t of stage p (the global rank
    order of one pipeline's ranks, TP fastest)."""
    out = {}
    for p in range(par.pp):
        stage = shards[p * par.tp:(p + 1) * par.tp]
        for key in stage[0]:
            dim = tp_split_dim(key, par)
            out[key] = stage[0][key].clone() if dim is None else torch.cat([s[key] for s in stage], dim=dim)
    return out
