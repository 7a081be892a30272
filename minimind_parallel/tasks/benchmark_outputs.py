"""What the benchmark writes: one row per (mode, swept value) cell, as a terminal line, CSV and
JSON rows (rewritten after every cell), and a PNG of memory and step time against the sweep."""
from __future__ import annotations

import csv
import json
import math
import os
import re
import time
from dataclasses import dataclass

MIB = 2**20
BREAKDOWN = ("params", "grads", "optimizer", "activations", "temporaries")
COLUMNS = ("kind", "mode", "swept", "value", "num_hidden_layers", "seq_len", "tp", "dp", "world", "dtype",
           "global_batch", "sequence_parallel", "async_communication", "vocab_parallel", "estimate", "status",
           "peak_mib", *(f"{k}_mib" for k in BREAKDOWN), "predicted_mib", "deviation_mib", "deviation_pct",
           "step_ms", "tokens_per_s", "vs_mode", "delta_peak_mib", "delta_peak_pct", "delta_step_pct",
           # pipeline cells: per stage (space-separated, stage 0 first), and the bubble (P-1)/(M+P-1)
           "pp", "pp_schedule", "num_microbatches", "peak_mib_per_stage", "predicted_mib_per_stage", "in_flight_per_stage",
           "idle_pct_per_stage", "bubble_pct", "reason")


@dataclass
class Paths:
    csv: str
    json: str
    plot: str
    logs: str


def default_paths(args, kind: str) -> Paths:
    stem = os.path.splitext(args.output_csv)[0] if args.output_csv else \
        os.path.join("results", f"benchmark_{kind}_{time.strftime('%Y%m%d_%H%M%S')}")
    paths = Paths(csv=args.output_csv or stem + ".csv", json=args.output_json or stem + ".json",
                  plot=args.output_plot or stem + ".png", logs=stem + "_logs")
    for p in (paths.csv, paths.json, paths.plot):
        os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
    os.makedirs(paths.logs, exist_ok=True)
    return paths


def new_row(kind, cell, par, a, global_batch: int, *, estimate: bool) -> dict:
    row = dict.fromkeys(COLUMNS)
    row.update(kind=kind, mode=cell.mode, swept=cell.swept, value=cell.value, num_hidden_layers=cell.num_hidden_layers,
               seq_len=cell.seq_len, tp=par.tp, dp=par.dp, world=par.world_size, dtype=a.dtype,
               global_batch=global_batch, sequence_parallel=par.sequence_parallel,
               async_communication=par.async_communication, vocab_parallel=par.vocab_parallel, estimate=estimate,
               pp=par.pp, status="ok", reason="")
    if par.pp > 1:
        row.update(pp_schedule=a.pp_schedule, num_microbatches=a.num_microbatches)
    return row


def fill_memory(row: dict, peak_bytes: int, breakdown: dict) -> None:
    row["peak_mib"] = peak_bytes / MIB
    for k in BREAKDOWN:
        row[f"{k}_mib"] = breakdown.get(k, 0) / MIB
    if row["predicted_mib"] is not None:
        row["deviation_mib"] = row["peak_mib"] - row["predicted_mib"]
        row["deviation_pct"] = 100 * row["deviation_mib"] / row["predicted_mib"] if row["predicted_mib"] else None


def one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def fail(row: dict, error: BaseException) -> None:
    oom = isinstance(error, MemoryError) or "out of memory" in str(error).lower() or \
        type(error).__name__ == "OutOfMemoryError"
    row["status"], row["reason"] = ("oom" if oom else "failed"), one_line(error)


ERROR_LINE = re.compile(r"^\s*(?:\[rank\d+\]:?\s*)?([\w.]*(?:Error|Exception)\b.*)$")


