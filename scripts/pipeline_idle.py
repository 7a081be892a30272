"""Idle per stage and step time of GPipe, 1F1B, interleaved 1F1B and ZB-H1, in ONE launch of
--pp_size gloo ranks: every (schedule, M) cell runs --repeats times, the schedules alternating
within each round (round r runs every M and schedule once before round r+1), so a drift of the
machine's load falls on all of them alike; each number is the median over the rounds.

    PYTHONPATH=. python scripts/pipeline_idle.py --out results/pipeline_idle
    PYTHONPATH=. python scripts/pipeline_idle.py --microbatches 2 4 8 --repeats 3 --hidden_size 512 --seq_len 256 \
        --vocab_size 2048 --out results/pipeline_idle_h512

A cell is what `benchmark --kind profile --modes pp` measures (profiling.trace.profile_steps, the
same function): --warmup plain steps, then --steps profiled ones. Per stage, "not computing" is
1 - compute / step of the profile's accounting (profiling/overlap.py: the step less the main
thread's operators outside communication -- the waits on neighbours, the exposed p2p, the gaps),
"schedule idle" the schedule's own count (1 - busy / wall of its F, B and W steps, StepResult,
median over the profiled steps); the step time is the profile's (mean over ranks), with the
rounds' min-max. Beside them the formula's bubble (schedules.bubble_fraction). One launch instead
of one per cell: no process start-up or imports between cells. The table is written atomically
to <out>/table.md, the numbers of every round to <out>/table.json, each cell's trace, report and
timeline PNG under <out>/<schedule>_m<M>_r<r>/. The model: fp32, --num_hidden_layers layers (a
multiple of pp x V), heads 8/4, micro_batch_size 2.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minimind_parallel import MiniMindConfig, ParallelConfig, ProcessGroups
from minimind_parallel.data.batches import random_batch
from minimind_parallel.files import atomic_path
from minimind_parallel.model import MiniMindForCausalLM
from minimind_parallel.pipeline_parallel import Schedule
from minimind_parallel.pipeline_parallel.schedules import bubble_fraction
from minimind_parallel.profiling.trace import profile_steps
from minimind_parallel.training import build_parallel_model, make_optimizer

SCHEDULES = ((Schedule.GPIPE, 1), (Schedule.ONE_F_ONE_B, 1), (Schedule.INTERLEAVED, 2), (Schedule.ZERO_BUBBLE, 1))


def _label(schedule: Schedule, v: int) -> str:
    return f"{schedule}" + (f" V={v}" if v > 1 else "")


def _cell(config, schedule: Schedule, v: int, m: int, args, out_dir: str) -> dict:
    """One profiled cell on this rank -> (on rank 0) its numbers per stage."""
    par = ParallelConfig(pp=args.pp_size, virtual_stages=v)
    groups = ProcessGroups.build(par)
    torch.manual_seed(0)
    model = build_parallel_model(config, par, groups, MiniMindForCausalLM(config).state_dict())
    optimizer = make_optimizer(model, 1e-3)
    ids, targets = random_batch(0, 2 * m, args.seq_len, config.vocab_size)
    result = profile_steps(model, optimizer, groups, ids, targets, steps=args.steps, warmup=args.warmup,
                           num_microbatches=m, schedule=schedule, out_dir=out_dir, title=os.path.basename(out_dir))
    idle = statistics.median(1 - s.busy_s / s.wall_s for s in result["steps"])
    stages = [None] * dist.get_world_size()
    dist.all_gather_object(stages, (groups.pp_rank, idle, max(s.max_in_flight for s in result["steps"])))
    by_stage = sorted(stages)
    return dict(schedule=_label(schedule, v), m=m, step_ms=result["summary"]["step_ms"],
                not_computing=[100 * (1 - r["compute_ms"] / r["step_ms"]) for r in result["ranks"]],
                schedule_idle=[100 * i for _, i, _ in by_stage], held=[h for _, _, h in by_stage],
                bubble=100 * bubble_fraction(args.pp_size, m, schedule, v))


def _rank(rank: int, world: int, store: str, args, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    config = MiniMindConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                            num_attention_heads=8, num_key_value_heads=4, vocab_size=args.vocab_size,
                            tie_word_embeddings=False)
    rounds = []
    for r in range(args.repeats):       # round by round: every cell once per round
        for m in args.microbatches:
            for schedule, v in SCHEDULES:
                cell = _cell(config, schedule, v, m, args, os.path.join(args.out, f"{schedule}_m{m}_r{r}"))
                rounds.append(dict(cell, round=r))
    if rank == 0:
        out["rounds"] = rounds
    dist.destroy_process_group()


def median_rows(rounds: list[dict]) -> list[dict]:
    """The rounds of each cell -> one row: the median of every number (per stage for the idle
    columns), the step time's min and max."""
    cells: dict = {}
    for r in rounds:
        cells.setdefault((r["m"], r["schedule"]), []).append(r)
    rows = []
    for runs in cells.values():
        steps = [r["step_ms"] for r in runs]
        per_stage = {k: [statistics.median(xs) for xs in zip(*(r[k] for r in runs))]
                     for k in ("not_computing", "schedule_idle")}
        rows.append(dict(runs[0], step_ms=statistics.median(steps), step_ms_range=(min(steps), max(steps)),
                         repeats=len(runs), held=runs[0]["held"], **per_stage))
    return rows


