"""Dense MiniMind state dict <-> per-rank tensor-parallel shards (exact round trip).

The plan is one table: which dim of each parameter is split over TP (None = replicated).
"""
from __future__ import annotations

import re

import torch

from .config import ParallelConfig

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split the output dim (0)
ROW = ("o_proj", "down_proj")                                      # split the input dim (1)
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")            # split rows with --vocab_parallel


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


def shard_state_dict(dense: dict, par: ParallelConfig, tp_rank: int) -> dict:
    """This TP rank's shards (fresh contiguous tensors) of a dense state dict."""
    out = {}
    for key, value in dense.items():
        dim = tp_split_dim(key, par)
        out[key] = value.clone() if dim is None else value.chunk(par.tp, dim=dim)[tp_rank].clone()
    return out


def gather_state_dict(shards: list[dict], par: ParallelConfig) -> dict:
    """Inverse of shard_state_dict: shards[r] is TP rank r's state dict."""
    out = {}
    for key in shards[0]:
        dim = tp_split_dim(key, par)
        out[key] = shards[0][key].clone() if dim is None else torch.cat([s[key] for s in shards], dim=dim)
    return out
