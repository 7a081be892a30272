"""Over which process group a parameter's gradient is reduced and its optimizer state sharded.

Dense parameters are replicated over DP and CP, so they are sharded over the DP x CP group
(`ProcessGroups.dp_cp`). Every sharded component (the distributed optimizer's buffers, the grad
norm over the shards) asks this function, so a parameter replicated over another group (expert
weights over the expert-data-parallel group) changes this one place.
"""
from __future__ import annotations

from ..groups import ProcessGroups
from ..moe.placement import expert_of


def reduction_group(groups: ProcessGroups, name: str):
    """The group over which parameter `name` (as named on its stage) is replicated: DP x CP for a
    dense parameter, the expert-data-parallel group for an expert's weight (the same group at
    ep_size 1; `data_parallel.reduction_group` is this rule for a Parameter)."""
    return groups.edp if expert_of(name) is not None else groups.dp_cp
