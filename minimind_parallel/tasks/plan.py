"""`plan`: which layout fits the devices and which is fastest, no ranks launched.

    python -m evaluation.parallel plan -- --world_size 8 --device cuda --device_memory_gib 24 \\
        --hidden_size 768 --num_hidden_layers 32 --seq_len 2048 --global_batch_size 16 --output_json plan.json

Every layout of the space (planning/space.py: the dimensions and check_layout's constraints) with
its predicted per-rank peak (the analytic memory model; on CUDA plus the cuBLAS workspaces) and
step time (planning/time_model.py, at a GPU profile's or a calibration file's rates); prints the
fitting ones ranked by predicted tokens/s and why the others were cut, writes the JSON (each
layout's train command and the `benchmark --estimate` command of its cell) and a PNG of predicted
memory against time with the budget line. `--calibrate` measures this machine's rates instead
(planning/calibrate.py) and writes them to --calibration.
"""
from __future__ import annotations

import argparse
import collections
import csv
import functools
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time

from ..config import ConfigError, MiniMindConfig, check_layout
from ..files import atomic_path, check_directory
from ..job import Job, LaunchOptions, TaskOptions
from ..options import (PRESETS, Parser, add_moe_args, check_at_least, check_number, launcher_layout,
                       program_name)
from ..planning import GPU_PROFILES, Workload, plan
from ..planning.agreement import mape, spearman
from ..planning.hardware import CPU_DEFAULT, gpu_profile, load_calibration, save_calibration
from ..planning.forked import forked_worker, usable_cpus
from ..planning.ranking import paused_collector
from ..planning.space import DOMINATED, Candidate, flag_names
from .benchmark.command import BatchPolicy, Kind
from .benchmark.outputs import Status
from .export import check_single_process
from .task import Task

GIB, MIB = 2**30, 2**20
# how the commands of a layout start (from the repository root, as README's commands)
PROGRAM = ("python", "-m", "evaluation.parallel")
# the corpus and tokenizer of README's Train section, which a train command reads
TRAIN_DATA = ("--data_path", "data/stdlib.jsonl", "--tokenizer_path", "data/tokenizer")
# where write_json puts the layouts' rows (no other string of the JSON holds a NUL)
LAYOUTS = "\0layouts\0"


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="plan", description="rank every layout that fits the devices by predicted tokens/s (no ranks)")
    p.add_argument("--world_size", type=int, default=None, help="ranks (one device each)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes the ranks are spread over (equally)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--device_memory_gib", type=float, default=None,
                   help="memory per device (default: the --gpu profile's; required on CPU)")
    p.add_argument("--gpu", default=None, help=f"built-in rates of a GPU: {', '.join(GPU_PROFILES)} (default H100)")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="rates measured by plan --calibrate (instead of --gpu); with --calibrate: where they go")
    p.add_argument("--calibrate", action="store_true", help="measure this machine's rates into --calibration")
    p.add_argument("--hidden_size", type=int, default=768)
    p.add_argument("--num_hidden_layers", type=int, default=8)
    p.add_argument("--num_attention_heads", type=int, default=8)
    p.add_argument("--num_key_value_heads", type=int, default=4)
    p.add_argument("--vocab_size", type=int, default=6400)
    p.add_argument("--intermediate_size", type=int, default=None)
    p.add_argument("--tie_word_embeddings", action=argparse.BooleanOptionalAction, default=False)
    add_moe_args(p)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the parameters' and activations' dtype (the train commands use --precision pure; float16 "
                        "parameters cannot take AdamW steps)")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--global_batch_size", type=int, default=16, help="rows per optimizer step over every replica")
    p.add_argument("--processes", type=int, default=None,
                   help="processes that predict the layouts (default: this machine's CPUs, up to 4, for a space of "
                        "thousands; planning/forked.py)")
    p.add_argument("--top", type=int, default=10, help="fitting layouts printed (the JSON has all)")
    p.add_argument("--output_json", default=None, help="default results/plan_<time>.json")
    p.add_argument("--output_plot", default=None, help="default: beside the JSON (PNG)")
    p.add_argument("--overwrite", action="store_true", help="replace the outputs of an earlier plan")
    p.add_argument("--validate", type=int, default=0, metavar="K",
                   help="run the top K and K random fitting layouts as real benchmark cells here (memory and "
                        "throughput) and report predicted against measured")
    p.add_argument("--validate_iters", type=int, default=3, help="measured steps of each validation cell")
    p.add_argument("--validate_time", action=argparse.BooleanOptionalAction, default=True,
                   help="--validate: measure the step times too (--no-validate_time: the memory cells alone)")
    p.add_argument("--validate_rounds", type=int, default=3,
                   help="--validate: rounds of every layout's throughput cell; each layout's times are the medians")
    p.add_argument("--validate_calibrate", action=argparse.BooleanOptionalAction, default=True,
                   help="--validate: measure this machine's rates (plan --calibrate's) before each round and "
                        "predict the round's times at them (--no-validate_calibrate: the plan's rates)")
    p.add_argument("--seed", type=int, default=0, help="which random layouts --validate draws")
    return p


