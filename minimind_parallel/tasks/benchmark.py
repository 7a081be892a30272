"""`benchmark`: peak memory and step time over a sweep of (mode, swept value) cells.

The launcher checks every cell before anything starts, then runs each cell as its own torchrun
job (`run_cell` on every rank; rank 0 writes the cell's result to a JSON file), prints a row per
cell with the analytic prediction beside the measurement, and writes CSV/JSON after every cell
and a plot at the end. A cell that fails or runs out of memory is recorded and the sweep goes on.
With `--estimate` no process is launched: the memory API measures each cell under FakeTensorMode.

    python -m evaluation.parallel benchmark --kind memory --tp_size 2 -- --modes ddp tp \\
        --num_hidden_layers 8 16 --seq_len 2048 --dtype bfloat16 --sequence_parallel
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from tqdm import tqdm

from .. import launcher
from ..config import ConfigError, ParallelConfig
from ..context_parallel import ContextLayout
from ..data.batches import broadcast_batch, cp_tokens, dp_rows
from ..device_sync import synchronize
from ..files import atomic_path, new_file
from ..groups import ProcessGroups, first_on_node
from ..model import MiniMindForCausalLM
from ..pipeline_parallel import bubble_fraction
from ..options import (MODES, Parser, add_model_args, apply_mode, check_at_least, check_common, check_modes,
                       check_number, check_resources, collective_timeout, model_config, parallel_config,
                       program_name, resolve_device, split_argv)
from ..processes import Interrupted
from ..training import DTYPES, build_parallel_model, make_optimizer, train_step, wrap_data_parallel
from . import benchmark_outputs as outputs
from .task import Task

SWEEPABLE = ("num_hidden_layers", "seq_len")
TP_FLAGS = ("sequence_parallel", "async_communication", "shared_sp_gather", "vocab_parallel")
BATCH_POLICIES = ("fixed_per_rank", "fixed_global")
KINDS = ("memory", "throughput", "profile")


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="benchmark", description="memory and step time over a sweep of modes x one dimension")
    add_model_args(p)
    p.add_argument("--kind", choices=KINDS, default=None, help="default memory (also a launcher option)")
    p.add_argument("--modes", nargs="+", default=["tp"], help=f"presets: {', '.join(MODES)}")
    p.add_argument("--batch_policy", choices=BATCH_POLICIES, default=None,
                   help="fixed_per_rank: every DP replica gets --micro_batch_size rows (memory default); "
                        "fixed_global: the global batch is micro_batch_size x dp_size in every mode "
                        "(throughput always)")
    p.add_argument("--num_hidden_layers", type=int, nargs="+", default=[8])
    p.add_argument("--seq_len", type=int, nargs="+", default=[2048])
    p.add_argument("--warmup_iters", type=int, default=2)
    p.add_argument("--benchmark_iters", type=int, default=5)
    p.add_argument("--output_csv", default=None, help="default results/benchmark_<kind>_<time>_<pid>_<random>.csv")
    p.add_argument("--output_json", default=None, help="default: beside the CSV")
    p.add_argument("--output_plot", default=None, help="default: beside the CSV (PNG)")
    p.add_argument("--estimate", action="store_true", help="memory under FakeTensorMode, in-process, no kernels")
    p.add_argument("--cuda_capability", default="9.0", metavar="MAJOR.MINOR",
                   help="with --estimate --device cuda: the GPU generation whose allocator peak is predicted "
                        "(cuBLAS workspace size; default 9.0, H100/H200)")
    p.add_argument("--cell_timeout", type=float, default=None, metavar="SECONDS",
                   help="kill a cell's ranks after this long and record it as timed out (default: no limit)")
    p.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier run of the same name")
    # Launcher -> worker plumbing and a test hook; not for users.
    p.add_argument("--result_json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--profile_dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--inject_oom", default=None, metavar="MODE:VALUE", help=argparse.SUPPRESS)
    return p


# ---------------------------------------------------------------- the sweep and its checks

@dataclass(frozen=True)
class Cell:
    mode: str
    num_hidden_layers: int
    seq_len: int
    swept: str  # which of SWEEPABLE varies

    @property
    def value(self) -> int:
        return getattr(self, self.swept)

    @property
    def name(self) -> str:
        return f"{self.mode}:{self.value}"


def kind_of(launch, args) -> str:
    if launch.kind and args.kind and launch.kind != args.kind:
        raise ConfigError(f"--kind given twice with different values; got {launch.kind} and {args.kind}")
    return args.kind or launch.kind or "memory"


def batch_policy(kind: str, args) -> str:
    return "fixed_global" if kind == "throughput" else (args.batch_policy or "fixed_per_rank")


def plan(args) -> list[Cell]:
    """The cells in run order: swept value outer, mode inner (so each mode follows the one it is compared with)."""
    swept = [name for name in SWEEPABLE if len(getattr(args, name)) > 1]
    if len(swept) > 1:
        raise ConfigError(f"sweep one dimension at a time; got num_hidden_layers={args.num_hidden_layers} "
                          f"and seq_len={args.seq_len}")
    swept = swept[0] if swept else "num_hidden_layers"
    fixed = {name: getattr(args, name)[0] for name in SWEEPABLE}
    return [Cell(mode=mode, swept=swept, **{**fixed, swept: value})
            for value in getattr(args, swept) for mode in args.modes]


def cell_args(args, cell: Cell) -> argparse.Namespace:
    """The task args of one cell: its sizes, its mode's preset flags; ddp drops the TP flags."""
    a = argparse.Namespace(**vars(args))
    a.num_hidden_layers, a.seq_len = cell.num_hidden_layers, cell.seq_len
    if cell.mode == "ddp":
        for flag in TP_FLAGS:
            setattr(a, flag, False)
    apply_mode(a, cell.mode)
    return a


