"""The launcher's side of a benchmark: run every cell (each its own torchrun job, or an estimate
in this process), a row per cell with the analytic prediction beside the measurement, the
outputs rewritten after every cell. A cell that fails or runs out of memory is recorded and the
sweep goes on."""
from __future__ import annotations

import json
import os
import sys
import tempfile

from tqdm import tqdm

from ... import launcher, memory
from ...files import new_file
from ...job import Job
from ...options import model_config, program_name, resolve_device
from ...pipeline_parallel import bubble_fraction
from ...processes import Interrupted
from . import outputs
from .cells import CellRun, cell_job, cell_run, sweep_cells
from .command import BatchPolicy, Kind, batch_policy
from .estimate import estimate_cell, estimate_device
from .outputs import Status
from .profile import cell_dir, compare_cells


def run_benchmark(job: Job) -> int:
    """Run every cell (checked by `checks.check`); returns 0 when every cell succeeded, 1 otherwise. SIGINT or
    SIGTERM (processes.Interrupted) ends the running cell's processes, records the cell as
    interrupted, writes every output with the finished rows, then passes the interruption on."""
    launch, args, kind = job.launch, job.task, job.task.kind
    cells = sweep_cells(args)
    paths = outputs.claim_paths(args, kind)
    if kind == Kind.THROUGHPUT and args.batch_policy == BatchPolicy.FIXED_PER_RANK:
        print("benchmark: --kind throughput compares modes on the same global batch: using fixed_global")
    device = estimate_device(launch, args) if args.estimate else resolve_device(launch)
    meta = dict(command=[*program_name().split(), *job.argv], kind=kind, device=device,
                swept=cells[0].swept, batch_policy=batch_policy(kind, args))
    print(f"benchmark: kind={kind} device={device} modes={' '.join(args.modes)} "
          f"{cells[0].swept}={getattr(args, cells[0].swept)} batch_policy={meta['batch_policy']} "
          f"dtype={args.dtype} world={job.parallel.world_size}", flush=True)
    table = outputs.Table(cells[0].swept, kind)
    results: list[dict] = []
    bar = tqdm(cells, desc="benchmark", unit="cell", file=sys.stderr, dynamic_ncols=True)
    print(table.header(), flush=True)

    def record(row: dict) -> None:
        outputs.compare_with_previous(row, results)
        results.append(row)
        outputs.write_csv(paths.csv, results)
        outputs.write_json(paths.json, results, meta)
        bar.write(table.line(row))

    interrupted, row = None, None
    fake_memo: dict = {}   # --estimate: what the fake dispatch of one cell remembers for the next (metadata only)
    try:
        for cell in bar:
            bar.set_postfix_str(cell.name)
            run = cell_run(job, cell)
            row = new_cell_row(job, run)
            run_one(job, run, row, paths, fake_memo)
            record(row)
    except Interrupted as e:  # the cell's processes are gone (launcher.run_torchrun); keep what finished
        interrupted = e
        if len(results) < len(cells):  # the cell running, or about to start, when the signal came
            if row is None or any(r is row for r in results):
                row = new_cell_row(job, cell_run(job, cells[len(results)]))
            row["status"], row["reason"] = Status.INTERRUPTED, f"{e}; the cell's processes were ended"
            record(row)
    bar.close()
    outputs.write_csv(paths.csv, results)  # again: an interruption may have come while they were written
    outputs.write_json(paths.json, results, meta)
    outputs.write_plot(paths.plot, results, cells[0].swept)
    if kind == Kind.PROFILE:  # traces and reports of this run's finished cells; here the modes side by side
        done = [cell for cell, r in zip(cells, results) if r["status"] == Status.OK]
        print(compare_cells(paths.csv, done) or "benchmark: no profile finished")
    failed = [r for r in results if r["status"] != Status.OK]
    if outputs.noise_note(results):
        print(outputs.noise_note(results))
    print(f"benchmark: {len(results) - len(failed)} of {len(results)} cells ok; wrote {paths.csv}, {paths.json}, "
          f"{paths.plot}")
    if interrupted:
        raise interrupted
    return 1 if failed else 0


