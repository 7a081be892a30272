"""Process groups for the rank grid dp x pp x cp x tp (TP varies fastest), in one explicit object.

Expert parallelism adds no axis: its groups are carved out of each DP x CP rank list
(`expert_groups`, Megatron-LM's layout).

Nothing here is global: build a `ProcessGroups` once per process and pass it to the code that
needs it. `ProcessGroups.single()` stands in for a one-rank layout (no communication at all).
"""
from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import ParallelConfig
from .plan import is_first_stage, is_last_stage

AXES = ("dp", "pp", "cp", "tp")


def first_on_node() -> bool:
    """Whether this rank is the first of its node (torchrun's LOCAL_RANK 0): the one that hands a
    result to its node's launcher. Without torchrun, global rank 0."""
    local = os.environ.get("LOCAL_RANK")
    return int(local) == 0 if local is not None else dist.get_rank() == 0


def rank_grid(par: ParallelConfig) -> torch.Tensor:
    """grid[d, p, c, t] = global rank; TP fastest, then CP, then PP, then DP."""
    return torch.arange(par.world_size).view(par.dp, par.pp, par.cp, par.tp)


def groups_along(grid: torch.Tensor, axis: int) -> list[list[int]]:
    """All rank lists that vary only along `axis` of the grid."""
    moved = grid.movedim(axis, -1)
    return moved.reshape(-1, grid.shape[axis]).tolist()


def replica_index(coords: dict, par: ParallelConfig) -> int:
    """A rank's place among the DP x CP ranks of its (pp, tp) coordinates: d * C + c, the order of
    the `dp_cp` group's ranks."""
    return coords["dp"] * par.cp + coords["cp"]


def expert_groups(replicas: list[int], ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """Megatron-LM's expert layout over one DP x CP rank list L (n = dp x cp ranks, ep divides n):
    -> (EP groups, the contiguous L[i*ep:(i+1)*ep]; EDP groups, the strided L[j::ep], the ranks
    that hold the same experts). With ep = 1 the one EDP group is L."""
    ep_groups = [replicas[i:i + ep] for i in range(0, len(replicas), ep)]
    edp_groups = [replicas[j::ep] for j in range(ep)]
    return ep_groups, edp_groups


def groups_across(grid: torch.Tensor, axes: tuple[int, ...]) -> list[list[int]]:
    """All rank lists that vary only along `axes` of the grid (e.g. DP and CP together)."""
    moved = grid.movedim(axes, tuple(range(-len(axes), 0)))
    return moved.reshape(-1, math.prod(grid.shape[a] for a in axes)).tolist()


@dataclass
class ProcessGroups:
    par: ParallelConfig
    rank: int
    coords: dict          # {"dp": d, "pp": p, "cp": c, "tp": t} of this rank
    tp: dist.ProcessGroup | None = None  # None when the axis has size 1 -- no communication
    pp: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None
    pp_ranks: list[int] | None = None    # global ranks of this rank's pipeline, stage order
    embed: dist.ProcessGroup | None = None  # first + last stage (tied embeddings span them); None if pp = 1
    dp_cp: dist.ProcessGroup | None = None  # DP x CP: every replica of a parameter (gradient reduction)
    ep: dist.ProcessGroup | None = None     # expert parallel: a contiguous slice of the DP x CP ranks (token all-to-all)
    edp: dist.ProcessGroup | None = None    # expert data parallel: the DP x CP ranks holding the same experts

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def tp_size(self) -> int:
        return self.par.tp

    @property
    def cp_rank(self) -> int:
        return self.coords["cp"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert-parallel group: which slice of the experts it holds."""
        return replica_index(self.coords, self.par) % self.par.ep

    @property
    def ep_size(self) -> int:
        return self.par.ep

    @property
    def is_first_stage(self) -> bool:
        return is_first_stage(self.pp_rank)

    @property
    def is_last_stage(self) -> bool:
        return is_last_stage(self.pp_rank, self.par.pp)

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (same dp/cp/tp coordinates), None on the first."""
        return None if self.is_first_stage else self.pp_ranks[self.pp_rank - 1]

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last_stage else self.pp_ranks[self.pp_rank + 1]

    @classmethod
    def single(cls, par: ParallelConfig | None = None) -> "ProcessGroups":
        par = par or ParallelConfig()
        assert par.world_size == 1
        return cls(par=par, rank=0, coords=dict.fromkeys(AXES, 0), pp_ranks=[0])

    @classmethod
    def build(cls, par: ParallelConfig, *, timeout: datetime.timedelta | None = None) -> "ProcessGroups":
        """Collective over the world: every rank creates every group, in the same order. `timeout`: the
        longest a collective of these groups waits (None: torch's default for new groups, 30 minutes on
        gloo, whatever the default group was given)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        if world != par.world_size:
            raise ValueError(f"world size {world} != dp*pp*cp*tp = {par.world_size}")
        grid = rank_grid(par)
        index = (grid == rank).nonzero()[0].tolist()
        out = cls(par=par, rank=rank, coords=dict(zip(AXES, index)))
        for axis, name in enumerate(AXES):
            for ranks in groups_along(grid, axis):
                group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    setattr(out, name, group)
                    if name == "pp":
                        out.pp_ranks = ranks
        for ranks in groups_along(grid, AXES.index("pp")):  # embedding groups: first + last stage
            group = dist.new_group([ranks[0], ranks[-1]], timeout=timeout) if len(ranks) > 1 else None
            if rank in (ranks[0], ranks[-1]):
                out.embed = group
        # Parameters are replicated over CP as over DP: their grads are reduced over both at once
        # (Megatron-LM's and picotron's data-parallel x context-parallel group).
        for ranks in groups_across(grid, (AXES.index("dp"), AXES.index("cp"))):
            group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
            if rank in ranks:
                out.dp_cp = group
        out.ep, out.edp = _expert_groups(par, grid, rank, out.dp_cp, timeout)
        return out


def _expert_groups(par: ParallelConfig, grid: torch.Tensor, rank: int, dp_cp, timeout):
    """This rank's (EP group, EDP group) of `expert_groups`, every group created on every rank in
    the same order; with ep = 1 the EDP group is the DP x CP group itself. None: a one-rank group."""
    ep_group = edp_group = None
    for replicas in groups_across(grid, (AXES.index("dp"), AXES.index("cp"))):
        ep_lists, edp_lists = expert_groups(replicas, par.ep)
        for ranks in ep_lists:
            group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
            if rank in ranks:
                ep_group = group
        for ranks in edp_lists:
            if par.ep == 1:                     # L itself: the DP x CP group, no second copy
                group = dp_cp if rank in ranks else None
            else:
                group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
            if rank in ranks:
                edp_group = group
    return ep_group, edp_group