def cell_parallel(launch, a, mode: str) -> ParallelConfig:
    """Every mode uses the same ranks: world = dp x pp x cp x tp; ddp spends them all on data parallelism."""
    par = parallel_config(launch, a)
    return ParallelConfig(dp=par.world_size) if mode == "ddp" else par


def rows_per_replica(kind: str, args, par: ParallelConfig, launch) -> int:
    """Rows of one microbatch on each DP replica of the cell's layout `par`."""
    if batch_policy(kind, args) == "fixed_per_rank":
        return args.micro_batch_size
    return args.micro_batch_size * launch.dp_size // par.dp


def check_batch_split(launch, args, kind: str, cell: Cell, par: ParallelConfig) -> None:
    global_batch = args.micro_batch_size * launch.dp_size
    if batch_policy(kind, args) == "fixed_global" and global_batch % par.dp:
        raise ConfigError(f"fixed_global: the global batch must split evenly over the data-parallel ranks of mode "
                          f"{cell.mode}; got global batch={global_batch} (micro_batch_size x dp_size), dp={par.dp}")


def check_benchmark(launch, args, kind: str) -> list[Cell]:
    """Every constraint of every cell, before anything launches; -> the cells."""
    if args.estimate and kind != "memory":
        raise ConfigError(f"--estimate measures memory without running kernels; got --kind {kind}")
    if not re.fullmatch(r"[0-9]+(\.[0-9]+)?", args.cuda_capability):
        raise ConfigError(f"--cuda_capability is MAJOR.MINOR (e.g. 9.0); got {args.cuda_capability!r}")
    check_at_least(args, 1, ("benchmark_iters",))
    check_at_least(args, 0, ("warmup_iters",))
    check_number(args, "cell_timeout", minimum=0.0, exclusive=True, unit=" seconds")
    if args.num_microbatches > 1 and launch.pp_size == 1:
        raise ConfigError(f"num_microbatches > 1 needs pipeline parallelism; got num_microbatches="
                          f"{args.num_microbatches}, pp_size={launch.pp_size}")
    check_modes(args.modes, launch)
    cells = plan(args)
    check_nodes(launch, args, kind, cells)
    each_args = [cell_args(args, cell) for cell in cells]
    runs = [(a, cell_parallel(launch, a, cell.mode)) for a, cell in zip(each_args, cells)]
    check_common(launch, args, runs, steps=None if args.estimate else ": use bfloat16, or --estimate",
                 kernels=not args.estimate)
    for cell, (_, par) in zip(cells, runs):
        check_batch_split(launch, args, kind, cell, par)
    return cells


def check_nodes(launch, args, kind: str, cells: list[Cell]) -> None:
    """Several nodes run one cell per command: a cell is one torchrun job, one rendezvous of every
    node, and the nodes' launchers have no way to agree on the next cell or on a failed one."""
    if launch.nnodes == 1 or args.estimate:
        return
    if len(cells) > 1:
        raise ConfigError(f"on several nodes a benchmark runs one cell (one rendezvous of every node): give one "
                          f"mode and one value per command; got --nnodes {launch.nnodes} and {len(cells)} cells "
                          f"({' '.join(c.name for c in cells)})")
    if kind == "profile":
        raise ConfigError(f"--kind profile runs on one node (its traces and report are rank 0's); got --nnodes "
                          f"{launch.nnodes}")


