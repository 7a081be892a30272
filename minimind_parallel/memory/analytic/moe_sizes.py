"""The mixture-of-experts facet of the memory model (moe.MOEFeedForward in training mode).

What one MoE layer saves for backward (`moe_saved`, the kind "block.moe" in place of "block.mlp")
and what MoE layers keep outside autograd's saved tensors (`moe_temporaries`): each layer's
tokens per expert of its last forward (int64 [E], kept for the benchmark's histogram) and its
aux loss (0-dim, MiniMind's `self.aux_loss`), alive all step; and, until the step's backward
ends, the model's aux loss summed over the layers, its 1/M share and the objective it joins
(LM loss + aux, promoted to at least float32), and the LM loss in the model dtype beside it when
that is below float32. The
column-parallel inputs a block saves lose gate/up's share and gain the router's input
(`moe_column_input`).

Checked against `--estimate` to the byte (tests/test_memory.py) where the step's peak is the
head's backward, on one rank and under TP, SP (basic, shared gather, async, VP), selective
recompute, PP and DP, and under CP at the head's backward (the objective scaled by cp in place of
the objective) and at the optimizer step (`moe_report`: the step's reported aux loss), and at
the tied grads' sum under --recompute full and CP (the grad of the stage's summed aux loss gone
by then: backward_moments._after_the_aux_losses).
The moments inside an MoE layer's own backward (its experts', one by one, and the norm's after
it: moe_backward_moments.py), where a small vocabulary against N k I_e puts the peak, and under
SP the sum of the TP-partial router and expert grads (schedule_replay.partial_grad_sum), are
checked at one rank, TP, SP, EP 2 and 4, selective recompute and an earlier pipeline stage.

Under expert parallelism the dispatch adds its two saved indices (`ep_dispatch_saved`), for the
balanced routing --estimate follows (checked at ep 2 and 4, alone and beside TP + SP, PP, CP).

The routing (`Routing`): under EP the rows a rank's experts receive, M, depend on where the
tokens went; what its experts save (their input, gate out, up out, silu, product) and the
dispatch's two indices are [M]-shaped (`received_row_bytes`), the rest of the layer [N k]-shaped.
`predict_memory` takes the policy -- balanced (M = N k on every rank, --estimate's), the worst
case (every token of the EP group on one rank's experts: M = P N k) -- or a measured histogram
(the benchmark's tokens per expert: each MoE layer's rows per expert from one EP group in one
microbatch; every microbatch taken to route alike, or a list of them, one per microbatch), and
predicts its worst EP rank. Checked against a real ep-2 run fed its own
histogram, and one routed to a single rank's experts (tests/test_memory.py).
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from ...config import Choice, MiniMindConfig, ParallelConfig, Recompute
from ...moe.experts import balanced_counts
from ...moe.placement import local_experts
from ...plan import stage_layers


class RoutingPolicy(Choice):
    BALANCED = "balanced"   # every source routes N k / E rows to each expert (--estimate's policy)
    WORST = "worst"         # every token of the EP group on one EP rank's experts


# a measured routing: {MoE layer's module name ("model.layers.{i}.mlp"): rows each expert
# receives from one EP group in one microbatch} (the benchmark's tokens per expert); every
# microbatch routed alike, or a list of them, one per microbatch of the step
Histogram = Mapping[str, Sequence[int]]
Routing = RoutingPolicy | Histogram | Sequence[Histogram]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def routing_text(routing: Routing) -> str:
    """Which routing a prediction is for (the output says which it printed)."""
    if routing == RoutingPolicy.BALANCED:
        return "balanced (N x k / E rows per expert from every source)"
    if routing == RoutingPolicy.WORST:
        return "worst case (every token of the EP group on one EP rank's experts)"
    if is_per_microbatch(routing):
        return "the given histograms, one per microbatch (tokens per expert per MoE layer)"
    return "the given histogram (tokens per expert per MoE layer)"


def is_per_microbatch(routing: Routing) -> bool:
    """Whether `routing` is a list of histograms, one per microbatch."""
    return isinstance(routing, (list, tuple))


def microbatch_routings(routing: Routing, num_microbatches: int) -> list[Routing]:
    """The routing of each of the step's `num_microbatches` microbatches: a list's own (one per
    microbatch: ValueError in one line otherwise), or the one routing for all."""
    if not is_per_microbatch(routing):
        return [routing] * num_microbatches
    if len(routing) != num_microbatches:
        raise ValueError(f"routing histograms: one per microbatch, num_microbatches={num_microbatches}; "
                         f"got {len(routing)}")
    return list(routing)


def received_row_bytes(c: MiniMindConfig, par: ParallelConfig, b: int) -> int:
    """What one MoE layer saves per row its rank's experts receive: the experts' input [M, H],
    gate out, up out, silu and product [M, I_e], and under EP the dispatch's two int64 indices."""
    return b * c.hidden_size + 4 * b * c.moe_intermediate_size + (16 if par.ep > 1 else 0)


