"""`predict_memory`: the peak of a training step, every pipeline stage (and CP rank), and its
breakdown by category: the largest of the moments of the stage's replayed schedule."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ...memo import Frozen
from ...config import MiniMindConfig, ParallelConfig, check_layout
from ...pipeline_parallel.order import Schedule, Step, check_schedule
from ...zero.buckets import DEFAULT_BUCKET_MB
from ..tracker import CATEGORIES
from .fsdp_composition import check_composition
from .fsdp_pipeline import pipelined_fully_sharded_moments
from .fsdp_posted import posted_fully_sharded_moments
from .fsdp_remembered import remembered_pipelined_moments, remembered_posted_moments
from .fsdp_replay import check_fully_sharded, fully_sharded_moments
from .orders import stage_order, stage_posted, stage_releases
from .moe_sizes import (Routing, RoutingPolicy, is_per_microbatch, microbatch_routings, moe_report, moe_temporaries,
                        received_row_bytes, routing_text, stage_expert_rows)
from .posted_peak import remembered_posted_peak
from .posted_replay import replay_posted
from .remembered_sizes import SizesKind, chunk_kinds, model_key, stage_kind
from .saved_kinds import as_dtype
from .schedule_replay import moe_lingering, optimizer_step, partial_grad_sum, replay_schedule
from .stage_sizes import StageSizes, chunk_sizes, stage_sizes
from .zero_sizes import (optimizer_state_bytes, remembered_staging_plans, slice_sizes, staging_bytes, zero2_moments,
                         zero_layouts)


# the schedules whose orders the model replays (zb too: every variant)
MODELLED_SCHEDULES = (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE)
# the --zero levels it predicts for every layout the planner enumerates (3, FSDP2's gathers --
# under PP by fsdp_pipeline.py, under interleaved and zb by fsdp_posted.py -- but for the layouts
# fsdp_replay.check_fully_sharded and fsdp_composition.check_composition refuse, which the planner
# cuts through space.check_candidate);
# the planner enumerates these two tuples' members
MODELLED_ZERO_LEVELS = (0, 1, 2, 3)


@dataclass
class MemoryPrediction:
    peak_bytes: int
    breakdown: dict[str, int]                 # CATEGORIES -> bytes at the predicted peak
    activations_by_kind: dict[str, int]       # "block.<kind>" (one block) and "model.<kind>"
    num_layers: int                           # layers on this stage
    peak_at: str = ""                         # which moment of the step is the peak
    candidates: dict[str, int] = field(default_factory=dict)
    per_stage: list[int] = field(default_factory=list)   # peak bytes of each pipeline stage
    held_per_microbatch: int = 0   # what one microbatch keeps on this stage from its forward to its backward
    held_at_peak: int = 0          # microbatches whose activations are held at the peak
    routing: str = ""              # MoE: the routing predicted for (moe_sizes.routing_text)

    def mib(self) -> float:
        return self.peak_bytes / 2**20


def predict_memory(model_config: MiniMindConfig, par: ParallelConfig, *, seq_len: int, micro_batch_size: int,
                   dtype=torch.bfloat16, device: str = "cpu", num_microbatches: int = 1,
                   schedule: Schedule = Schedule.ONE_F_ONE_B, stage: int | None = None, cp_rank: int | None = None,
                   bucket_size_mb: float = DEFAULT_BUCKET_MB, worst_only: bool = False,
                   routing: Routing = RoutingPolicy.BALANCED, checked: bool = False,
                   model_key: Frozen | None = None) -> MemoryPrediction:
    """Predicted peak of a training step of `num_microbatches` microbatches of `micro_batch_size`
    sequences on the worst rank of pipeline stage `stage` (None: of the worst stage), with the
    breakdown of CATEGORIES. device="cuda" leaves out AdamW's step counters (they live on the CPU
    there). The prediction of every stage is in `per_stage`. Under CP `cp_rank` picks the CP rank
    (None: the worst; with the load-balanced split every CP rank holds the same bytes, with the
    contiguous one the later ranks' attention sees more blocks). Under --zero 1 and 2 (`par.zero`)
    the distributed optimizer's buffers, of buckets of `bucket_size_mb` MiB (zero_sizes.py).
    `worst_only` (with stage None): only the stages that can hold the worst peak
    (`candidate_stages`), which `per_stage` then lists, and only the moments that can be the
    first largest (of each backward its largest; of a posted order, interleaved or zb, its peak
    alone, posted_peak.py), which `candidates` then lists; the prediction is the same. MoE under
    EP: for `routing` (moe_sizes.Routing: balanced, the worst case, or a measured histogram of
    tokens per expert, or a list of them, one per microbatch; then the worst EP rank's), said in
    `routing`. `checked`: the caller has run check_layout and check_schedule on this layout already
    (the planner's space), not run again. `model_key`: Frozen(model_config), made once by a caller
    that asks about many layouts of the model (the planner), else made here for each."""
    c = model_config
    if par.zero == 3:
        check_composition(par, schedule, num_microbatches)
        # (under PP too: fsdp_pipeline.py's stage holds the same MoE tensors and few-token moments)
        check_fully_sharded(c, par, seq_len // par.cp * micro_batch_size)
    elif par.zero not in MODELLED_ZERO_LEVELS:
        raise NotImplementedError(f"predict_memory: --zero {par.zero} is not modelled; "
                                  f"modelled: --zero {', '.join(map(str, MODELLED_ZERO_LEVELS))}")
    if not c.flash_attn:
        raise NotImplementedError("predict_memory: only the flash (scaled_dot_product_attention) path is modelled")
    if not checked:
        check_layout(c, par, seq_len=seq_len)
        check_schedule(schedule, par, num_microbatches)
    if par.pp > 1 and schedule not in MODELLED_SCHEDULES:
        raise NotImplementedError(f"predict_memory: the {schedule} schedule is not modelled "
                                  f"({', '.join(map(str, MODELLED_SCHEDULES))} are)")
    if cp_rank is not None and not 0 <= cp_rank < par.cp:
        raise ValueError(f"cp_rank must be in [0, cp); got cp_rank={cp_rank}, cp={par.cp}")
    cp_ranks = [cp_rank] if cp_rank is not None else range(1 if par.cp_load_balance else par.cp)
    # a measured routing differs between EP ranks: each one's (the policies are symmetric)
    ep_ranks = range(par.ep) if c.use_moe and routing not in tuple(RoutingPolicy) else range(1)
    if model_key is not None and model_key.config is not c:
        raise ValueError("predict_memory: model_key is not Frozen(model_config)")
    memo: dict = {} if model_key is None else {"model": model_key}   # worst_only: the sizes of each kind of
    # model chunk, across the stages
    stages = [max((_predict_stage(c, par, p, seq_len=seq_len, micro_batch_size=micro_batch_size,
                                  num_microbatches=num_microbatches, schedule=schedule, dtype=dtype, device=device,
                                  cp_rank=r, bucket_size_mb=bucket_size_mb, memo=memo if worst_only else None,
                                  **_routed(c, par, routing, p, e, dtype=dtype, seq_len=seq_len,
                                            micro_batch_size=micro_batch_size, num_microbatches=num_microbatches))
                   for r in cp_ranks for e in ep_ranks), key=lambda s: s.peak_bytes)
              for p in (candidate_stages(par, schedule) if worst_only and stage is None else range(par.pp))]
    pick = stages[stage] if stage is not None else max(stages, key=lambda s: s.peak_bytes)
    pick.per_stage = [s.peak_bytes for s in stages]
    pick.routing = routing_text(routing) if c.use_moe else ""
    return pick


def candidate_stages(par: ParallelConfig, schedule: Schedule) -> list[int]:
    """The stages that can hold a step's worst peak, in order. Under gpipe and 1f1b without model
    chunks the middle stages 1 .. P-2 hold the same sizes (L/P layers each, neither the embedding
    nor the head) and stage 1 as many microbatches in flight as any of them, at every moment (GPipe:
    all M; 1F1B: min(P - p, M) on stage p): so the first, the second and the last stage. Otherwise
    every stage."""
    if schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B) and par.virtual_stages == 1:
        return sorted({0, min(1, par.pp - 1), par.pp - 1})
    return list(range(par.pp))


def _routed(c: MiniMindConfig, par: ParallelConfig, routing: Routing, stage: int, ep_rank: int, *, dtype,
            seq_len: int, micro_batch_size: int, num_microbatches: int = 1) -> dict:
    """The stage's MoE layers on EP rank `ep_rank` under `routing` (StageSizes.routed and
    expert_rows): what each saves beyond the balanced routing's (its rows received off N k, at
    `received_row_bytes` each) and the rows of each of its experts; none: the balanced routing's.
    A list of histograms, one per microbatch: those of the first, and each microbatch's as
    `microbatches` (`_predict_stage`). Under PP each model chunk's too, as `chunk_routes` (the posted
    orders' chunks: virtual stage v P + stage of a P V-stage pipeline)."""
    if not c.use_moe or routing == RoutingPolicy.BALANCED:
        return {}
    one = dict(dtype=dtype, seq_len=seq_len, micro_batch_size=micro_batch_size)
    if is_per_microbatch(routing):
        each = tuple(_routed(c, par, r, stage, ep_rank, **one) for r in microbatch_routings(routing, num_microbatches))
        return {**each[0], "microbatches": each}
    if par.pp == 1:
        return _stage_routed(c, par, routing, stage, ep_rank, **one)
    chunked = replace(par, pp=par.pp * par.virtual_stages, virtual_stages=1)
    return {**_stage_routed(c, par, routing, stage, ep_rank, **one),
            "chunk_routes": tuple(_stage_routed(c, chunked, routing, v * par.pp + stage, ep_rank, **one)
                            for v in range(par.virtual_stages))}


def _stage_routed(c: MiniMindConfig, par: ParallelConfig, routing: Routing, stage: int, ep_rank: int, *, dtype,
                  seq_len: int, micro_batch_size: int) -> dict:
    """`_routed` of one histogram on the stage's layers."""
    tokens = seq_len // par.cp * micro_batch_size // par.sequence_shards
    per_row = received_row_bytes(c, par, torch.empty((), dtype=as_dtype(dtype)).element_size())
    experts = list(stage_expert_rows(c, par, routing, stage, seq_len=seq_len, micro_batch_size=micro_batch_size,
                                     ep_rank=ep_rank).values())
    return {"routed": tuple((sum(m) - tokens * c.num_experts_per_tok) * per_row for m in experts),
            "expert_rows": tuple(tuple(m) for m in experts)}


def _predict_stage(c: MiniMindConfig, par: ParallelConfig, stage: int, *, seq_len: int, micro_batch_size: int,
                   num_microbatches: int, schedule: str, dtype, device: str, cp_rank: int = 0,
                   bucket_size_mb: float = DEFAULT_BUCKET_MB, routed: tuple[int, ...] = (),
                   expert_rows: tuple[tuple[int, ...], ...] = (), microbatches: tuple[dict, ...] = (),
                   chunk_routes: tuple[dict, ...] = (), memo: dict | None = None) -> MemoryPrediction:
    """One pipeline stage (or the whole model when pp = 1) over a step, on CP rank `cp_rank`:
    every moment of the schedule that can hold the peak, each a sum of what is alive then. With
    a `memo` (one layout's: predict_memory's worst_only) only the moments that can be the first largest.
    `microbatches`: each microbatch's own `routed` and `expert_rows` (a routing per microbatch; under
    PP its `chunk_routes` too);
    `chunk_routes`: each model chunk's, under a measured routing (the posted orders' chunks)."""
    sized = dict(seq_len=seq_len, micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
                 dtype=as_dtype(dtype), cp_rank=cp_rank, routed=routed, expert_rows=expert_rows)
    memo = None if microbatches else memo
    kind = stage_kind(c, par, stage, memo, **sized) if memo is not None and (par.zero != 3 or par.pp > 1) else None
    s = kind.sizes if kind else stage_sizes(c, par, stage, **sized)
    each = ([stage_sizes(c, par, stage, **{**sized, "routed": m["routed"], "expert_rows": m["expert_rows"]})
             for m in microbatches] if microbatches else None)
    model = model_key(c, memo) if memo is not None else None   # Frozen(c), once per layout
    layouts = zero_layouts(c, par, stage, as_dtype(dtype), bucket_size_mb, model=model)
    # the flat buffers: padding too
    stored = s.b * sum(layout.numel for layout in layouts) if layouts else s.param_bytes
    params = stored + 2 * s.b * c.max_position_embeddings * c.head_dim   # RoPE cos/sin, cast to dtype
    order_key = (par.pp, stage, num_microbatches, schedule, par.virtual_stages)
    order = stage_order(*order_key)
    is_posted = stage_posted(*order_key)
    if each is not None and par.zero == 3:
        raise NotImplementedError(f"predict_memory: a routing per microbatch is modelled without --zero 3; "
                                  f"got the {schedule} schedule, --zero {par.zero}")
    if par.zero == 3 and kind:   # the planner's: of the walks the first largest moments, remembered
        return _predict_remembered_fully_sharded(kind, order, order_key, c, par, stage, device, memo, cp_rank=cp_rank,
                                                 seq_len=seq_len, micro_batch_size=micro_batch_size,
                                                 num_microbatches=num_microbatches, dtype=as_dtype(dtype))
    if par.zero == 3 and par.pp > 1:
        chunked = None   # a posted order: each chunk's sizes and the sends' release points
        if is_posted:
            chunked = (chunk_sizes(c, par, stage, seq_len=seq_len, micro_batch_size=micro_batch_size,
                                   num_microbatches=num_microbatches, dtype=as_dtype(dtype), cp_rank=cp_rank),
                       stage_releases(par.pp, num_microbatches, schedule, par.virtual_stages)[stage])
        return _predict_pipelined_fully_sharded(s, order, c, device, chunked, peak_only=memo is not None)
    if par.zero == 3:
        return _predict_fully_sharded(s, order, c, device)
    if is_posted:   # its sends' release points come from every stage's order
        kw = dict(seq_len=seq_len, micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
                  dtype=as_dtype(dtype), cp_rank=cp_rank)
        if memo is not None and not chunk_routes:   # the first largest moment alone, by the total the peak is taken by
            kinds = chunk_kinds(c, par, stage, memo, **kw)
            moments, in_flight = remembered_posted_peak(kind, kinds, order_key, grads_count=not layouts)
            chunks = [k.sizes for k in kinds]
        else:
            releases = stage_releases(par.pp, num_microbatches, schedule, par.virtual_stages)[stage]
            # a routing per microbatch: each unit's chunk sizes its microbatch's (the last's linger)
            units = [chunk_sizes(c, par, stage, each=m["chunk_routes"], **kw) for m in microbatches]
            chunks = units[-1] if units else chunk_sizes(c, par, stage, each=chunk_routes, **kw)
            moments, in_flight = replay_posted(s, chunks, order, releases, each=units or None)
    else:
        moments, in_flight = (_replayed(kind, order, order_key, not layouts) if kind
                              else replay_schedule(s, order, each=each))
        chunks = [each[order[-1].microbatch] if each else s]
    # MoE: each chunk's last received input, past its backward to the step's end (moe_lingering)
    linger = [sum(x) for x in zip((0, 0), *(moe_lingering(cs) for cs in chunks))]
    state, step = moe_temporaries(c, par, s.layers, f=s.f, loss_copy=s.weight if s.last else 0, last=s.last, b=s.b)
    if state + step:   # MoE's: a dense model has none
        moments = {k: (g, a, t + state + step) for k, (g, a, t) in moments.items()}
    if not layouts:
        states = 2 * s.param_bytes + (4 * len(s.shapes) if device == "cpu" else 0)  # exp_avg, exp_avg_sq, step
        moments["optimizer"] = optimizer_step(s)
    elif par.zero == 1:   # the grad buffer from the start; AdamW over the slices
        states = optimizer_state_bytes(layouts, s.b, device)
        moments = {k: (stored, a, t) for k, (_, a, t) in moments.items()}
        moments["optimizer"] = optimizer_step(s, slice_sizes(layouts, s.b), grads=stored)
    else:   # the slices and the staging buffers all step; AdamW over the slices
        states = optimizer_state_bytes(layouts, s.b, device)
        plans = remembered_staging_plans(c, par, stage, as_dtype(dtype), bucket_size_mb, schedule, model=model)
        moments = zero2_moments(moments, layouts, plans, s.b)
        grads, a, t = optimizer_step(s, slice_sizes(layouts, s.b), grads=sum(s.b * x.shard_numel for x in layouts))
        moments["optimizer"] = (grads, a, t + staging_bytes(layouts, plans, s.b))
    if not layouts and s.partial_grads_flat:
        moments["partial_grad_sum"] = partial_grad_sum(s)
    report = moe_report(c, last=s.last, f=s.f)
    for name in ("optimizer", "partial_grad_sum"):
        if name in moments:
            g, a, t = moments[name]
            moments[name] = (g, a + linger[0], t + state + report + linger[1])
    return _peak(s, moments, in_flight, params, states)


def _replayed(kind: SizesKind, order: tuple, order_key: tuple, grads_count: bool) -> tuple[dict, dict]:
    """replay_schedule of a kind's sizes with only each backward's largest moment (the planner's), once
    per order and grads_count: a kind is one for the zero levels that leave its sizes alone
    (remembered_sizes.stage_kind), and --zero 1 and 2 count no grads there. Its moments a copy: the
    caller adds the optimizer's. `order_key`: what `order` is the stage_order of (a short key)."""
    key = ("replay", order_key, grads_count)
    if key not in kind.derived:
        kind.derived[key] = replay_schedule(kind.sizes, order, grads_count=grads_count, backward=kind.backward)
    moments, in_flight = kind.derived[key]
    return dict(moments), in_flight


def _predict_remembered_fully_sharded(kind: SizesKind, order: tuple, order_key: tuple, c: MiniMindConfig,
                                      par: ParallelConfig, stage: int, device: str, memo: dict,
                                      **kw) -> MemoryPrediction:
    """_predict_pipelined_fully_sharded's prediction (peak_only) of the stage `kind` from remembered
    pieces (fsdp_remembered.py): a posted order's walk over its chunk kinds' cut terms, gpipe's and
    1f1b's replay the kind's."""
    s = kind.sizes
    state, step = moe_temporaries(c, s.par, s.layers, f=s.f, loss_copy=s.weight if s.last else 0, last=s.last)
    if stage_posted(*order_key):
        chunks = chunk_kinds(c, par, stage, memo, **kw)
        made = remembered_posted_moments(kind, chunks, order_key, device, step, state // s.layers)
        return _predict_pipelined_fully_sharded(s, order, c, device, ([k.sizes for k in chunks],), made=made)
    made = remembered_pipelined_moments(kind, order, _replayed(kind, order, order_key, True), device, step,
                                        state // s.layers)
    return _predict_pipelined_fully_sharded(s, order, c, device, made=made)


def _predict_fully_sharded(s: StageSizes, order: tuple, c: MiniMindConfig, device: str) -> MemoryPrediction:
    """--zero 3 (FSDP2): its moments and this rank's shards (fsdp_replay.py)."""
    rope = 2 * s.b * c.max_position_embeddings * c.head_dim
    state, step = moe_temporaries(c, s.par, s.layers, f=s.f, loss_copy=s.weight)
    moments, in_flight, params, states = fully_sharded_moments(s, order, device, step, state // s.layers)
    report = moe_report(c, last=True, f=s.f)
    moments = {k: (g, a, t + state + (report if k == "optimizer" else step)) for k, (g, a, t) in moments.items()}
    return _peak(s, moments, in_flight, params + rope, states)


def _predict_pipelined_fully_sharded(s: StageSizes, order: tuple, c: MiniMindConfig, device: str,
                                     chunked: tuple | None = None, peak_only: bool = False,
                                     made: tuple | None = None) -> MemoryPrediction:
    """--zero 3 (FSDP2) under PP: its moments and this rank's shards (fsdp_pipeline.py; a posted
    order, `chunked` its chunks' sizes and release points: fsdp_posted.py; `peak_only`: of its walk
    the first largest moment alone, predict_memory's worst_only). MoE: after the schedule
    (its reduces, the optimizer step) each chunk's last received input lingers (moe_lingering);
    while the groups reduce, each unit's reported aux share is alive, not the backward's terms."""
    rope = 2 * s.b * c.max_position_embeddings * c.head_dim
    state, step = moe_temporaries(c, s.par, s.layers, f=s.f, loss_copy=s.weight if s.last else 0, last=s.last)
    if made is not None:   # the moments made already (fsdp_remembered.py; `chunked`: the chunks' sizes alone)
        moments, in_flight, params, states = made
    elif chunked is None:
        moments, in_flight, params, states = pipelined_fully_sharded_moments(s, order, device, step, state // s.layers)
    else:
        moments, in_flight, params, states = posted_fully_sharded_moments(s, chunked[0], order, chunked[1], device,
                                                                          peak_only, step, state // s.layers)
    report = moe_report(c, last=s.last, f=s.f)
    linger = [sum(x) for x in zip((0, 0), *(moe_lingering(cs) for cs in (chunked[0] if chunked else [s])))]
    shares = sum(a.step is Step.FORWARD for a in order) * s.f if c.use_moe else 0
    after = {"optimizer": report, **{k: shares for k in moments if k.startswith("reduce")}}
    moments = {k: (g, a + (linger[0] if k in after else 0),
                   t + state + after.get(k, step) + (linger[1] if k in after else 0)) for k, (g, a, t) in moments.items()}
    return _peak(s, moments, in_flight, params + rope, states)


def _peak(s: StageSizes, moments: dict, in_flight: dict, params: int, states: int) -> MemoryPrediction:
    """The largest moment, its breakdown by category (params and states alive at every moment)."""
    totals = {k: params + states + sum(v) for k, v in moments.items()}
    peak_at = max(totals, key=totals.get)
    grads, act, temp = moments[peak_at]
    breakdown = dict(zip(CATEGORIES, (params, grads, states, act, temp)))
    return MemoryPrediction(peak_bytes=sum(breakdown.values()), breakdown=breakdown, activations_by_kind=s.kinds,
                            num_layers=s.layers, peak_at=peak_at, candidates=totals, held_per_microbatch=s.held,
                            held_at_peak=in_flight.get(peak_at, 0))