def resolve(launch: LaunchOptions, args: argparse.Namespace, argv: tuple[str, ...]) -> Job:
    if args.output_json is None:
        args.output_json = os.path.join("results", f"plan_{time.strftime('%Y%m%d_%H%M%S')}_{os.getpid()}.json")
    if args.output_plot is None:
        args.output_plot = os.path.splitext(args.output_json)[0] + ".png"
    return Job(launch=launch, task=TaskOptions.of(args), model=None, parallel=launcher_layout(launch), argv=argv)


def model_of(args) -> MiniMindConfig:
    return MiniMindConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                          num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
                          vocab_size=args.vocab_size, intermediate_size=args.intermediate_size,
                          tie_word_embeddings=args.tie_word_embeddings, use_moe=args.use_moe,
                          num_experts=args.num_experts, num_experts_per_tok=args.num_experts_per_tok,
                          moe_intermediate_size=args.moe_intermediate_size, norm_topk_prob=args.norm_topk_prob,
                          router_aux_loss_coef=args.router_aux_loss_coef)


def workload_of(args) -> Workload:
    return Workload(model=model_of(args), seq_len=args.seq_len, global_batch_size=args.global_batch_size,
                    world_size=args.world_size, nnodes=args.nnodes, dtype=args.dtype)


def calibration_shapes(args):
    """What --calibrate (and each --validate round) measures the rates at: the workload's block and sequence."""
    from ..planning.calibrate import Shapes
    return Shapes(model=model_of(args), seq=args.seq_len)


def hardware_of(args):
    if args.calibration is not None and not args.calibrate:
        return load_calibration(args.calibration)
    if args.device == "cpu":
        return CPU_DEFAULT
    return gpu_profile(args.gpu or "H100")


def budget_gib(args, hw) -> float:
    return args.device_memory_gib if args.device_memory_gib is not None else hw.memory_gib


def check(job: Job) -> None:
    launch, args = job.launch, job.task
    check_single_process(launch, "plan")
    if args.calibrate:
        if args.calibration is None:
            raise ConfigError("--calibrate writes the rates it measures to --calibration FILE; got no --calibration")
        check_new(args.calibration, args.overwrite, "--calibration")
        return
    if args.world_size is None:
        raise ConfigError("plan needs --world_size N (the ranks to lay out)")
    check_at_least(args, 1, ("world_size", "nnodes", "global_batch_size", "top", "num_hidden_layers", "validate_iters",
                             "validate_rounds"))
    check_at_least(args, 0, ("validate",))
    if args.processes is not None:
        check_at_least(args, 1, ("processes",))
    if args.validate and args.nnodes > 1:
        raise ConfigError(f"--validate runs its cells on this machine, one node; got --nnodes {args.nnodes}")
    if args.world_size % args.nnodes:
        raise ConfigError(f"world_size must be divisible by nnodes; got world_size={args.world_size}, "
                          f"nnodes={args.nnodes}")
    if args.gpu is not None and args.calibration is not None:
        raise ConfigError(f"give --gpu or --calibration, not both; got --gpu {args.gpu}, --calibration {args.calibration}")
    if args.gpu is not None and args.device != "cuda":
        raise ConfigError(f"--gpu names a GPU's rates and needs --device cuda; got --device {args.device}")
    hw = hardware_of(args)
    check_number(args, "device_memory_gib", minimum=0.0, exclusive=True, unit=" GiB")
    if budget_gib(args, hw) is None:
        raise ConfigError(f"--device {args.device} needs --device_memory_gib G (memory per rank)")
    check_layout(model_of(args), launcher_layout(launch), seq_len=args.seq_len)   # the model itself, on one rank
    check_new(args.output_json, args.overwrite, "--output_json")
    check_new(args.output_plot, args.overwrite, "--output_plot")
    if args.validate:   # its cells' CSVs: an earlier plan's are never read as this one's
        check_new(validation_dir(args.output_json), args.overwrite, "--validate's results")