def check(launch, args) -> None:
    """check_benchmark, then what depends on the machine: the outputs can be written, the ranks fit."""
    kind = kind_of(launch, args)
    cells = check_benchmark(launch, args, kind)
    outputs.check_paths(args, kind)
    if not args.estimate:
        each_args = [cell_args(args, cell) for cell in cells]
        runs = [(a, cell_parallel(launch, a, cell.mode)) for a, cell in zip(each_args, cells)]
        check_resources(launch, runs, rows=[rows_per_replica(kind, args, par, launch) for _, par in runs])


# ---------------------------------------------------------------- launcher side

def run_benchmark(launch, args, argv: list[str]) -> int:
    """Run every cell (checked by `check`); returns 0 when every cell succeeded, 1 otherwise. SIGINT or
    SIGTERM (processes.Interrupted) ends the running cell's processes, records the cell as
    interrupted, writes every output with the finished rows, then passes the interruption on."""
    kind = kind_of(launch, args)
    cells = plan(args)
    paths = outputs.claim_paths(args, kind)
    if kind == "throughput" and args.batch_policy == "fixed_per_rank":
        print("benchmark: --kind throughput compares modes on the same global batch: using fixed_global")
    device = estimate_device(launch, args) if args.estimate else resolve_device(launch)
    meta = dict(command=[*program_name().split(), *argv], kind=kind, device=device,
                swept=cells[0].swept, batch_policy=batch_policy(kind, args))
    print(f"benchmark: kind={kind} device={device} modes={' '.join(args.modes)} "
          f"{cells[0].swept}={getattr(args, cells[0].swept)} batch_policy={meta['batch_policy']} "
          f"dtype={args.dtype} world={parallel_config(launch, args).world_size}", flush=True)
    table = outputs.Table(cells[0].swept, kind)
    results: list[dict] = []
    bar = tqdm(cells, desc="benchmark", unit="cell", file=sys.stderr, dynamic_ncols=True)
    print(table.header(), flush=True)

    def record(row: dict) -> None:
        outputs.compare_with_previous(row, results)
        results.append(row)
        outputs.write_csv(paths.csv, results)
        outputs.write_json(paths.json, results, meta)
        bar.write(table.line(row))

    interrupted, row = None, None
    try:
        for cell in bar:
            bar.set_postfix_str(cell.name)
            row = new_cell_row(launch, args, kind, cell)
            run_one(launch, args, argv, cell, row, paths)
            record(row)
    except Interrupted as e:  # the cell's processes are gone (launcher.run_torchrun); keep what finished
        interrupted = e
        if len(results) < len(cells):  # the cell running, or about to start, when the signal came
            if row is None or any(r is row for r in results):
                row = new_cell_row(launch, args, kind, cells[len(results)])
            row["status"], row["reason"] = "interrupted", f"{e}; the cell's processes were ended"
            record(row)
    bar.close()
    outputs.write_csv(paths.csv, results)  # again: an interruption may have come while they were written
    outputs.write_json(paths.json, results, meta)
    outputs.write_plot(paths.plot, results, cells[0].swept)
    if kind == "profile":  # traces and reports of this run's finished cells; here the modes side by side
        from ..profiling.sweep import compare_cells
        done = [cell for cell, r in zip(cells, results) if r["status"] == "ok"]
        print(compare_cells(paths.csv, done) or "benchmark: no profile finished")
    failed = [r for r in results if r["status"] != "ok"]
    if outputs.noise_note(results):
        print(outputs.noise_note(results))
    print(f"benchmark: {len(results) - len(failed)} of {len(results)} cells ok; wrote {paths.csv}, {paths.json}, "
          f"{paths.plot}")
    if interrupted:
        raise interrupted
    return 1 if failed else 0


def cell_sizes(launch, args, kind: str, cell: Cell) -> tuple:
    """-> (the cell's args, its layout, the sizes of a step the memory API takes)."""
    a = cell_args(args, cell)
    par = cell_parallel(launch, a, cell.mode)
    sizes = dict(seq_len=a.seq_len, micro_batch_size=rows_per_replica(kind, args, par, launch),
                 dtype=DTYPES[args.dtype], num_microbatches=args.num_microbatches, schedule=args.pp_schedule)
    return a, par, sizes


