"""`benchmark --kind profile`: the two ends the benchmark driver calls (the traces and reports
themselves are profiling/'s).

    worker, every rank, one cell:  profile_cell(...)   -> the cell's result (step time, summary)
    launcher, after every cell:    compare_cells(...)  -> comparison table, JSON and timeline PNG

Each cell writes to <stem>_profiles/<mode>_<swept><value>/: trace_rank<r>.json (open in
Perfetto), report_rank<r>.json, report.json (every rank and the mean) and timeline.png.
"""
from __future__ import annotations

import json
import os

from ...files import atomic_path
from ...profiling.overlap import format_comparison, format_report
from ...profiling.timeline import plot_timelines
from ...profiling.trace import profile_steps
from .cells import Cell


def cell_dir(csv_path: str, cell: Cell) -> str:
    return os.path.join(os.path.splitext(csv_path)[0] + "_profiles", f"{cell.mode}_{cell.swept}{cell.value}")


def profile_cell(model, optimizer, groups, ids, targets, args, device) -> tuple[dict, list]:
    """--warmup_iters plain steps, then --benchmark_iters profiled ones (--num_microbatches
    through --pp_schedule), into --profile_dir. -> (the cell's result, this rank's StepResults)."""
    result = profile_steps(model, optimizer, groups, ids, targets, steps=args.benchmark_iters,
                           warmup=args.warmup_iters, num_microbatches=args.num_microbatches,
                           schedule=args.pp_schedule, out_dir=args.profile_dir, device=device,
                           title=os.path.basename(args.profile_dir))
    summary = result["summary"]
    if groups.rank == 0:
        print(format_report(summary, f"{os.path.basename(args.profile_dir)}: "), flush=True)
    return {"step_ms": summary["step_ms"], "peak_bytes": None, "breakdown": None, "profile": summary}, result["steps"]


def compare_cells(csv_path: str, cells) -> str | None:
    """Each of `cells`' report (the cells of this run that finished: a failed cell's directory may hold
    an earlier run's report), then the cells side by side. Writes <stem>_profile.json and
    <stem>_timeline.png (one panel per cell, one step per rank); returns the text (None when no
    cell finished)."""
    summaries, timelines = {}, {}
    for cell in cells:
        path = os.path.join(cell_dir(csv_path, cell), "report.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            report = json.load(f)
        summaries[cell.name] = report["summary"]
        timelines[cell.name] = [r["timeline"] for r in report["ranks"]]
    if not summaries:
        return None
    stem = os.path.splitext(csv_path)[0]
    with atomic_path(stem + "_profile.json") as tmp, open(tmp, "w") as f:
        json.dump(summaries, f, indent=1)
    plot_timelines(timelines, stem + "_timeline.png")
    details = [format_report(s, f"{name}: ") for name, s in summaries.items()]
    return "\n\n".join([*details, format_comparison(summaries)])
