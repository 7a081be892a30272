"""What every rank of a cell's torchrun job runs: build the cell's model, warm up, measure (or
profile), and hand the result to its node's launcher as JSON."""
from __future__ import annotations

import gc
import json
import statistics
import time
from contextlib import nullcontext
from dataclasses import replace

import torch
import torch.distributed as dist

from ... import memory
from ...config import DTYPES
from ...context_parallel import ContextLayout
from ...data.batches import broadcast_batch, cp_tokens, dp_rows
from ...device_sync import synchronize
from ...files import atomic_path
from ...groups import ProcessGroups, first_on_node
from ...job import Job
from ...model import MiniMindForCausalLM
from ...moe import recorded_routing
from ...options import collective_timeout
from ...training import build_parallel_model, make_optimizer, train_step, wrap_data_parallel
from .cells import job_run
from .command import Kind
from .profile import profile_cell


def run_cell(job: Job, device) -> int:
    """One cell on this rank (the cell's job, cells.cell_job): build, warm up, measure; the first rank
    of every node writes the result JSON (the job's report) for its node's launcher (every rank holds
    the same result: `measure` gathers it)."""
    run = job_run(job)
    cell, a, par, config = run.cell, run.args, run.par, job.model
    args, kind = a, a.kind
    groups = ProcessGroups.build(par, timeout=collective_timeout(job.launch))
    if args.inject_oom in (f"{cell.mode}:{cell.num_hidden_layers}", f"{cell.mode}:{cell.seq_len}"):  # test hook: a cell that dies the way a too-large one does
        raise torch.cuda.OutOfMemoryError(f"injected out-of-memory in cell {cell.name}")
    torch.manual_seed(args.seed)
    dense = MiniMindForCausalLM(config).state_dict()
    model = build_parallel_model(config, par, groups, dense, dtype=DTYPES[args.dtype], device=device)
    del dense
    gc.collect()
    model = wrap_data_parallel(model, groups)
    optimizer = make_optimizer(model, args.learning_rate, groups, args.bucket_size_mb, args.pp_schedule)
    # M microbatches of `run.rows` rows per DP replica (M = 1 without a pipeline)
    batch = dp_rows(broadcast_batch(run.rows * args.num_microbatches * par.dp, a.seq_len, config.vocab_size,
                                    args.seed + 1, device), groups.dp_rank, par.dp)
    ids, targets = cp_tokens(batch, ContextLayout.of(par, a.seq_len), groups.cp_rank)  # [rows, S/C]
    result = (profile if kind == Kind.PROFILE else measure)(kind, model, optimizer, groups, ids, targets, args, device)
    global_tokens = run.rows * par.dp * a.seq_len * args.num_microbatches
    result["tokens_per_s"] = global_tokens / (result["step_ms"] / 1e3)
    if first_on_node() and job.report:
        with atomic_path(job.report) as tmp, open(tmp, "w") as f:
            json.dump(result, f)
    return 0


def measure(kind, model, optimizer, groups, ids, targets, args, device) -> dict:
    """Median step time over the measured iterations, max over ranks, and its spread (each rank's
    fastest and slowest iteration, max over ranks: min <= median <= max); with kind memory the
    worst rank's peak (MemoryMeter around the measured iterations)."""
    steps = []

    def timed_step() -> float:
        synchronize(device)
        t0 = time.perf_counter()
        result = train_step(model, optimizer, groups, ids, targets, num_microbatches=args.num_microbatches,
                            schedule=args.pp_schedule).schedule
        steps.append(replace(result, loss=None, logits=[]))   # its numbers: no tensor outlives its step
        synchronize(device)
        return time.perf_counter() - t0

    for _ in range(args.warmup_iters):
        timed_step()
    del steps[:]
    meter = memory.MemoryMeter(device, model, optimizer) if kind == Kind.MEMORY else None
    with meter or nullcontext():
        times = [timed_step() for _ in range(args.benchmark_iters - 1)]
        with recorded_routing(model) as each:   # the last measured step's, microbatch by microbatch
            times.append(timed_step())
    mine = {"step_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            **stage_numbers(groups, steps), "routing": own_routing(each, groups)}
    if meter is not None:
        report = meter.report()
        mine.update(peak_bytes=int(report.peak_bytes), breakdown={k: int(v) for k, v in report.breakdown.items()})
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    worst = max(ranks, key=lambda r: r.get("peak_bytes", 0))
    return {"step_ms": 1e3 * max(r["step_s"] for r in ranks), "step_ms_min": 1e3 * max(r["min_s"] for r in ranks),
            "step_ms_max": 1e3 * max(r["max_s"] for r in ranks),
            "peak_bytes": worst.get("peak_bytes"), "breakdown": worst.get("breakdown"),
            "peak_bytes_per_rank": [r.get("peak_bytes") for r in ranks],
            "per_rank": per_rank(ranks), **routing_result(ranks)}


def own_routing(each: list[dict[str, list[int]]], groups) -> list[dict[str, list[int]]]:
    """This rank's MoE layers' tokens per expert of each microbatch of the last measured step
    (moe.recorded_routing), when its tokens are its own: without SP every TP rank routes the same
    tokens, so TP rank 0 alone counts them."""
    if groups.tp_rank != 0 and not groups.par.sequence_parallel:
        return []
    return each


def routing_result(ranks: list[dict]) -> dict:
    """The result's routing: each microbatch's histogram summed over the ranks
    (`routing_per_microbatch`, a list in `--routing FILE`'s form) and the last one's
    (`tokens_per_expert`); none without MoE layers."""
    count = max((len(r["routing"]) for r in ranks), default=0)
    each = [merged_routing([r["routing"][i] for r in ranks if i < len(r["routing"])]) for i in range(count)]
    return {"tokens_per_expert": each[-1] if each else {}, "routing_per_microbatch": each}


def merged_routing(histograms: list[dict[str, list[int]]]) -> dict[str, list[int]]:
    """Every MoE layer's tokens per expert summed over the ranks holding different tokens (DP, CP,
    SP; each rank's histogram of one microbatch, pipeline stages their own layers)."""
    out: dict[str, list[int]] = {}
    for histogram in histograms:
        for name, counts in histogram.items():
            name = name.removeprefix("module.")
            out[name] = [a + b for a, b in zip(out[name], counts)] if name in out else list(counts)
    return dict(sorted(out.items(), key=lambda kv: _layer_index(kv[0])))


def _layer_index(name: str) -> int:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else -1


def profile(kind, model, optimizer, groups, ids, targets, args, device) -> dict:
    """`--kind profile`: trace the measured steps, write the per-rank trace and overlap report
    (profile.py); return the same dict as `measure` (step_ms, per_rank; no peak)."""
    result, steps = profile_cell(model, optimizer, groups, ids, targets, args, device)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, stage_numbers(groups, steps))
    return {**result, "per_rank": per_rank(ranks)}


def stage_numbers(groups, steps: list) -> dict:
    """This rank's pipeline numbers over the measured steps (schedule StepResults): its stage,
    the most microbatches it held at once, its median share of wall time not spent computing."""
    return {"pp_rank": groups.pp_rank, "max_in_flight": max(s.max_in_flight for s in steps),
            "idle": statistics.median(1 - s.busy_s / s.wall_s for s in steps)}


def per_rank(ranks: list[dict]) -> list[dict]:
    """What `sweep.fill_pipeline` reads from every rank (peak_bytes None when no meter ran)."""
    return [{"pp_rank": r["pp_rank"], "peak_bytes": r.get("peak_bytes"), "max_in_flight": r["max_in_flight"],
             "idle": r["idle"]} for r in ranks]
