"""The router: MiniMind's `MoEGate` step of `MOEFeedForward.forward`.

    scores  = softmax(gate(x))                       [N, E]   (gate: Linear H -> E, no bias)
    weights, indices = topk(scores, k, sorted=False) [N, k]
    weights /= weights.sum(-1) + 1e-20               when norm_topk_prob (MiniMind's epsilon)

The softmax runs in the activations' dtype, as MiniMind's does (no float32 upcast).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Routing:
    scores: torch.Tensor     # [N, E] softmax of the gate logits (every expert, every token)
    weights: torch.Tensor    # [N, k] the chosen experts' weights (renormalised when norm_topk_prob)
    indices: torch.Tensor    # [N, k] int64 the chosen experts

    @property
    def top_k(self) -> int:
        return self.indices.shape[-1]


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> Routing:
    """logits: [N, E] the gate's output for N tokens -> the top-k experts of each and their weights."""
    scores = F.softmax(logits, dim=-1)
    weights, indices = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(scores=scores, weights=weights, indices=indices)


def tokens_per_expert(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64: how many of the N x k (token, slot) pairs of `indices` [N, k] chose each expert.
    A scatter-add, not bincount: its shape does not depend on the values (fake tensors, no sync)."""
    flat = indices.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
