"""The pipeline schedules' idle per stage, measured: `benchmark --kind profile` for each schedule
and number of microbatches, then one table (docs/pipeline.md).

    PYTHONPATH=. python scripts/pipeline_bubble.py --pp_size 2 --microbatches 2 4 8 --memory_microbatches 4 --out results/pipeline_bubble
    PYTHONPATH=. python scripts/pipeline_bubble.py --pp_size 4 --microbatches 4 8 --layers 8 --out results/pipeline_bubble_pp4

Each cell is its own 2- (or 4-) rank run: --warmup_iters 1, --benchmark_iters 3, the model below.
Per stage: "not computing" is 1 - compute / step of the profile's accounting (profiling/overlap.py:
the step less the main thread's operators outside communication, i.e. the waits on neighbours, the
exposed p2p and the gaps), and "schedule idle" is the schedule's own count (1 - busy / wall of its
forward, backward and W steps, StepResult). Beside them the formula's bubble (bubble_fraction).
Each cell's timeline PNG (one step per stage) is the benchmark's <out>/<schedule>_m<M>_timeline.png.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys

from minimind_parallel.files import atomic_path

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1))
MODEL = ["--num_attention_heads", "8", "--num_key_value_heads", "4", "--micro_batch_size", "2", "--warmup_iters", "1",
         "--benchmark_iters", "3"]


def run_cell(pp: int, schedule: str, v: int, m: int, layers: int, out: str) -> dict:
    stem = os.path.join(out, f"{schedule}_m{m}")
    cmd = [sys.executable, "-m", "evaluation.parallel", "benchmark", "--kind", "profile", "--pp_size", str(pp), "--",
           "--modes", "pp", "--pp_schedule", schedule, "--virtual_stages", str(v), "--num_microbatches", str(m),
           "--num_hidden_layers", str(layers), *MODEL, "--output_csv", stem + ".csv"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(stem + ".csv") as f:
        row = next(csv.DictReader(f))
    cell = os.path.join(stem + "_profiles", f"pp_num_hidden_layers{layers}")
    with open(os.path.join(cell, "report.json")) as f:
        ranks = json.load(f)["ranks"]
    return dict(schedule=schedule + (f" V={v}" if v > 1 else ""), m=m, step_ms=float(row["step_ms"]),
                not_computing=[100 * (1 - r["compute_ms"] / r["step_ms"]) for r in ranks],
                schedule_idle=row["idle_pct_per_stage"], bubble=float(row["bubble_pct"]),
                held=row["in_flight_per_stage"])


def memory_cell(pp: int, schedule: str, v: int, m: int, layers: int, out: str) -> dict:
    """Peak MiB per stage of a real run, the CPU tracker (`benchmark --kind memory`)."""
    stem = os.path.join(out, f"memory_{schedule}_m{m}")
    cmd = [sys.executable, "-m", "evaluation.parallel", "benchmark", "--kind", "memory", "--pp_size", str(pp), "--",
           "--modes", "pp", "--pp_schedule", schedule, "--virtual_stages", str(v), "--num_microbatches", str(m),
           "--num_hidden_layers", str(layers), *MODEL, "--output_csv", stem + ".csv"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(stem + ".csv") as f:
        row = next(csv.DictReader(f))
    return dict(schedule=schedule + (f" V={v}" if v > 1 else ""), m=m, peak_mib_per_stage=row["peak_mib_per_stage"],
                predicted_mib_per_stage=row["predicted_mib_per_stage"], held=row["in_flight_per_stage"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pp_size", type=int, default=2)
    p.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden_size", type=int, default=512)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--vocab_size", type=int, default=2048)
    p.add_argument("--out", default="results/pipeline_bubble")
    p.add_argument("--memory_microbatches", type=int, default=None, help="also each schedule's peak memory at this M")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    MODEL.extend(["--hidden_size", str(a.hidden_size), "--seq_len", str(a.seq_len), "--vocab_size", str(a.vocab_size)])
    rows = [run_cell(a.pp_size, s, v, m, a.layers, a.out) for m in a.microbatches for s, v in SCHEDULES]
    print("| schedule | M | step ms | not computing % per stage (profile) | schedule idle % per stage | "
          "formula bubble % | microbatches held per stage |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['schedule']} | {r['m']} | {r['step_ms']:.0f} | {' '.join(f'{x:.1f}' for x in r['not_computing'])} | "
              f"{r['schedule_idle']} | {r['bubble']:.1f} | {r['held']} |")
    memory = []
    if a.memory_microbatches:
        memory = [memory_cell(a.pp_size, s, v, a.memory_microbatches, a.layers, a.out) for s, v in SCHEDULES]
        print("\n| schedule | M | peak MiB per stage (CPU tracker) | analytic model | microbatches held |")
        print("|---|---|---|---|---|")
        for r in memory:
            print(f"| {r['schedule']} | {r['m']} | {r['peak_mib_per_stage']} | {r['predicted_mib_per_stage'] or '-'} | "
                  f"{r['held']} |")
    with atomic_path(os.path.join(a.out, "table.json")) as tmp, open(tmp, "w") as f:
        json.dump(dict(bubble=rows, memory=memory), f, indent=1)


if __name__ == "__main__":
    main()