def failure_from_log(log: str, code: int) -> tuple[str, str]:
    """(status, reason) of a cell whose ranks failed: the last `SomethingError: ...` line of its log."""
    try:
        with open(log, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    errors = [m.group(1).strip() for m in map(ERROR_LINE.match, lines) if m]
    errors = [e for e in errors if not e.startswith(("torch.distributed.elastic", "ChildFailedError"))] or errors
    reason = errors[-1] if errors else f"exit code {code}"
    oom = any("OutOfMemoryError" in e or "out of memory" in e.lower() for e in errors)
    return ("oom" if oom else "failed"), f"{reason[:300]} (log: {log})"


def compare_with_previous(row: dict, done: list[dict]) -> None:
    """Deltas against the mode run just before at the same swept value (the book's tables)."""
    prev = next((r for r in reversed(done) if r["value"] == row["value"]), None)
    if prev is None or prev["status"] != "ok" or row["status"] != "ok":
        return
    row["vs_mode"] = prev["mode"]
    if row["peak_mib"] is not None and prev["peak_mib"]:
        row["delta_peak_mib"] = row["peak_mib"] - prev["peak_mib"]
        row["delta_peak_pct"] = 100 * row["delta_peak_mib"] / prev["peak_mib"]
    if row["step_ms"] is not None and prev["step_ms"]:
        row["delta_step_pct"] = 100 * (row["step_ms"] - prev["step_ms"]) / prev["step_ms"]


def fmt(x, spec=".1f", signed=False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, ("+" if signed else "") + spec)


class Table:
    """One terminal line per cell; the columns are explained in docs/benchmark.md."""

    def __init__(self, swept: str, kind: str):
        self.swept = {"num_hidden_layers": "layers", "seq_len": "seq_len"}[swept]
        self.kind = kind

    def header(self) -> str:
        return (f"{'mode':<15} {self.swept:>7} {'status':>6} {'peak MiB':>10} {'params/grads/optim/act/tmp MiB':>31} "
                f"{'pred MiB':>10} {'deviation':>17} {'step ms':>9} {'tokens/s':>10}  vs previous mode\n" + "-" * 140)

    def line(self, r: dict) -> str:
        parts = "/".join(fmt(r[f"{k}_mib"], ".0f") for k in BREAKDOWN) if r["peak_mib"] is not None else "-"
        dev = "-" if r["deviation_mib"] is None else \
            f"{fmt(r['deviation_mib'], '.2f', True)} ({fmt(r['deviation_pct'], signed=True)}%)"
        vs = ""
        if r["vs_mode"]:
            mem = f"{fmt(r['delta_peak_mib'], '.2f', True)} MiB ({fmt(r['delta_peak_pct'], signed=True)}%)" \
                if r["delta_peak_mib"] is not None else ""
            step = f"time {fmt(r['delta_step_pct'], signed=True)}%" if r["delta_step_pct"] is not None else ""
            vs = f"vs {r['vs_mode']}: " + ", ".join(s for s in (mem, step) if s)
        line = (f"{r['mode']:<15} {r['value']:>7} {r['status']:>6} {fmt(r['peak_mib'], '.2f'):>10} {parts:>31} "
                f"{fmt(r['predicted_mib'], '.2f'):>10} {dev:>17} {fmt(r['step_ms'], '.2f'):>9} "
                f"{fmt(r['tokens_per_s'], '.0f'):>10}  {vs}")
        if r["idle_pct_per_stage"] is not None:
            line += (f"\n    {r['pp_schedule']} pp={r['pp']} M={r['num_microbatches']}: per stage peak MiB "
                     f"{r['peak_mib_per_stage'] or '-'} (predicted {r['predicted_mib_per_stage']}), microbatches held "
                     f"{r['in_flight_per_stage']}, idle % {r['idle_pct_per_stage']} (bubble (P-1)/(M+P-1) = "
                     f"{fmt(r['bubble_pct'])}%)")
        elif r["predicted_mib_per_stage"] is not None and r["pp"] > 1:
            line += (f"\n    {r['pp_schedule']} pp={r['pp']} M={r['num_microbatches']}: per stage peak MiB "
                     f"{r['peak_mib_per_stage'] or '-'} (predicted {r['predicted_mib_per_stage']})")
        if r["status"] != "ok":
            line += f"\n    {r['status']}: {r['reason']}"
        return line.rstrip()


def _atomic_write(path: str, write) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        write(f)
    os.replace(tmp, path)


def write_csv(path: str, rows: list[dict]) -> None:
    def write(f):
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({k: "" if v is None else round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                    for r in rows)
    _atomic_write(path, write)


def write_json(path: str, rows: list[dict], meta: dict) -> None:
    """{"command": ..., "kind": ..., "device": ..., "swept": ..., "rows": [one per finished cell]}"""
    _atomic_write(path, lambda f: json.dump({**meta, "rows": rows}, f, indent=1))


def write_plot(path: str, rows: list[dict], swept: str) -> None:
    """Peak memory (measured solid, predicted dashed) and step time against the swept dimension, per mode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, step) = plt.subplots(1, 2, figsize=(11, 4.2))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    for i, mode in enumerate(modes):
        color = f"C{i}"
        mine = [r for r in rows if r["mode"] == mode]
        ok = [r for r in mine if r["status"] == "ok"]
        if ok and ok[0]["peak_mib"] is not None:
            mem.plot([r["value"] for r in ok], [r["peak_mib"] for r in ok], "o-", color=color, label=mode)
        pred = [r for r in mine if r["predicted_mib"] is not None]
        if pred:
            mem.plot([r["value"] for r in pred], [r["predicted_mib"] for r in pred], "--", color=color, alpha=0.6,
                     label=f"{mode} (predicted)")
        timed = [r for r in ok if r["step_ms"] is not None]
        if timed:
            step.plot([r["value"] for r in timed], [r["step_ms"] for r in timed], "o-", color=color, label=mode)
        for r in mine:
            if r["status"] != "ok":
                mem.axvline(r["value"], color=color, ls=":", alpha=0.5)
    xlabel = {"num_hidden_layers": "num_hidden_layers", "seq_len": "seq_len"}[swept]
    mem.set(xlabel=xlabel, ylabel="peak MiB (worst rank)", title="peak memory")
    step.set(xlabel=xlabel, ylabel="step ms (median, max over ranks)", title="step time")
    values = sorted({r["value"] for r in rows})
    for ax in (mem, step):
        ax.set_xticks(values)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