def new_cell_row(launch, args, kind: str, cell: Cell) -> dict:
    """The cell's row before it runs: its sizes and the analytic prediction."""
    a, par, sizes = cell_sizes(launch, args, kind, cell)
    row = outputs.new_row(kind, cell, par, a, sizes["micro_batch_size"] * par.dp, estimate=args.estimate)
    try:  # a missing prediction must not lose the measurement
        from ..memory import predict_memory
        device = "cpu" if args.estimate else resolve_device(launch)
        pred = predict_memory(model_config(a), par, device=device, **sizes)
        row["predicted_mib"] = pred.peak_bytes / outputs.MIB
        row["predicted_mib_per_stage"] = " ".join(f"{b / outputs.MIB:.2f}" for b in pred.per_stage)
    except Exception as e:
        row["reason"] = "no prediction: " + outputs.one_line(e)
    return row


def run_one(launch, args, argv, cell: Cell, row: dict, paths) -> None:
    """Run one cell and fill its row (status ok / oom / failed / timeout, with the reason)."""
    a, par, sizes = cell_sizes(launch, args, row["kind"], cell)
    config = model_config(a)
    if args.estimate:
        try:  # every stage (the worst CP rank of each: the last ones under the contiguous split); the worst is the cell's peak
            from ..memory import estimate_step_memory
            cp_ranks = range(1 if par.cp_load_balance else par.cp)
            reports = [max((estimate_step_memory(config, par, iters=2, stage=p, cp_rank=r, **sizes) for r in cp_ranks),
                           key=lambda r: r.peak_bytes) for p in range(par.pp)]
            worst = max(reports, key=lambda r: r.peak_bytes)
            outputs.fill_memory(row, worst.peak_bytes, worst.breakdown)
            row["peak_mib_per_stage"] = " ".join(f"{r.peak_bytes / outputs.MIB:.2f}" for r in reports)
            if launch.device == "cuda":
                fill_cuda_allocator(row, args, config, par, sizes)
        except Exception as e:
            outputs.fail(row, e)
    else:
        launch_cell(launch, argv, cell, par, a.async_communication, row, paths, timeout=args.cell_timeout)


def estimate_device(launch, args) -> str:
    if launch.device == "cuda":
        return f"cuda (estimate, allocator of compute capability {args.cuda_capability})"
    return "cpu (estimate)"


def fill_cuda_allocator(row: dict, args, config, par: ParallelConfig, sizes: dict) -> None:
    """--estimate --device cuda: the predicted torch.cuda.max_memory_allocated of the worst stage
    (memory/allocator.py: the step's allocations through the caching allocator's rules, plus the
    cuBLAS workspaces), under this process's CUBLAS_WORKSPACE_CONFIG / PYTORCH_CUDA_ALLOC_CONF."""
    from ..memory.allocator import CudaSetup, predict_cuda_peak
    setup = CudaSetup.from_env(capability=parse_capability(args.cuda_capability))
    preds = [predict_cuda_peak(config, par, setup=setup, stage=p, **sizes) for p in range(par.pp)]
    worst = max(preds, key=lambda q: q.max_memory_allocated)
    row["cuda_allocated_mib"] = worst.max_memory_allocated / outputs.MIB
    row["cuda_workspace_mib"] = worst.workspace_bytes / outputs.MIB
    row["cuda_rounding_mib"] = worst.rounding_bytes / outputs.MIB


def parse_capability(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)


def launch_cell(launch, argv, cell: Cell, par: ParallelConfig, async_communication: bool, row: dict, paths, *,
                timeout: float | None = None) -> None:
    """The cell's torchrun job: the same command line narrowed to this cell, plus where to put the result;
    killed after `timeout` seconds (recorded as timed out). Its log never replaces an earlier run's."""
    with new_file(os.path.join(paths.logs, f"{cell.mode}_{cell.swept}{cell.value}.log")) as log_file, \
            tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        head, tail = split_argv(argv)
        worker_argv = [*head, "--", *tail, "--modes", cell.mode, "--num_hidden_layers", str(cell.num_hidden_layers),
                       "--seq_len", str(cell.seq_len), "--result_json", result_path]
        if row["kind"] == "profile":
            from ..profiling.sweep import cell_dir
            worker_argv += ["--profile_dir", cell_dir(paths.csv, cell)]
        code = launcher.run_torchrun(launch, par.world_size, worker_argv, async_communication=async_communication,
                                     log=log_file.tmp, timeout=timeout)
        result = None
        if os.path.exists(result_path):
            with open(result_path) as f:
                result = json.load(f)
    log = log_file.path
    if code == launcher.TIMED_OUT:
        row["status"], row["reason"] = "timeout", f"ranks killed after --cell_timeout {timeout:g} s (log: {log})"
        return
    if code != 0 or result is None:
        row["status"], row["reason"] = outputs.failure_from_log(log, code)
        return
    row["step_ms"], row["tokens_per_s"] = result["step_ms"], result["tokens_per_s"]
    row["step_ms_min"], row["step_ms_max"] = result.get("step_ms_min"), result.get("step_ms_max")  # profile: none
    if result["peak_bytes"] is not None:
        outputs.fill_memory(row, result["peak_bytes"], result["breakdown"])
    if par.pp > 1:
        fill_pipeline(row, result, par)


