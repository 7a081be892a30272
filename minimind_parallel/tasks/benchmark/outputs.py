"""What the benchmark writes: one row per (mode, swept value) cell, as a terminal line, CSV and
JSON rows (rewritten after every cell), and a PNG of memory and step time against the sweep."""
from __future__ import annotations

import csv
import json
import math
import os
import re
import secrets
import time
from dataclasses import dataclass

from ...config import Choice, ConfigError
from ...files import atomic_path, check_directory
from .command import Kind

MIB = 2**20
BREAKDOWN = ("params", "grads", "optimizer", "activations", "temporaries")


class Status(Choice):
    """How a cell ended (its row's `status`; `reason` says why when not ok)."""

    OK = "ok"
    OOM = "oom"                   # out of memory (CUDA or CPU allocator)
    FAILED = "failed"             # any other error, or a rank killed by a signal
    TIMEOUT = "timeout"           # killed after --cell_timeout
    INTERRUPTED = "interrupted"   # the sweep was stopped (Ctrl-C, SIGTERM) during the cell


COLUMNS = ("kind", "mode", "swept", "value", "num_hidden_layers", "seq_len", "tp", "dp", "world", "dtype",
           "global_batch", "sequence_parallel", "async_communication", "vocab_parallel", "estimate", "status",
           "peak_mib", *(f"{k}_mib" for k in BREAKDOWN), "predicted_mib", "deviation_mib", "deviation_pct",
           "step_ms", "tokens_per_s", "vs_mode", "delta_peak_mib", "delta_peak_pct", "delta_step_pct",
           # pipeline cells: per stage (space-separated, stage 0 first), and the schedule's bubble (bubble_fraction)
           "pp", "pp_schedule", "num_microbatches", "peak_mib_per_stage", "predicted_mib_per_stage", "in_flight_per_stage",
           "idle_pct_per_stage", "bubble_pct",
           # --estimate --device cuda: predicted torch.cuda.max_memory_allocated and its allocator terms
           "cuda_allocated_mib", "cuda_workspace_mib", "cuda_rounding_mib", "reason",
           # the step time's spread over the measured iterations (max over ranks of each rank's fastest and
           # slowest), and whether the two cells compared (vs_mode) overlap in it
           "step_ms_min", "step_ms_max", "delta_step_within_spread",
           # MoE cells: tokens routed to each expert in the last measured microbatch, per layer ("|" between
           # layers, the global batch's rows of that microbatch); --estimate: the balanced split it assumes
           "tokens_per_expert",
           # MoE cells: every microbatch's of the last measured step, as JSON (a list of histograms, one per
           # microbatch: what `--routing FILE` takes, so a cell's prediction can use each microbatch's)
           "routing_per_microbatch")


@dataclass
class Paths:
    csv: str
    json: str
    plot: str
    logs: str


def default_stem(kind: Kind) -> str:
    """results/benchmark_<kind>_<date>_<time>_<pid>_<random>: no two runs share it (claim_paths makes sure)."""
    return os.path.join("results", f"benchmark_{kind}_{time.strftime('%Y%m%d_%H%M%S')}_{os.getpid()}_"
                                   f"{secrets.token_hex(2)}")


def output_paths(args, stem: str) -> Paths:
    """--output_csv / --output_json / --output_plot, each defaulting to `stem` (the CSV's, when given) + extension."""
    stem = os.path.splitext(args.output_csv)[0] if args.output_csv else stem
    return Paths(csv=args.output_csv or stem + ".csv", json=args.output_json or stem + ".json",
                 plot=args.output_plot or stem + ".png", logs=stem + "_logs")


def written(paths: Paths, kind: Kind) -> dict[str, str]:
    """What a run writes, by the option (or the description) that names it; the logs are never replaced."""
    out = {"--output_csv": paths.csv, "--output_json": paths.json, "--output_plot": paths.plot}
    if kind == Kind.PROFILE:
        stem = os.path.splitext(paths.csv)[0]
        out.update({"the profile comparison": stem + "_profile.json", "the profile timeline": stem + "_timeline.png"})
    return out


def plot_formats() -> tuple[str, ...]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # here: matplotlib is optional and slow to import
    return tuple(FigureCanvasAgg.get_supported_filetypes())