def check_new(path: str, overwrite: bool, what: str) -> None:
    """A user's earlier results are never replaced silently; the folder can be written."""
    if os.path.exists(path) and not overwrite:
        raise ConfigError(f"{what} {path} already exists; pass --overwrite to replace it")
    check_directory(f"{what} {path}", os.path.dirname(os.path.abspath(path)))


# ---------------------------------------------------------------- the commands of a layout

def model_argv(args) -> list[str]:
    argv = ["--hidden_size", args.hidden_size, "--num_hidden_layers", args.num_hidden_layers,
            "--num_attention_heads", args.num_attention_heads, "--num_key_value_heads", args.num_key_value_heads,
            "--vocab_size", args.vocab_size]
    if args.intermediate_size is not None:
        argv += ["--intermediate_size", args.intermediate_size]
    argv.append("--tie_word_embeddings" if args.tie_word_embeddings else "--no-tie_word_embeddings")
    if args.use_moe:
        argv += ["--use_moe", "--num_experts", args.num_experts, "--num_experts_per_tok", args.num_experts_per_tok,
                 "--norm_topk_prob" if args.norm_topk_prob else "--no-norm_topk_prob",
                 "--router_aux_loss_coef", args.router_aux_loss_coef]
        if args.moe_intermediate_size is not None:
            argv += ["--moe_intermediate_size", args.moe_intermediate_size]
    return [str(a) for a in argv]


def launcher_argv(k: Candidate, device: str, nnodes: int) -> list[str]:
    argv = ["--tp_size", k.tp, "--pp_size", k.pp, "--dp_size", k.dp, "--device", device]
    if k.cp > 1:
        argv += ["--cp", "--cp_size", k.cp]
    if k.ep > 1:
        argv += ["--ep_size", k.ep]
    if nnodes > 1:
        argv += ["--nnodes", nnodes, "--node_rank", 0]
    return [str(a) for a in argv]


def flag_argv(k: Candidate) -> list[str]:
    argv = [f"--{name}" for name in ("sequence_parallel", "async_communication", "shared_sp_gather", "vocab_parallel")
            if getattr(k, name)]
    argv += ["--recompute", str(k.recompute), "--loss_chunks", str(k.loss_chunks)]
    if k.zero:
        argv += ["--zero", str(k.zero)]
    if k.cp > 1:
        argv += ["--cp_comm_type", str(k.cp_comm_type), "--cp_load_balance" if k.cp_load_balance else "--no-cp_load_balance"]
    if k.pp > 1:
        argv += ["--pp_schedule", str(k.pp_schedule)]
    if k.virtual_stages > 1:
        argv += ["--virtual_stages", str(k.virtual_stages)]
    return argv


def benchmark_mode(k: Candidate) -> str:
    """The benchmark preset of the layout's model-parallel dimensions (options.PRESETS; none: ddp); with
    ep > 1 its expert-parallel one (space.EXPERT_PARALLEL_MODES). The MoE model and --zero are flags
    the cell passes explicitly, which a preset keeps."""
    dims = (k.tp > 1, k.pp > 1, k.cp > 1)
    if k.ep > 1:
        return next(p.name for p in PRESETS if p.ep and (p.tp, p.pp, p.cp) == dims)
    if not any(dims):
        return "ddp"
    return next(p.name for p in PRESETS if not p.flags and not p.replicas and (p.tp, p.pp, p.cp) == dims)


def train_command(k: Candidate, args, model: list[str] | None = None) -> str:
    """`model`: model_argv(args), if made already (the plan's thousands of commands share it)."""
    return shell_join_parts(*train_parts(k, args, model))


def train_parts(k: Candidate, args, model: list[str] | None = None,
                flags: tuple[str, ...] | None = None) -> tuple[tuple, ...]:
    """train_command's words in parts that many layouts share; `flags`: tuple(flag_argv(k)), if made."""
    return ((*PROGRAM, "train", *launcher_argv(k, args.device, args.nnodes)),
            ("--", *TRAIN_DATA, *(model or model_argv(args)), "--max_seq_len", str(args.seq_len)),
            ("--batch_size", str(k.micro_batch_size), "--accumulation_steps", str(k.num_microbatches),
             "--dtype", args.dtype, "--precision", "pure"),
            flags if flags is not None else tuple(flag_argv(k)))


