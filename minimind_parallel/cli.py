"""Command line: `python -m minimind_parallel <task> [launcher args] -- [task args]`.

The launcher parses and checks everything, prints one line per bad input and exits 2 before any
process starts, then launches the ranks with torchrun (`torch.distributed.run`). Each rank runs
`python -m minimind_parallel.worker` with the same arguments.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys

from .config import ConfigError, MiniMindConfig, ParallelConfig, check_layout

TASKS = ("validate", "benchmark")
BENCHMARK_KINDS = ("memory", "throughput", "profile")
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")


class Parser(argparse.ArgumentParser):
    """argparse that reports bad input as one ConfigError line instead of usage + exit."""

    def error(self, message):
        raise ConfigError(f"{self.prog}: {message}")


def launcher_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m minimind_parallel",
                                description="Model-parallel MiniMind: <task> [launcher args] -- [task args]")
    p.add_argument("task", help=f"one of {', '.join(TASKS)}")
    p.add_argument("--tp_size", type=int, default=1)
    p.add_argument("--pp_size", type=int, default=1)
    p.add_argument("--cp", action="store_true", help="enable context parallelism")
    p.add_argument("--cp_size", type=int, default=1)
    p.add_argument("--dp_size", type=int, default=1, help="data-parallel replicas on top of tp x pp x cp")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node_rank", type=int, default=0)
    p.add_argument("--master_addr", default="127.0.0.1")
    p.add_argument("--master_port", type=int, default=None)
    p.add_argument("--kind", choices=BENCHMARK_KINDS, default=None,
                   help="benchmark only: what to measure (also accepted among the task args)")
    return p


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Task args every task shares (SPEC 4)."""
    p.add_argument("--hidden_size", type=int, default=768)
    p.add_argument("--num_attention_heads", type=int, default=8)
    p.add_argument("--num_key_value_heads", type=int, default=4)
    p.add_argument("--vocab_size", type=int, default=6400)
    p.add_argument("--intermediate_size", type=int, default=None)
    p.add_argument("--tie_word_embeddings", action="store_true", help="tie lm_head to the embedding")
    p.add_argument("--micro_batch_size", type=int, default=2)
    p.add_argument("--num_microbatches", type=int, default=1)
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--sequence_parallel", action="store_true")
    p.add_argument("--async_communication", action="store_true")
    p.add_argument("--shared_sp_gather", action="store_true")
    p.add_argument("--vocab_parallel", action="store_true")
    p.add_argument("--pp_schedule", choices=("gpipe", "1f1b"), default="1f1b",
                   help="pipeline schedule over --num_microbatches (with one stage: gradient accumulation)")
    p.add_argument("--cp_comm_type", choices=("all_gather", "a2a"), default="all_gather")
    p.add_argument("--flash_attn", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=1234)


