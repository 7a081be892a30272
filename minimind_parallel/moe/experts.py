"""The local experts as grouped GEMMs over tokens sorted by expert.

Each expert is MiniMind's SwiGLU `FeedForward` of width `moe_intermediate_size`, its parameters
under MiniMind's names `experts.{e}.{gate,up,down}_proj.weight` (`e` the global expert index, so a
rank holding experts [a, b) keeps the dense model's keys). The tokens arrive sorted by expert with
the count of each ([T, H] = the concatenation of expert a's, then a+1's, ...); each projection is
one GEMM per expert over its contiguous rows:

    torch._grouped_mm      one call for all experts (offsets = cumsum of the counts, no host
                           sync) on CUDA in bfloat16 from compute capability 9.0, every row
                           16-byte aligned; the weights are stacked to [E_local, in, out] for it
                           (a copy of the layer's expert weights, kept for backward).
    a loop of F.linear     over the experts' slices otherwise: the same GEMMs one by one (the
                           counts read on the host). On the CPU torch._grouped_mm runs float32
                           and bfloat16 too, but measured no faster than the loop here
                           (scripts/moe_step_time.py) and it holds the stacked copy, so the CPU
                           takes the loop.

Under fake tensors (`--estimate`) the counts have no values: the loop splits the tokens by the
layer's given routing (fake_routing.py), or without one as if routed evenly (`balanced_counts`:
N*k/E per expert, the remainder on the first ones), the estimate's stated policy. Only the
loop's per-expert temporaries depend on the split; every tensor that lives through backward has
the shape of all the rows this rank's experts receive.

Unlike MiniMind's loop (a gather and an `index_add_` per expert, over the unsorted tokens), the
gather happens once (the sort) and the scatter once (the combine).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

# (the parameter's key below the MoE layer, e.g. "experts.%.gate_proj.weight"; its dense shape
# [out, in]) -> the Linear holding it: torch's (the dense model) or the parallel plan's layer
LinearBuilder = Callable[[str, tuple[int, int]], nn.Module]


def plain_linear(key: str, shape: tuple[int, int]) -> nn.Linear:
    out_features, in_features = shape
    return nn.Linear(in_features, out_features, bias=False)


class Expert(nn.Module):
    """One expert: down(silu(gate(x)) * up(x)), MiniMind's FeedForward with moe_intermediate_size."""

    def __init__(self, hidden: int, intermediate: int, linear: LinearBuilder = plain_linear):
        super().__init__()
        self.gate_proj = linear("experts.%.gate_proj.weight", (intermediate, hidden))
        self.down_proj = linear("experts.%.down_proj.weight", (hidden, intermediate))
        self.up_proj = linear("experts.%.up_proj.weight", (intermediate, hidden))

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedExperts(nn.ModuleDict):
    """The experts `expert_ids` (global indices, contiguous) of one MoE layer. A dict keyed by the
    global index keeps MiniMind's names (`experts.{e}`) on every rank."""

    def __init__(self, hidden: int, intermediate: int, expert_ids: range, linear: LinearBuilder = plain_linear):
        super().__init__({str(e): Expert(hidden, intermediate, linear) for e in expert_ids})
        self.expert_ids = expert_ids

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor, fake_rows: list[int] | None = None) -> torch.Tensor:
        """tokens [T, H] sorted by local expert, counts [E_local] (sum T) -> [T, H] in the same order.
        fake_rows: on fake tensors, the rows of each local expert (None: the balanced split)."""
        experts = list(self.values())
        if grouped_mm_fits(tokens, experts[0]):
            return _grouped(tokens, counts, experts)
        return _looped(tokens, counts, experts, fake_rows)


def grouped_mm_fits(tokens: torch.Tensor, expert: Expert) -> bool:
    """Whether the experts run as one torch._grouped_mm: CUDA, bfloat16, compute capability >= 9.0,
    rows 16-byte aligned (not on fake tensors)."""
    if not hasattr(torch, "_grouped_mm") or tokens.dtype != torch.bfloat16 or tokens.device.type != "cuda":
        return False
    if is_fake(tokens) or torch.cuda.get_device_capability(tokens.device) < (9, 0):
        return False
    inter, hidden = expert.gate_proj.weight.shape
    per_row = 16 // tokens.element_size()
    return hidden % per_row == 0 and inter % per_row == 0


def _grouped(tokens, counts, experts):
    offsets = torch.cumsum(counts, 0).to(torch.int32)                    # [E_local] row ends

    def mm(x, name):                                                     # [T, in] @ [E, in, out] -> [T, out]
        w = torch.stack([getattr(e, name).weight for e in experts])      # [E, out, in]
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)

    return mm(F.silu(mm(tokens, "gate_proj")) * mm(tokens, "up_proj"), "down_proj")


def balanced_counts(rows: int, experts: int) -> list[int]:
    """rows split as evenly as it goes over `experts`, the remainder on the first ones."""
    return [rows // experts + (e < rows % experts) for e in range(experts)]


def host_counts(tokens: torch.Tensor, counts: torch.Tensor, fake_rows: list[int] | None = None) -> list[int]:
    """The counts on the host; under fake tensors (no values) `fake_rows`, or the balanced split."""
    if not is_fake(tokens):
        return counts.tolist()
    return list(fake_rows) if fake_rows is not None else balanced_counts(tokens.shape[0], counts.shape[0])


def _looped(tokens, counts, experts, fake_rows=None):
    parts = tokens.split(host_counts(tokens, counts, fake_rows))         # one [T_e, H] slice per expert
    return torch.cat([e(part) for e, part in zip(experts, parts)]) if parts else tokens[:0]
