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
- interleaved and zb: posted_peak.py's rows of the walk over each chunk kind's terms cut to each
  action's first largest moment, with the grads counted (FSDP2's unsharded grads are temporaries,
  and its gathered bytes the same within an action), and to each row the gathered bytes of the
  root and of the chunks forwarded so far (a chunk's blocks' from its kind's layers: every block
  holds the same shapes), remembered per order and chunk layers, and to a chunk's first forward
  its top block's all-gather output (fsdp_pipeline.first_forward_end);
- the reduces after the schedule: the caller adds the same bytes to each, so only their first
  largest is kept, remembered by the groups and the batch's bytes.
"""
from __future__ import annotations

import functools

import numpy as np

from ...config import Recompute
from ...pipeline_parallel.order import Action, Step
from .fsdp_pipeline import (StageGroups, _after_the_schedule, first_forward_end, gathered_moments, grouped_reduces,
                            optimized, stage_groups, with_whole_experts)
from .fsdp_posted import zero_bubble_first_forward
from .orders import stage_order
from .posted_peak import _name, _zero_bubble, remembered_rows
from .remembered_sizes import SizesKind
from .stage_sizes import StageSizes


def kind_groups(kind: SizesKind) -> StageGroups:
    """stage_groups of the kind's sizes, made once per kind."""
    if "fsdp groups" not in kind.derived:
        kind.derived["fsdp groups"] = stage_groups(kind.sizes)
    return kind.derived["fsdp groups"]


def first_largest_reduces(s: StageSizes, z: StageGroups, order: list[Action]) -> dict:
    """Of fsdp_pipeline.reduces only the first largest moment (by its total)."""
    return with_whole_experts(_first_largest_reduces(z.each, *_after_the_schedule(s, order),
                                                     s.par.recompute == Recompute.FULL), z)


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


def remembered_posted_moments(kind: SizesKind, chunks: list[SizesKind], order_key: tuple, device: str,
                              moe_step: int = 0, moe_layer_state: int = 0) -> tuple[dict, dict, int, int]:
    """fsdp_posted.posted_fully_sharded_moments(peak_only=True)'s first largest moments of the stage
    `kind` over the posted order `order_key` = (P, stage, M, schedule, V), its chunks of `chunks`
    kinds (remembered_sizes.chunk_kinds): posted_peak's rows of the walk over the chunks' cut terms
    (the grads counted) with FSDP2's gathered bytes added to each row (`_gathered_rows`); zb's first
    forward's moments as fsdp_posted's (`moe_step`, `moe_layer_state`: its MoE terms)."""
    s, z = kind.sizes, kind_groups(kind)
    m, f, units, with_grads = remembered_rows(kind, chunks, order_key, True)
    key = ("gathered rows", tuple(chunks), order_key)   # on the kind, as its rows: their key hashes every row
    if key not in kind.derived:
        kind.derived[key] = _gathered_rows(m.rows, tuple(k.sizes.layers for k in chunks))
    seen, firsts = kind.derived[key]
    root_unsaved = z.embedding if not s.tied_here else 0
    full = s.par.recompute == Recompute.FULL
    blocks = seen * (z.block + z.experts)            # the forwarded chunks' blocks (and experts) gathered, per row
    totals = with_grads + (z.each[0][0] + blocks)      # with the root's (a new array: the rows' are remembered)
    extra = None                                     # (row, bytes): the last chunk's cross-entropy in its first forward
    for r, c in firsts:                              # a chunk's first forward: its top block's all-gather output
        added = _first_forward_added(chunks[c].sizes, z.experts or z.block)
        totals[r] += added[0]
        extra = (r, added[1]) if len(added) > 1 else extra
    ranked = totals if extra is None else np.insert(totals, extra[0] + 1, totals[extra[0]] + extra[1])
    pick = int(ranked.argmax())
    r = pick - (1 if extra is not None and pick > extra[0] else 0)
    g, a, t = int(m.grads[r] @ f), int(m.acts[r] @ f), int(m.temps[r] @ f)
    held = (z.each[0][0] - root_unsaved + (0 if full else int(blocks[r])), root_unsaved + (int(blocks[r]) if full else 0))
    shift = int(ranked[pick]) - (g + a + t + sum(held))   # what the first forward adds
    name = _name(m.rows[r], units)
    if extra is not None and pick == extra[0] + 1:
        name = f"cross_entropy{name[len('forward_end'):]}"
    moments, in_flight = {name: (0, a + held[0], t + g + held[1] + shift)}, {name: m.rows[r][3]}
    order = stage_order(*order_key)
    if _zero_bubble(order_key):
        moments.update(zero_bubble_first_forward(s, z, order, moe_step, moe_layer_state))
    moments.update(first_largest_reduces(s, z, order))
    return optimized(s, z, moments, in_flight, device)


def _first_forward_added(cs: StageSizes, top: int) -> tuple[int, ...]:
    """What fsdp_pipeline.first_forward_end adds to a chunk's first forward's end (`cs`: the chunk's
    sizes, `top`: its top block's all-gather output), and on the last chunk with the replicated
    head's loss what its cross-entropy moment right after holds beyond the forward's end (it adds
    bytes to the moment: so its moments of an empty one)."""
    return tuple(sum(v) for v in first_forward_end(cs, "forward_end", (0, 0, 0), top).values())


@functools.lru_cache(maxsize=4096)
def _gathered_rows(rows: tuple, layers: tuple) -> tuple[np.ndarray, tuple]:
    """Per row of posted_peak's walk (`rows`: (step, label, (microbatch, chunk), units)) the layers of
    the chunks forwarded so far, its own first forward included (`layers[c]`: chunk c's), and the
    rows of each chunk's first forward: ((row, chunk), ...)."""
    firsts, seen, out = [], set(), []
    for r, (step, _, (_, c), _) in enumerate(rows):
        if step is Step.FORWARD and c not in seen:
            seen.add(c)
            firsts.append((r, c))
        out.append(sum(layers[k] for k in seen))
    return np.array(out, dtype=np.int64), tuple(firsts)
