"""--zero 3 (FSDP2) under the posted schedules (interleaved's model chunks, zb's W steps): the
posted replay (posted_replay.walk, every unit's moments with the dense model's grads) composed with
the gathered stage of fsdp_pipeline.py. A stage's model chunks share its FSDP2 groups (the root's,
one per block: zero/fully_shard.py wraps the stage's whole model), and a chunk's blocks are
gathered at its first forward and kept to the schedule's end (reshard_after_forward False), the
root's at the stage's first forward. So at each moment of the walk:

    grads       the dense model's grads so far (zb: the deferred ones from the first W) are FSDP2's
                unsharded grads on its gathered parameters: temporaries
    gathered    the root's and the blocks of every chunk forwarded so far: activations where
                autograd saves them, temporaries for the untied embedding and under --recompute
                full for the blocks (fsdp_pipeline.py)
    a chunk's first forward  its top block's all-gather output, alive to the model's return
                (the last chunk of the last stage: inside its cross-entropy, fsdp_pipeline.py)
    zb's first forward  the order's first action, nothing held before it: the moments where each
                group is gathered, as under 1f1b (fsdp_pipeline._first_forward: a block's copy-out
                with the blocks below gathered and saved; the MoE model's experts make the
                copy-out of the block above its first the peak)

then the reduces after the schedule and AdamW over the shards, as fsdp_pipeline.py's.
"""
from __future__ import annotations

from ...config import Recompute
from ...moe.placement import expert_of
from ...pipeline_parallel.order import Action, Step
from .fsdp_pipeline import _first_forward, first_forward_end, group_bytes, groups_of, optimized, reduces, stage_groups
from .posted_replay import is_zero_bubble, stage_terms, unit_terms, walk
from .stage_sizes import StageSizes


def _chunk_gathered(s: StageSizes, chunks: list[StageSizes], gathered: dict) -> list[tuple[int, int, int]]:
    """Each chunk's blocks gathered: (saved, unsaved, its top block's last all-gather output) bytes."""
    full = s.par.recompute == Recompute.FULL
    out = []
    for cs in chunks:
        blocks = groups_of(cs)[1:]
        whole = sum(gathered[n] for names in blocks for n in names)
        # the top block's last all-gather: its experts' where they are a group of their own (fsdp_experts.py)
        experts = sum(gathered[n] for n in blocks[-1] if expert_of(n) is not None and s.par.ep > 1)
        out.append((0 if full else whole, whole if full else 0, experts or sum(gathered[n] for n in blocks[-1])))
    return out


def posted_fully_sharded_moments(s: StageSizes, chunks: list[StageSizes], order: list[Action], releases: dict,
                                 device: str, peak_only: bool = False, moe_step: int = 0,
                                 moe_layer_state: int = 0) -> tuple[dict, dict, int, int]:
    """The stage's moments under FSDP2 over a posted order (`chunks[c]`: chunk c's sizes, `releases`
    the sends' release points), the reduces' and the optimizer step's last; how many units each
    finds held; this rank's shards; AdamW's states. `peak_only` (the planner's): of the walk's
    moments only the first largest (the caller adds the same bytes to each of them). `moe_step`,
    `moe_layer_state`: as fsdp_pipeline.pipelined_fully_sharded_moments' (zb's first forward)."""
    shard, dense, gathered = group_bytes(s)
    z = stage_groups(s)
    root_unsaved = z.embedding if not s.tied_here else 0
    zb = is_zero_bubble(order)
    moments, in_flight = gathered_walk(s, chunks, [unit_terms(cs, zb) for cs in chunks], order, releases,
                                       (z.each[0][0] - root_unsaved, root_unsaved), _chunk_gathered(s, chunks, gathered),
                                       peak_only)
    if zb:
        moments.update(zero_bubble_first_forward(s, z, order, moe_step, moe_layer_state))
    moments.update(reduces(s, z, order))
    return optimized(s, z, moments, in_flight, device)


def zero_bubble_first_forward(s: StageSizes, z, order: list[Action], moe_step: int, moe_layer_state: int) -> dict:
    """zb's stage's first forward, where each FSDP2 group is gathered: its first action (one model
    chunk, nothing held before it), so 1F1B's moments (fsdp_pipeline._first_forward), named
    by the unit as the walk names them. -> name: (grads, activations, temporaries)."""
    i = order[0].microbatch
    made = _first_forward(s, i, z.block, z.each[0][0], moe_step, moe_layer_state,
                          (z.experts, z.experts_shard, z.experts_dense))
    return {f"{k[:-len(f'[{i}]')]}[{i}.0]": v for k, v in made.items()}


def gathered_walk(s: StageSizes, chunks: list[StageSizes], units: list, order: list[Action], releases: dict,
                  root: tuple[int, int], per_chunk: list[tuple[int, int, int]], peak_only: bool) -> tuple[dict, dict]:
    """The posted walk's moments (posted_replay.walk over the chunks' terms `units`) with FSDP2's
    gathered bytes: the root's (saved, unsaved) from the start, each chunk's blocks' (saved,
    unsaved, its top block's all-gather output: `per_chunk`) from its first forward on; how many
    units each finds held. `peak_only`: the first largest alone."""
    moments, in_flight, seen = {}, {}, set()
    held = list(root)   # the gathered bytes (saved, unsaved) of the root and the chunks forwarded so far
    best = [-1]         # peak_only: the largest total kept

    def emit(step: Step, label, unit: tuple, moment: tuple, n: int) -> None:
        i, c = unit
        first = step is Step.FORWARD and c not in seen
        if first:
            seen.add(c)
            held[0], held[1] = held[0] + per_chunk[c][0], held[1] + per_chunk[c][1]
        g, a, t = moment
        if peak_only and not first and g + a + t + held[0] + held[1] <= best[0]:
            return   # (a first forward's all-gather output is added below)
        name = (f"{label or 'forward_end'}[{i}.{c}]" if step is Step.FORWARD else f"weight[{i}.{c}]#{label}"
                if step is Step.WEIGHT else f"{label}[{i}.{c}]")
        here = {name: (0, a + held[0], t + g + held[1])}
        if first:
            here = first_forward_end(chunks[c], name, here[name], per_chunk[c][2])
        for k, v in here.items():
            if peak_only and sum(v) <= best[0]:
                continue
            if peak_only:
                moments.clear()
                in_flight.clear()
                best[0] = sum(v)
            moments[k], in_flight[k] = v, n

    walk(stage_terms(s), units, order, releases, emit)
    return moments, in_flight