def check_paths(args, kind: Kind) -> None:
    """Before anything runs: the outputs are distinct files, none from an earlier run unless --overwrite,
    their directories can be created and written, and the plot's extension is a format matplotlib writes."""
    paths = output_paths(args, default_stem(kind))
    named = written(paths, kind)
    seen: dict[str, str] = {}
    for what, path in named.items():
        key = os.path.realpath(path)
        if key in seen:
            raise ConfigError(f"{seen[key]} and {what} name the same file; got {path}")
        seen[key] = what
    ext = os.path.splitext(paths.plot)[1].lstrip(".").lower()
    if ext not in plot_formats():
        raise ConfigError(f"--output_plot must end in a format matplotlib writes ({', '.join(plot_formats())}); "
                          f"got {paths.plot}")
    for what, path in named.items():
        if os.path.isdir(path):
            raise ConfigError(f"{what} is a directory; got {path}")
        if os.path.lexists(path) and not args.overwrite:
            raise ConfigError(f"{what} exists (an earlier run's result); got {path}: name another file or pass "
                              f"--overwrite")
        check_directory(what, os.path.dirname(os.path.abspath(path)))
    if os.path.exists(paths.logs) and not os.path.isdir(paths.logs):
        raise ConfigError(f"the cells' log directory is a file; got {paths.logs}")
    check_directory("the cells' logs", paths.logs)


def claim_paths(args, kind: Kind) -> Paths:
    """The run's paths, directories made. A default stem is claimed by creating its log directory,
    which fails if another run took it (then another stem is drawn)."""
    if args.output_csv:
        paths = output_paths(args, "")
        os.makedirs(paths.logs, exist_ok=True)
    else:
        while True:
            paths = output_paths(args, default_stem(kind))
            os.makedirs(os.path.dirname(paths.logs), exist_ok=True)
            try:
                os.mkdir(paths.logs)
                break
            except FileExistsError:
                continue
    for p in (paths.csv, paths.json, paths.plot):
        os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
    return paths


def new_row(kind: Kind, cell, par, a, global_batch: int, *, estimate: bool) -> dict:
    row = dict.fromkeys(COLUMNS)
    row.update(kind=kind, mode=cell.mode, swept=cell.swept, value=cell.value, num_hidden_layers=cell.num_hidden_layers,
               seq_len=cell.seq_len, tp=par.tp, dp=par.dp, world=par.world_size, dtype=a.dtype,
               global_batch=global_batch, sequence_parallel=par.sequence_parallel,
               async_communication=par.async_communication, vocab_parallel=par.vocab_parallel, estimate=estimate,
               pp=par.pp, status=Status.OK, reason="")
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


OOM = re.compile(r"OutOfMemoryError|out of memory|can't allocate memory|Cannot allocate memory|MemoryError",
                 re.IGNORECASE)


def fail(row: dict, error: BaseException) -> None:
    oom = isinstance(error, MemoryError) or bool(OOM.search(f"{type(error).__name__}: {error}"))
    row["status"], row["reason"] = (Status.OOM if oom else Status.FAILED), one_line(error)


ERROR_LINE = re.compile(r"^\s*(?:\[rank\d+\]:?\s*)?([\w.]*(?:Error|Exception)\b.*)$")
# torchrun's summary of a failed job names the first rank that failed ("Root Cause"), its exit
# code and, for a rank killed by a signal, which one.
ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)[^\n]*?(?:\((SIG\w+)\))?\s*$",
                        re.DOTALL | re.MULTILINE)


def failure_from_log(log: str, code: int) -> tuple[Status, str]:
    """(status, reason) of a cell whose ranks failed: a rank killed by a signal when torchrun names one as
    the first failure (not the error its peers raised on losing it), else the last `SomethingError: ...`
    line of its log; oom when that is an out-of-memory error (CUDA or CPU allocator)."""
    try:
        with open(log, errors="replace") as f:
            text = f.read()
    except OSError:
        text = ""
    cause = ROOT_CAUSE.search(text)
    if cause and int(cause.group(2)) < 0:
        signal_name = cause.group(3) or f"signal {-int(cause.group(2))}"
        return Status.FAILED, f"rank {cause.group(1)} was killed by {signal_name} (log: {log})"
    errors = [m.group(1).strip() for m in map(ERROR_LINE.match, text.splitlines()) if m]
    errors = [e for e in errors if not e.startswith(("torch.distributed.elastic", "ChildFailedError"))]
    reason = errors[-1] if errors else f"rank {cause.group(1)} exited with code {cause.group(2)}" if cause else \
        f"exit code {code}"
    oom = any(OOM.search(e) for e in errors)
    return (Status.OOM if oom else Status.FAILED), f"{reason[:300]} (log: {log})"


def compare_with_previous(row: dict, done: list[dict]) -> None:
    """Deltas against the mode run just before at the same swept value (the book's tables)."""
    prev = next((r for r in reversed(done) if r["value"] == row["value"]), None)
    if prev is None or prev["status"] != Status.OK or row["status"] != Status.OK:
        return
    row["vs_mode"] = prev["mode"]
    if row["peak_mib"] is not None and prev["peak_mib"]:
        row["delta_peak_mib"] = row["peak_mib"] - prev["peak_mib"]
        row["delta_peak_pct"] = 100 * row["delta_peak_mib"] / prev["peak_mib"]
    if row["step_ms"] is not None and prev["step_ms"]:
        row["delta_step_pct"] = 100 * (row["step_ms"] - prev["step_ms"]) / prev["step_ms"]
        row["delta_step_within_spread"] = within_spread(row, prev)