def expert_rows(c: MiniMindConfig, par: ParallelConfig, routing: Routing, layers: Sequence[int], *,
                tokens: int, ep_rank: int) -> list[list[int]]:
    """The rows each local expert of EP rank `ep_rank` receives in one microbatch, for each of
    `layers` (global indices); their sum is M. Each of the P sources routes `tokens` x k rows.
    Balanced: M = N k split evenly over the rank's experts (as --estimate's loop splits them);
    the worst case: M = P N k on this rank, split evenly; a histogram: its counts (at ep 1 the
    rank's experts are all of them)."""
    rows, local = tokens * c.num_experts_per_tok, c.num_experts // par.ep
    if routing == RoutingPolicy.BALANCED:
        return [balanced_counts(rows, local)] * len(layers)
    if routing == RoutingPolicy.WORST:
        return [balanced_counts(par.ep * rows, local)] * len(layers)
    mine = local_experts(c.num_experts, par.ep, ep_rank)
    counts = _histogram_by_layer(c, routing, rows * par.ep)
    missing = [i for i in layers if i not in counts]
    if missing:
        raise ValueError(f"routing histogram: no counts for MoE layer(s) {missing}; got layers {sorted(counts)}")
    return [[counts[i][e] for e in mine] for i in layers]


def stage_expert_rows(c: MiniMindConfig, par: ParallelConfig, routing: Routing, stage: int, *, seq_len: int,
                      micro_batch_size: int, ep_rank: int) -> dict[int, list[int]]:
    """{global layer index: the rows each local expert of EP rank `ep_rank` receives in one
    microbatch} for the MoE layers of pipeline stage `stage` (`expert_rows` of its tokens: N k per
    source, N = its CP rank's, under SP its sequence shard's)."""
    tokens = seq_len // par.cp * micro_batch_size // par.sequence_shards
    layers = stage_layers(c.num_hidden_layers, par.pp, stage, par.virtual_stages)   # (its chunks')
    return dict(zip(layers, expert_rows(c, par, routing, layers, tokens=tokens, ep_rank=ep_rank)))


def check_histogram(c: MiniMindConfig, par: ParallelConfig, histogram: Histogram | Sequence[Histogram], *,
                    seq_len: int, micro_batch_size: int, num_microbatches: int = 1) -> None:
    """A histogram fits the layout: every MoE layer's E counts, summing to one EP group's routed
    rows of one microbatch; a list of them, one per microbatch, each (ValueError in one line
    otherwise)."""
    for one in microbatch_routings(histogram, num_microbatches if is_per_microbatch(histogram) else 1):
        for stage in range(par.pp):
            stage_expert_rows(c, par, one, stage, seq_len=seq_len, micro_batch_size=micro_batch_size, ep_rank=0)


def _histogram_by_layer(c: MiniMindConfig, histogram: Histogram, total: int) -> dict[int, Sequence[int]]:
    """{global layer index: counts [E]}, each layer's counts checked: E of them, summing to the
    EP group's routed rows."""
    out = {}
    for name, counts in histogram.items():
        m = _LAYER.search(name)
        if m is None:
            raise ValueError(f"routing histogram: {name!r} names no layer (want 'model.layers.{{i}}.mlp')")
        if len(counts) != c.num_experts or sum(counts) != total:
            raise ValueError(f"routing histogram: layer {name!r} must give num_experts={c.num_experts} counts "
                             f"summing to ep x tokens x k = {total}; got {len(counts)} summing to {sum(counts)}")
        out[int(m.group(1))] = counts
    return out


