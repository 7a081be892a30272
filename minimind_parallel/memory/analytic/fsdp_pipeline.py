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
                and under --recompute full for the blocks (their checkpoint saves nothing, and
                its re-run in backward saves under its own hooks)
    first forward  fsdp_replay's moments where each group is gathered (a block's copy-out, the
                top block's last residual add and lean SwiGLU), the blocks below still gathered;
                the top block's all-gather output lives to the root's post-forward (the model's
                return: the last stage's replicated head scales its loss after it)

then, after the schedule, each group's reduce (in FSDP2's state order: the root's, then the
blocks' from the bottom; a middle stage's root holds none): its parameters resharded, its grads
copied into its reduce-scatter input (padded, gathered size), then its reduce-scatter output (its
sharded grads) made while the last of its unsharded grads is still bound, the groups before it
holding their sharded grads, the batch and the reported losses alive; then AdamW over the shards.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ...config import Recompute
from ...moe.placement import expert_of
from ...pipeline_parallel.order import Action, Step
from .fsdp_experts import expert_forward_shift
from .fsdp_replay import _forward_moments
from .fsdp_sizes import FsdpSizes
from .schedule_replay import batch_saved, optimizer_step, replay_schedule, targets_saved
from .stage_sizes import StageSizes, numel

EMBEDDING = "model.embed_tokens.weight"


def groups_of(s: StageSizes) -> tuple[tuple[str, ...], ...]:
    """The stage's FSDP2 groups in the order FSDP2 reduces them: the root's, then each block's."""
    return _grouped(tuple(s.shapes))


