"""--zero 3 (FSDP2) under pipeline parallelism replayed: zero/fully_shard.py keeps a stage's
groups gathered from their first forward to the end of the schedule (reshard_after_forward
False), no backward reduce-scatters (set_requires_gradient_sync False) and every group reduces
once after the last backward (`reduced_after_the_schedule`). So each moment of the schedule is
the replicated stage's (schedule_replay.py) with:

    params      this rank's shards (and the RoPE tables), at every moment
    grads       none registered during the schedule: the unsharded grads FSDP2 accumulates on its
                gathered parameters are temporaries (not a registered parameter's .grad)
    gathered    every group's unsharded parameters (one padded storage each) from the first
                forward on: activations where autograd saves them (every parameter an op reads
                in backward), temporaries for the untied embedding (its backward needs the ids)
    forward_end[first]  the last group's all-gather output (the top block's), freed by the root's
                post-forward

then, after the schedule, each group's reduce (in FSDP2's state order: the root's, then the
blocks' from the bottom): its parameters resharded, its grads copied into its reduce-scatter
input (padded, gathered size), the groups before it holding their sharded grads; then AdamW over
the shards.
"""
from __future__ import annotations

from ...pipeline_parallel.order import Action
from .schedule_replay import optimizer_step, replay_schedule
from .stage_sizes import StageSizes, numel

EMBEDDING = "model.embed_tokens.weight"


def _groups(s: StageSizes) -> list[list[str]]:
    """The stage's FSDP2 groups in the order FSDP2 reduces them: the root's, then each block's."""
    blocks: dict[str, list[str]] = {}
    root = []
    for name in s.shapes:
        if name.startswith("model.layers."):
            blocks.setdefault(name.split(".")[2], []).append(name)
        else:
            root.append(name)
    return [root, *blocks.values()]


def pipelined_fully_sharded_moments(s: StageSizes, order: list[Action], device: str) -> tuple[dict, dict, int, int]:
    """The stage's moments under FSDP2 over a pipeline schedule, the reduces' and the optimizer
    step's last; how many microbatches each finds in flight; this rank's shards; AdamW's states."""
    world, b = s.par.dp * s.par.cp, s.b
    shard = {n: b * -(-shape[0] // world) * numel(shape[1:]) for n, shape in s.shapes.items()}
    dense = {n: b * numel(shape) for n, shape in s.shapes.items()}
    gathered = {n: world * v for n, v in shard.items()}
    unsaved = gathered[EMBEDDING] if EMBEDDING in gathered and not s.tied_here else 0
    groups = _groups(s)
    last_gather = sum(gathered[n] for n in groups[-1])
    replayed, in_flight = replay_schedule(s, order)
    first = f"forward_end[{order[0].microbatch}]"   # the stage's first forward: every group gathered in it
    whole = sum(gathered.values())
    moments = {k: (0, a + whole - unsaved, t + g + unsaved + (last_gather if k == first else 0))
               for k, (g, a, t) in replayed.items()}
    reduced = 0
    for j, names in enumerate(groups):
        later = [n for group in groups[j + 1:] for n in group]
        here = sum(gathered[n] for n in names)
        moments[f"reduce(group {j})"] = (reduced, 0, sum(gathered[n] for n in later)
                                         + sum(dense[n] for n in names + later) + here)
        reduced += sum(shard[n] for n in names)
    params = sum(shard.values())
    moments["optimizer"] = optimizer_step(s, list(shard.values()), grads=params)
    states = 2 * params + (4 * len(shard) if device == "cpu" else 0)
    return moments, in_flight, params, states
