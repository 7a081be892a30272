"""Every constraint of every cell, before anything launches: one ConfigError line, exit 2, no
process started. The cells' runs are built once here and read by every check."""
from __future__ import annotations

import re

from ...config import ConfigError
from ...job import Job
from ...memory.analytic.moe_sizes import RoutingPolicy, check_histogram
from ...options import check_at_least, check_common, check_modes, check_number, check_resources, model_config
from . import outputs
from .cells import CellRun, cell_run, sweep_cells
from .command import BatchPolicy, Kind, batch_policy


def check_benchmark(job: Job) -> list[CellRun]:
    """Every constraint of every cell that does not depend on the machine; -> the cells' runs."""
    launch, args, kind = job.launch, job.task, job.task.kind
    if args.estimate and kind != Kind.MEMORY:
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
    cells = sweep_cells(args)
    check_nodes(launch, args, kind, cells)
    runs = [cell_run(job, cell) for cell in cells]
    check_common(job, [(r.args, r.par) for r in runs],
                 steps=None if args.estimate else ": use bfloat16, or --estimate", kernels=not args.estimate)
    for run in runs:
        check_batch_split(launch, args, kind, run)
    check_routing(args.routing, runs)
    return runs


def check_routing(routing, runs: list[CellRun]) -> None:
    """--routing is for MoE cells; a histogram fits each one (its layers, experts, rows; a list of
    them, one per microbatch of the cell)."""
    moe = [r for r in runs if model_config(r.args).use_moe]
    if routing == RoutingPolicy.BALANCED:
        return
    if not moe:
        raise ConfigError(f"--routing is the routing of MoE cells; no mode of this sweep is MoE (got --routing "
                          f"{routing if routing in tuple(RoutingPolicy) else 'a histogram'})")
    if routing in tuple(RoutingPolicy):
        return
    for r in moe:
        try:
            check_histogram(model_config(r.args), r.par, routing, seq_len=r.sizes["seq_len"],
                            micro_batch_size=r.sizes["micro_batch_size"], num_microbatches=r.sizes["num_microbatches"])
        except ValueError as e:
            raise ConfigError(f"--routing, cell {r.cell.name}: {e}") from None


def check_batch_split(launch, args, kind: Kind, run: CellRun) -> None:
    global_batch = args.micro_batch_size * launch.dp_size
    if batch_policy(kind, args) == BatchPolicy.FIXED_GLOBAL and global_batch % run.par.dp:
        raise ConfigError(f"fixed_global: the global batch must split evenly over the data-parallel ranks of mode "
                          f"{run.cell.mode}; got global batch={global_batch} (micro_batch_size x dp_size), "
                          f"dp={run.par.dp}")


def check_nodes(launch, args, kind: Kind, cells: list) -> None:
    """Several nodes run one cell per command: a cell is one torchrun job, one rendezvous of every
    node, and the nodes' launchers have no way to agree on the next cell or on a failed one."""
    if launch.nnodes == 1 or args.estimate:
        return
    if len(cells) > 1:
        raise ConfigError(f"on several nodes a benchmark runs one cell (one rendezvous of every node): give one "
                          f"mode and one value per command; got --nnodes {launch.nnodes} and {len(cells)} cells "
                          f"({' '.join(c.name for c in cells)})")
    if kind == Kind.PROFILE:
        raise ConfigError(f"--kind profile runs on one node (its traces and report are rank 0's); got --nnodes "
                          f"{launch.nnodes}")


def check(job: Job) -> None:
    """check_benchmark, then what depends on the machine: the outputs can be written, the ranks fit."""
    args = job.task
    runs = check_benchmark(job)
    outputs.check_paths(args, args.kind)
    if not args.estimate:
        check_resources(job.launch, [(r.args, r.par) for r in runs], rows=[r.rows for r in runs])