def new_cell_row(job: Job, run: CellRun) -> dict:
    """The cell's row before it runs: its sizes and the analytic prediction."""
    par, args = run.par, job.task
    row = outputs.new_row(args.kind, run.cell, par, run.args, run.rows * par.dp, estimate=args.estimate)
    try:  # a missing prediction must not lose the measurement
        device = "cpu" if args.estimate else resolve_device(job.launch)
        pred = memory.predict_memory(model_config(run.args), par, device=device, routing=args.routing, **run.sizes)
        row["predicted_mib"] = pred.peak_bytes / outputs.MIB
        row["predicted_mib_per_stage"] = " ".join(f"{b / outputs.MIB:.2f}" for b in pred.per_stage)
    except Exception as e:
        row["reason"] = "no prediction: " + outputs.one_line(e)
    return row


def run_one(job: Job, run: CellRun, row: dict, paths, fake_memo: dict | None = None) -> None:
    """Run one cell and fill its row (status ok / oom / failed / timeout, with the reason); an
    estimate shares `fake_memo` with the sweep's other cells (memory/fake_memo.py)."""
    if job.task.estimate:
        estimate_cell(job, run, row, fake_memo)
    else:
        launch_cell(job, run, row, paths, timeout=job.task.cell_timeout)


def launch_cell(job: Job, run: CellRun, row: dict, paths, *, timeout: float | None = None) -> None:
    """The cell's torchrun job: the sweep's job narrowed to this cell (cells.cell_job), with where to put
    the result; killed after `timeout` seconds (recorded as timed out). Its log never replaces an earlier run's."""
    cell, par = run.cell, run.par
    with new_file(os.path.join(paths.logs, f"{cell.mode}_{cell.swept}{cell.value}.log")) as log_file, \
            tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        profile_dir = cell_dir(paths.csv, cell) if row["kind"] == Kind.PROFILE else None
        code = launcher.run_job(cell_job(job, run, report=result_path, profile_dir=profile_dir),
                                log=log_file.tmp, timeout=timeout)
        result = None
        if os.path.exists(result_path):
            with open(result_path) as f:
                result = json.load(f)
    log = log_file.path
    if code == launcher.TIMED_OUT:
        row["status"], row["reason"] = Status.TIMEOUT, f"ranks killed after --cell_timeout {timeout:g} s (log: {log})"
        return
    if code != 0 or result is None:
        row["status"], row["reason"] = outputs.failure_from_log(log, code)
        return
    row["step_ms"], row["tokens_per_s"] = result["step_ms"], result["tokens_per_s"]
    row["step_ms_min"], row["step_ms_max"] = result.get("step_ms_min"), result.get("step_ms_max")  # profile: none
    if result["peak_bytes"] is not None:
        outputs.fill_memory(row, result["peak_bytes"], result["breakdown"])
    row["tokens_per_expert"] = outputs.routing_text(result.get("tokens_per_expert") or {})
    row["routing_per_microbatch"] = outputs.routing_json(result.get("routing_per_microbatch") or [])
    if par.pp > 1:
        fill_pipeline(row, result, par)


def fill_pipeline(row: dict, result: dict, par) -> None:
    """Per stage (worst rank of each): peak MiB, microbatches of activations held, measured idle
    share (wall time not spent in forward/backward compute: the bubble plus p2p), beside the
    bubble of equal stages (P-1)/(M+P-1); interleaved (P-1)/(VM+P-1); zb (P-1)/(3M+P-1)."""
    stages = [[r for r in result["per_rank"] if r["pp_rank"] == p] for p in range(par.pp)]
    peaks = [max((r["peak_bytes"] or 0) for r in ranks) / outputs.MIB for ranks in stages]
    row["peak_mib_per_stage"] = " ".join(f"{m:.2f}" for m in peaks) if result["peak_bytes"] is not None else None
    row["in_flight_per_stage"] = " ".join(str(max(r["max_in_flight"] for r in ranks)) for ranks in stages)
    row["idle_pct_per_stage"] = " ".join(f"{100 * max(r['idle'] for r in ranks):.1f}" for ranks in stages)
    row["bubble_pct"] = 100 * bubble_fraction(par.pp, row["num_microbatches"], row["pp_schedule"], par.virtual_stages)