@functools.lru_cache(maxsize=1024)
def _grouped(names: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """groups_of, remembered by the parameter names (the planner's layouts share a few stages')."""
    blocks: dict[str, list[str]] = {}
    root = []
    for name in names:
        if name.startswith("model.layers."):
            blocks.setdefault(name.split(".")[2], []).append(name)
        else:
            root.append(name)
    return tuple(map(tuple, [root, *blocks.values()]))


def group_bytes(s: StageSizes) -> tuple[dict, dict, dict]:
    """Per parameter of the stage: this rank's shard (dim 0 padded to a multiple of W = dp x cp; under
    expert parallelism an expert's of the EDP ranks, W / ep), the dense tensor, the padded gathered
    one (bytes; none for an expert whole outside FSDP2, on one EDP rank)."""
    world, b = s.par.dp * s.par.cp, s.b
    edp = world // s.par.ep if s.par.ep > 1 else world
    over = {n: edp if expert_of(n) is not None else world for n in s.shapes}
    shard = {n: b * -(-shape[0] // over[n]) * numel(shape[1:]) for n, shape in s.shapes.items()}
    dense = {n: b * numel(shape) for n, shape in s.shapes.items()}
    return shard, dense, {n: over[n] * v if over[n] > 1 else 0 for n, v in shard.items()}


@dataclass(frozen=True)
class StageGroups:
    """The stage's FSDP2 groups in bytes (group_bytes summed per group, in FSDP2's order: the root's,
    then each block's, under expert parallelism each followed by its experts' over the EDP ranks)."""

    each: tuple        # per group: (gathered, dense, shard, its last parameter's dense; None: no parameters)
    shards: tuple      # every parameter's shard on this rank, in the model's order (AdamW's)
    embedding: int     # the gathered embedding (0: not on this stage)
    experts: int = 0   # one MoE layer's experts gathered over their EDP ranks (0: in their block's group)
    experts_shard: int = 0
    experts_dense: int = 0
    whole_experts: int = 0   # one EDP rank (ep = dp x cp): every expert of the stage whole, outside FSDP2

    @property
    def block(self) -> int:
        """One block's gathered bytes (the top one's; every block holds the same shapes), its experts' not."""
        return self.each[-2 if self.experts else -1][0]

    @property
    def blocks(self) -> int:
        return sum(e[0] for e in self.each[1:])

    @property
    def params(self) -> int:
        return sum(self.shards)


def stage_groups(s: StageSizes) -> StageGroups:
    """StageGroups of `s`, remembered by what they read: the parameters' shapes, W, the EDP ranks
    the experts shard over under expert parallelism (zero/fully_shard.py's `shard_experts`; W
    otherwise) and the dtype."""
    world = s.par.dp * s.par.cp
    return _stage_groups(tuple(s.shapes.items()), world, s.b, world // s.par.ep if s.par.ep > 1 else world)


@functools.lru_cache(maxsize=4096)
def _stage_groups(shapes: tuple, world: int, b: int, edp: int | None = None) -> StageGroups:
    edp = world if edp is None else edp
    own = edp != world   # the experts in groups of their own (one EDP rank: outside FSDP2, whole)
    shard = {n: b * -(-shape[0] // (edp if own and expert_of(n) is not None else world)) * numel(shape[1:])
             for n, shape in shapes}
    dense = {n: b * numel(shape) for n, shape in shapes}
    groups = _grouped(tuple(shard))
    if own:   # each block's group, then its experts' (FSDP2's state order: a module before its children)
        groups = (groups[0], *(part for names in groups[1:] for part in _experts_apart(names)[:2 if edp > 1 else 1]))
    each = tuple(((edp if own and names and expert_of(names[0]) is not None else world) * sum(shard[n] for n in names),
                  sum(dense[n] for n in names), sum(shard[n] for n in names),
                  dense[names[-1]] if names else None) for names in groups)
    experts = each[-1] if own and len(groups) > 1 and expert_of(groups[-1][0]) is not None else (0, 0, 0)
    return StageGroups(each=each, shards=tuple(shard.values()),
                       embedding=world * shard[EMBEDDING] if EMBEDDING in shard else 0,
                       experts=experts[0] if edp > 1 else 0, experts_shard=experts[2], experts_dense=experts[1],
                       whole_experts=sum(dense[n] for n in dense if own and edp == 1 and expert_of(n) is not None))


def _experts_apart(names: tuple) -> tuple:
    """A block's parameter names as FSDP2's groups: its own, then its experts' (where it has any)."""
    experts = tuple(n for n in names if expert_of(n) is not None)
    rest = tuple(n for n in names if expert_of(n) is None)
    return (rest, experts) if experts else (rest,)


def first_forward_end(s: StageSizes, name: str, moment: tuple, last_gather: int) -> dict:
    """The stage's first forward's end, `moment` without FSDP2's own bytes: the top block's
    all-gather output lives to the root's post-forward, as the model returns. An earlier stage,
    or the last inside its loss (VP, --loss_chunks): at the moment. The replicated head's loss is
    scaled after the return: a moment inside the loss (its cross-entropy made; not its scaled copy,
    the loss weight's cast nor, MoE, the objective, the reported aux share and the loss's copy in
    the model dtype, moe_sizes.moe_temporaries) holds it instead."""
    g, a, t = moment
    if not s.last:   # MoE: inside the model the stage's summed aux loss is not made yet
        return {name: (g, a, t + last_gather - (s.f if s.top_k else 0))}
    if s.par.vocab_parallel or s.par.loss_chunks > 1:
        return {name: (g, a, t + last_gather)}
    unmade = s.b + s.weight + (((0 if s.par.cp > 1 else s.f) + s.f + s.weight) if s.top_k else 0)
    return {name: moment, f"cross_entropy{name[len('forward_end'):]}": (g, a, t - unmade + last_gather)}


def _first_forward(s: StageSizes, i: int, block: int, root: int, moe_step: int, moe_layer_state: int,
                   experts: tuple = (0, 0, 0)) -> dict:
    """FSDP2's moments of the stage's first forward (microbatch `i`), where its groups are
    gathered (fsdp_replay's: each block's copy-out, the top block's last residual add and lean
    SwiGLU), with the blocks below still gathered (saved; --recompute full: not) and the root's
    gathered parameters (`root` bytes; `block`: one block's) not saved by anything yet. Under expert
    parallelism `experts`: one MoE layer's experts' (gathered, shard, dense) bytes, their own group
    (fsdp_experts.py's forward moments), the blocks below holding theirs too.
    -> name: (grads, activations, temporaries)."""
    z = FsdpSizes(block=block, block_shard=0, root=root, root_shard=0, root_unsaved=0, shards=(),
                  experts=experts[0], experts_shard=experts[1], experts_dense=experts[2])
    saved, unsaved = batch_saved(s), targets_saved(s)   # (the targets are not saved before the loss)
    out = {}
    for name, (a, t) in _forward_moments(s, z, fresh_root=True, seen=False, unmade_state=moe_layer_state).items():
        below = int(name.split()[-1][:-1]) * (block + z.experts)
        below += z.experts if name.startswith("block_forward_end") else 0   # the top block's experts, kept gathered
        a, t = (a, t + below) if s.par.recompute == Recompute.FULL else (a + below, t)
        t += expert_forward_shift(s, z, name, fresh_root=True)   # the all-gather output kept: the experts'
        out[f"{name}[{i}]"] = (0, saved - unsaved + a, s.batch - saved + unsaved + root + t - moe_step)
    return out


def _after_the_schedule(s: StageSizes, order: list[Action]) -> tuple[int, int]:
    """What the step's batch holds while the groups reduce (inside the schedule's step, before the
    optimizer's): (activations, temporaries). The ids and targets and the microbatches' loss
    weights (fp32: saved by the loss's scaling, on the last stage) and the last stage's reported
    losses, one per forward."""
    saved = batch_saved(s) + (4 * s.mb if s.last and s.weight == 0 else 0)
    forwards = sum(a.step is Step.FORWARD for a in order)
    return saved, s.batch - saved + (forwards * s.loss_scalar if s.last else 0)


def reduces(s: StageSizes, z: StageGroups, order: list[Action]) -> dict:
    """Each group's reduce after the schedule, in FSDP2's order (`z`: the stage's groups): its
    grads copied into its reduce-scatter input (its parameters resharded), then the output (its
    sharded grads) made, of its unsharded grads the last one still bound (by foreach_reduce's
    loop over them); the later groups still gathered. -> name: (grads, activations, temporaries)."""
    return with_whole_experts(grouped_reduces(z.each, *_after_the_schedule(s, order), s.par.recompute == Recompute.FULL), z)


def with_whole_experts(reduced: dict, z: StageGroups) -> dict:
    """The reduces' moments with the whole experts' grads (one EDP rank: .grad since their backward,
    reduced by finalize_grads after the groups, as under DDP)."""
    return {k: (g + z.whole_experts, a, t) for k, (g, a, t) in reduced.items()} if z.whole_experts else reduced


def grouped_reduces(each: tuple, saved: int, batch: int, full: bool) -> dict:
    """reduces of the groups' bytes `each` (gathered, dense, shard, its last parameter's dense; None:
    no parameters), what the batch holds meanwhile (`saved`, `batch`: _after_the_schedule) and
    whether --recompute is full."""
    still, later_dense = sum(e[0] for e in each), sum(e[1] for e in each)   # the later groups' (from j on, first)
    out, reduced = {}, 0
    for j, (gathered, dense, shard, last) in enumerate(each):
        still, later_dense = still - gathered, later_dense - dense
        if last is None:   # a middle stage's root holds no parameters: no group to reduce
            continue
        blind = still if full else 0   # the blocks' are never saved
        rest = batch + blind + gathered + later_dense
        out[f"reduce(group {j})"] = (reduced, saved + still - blind, rest + dense)
        reduced += shard
        out[f"reduce_scatter(group {j})"] = (reduced, saved + still - blind, rest + last)
    return out


def pipelined_fully_sharded_moments(s: StageSizes, order: list[Action], device: str, moe_step: int = 0,
                                    moe_layer_state: int = 0) -> tuple[dict, dict, int, int]:
    """The stage's moments under FSDP2 over a pipeline schedule, the reduces' and the optimizer
    step's last; how many microbatches each finds in flight; this rank's shards; AdamW's states.
    `moe_step`, `moe_layer_state`: the MoE tensors alive until the step's end and each layer's
    alive all step, which the caller adds to every moment (moe_sizes.moe_temporaries)."""
    return gathered_moments(s, stage_groups(s), order, replay_schedule(s, order), device, moe_step, moe_layer_state)


def gathered_moments(s: StageSizes, z: StageGroups, order: list[Action], replayed: tuple[dict, dict], device: str,
                     moe_step: int = 0, moe_layer_state: int = 0, reduced=reduces) -> tuple[dict, dict, int, int]:
    """pipelined_fully_sharded_moments of the replicated stage's replay `replayed` (its moments
    and their microbatches in flight; of each backward its first largest moment alone gives the
    same peak: FSDP2's bytes are the same at every moment of the schedule, the grads counted),
    the reduces' moments by `reduced` (reduces, or of them the first largest alone)."""
    unsaved = z.embedding if not s.tied_here else 0
    if s.par.recompute == Recompute.FULL:   # a block's checkpoint saves nothing of its forward (nor its re-run)
        unsaved += z.blocks
    last_gather = z.experts or z.block   # the top block's experts' all-gather, the last (fsdp_experts.py)
    replayed, in_flight = replayed
    first = f"forward_end[{order[0].microbatch}]"   # the stage's first forward: every group gathered in it
    whole = sum(e[0] for e in z.each)
    moments = {k: (0, a + whole - unsaved, t + g + unsaved) for k, (g, a, t) in replayed.items()}
    moments.update(first_forward_end(s, first, moments[first], last_gather))
    moments.update(_first_forward(s, order[0].microbatch, z.block, z.each[0][0], moe_step, moe_layer_state,
                                  (z.experts, z.experts_shard, z.experts_dense)))
    moments.update(reduced(s, z, order))
    return optimized(s, z, moments, in_flight, device)


def optimized(s: StageSizes, z: StageGroups, moments: dict, in_flight: dict, device: str) -> tuple[dict, dict, int, int]:
    """`moments` with AdamW's step over this rank's shards last; the moments, their microbatches
    in flight, the shards' bytes and AdamW's states (a step counter per tensor on the CPU)."""
    params = z.params
    moments["optimizer"] = optimizer_step(s, list(z.shards), grads=params)
    states = 2 * params + (4 * len(z.shards) if device == "cpu" else 0)
    return moments, in_flight, params, states
