"""`validate`: compare the requested layout with the dense model on every rank, print the report.

    python -m minimind_parallel validate --tp_size 2 -- --mode tp_sp_async --num_hidden_layers 2
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import replace

import torch.distributed as dist

from .. import launcher
from ..config import DTYPES, ConfigError
from ..files import atomic_path
from ..groups import ProcessGroups, first_on_node
from ..interop import load_minimind_state_dict
from ..job import Job, LaunchOptions, TaskOptions
from ..options import (Parser, add_model_args, add_rope_scaling_arg, apply_mode, check_at_least, check_common,
                       check_modes, check_number, check_resources, collective_timeout, mode_parallel, model_config)
from ..plan import stage_parameters
from ..validation import compare_with_dense, failures, format_report
from .task import Task


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="validate", description="compare a parallel layout with the dense model")
    add_model_args(p)
    p.add_argument("--num_hidden_layers", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=64)
    add_rope_scaling_arg(p)
    p.add_argument("--mode", default=None, help="a mode preset (tp, tp_sp, tp_sp_async, tp_vp, pp, tp_pp, ...)")
    p.add_argument("--optimizer_steps", type=int, default=3)
    p.add_argument("--log_interval", type=int, default=1)
    p.add_argument("--check_backward", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--atol", type=float, default=None, help="max-abs tolerance (default by dtype)")
    p.add_argument("--rtol", type=float, default=None, help="relative-L2 tolerance (default by dtype)")
    p.add_argument("--perturb", default=None, metavar="PARAM",
                   help="fault injection: add 1e-2 to this parameter's shard on TP rank 0 (checks the checker)")
    p.add_argument("--from_weight", default=None, metavar="PTH",
                   help="start both models from MiniMind weights ({weight}_{hidden}.pth) instead of a random init")
    return p


def resolve(launch: LaunchOptions, args: argparse.Namespace, argv: tuple[str, ...]) -> Job:
    """The run with its --mode preset applied, once: its flags in the options, its layout."""
    if args.mode is not None:
        check_modes([args.mode], launch)
    apply_mode(args, args.mode)
    return Job(launch=launch, task=TaskOptions.of(args), model=model_config(args),
               parallel=mode_parallel(launch, args, args.mode), argv=argv)


def check(job: Job) -> None:
    """Every constraint of a validate run (its mode's flags applied)."""
    launch, args = job.launch, job.task
    steps = (f" with --optimizer_steps {args.optimizer_steps}: use bfloat16, or --optimizer_steps 0"
             if args.optimizer_steps > 0 else None)
    check_at_least(args, 0, ("optimizer_steps",))
    check_at_least(args, 1, ("log_interval",))
    for name in ("atol", "rtol"):
        check_number(args, name, minimum=0.0)
    runs = [(args, job.parallel)]
    check_common(job, runs, steps=steps, sizes=("micro_batch_size", "num_microbatches", "seq_len"))
    check_perturb(job)
    initial_state(job)
    check_resources(launch, runs)


def initial_state(job: Job) -> dict | None:
    """The dense state dict of --from_weight (read strictly: ConfigError naming a key or shape), or None."""
    if job.task.from_weight is None:
        return None
    return load_minimind_state_dict(job.task.from_weight, job.model)


def check_perturb(job: Job) -> None:
    """--perturb names a parameter of the parallel model (as it is named on its pipeline stage)."""
    args, par = job.task, job.parallel
    if args.perturb is None:
        return
    names = {n for stage in range(par.pp) for n in stage_parameters(job.model, par, stage)}
    if args.perturb not in names:
        examples = ", ".join(sorted(n for n in names if ".layers." not in n))
        raise ConfigError(f"--perturb must name a parameter of the model (model.layers.<i>.self_attn.q_proj.weight, "
                          f"{examples}, ...); got --perturb {args.perturb}")


def launch_validate(job: Job) -> int:
    """One torchrun job; the first rank of every node writes the verdict (every rank holds the same
    rows) to the job's report file, so a failed comparison is the report and its last line (exit 1),
    not a failed job, on every node. Rank 0 prints the report; another node's launcher says the
    verdict in one line."""
    launch = job.launch
    with tempfile.TemporaryDirectory() as tmp:
        verdict_path = os.path.join(tmp, "verdict.json")
        code = launcher.run_job(replace(job, report=verdict_path))
        if code != 0 or not os.path.exists(verdict_path):
            return code or 1
        with open(verdict_path) as f:
            passed = json.load(f)["passed"]
    if launch.node_rank != 0:
        print(f"validate: {'PASSED' if passed else 'FAILED'} on node {launch.node_rank} of {launch.nnodes} "
              f"(node 0 prints the report)")
    return 0 if passed else 1


def run_rank(job: Job, device) -> int:
    args, config, par = job.task, job.model, job.parallel
    groups = ProcessGroups.build(par, timeout=collective_timeout(job.launch))
    dtype = DTYPES[args.dtype]
    rows = compare_with_dense(config, par, groups, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                              num_microbatches=args.num_microbatches, pp_schedule=args.pp_schedule,
                              dtype=dtype, lr=args.learning_rate, optimizer_steps=args.optimizer_steps,
                              log_interval=args.log_interval, check_backward=args.check_backward, seed=args.seed,
                              device=device, perturb=args.perturb, atol=args.atol, rtol=args.rtol,
                              initial_state=initial_state(job), bucket_size_mb=args.bucket_size_mb)
    bad = failures(rows)
    if dist.get_rank() == 0:
        print(f"validate: dp={par.dp} pp={par.pp} schedule={args.pp_schedule} microbatches={args.num_microbatches} "
              f"tp={par.tp} sp={par.sequence_parallel} async={par.async_communication} "
              f"shared_gather={par.shared_sp_gather} vp={par.vocab_parallel} cp={par.cp} "
              f"cp_comm_type={par.cp_comm_type} cp_load_balance={par.cp_load_balance} zero={par.zero} dtype={args.dtype} "
              f"layers={config.num_hidden_layers} seq={args.seq_len} steps={args.optimizer_steps}"
              f"{f' weights={args.from_weight}' if args.from_weight else ''}")
        print(format_report(rows))
        print(f"validate: {'FAILED' if bad else 'PASSED'} ({len(rows) - len(bad)} of {len(rows)} items within tolerance)")
    if job.report and first_on_node():
        with atomic_path(job.report) as tmp, open(tmp, "w") as f:
            json.dump({"passed": not bad}, f)
    if job.report:  # the launcher reports the verdict
        return 0
    return 1 if bad else 0


TASK = Task(name="validate", parser=parser, resolve=resolve, check=check, launch=launch_validate, run_rank=run_rank)
