"""`plan`: every layout of the space with its predicted per-rank peak (the analytic model; on
CUDA the allocator level: plus the cuBLAS workspaces it holds, memory/allocator.py, and its block
rounding, estimated by allocator_rounding.py) and step time
(time_model.py), the fitting ones ranked by predicted tokens/s, the others with why they were cut."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..collector import paused_collector
from ..config import DTYPES
from ..memo import Frozen
from ..memory import MemoryPrediction, predict_memory
from ..memory.allocator import CudaSetup
from ..memory.analytic.stage_sizes import stage_parameter_counts
from ..moe.placement import local_experts
from ..pipeline_parallel.order import Schedule
from .allocator_rounding import rounding_bytes
from .forked import forked_map, split, usable_cpus
from .hardware import Hardware
from .space import Candidate, Cut, Workload, enumerate_layouts
from .time_model import StepTime, expert_params, step_time

MIB = 2**20


@dataclass
class PlanEntry:
    candidate: Candidate
    peak_bytes: int
    breakdown: dict           # CATEGORIES -> bytes at the peak (+ "workspaces" and "rounding" on CUDA)
    time: StepTime
    tokens_per_s: float
    mfu: float
    row: bytes | None = None  # plan(row=...)'s text of a fitting entry, made where it was predicted

    @property
    def step_ms(self) -> float:
        return 1e3 * self.time.total


@dataclass
class Plan:
    workload: Workload
    hardware: Hardware
    budget_bytes: int
    fitting: list[PlanEntry] = field(default_factory=list)     # ranked, fastest first
    over_budget: list[PlanEntry] = field(default_factory=list)
    cuts: list[Cut] = field(default_factory=list)

    @property
    def candidates(self) -> int:
        return len(self.fitting) + len(self.over_budget) + len(self.cuts)


def model_flops_per_token(w: Workload) -> float:
    """6 N + the causal attention (forward + backward), the MFU's numerator per token."""
    from ..training.metrics import model_flops_per_token as flops
    return flops(w.model, w.seq_len)


def workspace_bytes(hw: Hardware) -> int:
    """What the CUDA allocator holds beyond the tensors that the planner adds: the cuBLAS workspaces
    of the GPU generation (memory/allocator.py's CudaSetup, this process's environment variables)."""
    return sum(CudaSetup.from_env(capability=hw.cuda_capability or (9, 0)).workspaces())


def evaluate(k: Candidate, w: Workload, hw: Hardware, device: str, flops_per_token: float,
             workspaces: int = 0, memo: dict | None = None, model_key: Frozen | None = None) -> PlanEntry:
    """Layout `k`'s predicted peak and step; on CUDA at the allocator level (`workspaces` bytes of cuBLAS
    workspaces, the estimated block rounding). `k` is one of the space's (space.check_candidate passed
    it: not checked again). `memo`: the time model's, across one plan's layouts; `model_key`:
    Frozen(w.model), made once for them (predict_memory's)."""
    par = k.parallel
    pred = predict_memory(w.model, par, seq_len=w.seq_len, micro_batch_size=k.micro_batch_size,
                          dtype=DTYPES[w.dtype], device=device, num_microbatches=k.num_microbatches,
                          schedule=k.pp_schedule if k.pp > 1 else Schedule.ONE_F_ONE_B, worst_only=True,
                          checked=True, model_key=model_key)   # space.check_candidate's
    breakdown = dict(pred.breakdown)
    peak = pred.peak_bytes
    if device == "cuda":
        breakdown["workspaces"], breakdown["rounding"] = workspaces, rounding_bytes(pred, par)
        peak += workspaces + breakdown["rounding"]
    params, block = stage_parameters(pred, k, w)
    experts = w.model.num_hidden_layers // k.pp * w.model.num_experts // k.ep * expert_params(w.model) \
        if w.model.use_moe else 0                                       # this rank's experts' elements
    t = step_time(k, w, hw, stage_params=params, expert_params=experts, block_params=block, memo=memo)
    tokens_per_s = w.global_batch_size * w.seq_len / t.total
    mfu = flops_per_token * tokens_per_s / (w.world_size * hw.peak_flops)
    return PlanEntry(candidate=k, peak_bytes=peak, breakdown=breakdown, time=t, tokens_per_s=tokens_per_s, mfu=mfu)