def cell_parts(k: Candidate, args, *, kind: Kind, device: str, model: list[str] | None = None,
               flags: tuple[str, ...] | None = None) -> tuple[tuple, ...]:
    """The benchmark cell of layout `k` (its preset, sizes and flags; one row per DP replica's microbatch),
    its words in parts that many layouts share; `flags`: tuple(flag_argv(k)), if made already."""
    return (("benchmark", "--kind", str(kind), *launcher_argv(k, device, 1)),
            ("--", "--modes", benchmark_mode(k), *(model or model_argv(args)), "--seq_len", str(args.seq_len)),
            ("--micro_batch_size", str(k.micro_batch_size), "--num_microbatches", str(k.num_microbatches),
             *(["--batch_policy", str(BatchPolicy.FIXED_PER_RANK)] if kind == Kind.MEMORY else []), "--dtype", args.dtype),
            flags if flags is not None else tuple(flag_argv(k)))


def cell_argv(k: Candidate, args, *, kind: Kind, device: str, model: list[str] | None = None) -> list[str]:
    """The benchmark cell of layout `k` as its words (cell_parts)."""
    return [word for part in cell_parts(k, args, kind=kind, device=device, model=model) for word in part]


def estimate_command(k: Candidate, args, hw, model: list[str] | None = None) -> str:
    return shell_join_parts(*estimate_parts(k, args, hw, model))


def estimate_parts(k: Candidate, args, hw, model: list[str] | None = None,
                   flags: tuple[str, ...] | None = None) -> tuple[tuple, ...]:
    """estimate_command's words in parts (cell_parts')."""
    cap = hw.cuda_capability or (9, 0)
    return (PROGRAM, *cell_parts(k, args, kind=Kind.MEMORY, device="cuda", model=model, flags=flags),
            ("--estimate", "--cuda_capability", f"{cap[0]}.{cap[1]}"))


def shell_join(argv: list[str]) -> str:
    """shlex.join, each word's quoting remembered: thousands of commands repeat the same words."""
    return " ".join(map(_quoted, argv))


def shell_join_parts(*parts: tuple[str, ...]) -> str:
    """shell_join of the parts' words in order, each part's quoting remembered: the plan's thousands of
    commands are a few dozen distinct parts (launcher, model, batch, flags)."""
    return " ".join(_joined(part) for part in parts if part)


@functools.lru_cache(maxsize=4096)
def _joined(part: tuple[str, ...]) -> str:
    return shell_join(part)


def json_command(parts: tuple[tuple[str, ...], ...]) -> str:
    """json.dumps(shell_join_parts(*parts)): JSON escapes each character alone, so the command's
    text is its parts' texts joined, each part's remembered."""
    return '"' + " ".join(_json_joined(part) for part in parts if part) + '"'


@functools.lru_cache(maxsize=4096)
def _json_joined(part: tuple[str, ...]) -> str:
    return json.dumps(shell_join(part))[1:-1]


@functools.lru_cache(maxsize=4096)
def _quoted(word: str) -> str:
    return shlex.quote(word)


# ---------------------------------------------------------------- outputs

def layout_row(e, args, hw, model: list[str] | None = None) -> dict:
    k = e.candidate
    return {"tp": k.tp, "pp": k.pp, "cp": k.cp, "dp": k.dp, "ep": k.ep, "zero": k.zero, "flags": _flag_values(k.flags),
            **_predicted(e), "train_command": train_command(k, args, model),
            "estimate_command": estimate_command(k, args, hw, model)}


def _flag_values(flags: dict) -> dict:
    return {n: (str(v) if not isinstance(v, (bool, int)) else v) for n, v in flags.items()}


def _predicted(e) -> dict:
    return {"predicted_peak_mib": e.peak_bytes / MIB, "predicted_step_ms": e.step_ms,
            "predicted_tokens_per_s": e.tokens_per_s, "predicted_mfu": e.mfu,
            "breakdown_mib": {c: v / MIB for c, v in e.breakdown.items()}, "time_ms": e.time.as_ms()}


def layout_json(e, args, hw, model: list[str] | None = None) -> str:
    """json.dumps(layout_row(e, ...)), made from remembered texts: the flags' (layouts share them)
    and the two commands' parts (the JSON's tens of megabytes are mostly these commands)."""
    k = e.candidate
    values = tuple(getattr(k, name) for name in flag_names())
    flags = tuple(flag_argv(k))
    return (f'{{"tp": {k.tp:d}, "pp": {k.pp:d}, "cp": {k.cp:d}, "dp": {k.dp:d}, "ep": {k.ep:d}, "zero": {k.zero:d}, '
            f'"flags": {_flags_json(values, tuple(map(type, values)))}, {json.dumps(_predicted(e))[1:-1]}, '
            f'"train_command": {json_command(train_parts(k, args, model, flags))}, '
            f'"estimate_command": {json_command(estimate_parts(k, args, hw, model, flags))}}}')


