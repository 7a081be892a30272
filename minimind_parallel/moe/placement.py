"""Which expert-parallel rank holds which experts: EP rank r of P holds the contiguous global
experts [r*E/P, (r+1)*E/P) (Megatron-LM's layout). Expert parameters keep their global index in
their names (`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`, MiniMind's keys), so
a rank's state dict, its checkpoint keys and validation's dense slices are the dense model's for
those experts, in every layout."""
from __future__ import annotations

import re

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def local_experts(num_experts: int, ep: int, ep_rank: int) -> range:
    """The global indices of the experts EP rank `ep_rank` of `ep` holds."""
    per_rank = num_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def expert_of(key: str) -> int | None:
    """The global expert index of state-dict key `key`, None for a parameter of no expert."""
    m = _EXPERT.search(key)
    return None if m is None else int(m.group(1))


def holds(key: str, num_experts: int, ep: int, ep_rank: int) -> bool:
    """Whether EP rank `ep_rank` holds parameter `key` (every rank holds the non-expert ones)."""
    e = expert_of(key)
    return e is None or e in local_experts(num_experts, ep, ep_rank)