def fill_pipeline(row: dict, result: dict, par: ParallelConfig) -> None:
    """Per stage (worst rank of each): peak MiB, microbatches of activations held, measured idle
    share (wall time not spent in forward/backward compute: the bubble plus p2p), beside the
    bubble (P-1)/(M+P-1) of equal stages."""
    stages = [[r for r in result["per_rank"] if r["pp_rank"] == p] for p in range(par.pp)]
    peaks = [max((r["peak_bytes"] or 0) for r in ranks) / outputs.MIB for ranks in stages]
    row["peak_mib_per_stage"] = " ".join(f"{m:.2f}" for m in peaks) if result["peak_bytes"] is not None else None
    row["in_flight_per_stage"] = " ".join(str(max(r["max_in_flight"] for r in ranks)) for ranks in stages)
    row["idle_pct_per_stage"] = " ".join(f"{100 * max(r['idle'] for r in ranks):.1f}" for ranks in stages)
    row["bubble_pct"] = 100 * bubble_fraction(par.pp, row["num_microbatches"])


# ---------------------------------------------------------------- worker side (every rank)

def run_cell(launch, args, device) -> int:
    """One cell on this rank: build, warm up, measure; the first rank of every node writes the result
    JSON for its node's launcher (every rank holds the same result: `measure` gathers it)."""
    kind = kind_of(launch, args)
    cell = plan(args)[0]
    a = cell_args(args, cell)
    config, par = model_config(a), cell_parallel(launch, a, cell.mode)
    groups = ProcessGroups.build(par, timeout=collective_timeout(launch))
    per_replica = rows_per_replica(kind, args, par, launch)
    if args.inject_oom in (f"{cell.mode}:{cell.num_hidden_layers}", f"{cell.mode}:{cell.seq_len}"):  # test hook: a cell that dies the way a too-large one does
        raise torch.cuda.OutOfMemoryError(f"injected out-of-memory in cell {cell.name}")
    torch.manual_seed(args.seed)
    dense = MiniMindForCausalLM(config).state_dict()
    model = build_parallel_model(config, par, groups, dense, dtype=DTYPES[args.dtype], device=device)
    del dense
    gc.collect()
    model = wrap_data_parallel(model, groups)
    optimizer = make_optimizer(model, args.learning_rate)
    # M microbatches of `per_replica` rows per DP replica (M = 1 without a pipeline)
    batch = dp_rows(broadcast_batch(per_replica * args.num_microbatches * par.dp, a.seq_len, config.vocab_size,
                                    args.seed + 1, device), groups.dp_rank, par.dp)
    ids, targets = cp_tokens(batch, ContextLayout.of(par, a.seq_len), groups.cp_rank)  # [rows, S/C]
    result = (profile if kind == "profile" else measure)(kind, model, optimizer, groups, ids, targets, args, device)
    global_tokens = per_replica * par.dp * a.seq_len * args.num_microbatches
    result["tokens_per_s"] = global_tokens / (result["step_ms"] / 1e3)
    if first_on_node() and args.result_json:
        with atomic_path(args.result_json) as tmp, open(tmp, "w") as f:
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
    meter = None
    if kind == "memory":
        from ..memory import MemoryMeter
        meter = MemoryMeter(device, model, optimizer)
    with meter or nullcontext():
        times = [timed_step() for _ in range(args.benchmark_iters)]
    mine = {"step_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            **stage_numbers(groups, steps)}
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
            "per_rank": per_rank(ranks)}


def profile(kind, model, optimizer, groups, ids, targets, args, device) -> dict:
    """`--kind profile`: trace the measured steps, write the per-rank trace and overlap report
    (profiling/sweep.py); return the same dict as `measure` (step_ms, per_rank; no peak)."""
    from ..profiling.sweep import profile_cell
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
    """What `fill_pipeline` reads from every rank (peak_bytes None when no meter ran)."""
    return [{"pp_rank": r["pp_rank"], "peak_bytes": r.get("peak_bytes"), "max_in_flight": r["max_in_flight"],
             "idle": r["idle"]} for r in ranks]


TASK = Task(name="benchmark", parser=parser, check=check, launch=run_benchmark, run_rank=run_cell, kinds=KINDS)