@functools.lru_cache(maxsize=1 << 16)
def _flags_json(values: tuple, types: tuple) -> str:
    """The JSON text of a layout's flags (`values` of Candidate's flag fields in order; `types`
    theirs, so that True and 1 are two keys)."""
    return json.dumps(_flag_values(dict(zip(flag_names(), values))))


def cut_summary(result) -> list[dict]:
    """Cut layouts by constraint (count and one example each); then those over the budget."""
    groups = collections.OrderedDict()
    for cut in result.cuts:
        groups.setdefault(cut.constraint, []).append(cut)
    rows = [{"constraint": name, "layouts": len(cuts), "example": cuts[0].candidate.describe(),
             "reason": cuts[0].reason} for name, cuts in groups.items()]
    if result.over_budget:
        least = result.over_budget[0]
        rows.append({"constraint": "predicted peak over the device memory", "layouts": len(result.over_budget),
                     "example": least.candidate.describe(),
                     "reason": f"the least over: {least.peak_bytes / GIB:.2f} GiB > {result.budget_bytes / GIB:.2f} "
                               f"GiB by {(least.peak_bytes - result.budget_bytes) / GIB:.2f} GiB"})
    return rows


def write_json(path: str, result, args, hw, seconds: float, argv: tuple[str, ...], validation: dict | None) -> None:
    out = {"command": [*program_name().split(), *argv],
           "workload": {"world_size": args.world_size, "nnodes": args.nnodes, "device": args.device,
                        "device_memory_gib": result.budget_bytes / GIB, "seq_len": args.seq_len,
                        "global_batch_size": args.global_batch_size, "dtype": args.dtype,
                        "model": model_argv(args)},
           "hardware": hw.to_json(), "candidates": result.candidates, "seconds": seconds,
           "layouts": LAYOUTS, "cut": cut_summary(result), "notes": notes(args)}
    if validation is not None:
        out["validation"] = validation
    # dumps without indent (the C encoder, ASCII), the layouts' rows (json_row's ASCII) in their place
    head, tail = json.dumps(out).split(json.dumps(LAYOUTS))
    make = json_row(args, hw)
    rows = [e.row if e.row is not None else make(e) for e in result.fitting]
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(f"{head}[".encode())
        f.write(b", ".join(rows))
        f.write(f"]{tail}".encode())


def json_row(args, hw):
    """A fitting layout's JSON row as bytes (layout_json; plan(row=...) makes them in the processes
    that predict the layouts, beside the predictions: made after them, the rows of a plan's tens
    of thousands of layouts were a second forked pass of about a tenth of its CPU)."""
    words = model_argv(args)
    return lambda e: layout_json(e, args, hw, words).encode()


def _forks(args) -> bool:
    """Whether the plot is drawn by a forked child: where more than one process may predict the layouts
    (--processes, else this machine's CPUs; plan's)."""
    return (args.processes or usable_cpus()) > 1


def import_plot() -> None:
    """matplotlib's pyplot on the Agg backend imported (slow to import, needed for the plot only)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401


def plot_points(result) -> dict:
    """What the plot draws of a plan (arrays, not lists: scatter takes a list's floats one by one
    through numpy.ma, seconds for a plan's; and a forked child is sent them pickled)."""
    import numpy as np
    series = [(np.array([e.step_ms for e in entries]), np.array([e.peak_bytes / GIB for e in entries]), label, color)
              for entries, label, color in ((result.fitting, "fits", "C0"), (result.over_budget, "over budget", "C3"))
              if entries]
    best = result.fitting[0] if result.fitting else None
    return {"series": series, "best": best and (best.step_ms, best.peak_bytes / GIB),
            "budget_gib": result.budget_bytes / GIB,
            "title": f"plan: {result.workload.world_size} ranks, {result.hardware.name}"}


def draw_plot(path: str, points: dict) -> None:
    """Predicted peak (GiB) against predicted step time, fitting and over-budget layouts, the budget line
    (`points`: plot_points')."""
    import_plot()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for ms, gib, label, color in points["series"]:
        ax.scatter(ms, gib, s=6, alpha=0.5, color=color, label=f"{label} ({len(ms)})")
    if points["best"] is not None:
        ax.scatter([points["best"][0]], [points["best"][1]], s=60, marker="*", color="k", label="ranked first")
    ax.axhline(points["budget_gib"], color="k", ls="--", lw=1, label=f"budget {points['budget_gib']:.1f} GiB")
    ax.set(xlabel="predicted step time (ms)", ylabel="predicted peak per rank (GiB)", xscale="log",
           title=points["title"])
    ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.11, top=0.93)   # fixed margins: no tight-layout draw
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def write_plot(path: str, result) -> None:
    draw_plot(path, plot_points(result))