def step_spread_ms(row: dict) -> float | None:
    """max - min of the cell's measured step times (None when they were not measured)."""
    if row.get("step_ms_min") is None or row.get("step_ms_max") is None:
        return None
    return row["step_ms_max"] - row["step_ms_min"]


def within_spread(row: dict, prev: dict) -> bool | None:
    """True when two cells' step times overlap (the slower cell's fastest iteration is no slower than
    the faster cell's slowest): the difference of their medians is within the spread, the machine's
    noise as much as the modes'. A wide spread beside a difference does not count when the ranges are
    apart (every iteration of one cell slower than every iteration of the other is a difference).
    None when a cell's spread was not measured."""
    if step_spread_ms(row) is None or step_spread_ms(prev) is None:
        return None
    return row["step_ms_min"] <= prev["step_ms_max"] and prev["step_ms_min"] <= row["step_ms_max"]


def noise_note(rows: list[dict]) -> str | None:
    """The end-of-run line naming the cells whose time difference is within their spread."""
    cells = [f"{r['mode']}:{r['value']}" for r in rows if r.get("delta_step_within_spread")]
    if not cells:
        return None
    return (f"benchmark: {len(cells)} time difference(s) within the step-time spread (min-max over iterations) "
            f"of the cells compared, so not told apart from noise: {' '.join(cells)}; more --benchmark_iters or an "
            f"idle machine separate them")


def fmt(x, spec=".1f", signed=False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, ("+" if signed else "") + spec)


class Table:
    """One terminal line per cell; the columns are explained in docs/benchmark.md."""

    def __init__(self, swept: str, kind: Kind):
        self.swept = {"num_hidden_layers": "layers", "seq_len": "seq_len"}[swept]
        self.kind = kind

    def header(self) -> str:
        return (f"{'mode':<15} {self.swept:>7} {'status':>6} {'peak MiB':>10} {'params/grads/optim/act/tmp MiB':>31} "
                f"{'pred MiB':>10} {'deviation':>17} {'step ms':>9} {'min-max ms':>17} {'tokens/s':>10}  "
                f"vs previous mode\n" + "-" * 158)

    def line(self, r: dict) -> str:
        parts = "/".join(fmt(r[f"{k}_mib"], ".0f") for k in BREAKDOWN) if r["peak_mib"] is not None else "-"
        dev = "-" if r["deviation_mib"] is None else \
            f"{fmt(r['deviation_mib'], '.2f', True)} ({fmt(r['deviation_pct'], signed=True)}%)"
        vs = ""
        if r["vs_mode"]:
            mem = f"{fmt(r['delta_peak_mib'], '.2f', True)} MiB ({fmt(r['delta_peak_pct'], signed=True)}%)" \
                if r["delta_peak_mib"] is not None else ""
            step = f"time {fmt(r['delta_step_pct'], signed=True)}%" if r["delta_step_pct"] is not None else ""
            if step and r.get("delta_step_within_spread"):
                step += " (within spread)"
            vs = f"vs {r['vs_mode']}: " + ", ".join(s for s in (mem, step) if s)
        line = (f"{r['mode']:<15} {r['value']:>7} {r['status']:>6} {fmt(r['peak_mib'], '.2f'):>10} {parts:>31} "
                f"{fmt(r['predicted_mib'], '.2f'):>10} {dev:>17} {fmt(r['step_ms'], '.2f'):>9} {spread_text(r):>17} "
                f"{fmt(r['tokens_per_s'], '.0f'):>10}  {vs}")
        if r["idle_pct_per_stage"] is not None:
            line += (f"\n    {r['pp_schedule']} pp={r['pp']} M={r['num_microbatches']}: per stage peak MiB "
                     f"{r['peak_mib_per_stage'] or '-'} (predicted {r['predicted_mib_per_stage']}), microbatches held "
                     f"{r['in_flight_per_stage']}, idle % {r['idle_pct_per_stage']} (the schedule's bubble = "
                     f"{fmt(r['bubble_pct'])}%)")
        elif r["predicted_mib_per_stage"] is not None and r["pp"] > 1:
            line += (f"\n    {r['pp_schedule']} pp={r['pp']} M={r['num_microbatches']}: per stage peak MiB "
                     f"{r['peak_mib_per_stage'] or '-'} (predicted {r['predicted_mib_per_stage']})")
        if r.get("cuda_allocated_mib") is not None:
            line += (f"\n    cuda allocator: max_memory_allocated {r['cuda_allocated_mib']:.2f} MiB = tensors "
                     f"{r['cuda_allocated_mib'] - r['cuda_workspace_mib'] - r['cuda_rounding_mib']:.2f} + cuBLAS "
                     f"workspaces {r['cuda_workspace_mib']:.2f} + block rounding {r['cuda_rounding_mib']:.2f}")
        if r.get("tokens_per_expert"):
            line += f"\n    tokens per expert, last microbatch, layer by layer: {r['tokens_per_expert']}"
        if r.get("routing_per_microbatch"):
            line += "\n    every microbatch's: the routing_per_microbatch column (a --routing file's JSON)"
        if r["status"] != Status.OK:
            line += f"\n    {r['status']}: {r['reason']}"
        return line.rstrip()