def stage_parameters(pred: MemoryPrediction, k: Candidate, w: Workload) -> tuple[int, int]:
    """This rank's parameter elements unsharded (its TP shards; under --zero 1/2 with the flat buffers'
    padding, as the memory model's params hold them, less RoPE's cos/sin tables), and under --zero 3
    one block's (FSDP2 gathers the whole of each: the memory model's params are this rank's shards;
    under PP the last stage's, whose step the time model costs)."""
    if k.zero == 3:
        c = w.model
        experts = local_experts(c.num_experts, k.ep, 0) if c.use_moe else range(c.num_experts)
        counts = stage_parameter_counts(c, k.parallel, k.pp - 1, experts)[1]
        return counts.total, counts.top_block
    rope = 2 * w.model.max_position_embeddings * w.model.head_dim
    return pred.breakdown["params"] // DTYPES[w.dtype].itemsize - rope, 0


# a space of fewer layouts is predicted in this process alone (a fork and the pickled results cost
# more than its share saves)
FORK_FROM = 2000
MAX_PROCESSES = 4   # each shares fewer remembered sizes with the others


def plan(w: Workload, hw: Hardware, *, device: str, budget_bytes: int, processes: int | None = None,
         row: Callable[[PlanEntry], bytes] | None = None) -> Plan:
    """Every layout of the space (space.enumerate_layouts), each that passes its constraints
    predicted; the ones within `budget_bytes` per rank ranked by tokens/s. `processes`: how many
    processes predict them (forked.py; default: this machine's CPUs, up to MAX_PROCESSES, for a
    space of FORK_FROM layouts or more), each a contiguous part of about equal cost. `row`: each
    fitting entry's text (its `row`: the JSON's), made by the process that predicted it, so that
    the texts are made in parallel with the predictions and not after them."""
    valid, cuts = enumerate_layouts(w)
    result = Plan(workload=w, hardware=hw, budget_bytes=budget_bytes, cuts=cuts)
    flops = model_flops_per_token(w)
    workspaces = workspace_bytes(hw) if device == "cuda" else 0
    memo: dict = {}   # step_time's: of this workload and hardware (each process its own)
    model = Frozen(w.model)
    if processes is None:
        processes = min(MAX_PROCESSES, usable_cpus()) if len(valid) >= FORK_FROM else 1
    with paused_collector():
        entries = _in_order(valid, lambda part: forked_map(
            lambda k: evaluate(k, w, hw, device, flops, workspaces, memo, model), part,
            split([_cost(k) for k in part], processes), then=row and (lambda e: _with_row(e, row, budget_bytes))))
    for e in entries:
        (result.fitting if e.peak_bytes <= budget_bytes else result.over_budget).append(e)
    result.fitting.sort(key=lambda e: (e.time.total, e.peak_bytes))   # fastest first: tokens/s is tokens / this
    result.over_budget.sort(key=lambda e: e.peak_bytes)
    return result


def _with_row(e: PlanEntry, row: Callable[[PlanEntry], bytes], budget_bytes: int) -> PlanEntry:
    """`e` with its text, where it fits (the JSON has the fitting entries' rows)."""
    if e.peak_bytes <= budget_bytes:
        e.row = row(e)
    return e


def _in_order(valid: list[Candidate], predict) -> list[PlanEntry]:
    """predict(layouts) of the layouts grouped by what their sizes share (`_sharing`: the layouts of
    a group are next to each other, so that a process's contiguous part holds whole groups, and
    the sizes of a group are made by one process, not each), the entries put back in the space's
    order."""
    groups: dict = {}
    order = sorted(range(len(valid)), key=lambda i: groups.setdefault(_sharing(valid[i]), len(groups)))
    entries = [None] * len(valid)
    for i, e in zip(order, predict([valid[i] for i in order])):
        entries[i] = e
    return entries


def _sharing(k: Candidate) -> tuple:
    """What every kind of sizes a layout's prediction makes is remembered on (remembered_sizes.py:
    a stage's and a model chunk's; the zero level, dp, the microbatches, the pipeline's shape and the
    loss's flags aside): layouts that differ here share none."""
    return (k.tp, k.cp, k.ep, k.sequence_parallel, k.async_communication, k.shared_sp_gather, k.recompute,
            k.cp_comm_type, k.cp_load_balance, k.micro_batch_size)


def _cost(k: Candidate) -> int:
    """About how long a layout's prediction takes: its stages predicted (predict.candidate_stages),
    a posted schedule's (interleaved, zb) each over its chunks."""
    if k.pp == 1:
        return 2
    if k.pp_schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
        return 2 + min(k.pp, 3)
    return 2 + 2 * k.pp