def notes(args) -> list[str]:
    """What the predictions leave out for this workload (printed and in the JSON)."""
    if not args.use_moe:
        return []
    return ["MoE: the predicted peak and step time are those of balanced routing (N k rows per rank through its "
            "experts); a skewed routing holds more (predict_memory's worst case: docs/memory.md)"]


def print_plan(result, args, hw, seconds: float) -> None:
    w = result.workload
    print(f"plan: {w.world_size} ranks on {w.nnodes} node(s), {args.device} {hw.name} ({hw.source}); "
          f"{result.budget_bytes / GIB:.2f} GiB per rank; S={w.seq_len}, global batch {w.global_batch_size}, "
          f"{args.dtype}")
    print(f"plan: {result.candidates} layouts, {len(result.fitting)} fit, {len(result.over_budget)} over the "
          f"memory, {len(result.cuts)} cut by a constraint ({seconds:.1f} s)")
    head = (f"{'#':>3} {'layout':<58} {'peak GiB':>8} {'step ms':>9} {'tokens/s':>10} {'MFU':>6}  "
            f"params/grads/optim/act/tmp GiB")
    print(head)
    print("-" * len(head))
    for i, e in enumerate(result.fitting[:args.top], 1):
        b = e.breakdown
        parts = "/".join(f"{b[c] / GIB:.2f}" for c in ("params", "grads", "optimizer", "activations", "temporaries"))
        if "workspaces" in b:
            parts += f" +{b['workspaces'] / MIB:.0f} MiB ws +{b['rounding'] / MIB:.1f} MiB rounding"
        print(f"{i:>3} {e.candidate.describe():<58} {e.peak_bytes / GIB:>8.2f} {e.step_ms:>9.2f} "
              f"{e.tokens_per_s:>10.0f} {100 * e.mfu:>5.1f}%  {parts}")
    if not result.fitting:
        print("plan: no layout fits")
    for note in notes(args):
        print(f"note: {note}")
    print("not enumerated (dominated): " + "; ".join(DOMINATED))
    print("cut:")
    for row in cut_summary(result):
        reason = row["reason"]
        values = reason[len(row["constraint"]):].lstrip("; ") if reason.startswith(row["constraint"]) else reason
        print(f"  {row['layouts']:>5} x {row['constraint']} (e.g. {row['example']}{': ' + values if values else ''})")


def work_scale_text(hw) -> str:
    """A CPU calibration's fitted factor on its isolated rates (planning/step_costs.py), when it has one."""
    scale = hw.extra.get("fitted", {}).get("work_scale")
    return "" if scale is None else f" (rates in a step: the isolated ones / {scale:.2f})"


def launch_plan(job: Job) -> int:
    args = job.task
    if args.calibrate:
        from ..planning.calibrate import calibrate
        hw = calibrate(args.device, args.dtype, calibration_shapes(args))
        save_calibration(hw, args.calibration)
        print(f"plan: {hw.name}: GEMM {hw.gemm_flops / 1e9:.1f} GFLOP/s, attention "
              f"{hw.attention_flops / 1e9:.1f} GFLOP/s (CP's blockwise {hw.blockwise_rate / 1e9:.1f}), memory "
              f"{hw.memory_bandwidth / 1e9:.2f} GB/s, op "
              f"{1e6 * hw.op_overhead_s:.1f} us, link {1e6 * hw.intra.latency_s:.0f} us + "
              f"{hw.intra.bandwidth / 1e9:.2f} GB/s + {1e6 * hw.intra.call_s:.0f} us a call in a step, "
              f"{1e6 * hw.fsdp_collective_s:.0f} us per FSDP2 collective{work_scale_text(hw)}; wrote {args.calibration}")
        return 0
    with paused_collector():   # from the plan to its outputs: no cycle worth a walk over its millions of objects
        return plan_outputs(job)


