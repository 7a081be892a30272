"""`predict_memory`: the peak of a training step, every pipeline stage (and CP rank), and its
breakdown by category: the largest of the moments of the stage's replayed schedule."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...config import MiniMindConfig, ParallelConfig, check_layout
from ...pipeline_parallel.order import Schedule, schedule_order
from ..tracker import CATEGORIES
from .moe_sizes import moe_temporaries
from .saved_kinds import as_dtype
from .schedule_replay import optimizer_step, replay_schedule
from .stage_sizes import stage_sizes


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

    def mib(self) -> float:
        return self.peak_bytes / 2**20


def predict_memory(model_config: MiniMindConfig, par: ParallelConfig, *, seq_len: int, micro_batch_size: int,
                   dtype=torch.bfloat16, device: str = "cpu", num_microbatches: int = 1,
                   schedule: Schedule = Schedule.ONE_F_ONE_B, stage: int | None = None, cp_rank: int | None = None) -> MemoryPrediction:
    """Predicted peak of a training step of `num_microbatches` microbatches of `micro_batch_size`
    sequences on the worst rank of pipeline stage `stage` (None: of the worst stage), with the
    breakdown of CATEGORIES. device="cuda" leaves out AdamW's step counters (they live on the CPU
    there). The prediction of every stage is in `per_stage`. Under CP `cp_rank` picks the CP rank
    (None: the worst; with the load-balanced split every CP rank holds the same bytes, with the
    contiguous one the later ranks' attention sees more blocks)."""
    c = model_config
    if not c.flash_attn:
        raise NotImplementedError("predict_memory: only the flash (scaled_dot_product_attention) path is modelled")
    check_layout(c, par, seq_len=seq_len)
    if cp_rank is not None and not 0 <= cp_rank < par.cp:
        raise ValueError(f"cp_rank must be in [0, cp); got cp_rank={cp_rank}, cp={par.cp}")
    cp_ranks = [cp_rank] if cp_rank is not None else range(1 if par.cp_load_balance else par.cp)
    stages = [max((_predict_stage(c, par, p, seq_len=seq_len, micro_batch_size=micro_batch_size,
                                  num_microbatches=num_microbatches, schedule=schedule, dtype=dtype, device=device,
                                  cp_rank=r) for r in cp_ranks), key=lambda s: s.peak_bytes)
              for p in range(par.pp)]
    pick = stages[stage] if stage is not None else max(stages, key=lambda s: s.peak_bytes)
    pick.per_stage = [s.peak_bytes for s in stages]
    return pick


def _predict_stage(c: MiniMindConfig, par: ParallelConfig, stage: int, *, seq_len: int, micro_batch_size: int,
                   num_microbatches: int, schedule: str, dtype, device: str, cp_rank: int = 0) -> MemoryPrediction:
    """One pipeline stage (or the whole model when pp = 1) over a step, on CP rank `cp_rank`:
    every moment of the schedule that can hold the peak, each a sum of what is alive then."""
    s = stage_sizes(c, par, stage, seq_len=seq_len, micro_batch_size=micro_batch_size,
                    num_microbatches=num_microbatches, dtype=as_dtype(dtype), cp_rank=cp_rank)
    params = s.param_bytes + 2 * s.b * c.max_position_embeddings * c.head_dim   # RoPE cos/sin, cast to dtype
    states = 2 * s.param_bytes + (4 * len(s.shapes) if device == "cpu" else 0)  # exp_avg, exp_avg_sq, step
    moments, in_flight = replay_schedule(s, schedule_order(par.pp, stage, num_microbatches, schedule))
    state, step = moe_temporaries(c, s.layers, f=s.f, loss_copy=s.weight)
    moments = {k: (g, a, t + state + step) for k, (g, a, t) in moments.items()}
    moments["optimizer"] = optimizer_step(s)
    moments["optimizer"] = moments["optimizer"][:2] + (moments["optimizer"][2] + state,)
    totals = {k: params + states + sum(v) for k, v in moments.items()}
    peak_at = max(totals, key=totals.get)
    grads, act, temp = moments[peak_at]
    breakdown = dict(zip(CATEGORIES, (params, grads, states, act, temp)))
    return MemoryPrediction(peak_bytes=sum(breakdown.values()), breakdown=breakdown, activations_by_kind=s.kinds,
                            num_layers=s.layers, peak_at=peak_at, candidates=totals, held_per_microbatch=s.held,
                            held_at_peak=in_flight.get(peak_at, 0))
