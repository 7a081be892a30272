"""--zero 3 (FSDP2) under a pipeline, remembered across the planner's layouts (predict_memory's
worst_only): to the byte the peak fsdp_pipeline.py and fsdp_posted.py give, from what the zero 0-2
layouts have made already.

- the stage's sizes are its kind's (remembered_sizes.stage_kind: they read the zero level only for
  DDP's buckets, none under a pipeline), a posted order's chunks their kinds' (chunk_kinds);
- FSDP2's groups (fsdp_pipeline.StageGroups) are remembered by what they read (the parameters'
  shapes, W = dp x cp, the dtype) and on the kind;
- gpipe and 1f1b: the replicated stage's replay, of each backward its first largest moment, is
  the kind's (the zero 0 layouts' too): FSDP2 adds the same gathered bytes to every moment of the
  schedule and counts its unsharded grads (temporaries), so the first largest is among those;
- interleaved and zb: the walk over each chunk kind's terms cut to each action's first largest
  moment, with the grads counted (posted_peak's cut; FSDP2's gathered bytes are the same within
  an action), a chunk's blocks' gathered bytes from its kind's layers (every block holds the same
  shapes) and the root's from the stage;
- the reduces after the schedule: the caller adds the same bytes to each, so only their first
  largest is kept, remembered by the groups and the batch's bytes.
"""
from __future__ import annotations

import functools

from ...config import Recompute
from ...pipeline_parallel.order import Action
from .fsdp_pipeline import (StageGroups, _after_the_schedule, gathered_moments, grouped_reduces, optimized,
                            stage_groups)
from .fsdp_posted import gathered_walk
from .posted_peak import _cut
from .posted_replay import is_zero_bubble
from .remembered_sizes import SizesKind


def kind_groups(kind: SizesKind) -> StageGroups:
    """stage_groups of the kind's sizes, made once per kind."""
    if "fsdp groups" not in kind.derived:
        kind.derived["fsdp groups"] = stage_groups(kind.sizes)
    return kind.derived["fsdp groups"]


def first_largest_reduces(s, z: StageGroups, order: list[Action]) -> dict:
    """Of fsdp_pipeline.reduces only the first largest moment (by its total)."""
    return _first_largest_reduces(z.each, *_after_the_schedule(s, order), s.par.recompute == Recompute.FULL)


@functools.lru_cache(maxsize=4096)
def _first_largest_reduces(each: tuple, saved: int, batch: int, full: bool) -> dict:
    out = grouped_reduces(each, saved, batch, full)
    name = max(out, key=lambda k: sum(out[k]))
    return {name: out[name]}


def remembered_pipelined_moments(kind: SizesKind, order: list[Action], replayed: tuple[dict, dict], device: str,
                                 moe_step: int = 0, moe_layer_state: int = 0) -> tuple[dict, dict, int, int]:
    """fsdp_pipeline.pipelined_fully_sharded_moments' first largest moments (gpipe, 1f1b) of the
    stage `kind`, from its replay of each backward's first largest moment `replayed` (a copy)."""
    return gathered_moments(kind.sizes, kind_groups(kind), order, replayed, device, moe_step, moe_layer_state,
                            reduced=first_largest_reduces)


def cut_terms(kind: SizesKind, zb: bool):
    """The chunk kind's terms with each action's list cut to its first largest moment, the grads
    counted (posted_peak's cut), made once per kind."""
    key = ("fsdp cut", zb)
    if key not in kind.derived:
        kind.derived[key] = _cut(kind.terms(zb), True)
    return kind.derived[key]


def remembered_posted_moments(kind: SizesKind, chunks: list[SizesKind], order: list[Action], releases: dict,
                              device: str) -> tuple[dict, dict, int, int]:
    """fsdp_posted.posted_fully_sharded_moments(peak_only=True)'s first largest moments of the stage
    `kind` over a posted order, its chunks of `chunks` kinds (remembered_sizes.chunk_kinds)."""
    s, z = kind.sizes, kind_groups(kind)
    root_unsaved = z.embedding if not s.tied_here else 0
    zb = is_zero_bubble(order)
    full = s.par.recompute == Recompute.FULL
    per_chunk = [(0 if full else k.sizes.layers * z.block, k.sizes.layers * z.block if full else 0, z.block)
                 for k in chunks]
    moments, in_flight = gathered_walk(s, [k.sizes for k in chunks], [cut_terms(k, zb) for k in chunks], order,
                                       releases, (z.each[0][0] - root_unsaved, root_unsaved), per_chunk, True)
    moments.update(first_largest_reduces(s, z, order))
    return optimized(s, z, moments, in_flight, device)