def plan_outputs(job: Job) -> int:
    """The plan, printed, validated (--validate), written (the JSON, the PNG)."""
    args = job.task
    # the plot drawn by a child forked now, which imports matplotlib while the space is enumerated (one
    # process), and draws while the JSON is written
    with forked_worker(import_plot, draw_plot, fork=_forks(args)) as plotter:
        t0 = time.perf_counter()
        hw = hardware_of(args)
        result = plan(workload_of(args), hw, device=args.device, budget_bytes=int(budget_gib(args, hw) * GIB),
                      processes=args.processes, row=json_row(args, hw))
        seconds = time.perf_counter() - t0
        print_plan(result, args, hw, seconds)
        validation = validate(result, args) if args.validate else None
        plotter.send(args.output_plot, plot_points(result))
        write_json(args.output_json, result, args, hw, seconds, job.argv, validation)
        plotter.result()
    print(f"plan: wrote {args.output_json}, {args.output_plot}")
    return 0


# ---------------------------------------------------------------- --validate: predicted against measured

def validation_dir(output_json: str) -> str:
    """Where --validate's benchmark cells write their CSVs: beside the JSON, named after it."""
    return os.path.splitext(output_json)[0] + "_validate"


def validation_layouts(result, k: int, seed: int) -> list:
    """The top k fitting layouts and k others drawn at random from the rest."""
    top, rest = result.fitting[:k], result.fitting[k:]
    return top + random.Random(seed).sample(rest, min(k, len(rest)))


def run_cell(argv: list[str], out_dir: str, name: str) -> dict:
    """One benchmark cell as its own command (its ranks launched by the benchmark); -> its CSV row, read
    only where the cell ended well (an earlier plan's CSV of the same name, which --overwrite let be
    replaced, is removed first: the benchmark refuses to overwrite it)."""
    csv_path = os.path.join(out_dir, f"{name}.csv")
    if os.path.exists(csv_path):
        os.remove(csv_path)
    cmd = [sys.executable, "-m", "evaluation.parallel", *argv, "--output_csv", csv_path]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate()
    finally:
        if proc.poll() is None:   # interrupted: the benchmark ends its ranks on SIGTERM
            proc.terminate()
            proc.wait()
    if proc.returncode != 0 or not os.path.exists(csv_path):
        return {"status": Status.FAILED, "reason": (err or "").strip().splitlines()[-1:]}
    with open(csv_path) as f:
        return next(csv.DictReader(f))


def validate(result, args) -> dict:
    """Each chosen layout's memory cell (the measured peak against the prediction: exact on CPU) and,
    unless --no-validate_time, its throughput cell (the measured step time against the predicted);
    MAPE and Spearman over them. The time is measured in --validate_rounds rounds, every layout once
    per round (so a change of the machine's load falls on all of them), each round with this
    machine's rates measured just before it (--validate_calibrate) and the layouts predicted at
    them; each layout's predicted and measured time are the medians over the rounds."""
    chosen = validation_layouts(result, args.validate, args.seed)
    out_dir = validation_dir(args.output_json)
    os.makedirs(out_dir, exist_ok=True)
    device = args.device
    iters = ["--warmup_iters", "1", "--benchmark_iters", str(args.validate_iters)]
    print(f"plan: validating {len(chosen)} layouts as benchmark cells on this machine ({device}), results in {out_dir}")
    memory = [run_cell([*cell_argv(e.candidate, args, kind=Kind.MEMORY, device=device), *iters], out_dir, f"{i}_memory")
              for i, e in enumerate(chosen)]
    rounds = time_rounds(result, args, chosen, out_dir, iters) if args.validate_time else []
    rows = [validation_row(e, mem, [r["layouts"][i] for r in rounds]) for i, (e, mem) in enumerate(zip(chosen, memory))]
    print_validation(rows, args.validate_time)
    return validation_summary(rows, rounds, args.validate_time)