def spread_text(r: dict) -> str:
    if r.get("step_ms_min") is None or r.get("step_ms_max") is None:
        return "-"
    return f"{r['step_ms_min']:.2f}-{r['step_ms_max']:.2f}"


def csv_value(v):
    """Ten significant digits: what a reader recomputes from the CSV (tokens/s from step ms) agrees to 1e-9."""
    return "" if v is None else format(v, ".10g") if isinstance(v, float) else v


def write_csv(path: str, rows: list[dict]) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows({k: csv_value(v) for k, v in r.items()} for r in rows)


def write_json(path: str, rows: list[dict], meta: dict) -> None:
    """{"command": ..., "kind": ..., "device": ..., "swept": ..., "rows": [one per finished cell]}"""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)


def write_plot(path: str, rows: list[dict], swept: str) -> None:
    """Peak memory (measured solid, predicted dashed) and, when some cell was timed, step time (the
    median, bars from the fastest to the slowest iteration) against the swept dimension, per mode.
    --estimate times nothing: its plot is the memory panel alone."""
    import matplotlib  # here, not at the top: matplotlib is optional and slow to import, needed for a plot only
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed_any = any(r["status"] == Status.OK and r["step_ms"] is not None for r in rows)
    fig, axes = plt.subplots(1, 2 if timed_any else 1, figsize=(11, 4.2) if timed_any else (6, 4.2), squeeze=False)
    mem, step = axes[0][0], (axes[0][1] if timed_any else None)
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    for i, mode in enumerate(modes):
        color = f"C{i}"
        mine = [r for r in rows if r["mode"] == mode]
        ok = [r for r in mine if r["status"] == Status.OK]
        if ok and ok[0]["peak_mib"] is not None:
            mem.plot([r["value"] for r in ok], [r["peak_mib"] for r in ok], "o-", color=color, label=mode)
        pred = [r for r in mine if r["predicted_mib"] is not None]
        if pred:
            mem.plot([r["value"] for r in pred], [r["predicted_mib"] for r in pred], "--", color=color, alpha=0.6,
                     label=f"{mode} (predicted)")
        timed = [r for r in ok if r["step_ms"] is not None]
        if step is not None and timed:
            plot_step_times(step, timed, color, mode)
        for r in mine:
            if r["status"] != Status.OK:
                mem.axvline(r["value"], color=color, ls=":", alpha=0.5)
    xlabel = {"num_hidden_layers": "num_hidden_layers", "seq_len": "seq_len"}[swept]
    mem.set(xlabel=xlabel, ylabel="peak MiB (worst rank)", title="peak memory")
    if step is not None:
        step.set(xlabel=xlabel, ylabel="step ms (median, max over ranks)", title="step time (bars: min-max)")
    values = sorted({r["value"] for r in rows})
    for ax in (mem, step) if step is not None else (mem,):
        ax.set_xticks(values)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format=os.path.splitext(path)[1].lstrip(".").lower())
    plt.close(fig)


def plot_step_times(ax, timed: list[dict], color: str, mode: str) -> None:
    """One mode's median step times, with bars to its fastest and slowest iteration where measured."""
    x, y = [r["value"] for r in timed], [r["step_ms"] for r in timed]
    if all(step_spread_ms(r) is not None for r in timed):
        yerr = [[r["step_ms"] - r["step_ms_min"] for r in timed], [r["step_ms_max"] - r["step_ms"] for r in timed]]
        ax.errorbar(x, y, yerr=yerr, fmt="o-", color=color, label=mode, capsize=3)
    else:
        ax.plot(x, y, "o-", color=color, label=mode)


def routing_text(histogram: dict[str, list[int]]) -> str | None:
    """"130 126 128 128 | 140 ..." : each MoE layer's tokens per expert, layer by layer (None: dense)."""
    return " | ".join(" ".join(str(n) for n in counts) for counts in histogram.values()) or None


def routing_json(each: list[dict[str, list[int]]]) -> str | None:
    """Each microbatch's histogram as one line of JSON, the form `--routing FILE` reads (None: dense)."""
    return json.dumps(each, separators=(",", ":")) if each else None