def validate_parser() -> argparse.ArgumentParser:
    p = Parser(prog="validate", description="compare a parallel layout with the dense model")
    add_model_args(p)
    p.add_argument("--num_hidden_layers", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--mode", default=None, help="a mode preset (tp, tp_sp, tp_sp_async, tp_vp, pp, tp_pp, ...)")
    p.add_argument("--optimizer_steps", type=int, default=3)
    p.add_argument("--log_interval", type=int, default=1)
    p.add_argument("--check_backward", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--atol", type=float, default=None, help="max-abs tolerance (default by dtype)")
    p.add_argument("--rtol", type=float, default=None, help="relative-L2 tolerance (default by dtype)")
    p.add_argument("--perturb", default=None, metavar="PARAM",
                   help="fault injection: add 1e-2 to this parameter's shard on TP rank 0 (checks the checker)")
    return p


# Mode presets: the TP-feature flags each mode turns on (flags given explicitly are kept too).
MODES = {
    "ddp": dict(),
    "tp": dict(),
    "tp_sp": dict(sequence_parallel=True),
    "tp_sp_async": dict(sequence_parallel=True, async_communication=True),
    "tp_async": dict(async_communication=True),                      # seed 4.4.1
    "tp_sp_async_shared": dict(sequence_parallel=True, async_communication=True, shared_sp_gather=True),
    "tp_vp": dict(vocab_parallel=True),
    "tp_sp_async_vp": dict(sequence_parallel=True, async_communication=True, vocab_parallel=True),
    "pp": dict(),     # stages from --pp_size, schedule from --pp_schedule
    "tp_pp": dict(),  # plain TP inside each stage (add --sequence_parallel etc. as wanted)
}


def task_parser(task: str) -> argparse.ArgumentParser:
    if task == "validate":
        return validate_parser()
    if task == "benchmark":
        from .tasks.benchmark import benchmark_parser
        return benchmark_parser()
    raise ConfigError(f"unknown task {task!r}; expected one of: {', '.join(TASKS)}")


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def parse(argv: list[str]):
    """-> (launcher namespace, task namespace); raises ConfigError on bad input."""
    head, tail = split_argv(argv)
    launch = launcher_parser().parse_args(head)
    if launch.task not in TASKS:
        raise ConfigError(f"unknown task {launch.task!r}; expected one of: {', '.join(TASKS)}")
    if launch.kind is not None and launch.task != "benchmark":
        raise ConfigError(f"--kind is a benchmark option; got task {launch.task!r}")
    if launch.cp_size > 1 and not launch.cp:
        raise ConfigError(f"--cp_size {launch.cp_size} needs --cp")
    if launch.cp and launch.cp_size > 1:
        raise ConfigError(f"context parallelism is not implemented yet; got --cp --cp_size {launch.cp_size}")
    args = task_parser(launch.task).parse_args(tail)
    return launch, args


def apply_mode(args, mode: str | None) -> None:
    if mode is None:
        return
    if mode not in MODES:
        raise ConfigError(f"unknown mode {mode!r}; expected one of: {', '.join(MODES)}")
    for flag, value in MODES[mode].items():
        setattr(args, flag, value)


def model_config(args, num_hidden_layers: int | None = None) -> MiniMindConfig:
    return MiniMindConfig(hidden_size=args.hidden_size, num_hidden_layers=num_hidden_layers or args.num_hidden_layers,
                          num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
                          vocab_size=args.vocab_size, intermediate_size=args.intermediate_size,
                          tie_word_embeddings=args.tie_word_embeddings, flash_attn=args.flash_attn)


def parallel_config(launch, args, *, tp: int | None = None, dp: int | None = None) -> ParallelConfig:
    return ParallelConfig(tp=launch.tp_size if tp is None else tp, pp=launch.pp_size, cp=launch.cp_size,
                          dp=launch.dp_size if dp is None else dp,
                          sequence_parallel=args.sequence_parallel, async_communication=args.async_communication,
                          shared_sp_gather=args.shared_sp_gather, vocab_parallel=args.vocab_parallel)


def resolve_device(launch) -> str:
    import torch
    if launch.device is not None:
        return launch.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str, dtype: str, world_per_node: int) -> None:
    import torch
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda needs a CUDA device; torch.cuda.is_available() is False")
        if world_per_node > torch.cuda.device_count():
            raise ConfigError(f"one GPU per rank: got {world_per_node} ranks per node, "
                              f"{torch.cuda.device_count()} GPUs")
        if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
            raise ConfigError("dtype bfloat16 is not supported on this GPU; use float16 or float32")


def check_task(launch, args) -> None:
    """Every constraint of a validate run; the benchmark checks each of its cells the same way."""
    apply_mode(args, getattr(args, "mode", None))
    for name in ("micro_batch_size", "num_microbatches", "seq_len"):
        if getattr(args, name) < 1:
            raise ConfigError(f"{name} must be >= 1; got {name}={getattr(args, name)}")
    if args.dtype == "float16" and getattr(args, "optimizer_steps", 0) > 0:
        raise ConfigError(f"float16 parameters cannot take AdamW steps (eps=1e-8 underflows to 0 in float16); "
                          f"got --dtype float16 with --optimizer_steps {args.optimizer_steps}: use bfloat16, "
                          f"or --optimizer_steps 0")
    par = parallel_config(launch, args)
    check_layout(model_config(args), par, seq_len=args.seq_len)
    if par.world_size % launch.nnodes:
        raise ConfigError(f"world size must be divisible by nnodes; got world_size={par.world_size}, "
                          f"nnodes={launch.nnodes}")
    check_device(resolve_device(launch), args.dtype, par.world_size // launch.nnodes)


def torchrun_command(launch, world_size: int, worker_argv: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world_size // launch.nnodes}",
           f"--nnodes={launch.nnodes}", "--max_restarts=0", "--monitor_interval=0.1"]
    if launch.nnodes == 1 and launch.master_port is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--node_rank={launch.node_rank}", f"--master_addr={launch.master_addr}",
                f"--master_port={launch.master_port or 29500}"]
    return cmd + ["-m", "minimind_parallel.worker", *worker_argv]


def launch_env(device: str, async_communication: bool) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    if device == "cuda" and async_communication:
        # One hardware queue: the async collective is issued before the wgrad GEMM (seed 4.4).
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return env


TIMED_OUT = 124  # run_torchrun's exit code when it killed the ranks at the timeout (as timeout(1))


def run_torchrun(launch, world_size: int, worker_argv: list[str], *, async_communication=False,
                 timeout: float | None = None, log: str | None = None) -> int:
    """Run the ranks to completion; `log`: a file that takes their stdout and stderr instead of the terminal.
    After `timeout` seconds the launcher and every rank it started are killed: -> TIMED_OUT."""
    device = resolve_device(launch)
    cmd = torchrun_command(launch, world_size, worker_argv)
    env = launch_env(device, async_communication)
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(log, "w")) if log is not None else None
        # its own session: on a timeout the whole group goes, ranks included
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=out,
                                stderr=subprocess.STDOUT if out is not None else None)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return TIMED_OUT
        except BaseException:  # Ctrl-C: take the ranks down too
            os.killpg(proc.pid, signal.SIGKILL)
            raise


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        launch, args = parse(argv)
        if launch.task == "benchmark":
            from .tasks.benchmark import run_benchmark
            return run_benchmark(launch, args, argv)
        check_task(launch, args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    par = parallel_config(launch, args)
    return run_torchrun(launch, par.world_size, argv, async_communication=args.async_communication)