def time_rounds(result, args, chosen: list, out_dir: str, iters: list[str]) -> list[dict]:
    """--validate_rounds rounds of every chosen layout's throughput cell; in each the rates (calibrated
    then, or the plan's) and, per layout, the step time predicted at them and the measured one."""
    from ..planning.calibrate import calibrate
    from ..planning.ranking import evaluate, model_flops_per_token
    w, flops = result.workload, model_flops_per_token(result.workload)
    rounds = []
    for r in range(args.validate_rounds):
        hw = calibrate(args.device, args.dtype, calibration_shapes(args)) if args.validate_calibrate else result.hardware
        print(f"plan: round {r + 1} of {args.validate_rounds}: GEMM {hw.gemm_flops / 1e9:.1f} GFLOP/s, op "
              f"{1e6 * hw.op_overhead_s:.1f} us, {1e6 * hw.intra.call_s:.0f} us a collective in a step, "
              f"{1e6 * hw.fsdp_collective_s:.0f} us per FSDP2 collective{work_scale_text(hw)} "
              f"(load average {os.getloadavg()[0]:.1f})", flush=True)
        layouts = []
        for i, e in enumerate(chosen):
            cell = run_cell([*cell_argv(e.candidate, args, kind=Kind.THROUGHPUT, device=args.device), *iters],
                            out_dir, f"{i}_throughput_{r}")
            ok = cell.get("status") == Status.OK
            layouts.append({"predicted_step_ms": evaluate(e.candidate, w, hw, args.device, flops).step_ms,
                            "measured_step_ms": float(cell["step_ms"]) if ok else None,
                            "status": Status.OK if ok else f"throughput {cell.get('status')}"})
        rounds.append({"hardware": hw.to_json(), "load_average": os.getloadavg()[0], "layouts": layouts})
    return rounds


def validation_row(e, mem: dict, timed: list[dict]) -> dict:
    """One layout: its memory cell against the plan's peak, its rounds' medians (all rounds ok)."""
    ok = mem.get("status") == Status.OK and all(t["status"] == Status.OK for t in timed)
    failed = [f"memory {mem.get('status')}"] * (mem.get("status") != Status.OK) + \
        [t["status"] for t in timed if t["status"] != Status.OK]
    row = {"layout": e.candidate.describe(), "predicted_peak_mib": e.peak_bytes / MIB,
           "measured_peak_mib": float(mem["peak_mib"]) if mem.get("status") == Status.OK else None,
           "status": Status.OK if ok else ", ".join(failed)}
    if timed:
        row.update(predicted_step_ms=statistics.median(t["predicted_step_ms"] for t in timed),
                   measured_step_ms=statistics.median(t["measured_step_ms"] for t in timed) if ok else None,
                   rounds=timed)
    return row


def print_validation(rows: list[dict], timed: bool) -> None:
    head = f"{'layout':<58} {'pred MiB':>10} {'meas MiB':>10}" + (f" {'pred ms':>9} {'meas ms':>9} {'error':>7}" if timed else "")
    print(head)
    for row in rows:
        if row["status"] != Status.OK:
            print(f"{row['layout']:<58} {row['status']}")
            continue
        line = f"{row['layout']:<58} {row['predicted_peak_mib']:>10.2f} {row['measured_peak_mib']:>10.2f}"
        if timed:
            err = 100 * (row["predicted_step_ms"] - row["measured_step_ms"]) / row["measured_step_ms"]
            line += f" {row['predicted_step_ms']:>9.1f} {row['measured_step_ms']:>9.1f} {err:>+6.1f}%"
        print(line, flush=True)


def validation_summary(rows: list[dict], rounds: list[dict], timed: bool) -> dict:
    """MAPE and Spearman of the medians, the largest memory difference (over the layouts that ran)."""
    done = [r for r in rows if r["status"] == Status.OK]
    summary = {"layouts": rows, "rounds": [{k: v for k, v in r.items() if k != "layouts"} for r in rounds],
               "load_average": os.getloadavg()[0]}
    if done:
        summary["memory_max_abs_diff_mib"] = max(abs(r["predicted_peak_mib"] - r["measured_peak_mib"]) for r in done)
    if timed and len(done) >= 2:
        pred, meas = [r["predicted_step_ms"] for r in done], [r["measured_step_ms"] for r in done]
        summary.update(time_mape_pct=mape(pred, meas), spearman=spearman(pred, meas))
        print(f"plan: time MAPE {summary['time_mape_pct']:.1f}%, Spearman {summary['spearman']:.3f} over {len(done)} "
              f"layouts (medians of {len(rounds)} rounds)")
    if done:
        print(f"plan: memory: largest |predicted - measured| {summary['memory_max_abs_diff_mib']:.3f} MiB over "
              f"{len(done)} layouts (load average {summary['load_average']:.1f})")
    return summary


def run_rank(job: Job, device) -> int:
    raise RuntimeError("plan runs in the launcher process; it starts no ranks")


TASK = Task(name="plan", parser=parser, resolve=resolve, check=check, launch=launch_plan, run_rank=run_rank,
            ends_at_once=True)