def table(rows: list[dict], args) -> str:
    head = (f"pp {args.pp_size}, L {args.num_hidden_layers}, H {args.hidden_size}, S {args.seq_len}, "
            f"V {args.vocab_size}, micro_batch_size 2, fp32, gloo; median of {args.repeats} rounds\n\n")
    lines = ["| schedule | M | step ms (median, min-max) | not computing % per stage (profile) | schedule idle % "
             "per stage | formula bubble % | microbatches held per stage |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["step_ms_range"]
        lines.append(f"| {r['schedule']} | {r['m']} | {r['step_ms']:.0f} ({lo:.0f}-{hi:.0f}) | "
                     f"{' '.join(f'{x:.1f}' for x in r['not_computing'])} | "
                     f"{' '.join(f'{x:.1f}' for x in r['schedule_idle'])} | {r['bubble']:.1f} | "
                     f"{' '.join(map(str, r['held']))} |")
    return head + "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp_size", type=int, default=2)
    p.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--vocab_size", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default="results/pipeline_idle")
    args = p.parse_args()
    bad = [f"{k}={getattr(args, k)}" for k in ("repeats", "warmup", "steps") if getattr(args, k) < (0 if k == "warmup"
                                                                                                   else 1)]
    if args.num_hidden_layers % (2 * args.pp_size) or any(m % args.pp_size for m in args.microbatches):
        bad.append(f"num_hidden_layers={args.num_hidden_layers} (a multiple of 2 x pp_size), "
                   f"microbatches={args.microbatches} (multiples of pp_size={args.pp_size}: interleaved V=2)")
    if bad:
        print(f"pipeline_idle: repeats and steps >= 1, warmup >= 0, layers and M fit interleaved V=2; got "
              f"{', '.join(bad)}", file=sys.stderr)
        return 2
    if os.path.exists(os.path.join(args.out, "table.md")):
        print(f"pipeline_idle: {args.out}/table.md exists (an earlier run's results); choose another --out",
              file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(args.pp_size, os.path.join(tmp, "store"), args, out), nprocs=args.pp_size)
        rounds = list(out["rounds"])
    text = table(median_rows(rounds), args)
    print(text, end="")
    with atomic_path(os.path.join(args.out, "table.md")) as path, open(path, "w") as f:
        f.write(text)
    with atomic_path(os.path.join(args.out, "table.json")) as path, open(path, "w") as f:
        json.dump(dict(args=vars(args), rounds=rounds), f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