def moe_saved(c: MiniMindConfig, par: ParallelConfig, *, b: int, f: int, tokens: int) -> int:
    """What one MoE layer saves for `tokens` routed tokens (its rank's: under SP its sequence shard)."""
    e, k, rows = c.num_experts, c.num_experts_per_tok, tokens * c.num_experts_per_tok
    router = b * tokens * e + 8 * tokens * k + ((b * tokens + b * tokens * k) if c.norm_topk_prob else 0)
    experts = 16 * rows + 3 * b * rows * c.hidden_size + 4 * b * rows * c.moe_intermediate_size + b * rows
    aux = f + f * e if c.router_aux_loss_coef > 0 else 0      # N, and the load [E]
    return router + experts + aux + ep_dispatch_saved(par, rows=rows)


def ep_dispatch_saved(par: ParallelConfig, *, rows: int) -> int:
    """What the EP dispatch of one MoE layer saves (moe/dispatch.py): the two index_selects' int64
    indices [M], to_experts (dispatch's regroup) and to_sources (combine's); the all-to-alls save
    nothing (their backward is the reverse all-to-all). M, the rows this rank's experts receive,
    is N*k under the balanced policy (every source sends N*k/P rows to every rank), so the
    experts' saved tensors keep their ep-1 shapes; with ep 1 the dispatcher is the identity."""
    return 2 * 8 * rows if par.ep > 1 else 0


def moe_column_input(par: ParallelConfig, column: int, *, b: int, n: int, nn_: int, hid: int) -> int:
    """The block's "column_input" kind with the MoE layer in place of gate/up: q/k/v's share of it,
    and the router's input -- the post-attention norm's output, [Nn, H] (under SP the shard), which
    the plain-TP and SP + async layouts already count (it is the one tensor gate/up saved)."""
    if par.sequence_parallel and not par.async_communication:
        # basic SP: three gathers for q/k/v (one shared with --shared_sp_gather), the router's shard
        return (b * n * hid if par.shared_sp_gather else 3 * b * n * hid) + basic_sp_router_input(par, b * nn_ * hid)
    return column


def basic_sp_router_input(par: ParallelConfig, shard: int) -> int:
    """What the router saves of its input under basic SP, the post-attention norm's output shard
    (`shard` bytes): the shard itself, or under --recompute selective nothing (the norm's output,
    re-made from the norm's saved input in backward: recompute/norm_recompute.py)."""
    return 0 if par.recompute == Recompute.SELECTIVE else shard


def moe_temporaries(c: MiniMindConfig, par: ParallelConfig, layers: int, *, f: int,
                    loss_copy: int, last: bool = True, b: int | None = None) -> tuple[int, int]:
    """(alive all step, alive until the step's backward ends) for `layers` MoE layers on a stage
    (`last`: the last pipeline stage); `loss_copy`: the LM loss's bytes when it is in the model
    dtype below float32, else 0. Under CP the last stage's objective is replaced by its copy scaled
    by cp (the stage's `cp_scaled_loss`); an earlier stage's term stays. `b`: the model dtype's
    bytes, an earlier stage's constant 0 aux losses' without an aux loss (None: `f`)."""
    if not c.use_moe:
        return 0, 0
    objective = 0 if par.cp > 1 and last else f
    if not last and c.router_aux_loss_coef <= 0:   # a constant 0 aux loss: no root, the sum not kept
        return layers * (8 * c.num_experts + (f if b is None else b)), f
    return layers * (8 * c.num_experts + f), 2 * f + objective + loss_copy


def moe_report(c: MiniMindConfig, *, last: bool, f: int) -> int:
    """The step's reported aux loss (StepResult.aux_loss, 0-dim, at least float32), made on the
    last stage when its schedule finishes: alive through the optimizer step."""
    return f if c.use_moe and last else 0
