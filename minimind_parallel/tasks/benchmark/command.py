"""The benchmark's command line: its task args, the sweep's job they resolve to, and the two
choices they make (the kind, given to the launcher or among the task args and resolved once into
the job, and the batch policy the kind implies)."""
from __future__ import annotations

import argparse
import json

from ...config import Choice, ConfigError
from ...job import Job, LaunchOptions, TaskOptions
from ...memory.analytic.moe_sizes import Routing, RoutingPolicy
from ...options import MODES, Parser, add_model_args, parallel_config


class Kind(Choice):
    """What a sweep measures (`--kind`)."""

    MEMORY = "memory"           # the peak and its breakdown, beside the analytic prediction
    THROUGHPUT = "throughput"   # step time and tokens/s on one global batch in every mode
    PROFILE = "profile"         # traces, the overlap report and the timelines


class BatchPolicy(Choice):
    """How many rows each DP replica gets (`--batch_policy`)."""

    FIXED_PER_RANK = "fixed_per_rank"
    FIXED_GLOBAL = "fixed_global"


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="benchmark", description="memory and step time over a sweep of modes x one dimension")
    add_model_args(p)
    p.add_argument("--kind", type=Kind.parse, choices=Kind.values(), default=None,
                   help="default memory (also a launcher option)")
    p.add_argument("--modes", nargs="+", default=["tp"], help=f"presets: {', '.join(MODES)}")
    p.add_argument("--batch_policy", type=BatchPolicy.parse, choices=BatchPolicy.values(), default=None,
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
    p.add_argument("--routing", type=routing_arg, default=RoutingPolicy.BALANCED, metavar="balanced|worst|FILE.json",
                   help="MoE: the routing the prediction (and --estimate, whose fake tensors cannot route) is for: "
                        "balanced (default), worst (every token of the EP group on one EP rank's experts), or a "
                        "JSON file of tokens per expert per layer ({\"model.layers.0.mlp\": [counts], ...}: one "
                        "EP group, one microbatch)")
    p.add_argument("--cell_timeout", type=float, default=None, metavar="SECONDS",
                   help="kill a cell's ranks after this long and record it as timed out (default: no limit)")
    p.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier run of the same name")
    # A test hook; not for users.
    p.add_argument("--inject_oom", default=None, metavar="MODE:VALUE", help=argparse.SUPPRESS)
    return p


def routing_arg(text: str) -> Routing:
    """--routing: a policy's name, or a JSON file {MoE layer's module name: tokens per expert} (or
    a list of them, one per microbatch)."""
    if text in RoutingPolicy.values():
        return RoutingPolicy(text)
    try:
        with open(text) as f:
            histogram = json.load(f)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"not {' or '.join(RoutingPolicy.values())}, nor a readable JSON file: {e}")
    each = histogram if isinstance(histogram, list) and histogram else [histogram]
    if not all(_is_histogram(h) for h in each):
        raise argparse.ArgumentTypeError(f"{text} must hold {{MoE layer name: [tokens per expert, ...]}} or a list "
                                         f"of them, one per microbatch")
    return histogram


def _is_histogram(histogram) -> bool:
    return isinstance(histogram, dict) and all(isinstance(v, list) and all(isinstance(n, int) for n in v)
                                               for v in histogram.values())


def resolve(launch: LaunchOptions, args: argparse.Namespace, argv: tuple[str, ...]) -> Job:
    """The sweep's job: its kind resolved; no one model (each cell has its own: cells.cell_job),
    the launcher's layout."""
    args.kind = kind_of(launch, args)
    return Job(launch=launch, task=TaskOptions.of(args), model=None, parallel=parallel_config(launch, args),
               argv=argv)


def kind_of(launch, args) -> Kind:
    """The kind given to the launcher or among the task args (the same one if both), else memory."""
    given = Kind(launch.kind) if launch.kind else None   # the launcher's --kind, a name among the tasks' kinds
    if given and args.kind and given != args.kind:
        raise ConfigError(f"--kind given twice with different values; got {given} and {args.kind}")
    return args.kind or given or Kind.MEMORY


def batch_policy(kind: Kind, args) -> BatchPolicy:
    if kind == Kind.THROUGHPUT:
        return BatchPolicy.FIXED_GLOBAL
    return args.batch_policy or BatchPolicy.FIXED_PER_RANK
