"""The benchmark driver: the sweep it plans, the input it refuses before launching anything, the
rows it writes per cell (a failing cell recorded, the sweep going on), one real run under
torchrun, and an --estimate run that launches nothing."""
import csv
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from minimind_parallel import MiniMindConfig, ParallelConfig, cli, files, launcher, tasks
from minimind_parallel.job import read_job
from minimind_parallel.memory import predict_memory
from minimind_parallel.options import MODES
from minimind_parallel.tasks import validate
from minimind_parallel.tasks.benchmark import outputs as outputs_module
from minimind_parallel.tasks.benchmark.cells import cell_args, cell_parallel, job_run, rows_per_replica, sweep_cells
from minimind_parallel.tasks.benchmark.checks import check_benchmark
from minimind_parallel.tasks.benchmark.profile import cell_dir
from test_cli import assert_refused_before_launch

TINY = ["--hidden_size", "64", "--num_attention_heads", "4", "--num_key_value_heads", "2", "--vocab_size", "128",
        "--seq_len", "16", "--warmup_iters", "1", "--benchmark_iters", "2"]

SEED_COMMAND = ("benchmark --kind memory --tp_size 2 --pp_size 1 -- --modes ddp tp --batch_policy fixed_per_rank "
                "--num_hidden_layers 8 16 32 64 --seq_len 2048 --hidden_size 768 --num_attention_heads 8 "
                "--num_key_value_heads 4 --vocab_size 6400 --micro_batch_size 2 --num_microbatches 1 "
                "--dtype bfloat16 --warmup_iters 2 --benchmark_iters 5 --sequence_parallel").split()


def outputs(tmp_path):
    return ["--output_csv", str(tmp_path / "b.csv"), "--output_json", str(tmp_path / "b.json"),
            "--output_plot", str(tmp_path / "b.png")]


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------- the sweep

def test_the_seed_command_sweeps_layers_for_each_mode_value_by_value():
    job = cli.resolve(SEED_COMMAND)
    kind = job.task.kind
    cells = [run.cell for run in check_benchmark(job)]
    assert kind == "memory"
    assert [(c.mode, c.num_hidden_layers) for c in cells] == [
        ("ddp", 8), ("tp", 8), ("ddp", 16), ("tp", 16), ("ddp", 32), ("tp", 32), ("ddp", 64), ("tp", 64)]
    assert {c.seq_len for c in cells} == {2048} and {c.swept for c in cells} == {"num_hidden_layers"}


def test_tp_flags_apply_to_the_tp_modes_and_ddp_uses_the_same_ranks_for_data_parallelism():
    job = cli.resolve(SEED_COMMAND + ["--async_communication"])
    launch, args = job.launch, job.task
    ddp, tp = sweep_cells(args)[:2]
    ddp_args, tp_args = cell_args(args, ddp), cell_args(args, tp)
    assert not ddp_args.sequence_parallel and not ddp_args.async_communication
    assert tp_args.sequence_parallel and tp_args.async_communication
    ddp_par, tp_par = cell_parallel(launch, ddp_args, "ddp"), cell_parallel(launch, tp_args, "tp")
    assert (ddp_par.dp, ddp_par.tp) == (2, 1) and (tp_par.dp, tp_par.tp) == (1, 2)
    assert ddp_par.world_size == tp_par.world_size == 2


def test_a_preset_turns_its_flags_on():
    args = cli.resolve(["benchmark", "--tp_size", "2", "--", "--modes", "tp", "tp_sp_async_vp"]).task
    tp, full = (cell_args(args, c) for c in sweep_cells(args))
    assert not (tp.sequence_parallel or tp.async_communication or tp.vocab_parallel)
    assert full.sequence_parallel and full.async_communication and full.vocab_parallel


# ---------------------------------------------------------------- the presets: what each mode's name says

MODE_SIZES = [  # launcher sizes -> the modes without extra flags that run on them (ddp on any)
    ([], ["ddp"]),
    (["--tp_size", "2"], ["ddp", "tp"]),
    (["--pp_size", "2"], ["ddp", "pp"]),
    (["--tp_size", "2", "--pp_size", "2"], ["ddp", "tp_pp"]),
    (["--cp", "--cp_size", "2"], ["ddp", "cp"]),
    (["--tp_size", "2", "--cp", "--cp_size", "2"], ["ddp", "tp_cp"]),
    (["--pp_size", "2", "--cp", "--cp_size", "2"], ["ddp", "pp_cp"]),
    (["--tp_size", "2", "--pp_size", "2", "--cp", "--cp_size", "2"], ["ddp", "tp_cp_pp"]),
]


@pytest.mark.parametrize("sizes,modes", MODE_SIZES, ids=[" ".join(s) or "one rank" for s, _ in MODE_SIZES])
def test_each_layout_mode_runs_on_the_sizes_its_name_says_and_no_other(sizes, modes):
    base = ["ddp", "tp", "pp", "tp_pp", "cp", "tp_cp", "pp_cp", "tp_cp_pp"]
    launch, _ = cli.parse(["benchmark", *sizes, "--"])
    assert [m for m in base if MODES[m].mismatch(launch) is None] == modes
    for mode in modes:  # its layout is the launcher's sizes; ddp spends the same ranks on data parallelism
        args = cli.resolve(["benchmark", *sizes, "--", "--modes", mode]).task
        par = cell_parallel(launch, cell_args(args, sweep_cells(args)[0]), mode)
        world = launch.tp_size * launch.pp_size * launch.cp_size
        expected = (1, 1, 1, world) if mode == "ddp" else (launch.tp_size, launch.pp_size, launch.cp_size, 1)
        assert (par.tp, par.pp, par.cp, par.dp) == expected


PRESET_MISMATCHES = [
    (["--pp_size", "2", "--tp_size", "2", "--", "--modes", "pp"],
     "mode pp is not tensor-parallel and needs --tp_size 1; got --tp_size 2 (the modes of these sizes: ddp, tp_pp)"),
    (["--", "--modes", "pp"], "mode pp is pipeline-parallel and needs --pp_size > 1; got --pp_size 1"),
    (["--", "--modes", "tp"], "mode tp is tensor-parallel and needs --tp_size > 1; got --tp_size 1"),
    (["--tp_size", "2", "--pp_size", "2", "--", "--modes", "ddp", "tp_sp"],
     "mode tp_sp is not pipeline-parallel and needs --pp_size 1; got --pp_size 2"),
    (["--tp_size", "2", "--cp", "--cp_size", "2", "--", "--modes", "tp", "--estimate"],
     "mode tp is not context-parallel and needs --cp_size 1; got --cp_size 2 (the modes of these sizes: ddp, tp_cp)"),
    (["--cp", "--", "--modes", "cp", "--estimate"], "mode cp is context-parallel and needs --cp_size > 1"),
]


@pytest.mark.parametrize("argv,message", PRESET_MISMATCHES, ids=[m for _, m in PRESET_MISMATCHES])
def test_a_mode_that_is_not_the_launchers_sizes_is_one_line_before_launch(argv, message, monkeypatch, capsys):
    assert_refused_before_launch(["benchmark", *argv], message, monkeypatch, capsys)


def test_validate_checks_its_mode_against_the_sizes_too(monkeypatch, capsys):
    assert_refused_before_launch(["validate", "--pp_size", "2", "--", "--mode", "tp_pp"],
                                 "mode tp_pp is tensor-parallel and needs --tp_size > 1", monkeypatch, capsys)
    job = cli.resolve(["validate", "--tp_size", "2", "--", "--mode", "ddp", "--sequence_parallel"])
    validate.check(job)  # ddp: the two ranks are data-parallel replicas, the TP flags off
    par = job.parallel
    assert (par.tp, par.dp, par.sequence_parallel) == (1, 2, False)


def test_a_mode_without_tensor_parallelism_turns_the_tp_flags_off_as_ddp_does():
    job = cli.resolve(["benchmark", "--pp_size", "2", "--", "--modes", "ddp", "pp", "--sequence_parallel",
                       "--vocab_parallel", "--recompute", "selective"])
    assert job.task.kind == "memory"
    runs = check_benchmark(job)  # before, pp kept --sequence_parallel on one TP rank: refused
    for run in runs:
        assert not (run.par.sequence_parallel or run.par.vocab_parallel) and run.par.recompute == "selective"
    assert [(r.par.pp, r.par.dp) for r in runs] == [(1, 2), (2, 1)]


def test_seq_len_can_be_the_swept_dimension():
    _, args = cli.parse(["benchmark", "--tp_size", "2", "--", "--modes", "tp", "--seq_len", "512", "1024",
                         "--num_hidden_layers", "4"])
    cells = sweep_cells(args)
    assert [(c.seq_len, c.num_hidden_layers, c.swept) for c in cells] == [(512, 4, "seq_len"), (1024, 4, "seq_len")]


def test_batch_policies():
    job = cli.resolve(["benchmark", "--tp_size", "2", "--", "--modes", "ddp", "tp", "--micro_batch_size", "4"])
    launch, args = job.launch, job.task
    ddp, tp = (cell_parallel(launch, cell_args(args, c), c.mode) for c in sweep_cells(args))
    # fixed_per_rank: every replica gets micro_batch_size rows, so ddp's global batch is world x larger
    assert [rows_per_replica("memory", args, p, launch) for p in (ddp, tp)] == [4, 4]
    # fixed_global (always for throughput): the same global batch in every mode
    assert [rows_per_replica("throughput", args, p, launch) for p in (ddp, tp)] == [2, 4]


def test_kind_is_only_for_the_benchmark(monkeypatch, capsys):
    monkeypatch.setattr(launcher, "run_torchrun", lambda *a, **k: pytest.fail("launched"))
    assert cli.main(["validate", "--kind", "memory", "--"]) == 2
    assert "--kind is a benchmark option" in capsys.readouterr().err


# ---------------------------------------------------------------- rows per cell, failures recorded

def fake_torchrun(oom_cell, hung_cell=None, times=None):
    """Stands in for the ranks: writes the result file the worker would, or a log of a rank that ran
    out of memory, or returns what run_torchrun returns after killing hung ranks. `times`: cell name ->
    (fastest, median, slowest) step ms (default: 10 ms per layer, no spread given)."""
    calls = []

    def run(launch, world, worker_argv, *, async_communication=False, timeout=None, log=None):
        (job_file,) = worker_argv
        job = read_job(job_file, lambda name: tasks.get(name).parser())
        cell, result_json = job_run(job).cell, job.report
        calls.append((cell.name, world, async_communication, timeout))
        if cell.name == hung_cell:
            return launcher.TIMED_OUT
        if cell.name == oom_cell:
            with open(log, "w") as f:
                f.write("Traceback (most recent call last):\n[rank1]: torch.OutOfMemoryError: CUDA out of memory.\n")
            return 1
        spread = {}
        if times is not None:
            fastest, median, slowest = times[cell.name]
            spread = {"step_ms": median, "step_ms_min": fastest, "step_ms_max": slowest}
        with open(result_json, "w") as f:
            json.dump({"step_ms": 10.0 * cell.num_hidden_layers, "tokens_per_s": 1.0, "peak_bytes": 2**20 *
                       (100 if cell.mode == "ddp" else 60) * cell.num_hidden_layers,
                       "breakdown": {"params": 2**20, "activations": 2**21}, **spread}, f)
        return 0
    return run, calls


def test_a_hung_cell_is_recorded_as_timed_out_and_the_sweep_goes_on(monkeypatch, tmp_path):
    run, calls = fake_torchrun(oom_cell=None, hung_cell="tp:1")
    monkeypatch.setattr(launcher, "run_torchrun", run)
    assert cli.main(["benchmark", "--tp_size", "2", "--", "--modes", "tp", "ddp", "--num_hidden_layers", "1", *TINY,
                     "--cell_timeout", "30", *outputs(tmp_path)]) == 1
    rows = read_csv(tmp_path / "b.csv")
    assert [(r["mode"], r["status"]) for r in rows] == [("tp", "timeout"), ("ddp", "ok")]
    assert "--cell_timeout 30 s" in rows[0]["reason"] and {c[3] for c in calls} == {30.0}


def test_run_torchrun_kills_every_rank_at_the_timeout(monkeypatch, tmp_path):
    """The launcher and the processes it started (the ranks) all go; nothing is left running."""
    pid_file = tmp_path / "grandchild.pid"
    child = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
             f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(600)")
    monkeypatch.setattr(launcher, "torchrun_command", lambda *a: [sys.executable, "-c", child])
    launch, _ = cli.parse(["benchmark", "--device", "cpu", "--"])
    assert launcher.run_torchrun(launch, 1, [], timeout=3, log=str(tmp_path / "log")) == launcher.TIMED_OUT
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # reaped by init once killed
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"rank process {grandchild} survived the timeout")


def test_every_cell_gets_a_row_and_a_failed_cell_does_not_stop_the_sweep(monkeypatch, tmp_path, capsys):
    run, calls = fake_torchrun(oom_cell="tp_sp_async:2")
    monkeypatch.setattr(launcher, "run_torchrun", run)
    code = cli.main(["benchmark", "--tp_size", "2", "--", "--modes", "ddp", "tp_sp_async", "--num_hidden_layers",
                     "1", "2", "3", *TINY, *outputs(tmp_path)])
    assert code == 1  # not every cell succeeded
    assert [c[:3] for c in calls] == [("ddp:1", 2, False), ("tp_sp_async:1", 2, True), ("ddp:2", 2, False),
                                      ("tp_sp_async:2", 2, True), ("ddp:3", 2, False), ("tp_sp_async:3", 2, True)]
    rows = read_csv(tmp_path / "b.csv")
    assert [(r["mode"], r["value"], r["status"]) for r in rows] == [
        ("ddp", "1", "ok"), ("tp_sp_async", "1", "ok"), ("ddp", "2", "ok"), ("tp_sp_async", "2", "oom"),
        ("ddp", "3", "ok"), ("tp_sp_async", "3", "ok")]
    assert "OutOfMemoryError" in rows[3]["reason"] and rows[3]["peak_mib"] == ""
    assert float(rows[5]["peak_mib"]) == 180 and float(rows[5]["delta_peak_mib"]) == -120
    assert rows[5]["vs_mode"] == "ddp" and float(rows[5]["delta_peak_pct"]) == -40
    data = json.load(open(tmp_path / "b.json"))
    assert len(data["rows"]) == 6 and data["rows"][3]["status"] == "oom"
    assert (tmp_path / "b.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "vs ddp: -120.00 MiB (-40.0%), time +0.0%" in out and "oom: torch.OutOfMemoryError" in out


def test_a_time_difference_within_the_cells_spread_is_marked_as_noise(monkeypatch, tmp_path, capsys):
    """At 1 layer tp is 40 ms faster than ddp and every tp iteration is faster than every ddp one (its
    own spread of 50 ms notwithstanding): a difference. At 2 layers tp is 20 ms slower, but its
    iterations lie inside ddp's (70-130 ms): the +20% is marked, and named at the end."""
    run, _ = fake_torchrun(oom_cell=None, times={"ddp:1": (95, 100, 105), "tp:1": (40, 60, 90),
                                                 "ddp:2": (70, 100, 130), "tp:2": (115, 120, 125)})
    monkeypatch.setattr(launcher, "run_torchrun", run)
    assert cli.main(["benchmark", "--tp_size", "2", "--", "--modes", "ddp", "tp", "--num_hidden_layers", "1", "2",
                     *TINY, *outputs(tmp_path)]) == 0
    rows = read_csv(tmp_path / "b.csv")
    assert list(rows[0])[-5:] == ["step_ms_min", "step_ms_max", "delta_step_within_spread",  # added at the end
                                  "tokens_per_expert", "routing_per_microbatch"]
    assert [(r["step_ms_min"], r["step_ms"], r["step_ms_max"]) for r in rows] == [
        ("95", "100", "105"), ("40", "60", "90"), ("70", "100", "130"), ("115", "120", "125")]
    assert [r["delta_step_within_spread"] for r in rows] == ["", "False", "", "True"]
    assert json.loads((tmp_path / "b.json").read_text())["rows"][3]["delta_step_within_spread"] is True
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("tp ")]
    assert "time -40.0%" in lines[0] and "within spread" not in lines[0] and "40.00-90.00" in lines[0]
    assert "time +20.0% (within spread)" in lines[1]
    assert "benchmark: 1 time difference(s) within the step-time spread" in out and ": tp:2;" in out


def png_width(path) -> int:
    with open(path, "rb") as f:
        return int.from_bytes(f.read(24)[16:20], "big")   # the IHDR chunk's width


def test_the_plot_leaves_out_the_step_time_panel_when_nothing_was_timed(monkeypatch, tmp_path):
    run, _ = fake_torchrun(oom_cell=None, times={"tp:1": (9, 10, 12)})
    monkeypatch.setattr(launcher, "run_torchrun", run)
    sweep = ["benchmark", "--tp_size", "2", "--", "--modes", "tp", "--num_hidden_layers", "1", *TINY]
    assert cli.main([*sweep, *outputs(tmp_path / "timed")]) == 0
    assert cli.main([*sweep, "--estimate", *outputs(tmp_path / "estimated")]) == 0
    timed, estimated = png_width(tmp_path / "timed" / "b.png"), png_width(tmp_path / "estimated" / "b.png")
    assert estimated < 0.6 * timed     # one panel (memory) beside two (memory, step time)


def test_rows_are_written_as_each_cell_finishes(monkeypatch, tmp_path):
    run, _ = fake_torchrun(oom_cell=None)
    seen = []

    def run_and_look(*a, **k):
        path = tmp_path / "b.csv"
        seen.append(len(read_csv(path)) if path.exists() else 0)
        return run(*a, **k)
    monkeypatch.setattr(launcher, "run_torchrun", run_and_look)
    assert cli.main(["benchmark", "--tp_size", "2", "--", "--modes", "tp", "--num_hidden_layers", "1", "2", "3",
                     *TINY, *outputs(tmp_path)]) == 0
    assert seen == [0, 1, 2]


def test_relative_outputs_in_a_directory_not_made_yet_are_written_there(monkeypatch, tmp_path):
    """The README's quick start on a fresh clone: `--output_csv results/x.csv` with no results/ yet."""
    run, _ = fake_torchrun(oom_cell=None)
    monkeypatch.setattr(launcher, "run_torchrun", run)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["benchmark", "--tp_size", "2", "--", "--modes", "tp", "--num_hidden_layers", "1", *TINY,
                     "--output_csv", "results/quickstart.csv"]) == 0
    assert len(read_csv(tmp_path / "results" / "quickstart.csv")) == 1


@pytest.mark.parametrize("option", ["--output_csv", "--output_json", "--output_plot"])
def test_an_output_where_nothing_can_be_created_is_one_line_before_launch(option, tmp_path, monkeypatch, capsys):
    """/proc refuses new files even to root, whom every permission check lets through."""
    paths = {"--output_csv": tmp_path / "b.csv", "--output_json": tmp_path / "b.json", "--output_plot": tmp_path / "b.png"}
    paths[option] = "/proc/benchmark/b" + os.path.splitext(paths[option])[1]
    argv = ["benchmark", "--tp_size", "2", "--", "--modes", "tp", "--num_hidden_layers", "1", *TINY,
            *[str(x) for pair in paths.items() for x in pair]]
    assert_refused_before_launch(argv, f"cannot write {option}: nothing can be created in directory /proc (",
                                 monkeypatch, capsys)
    assert not os.listdir(tmp_path)


# ---------------------------------------------------------------- real runs

def test_estimate_runs_in_process_and_launches_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher, "run_torchrun", lambda *a, **k: pytest.fail("--estimate launched ranks"))
    assert cli.main(["benchmark", "--tp_size", "2", "--", "--modes", "ddp", "tp_sp_async", "--num_hidden_layers", "1",
                     *TINY, "--seq_len", "16", "32", "--estimate", *outputs(tmp_path)]) == 0
    rows = read_csv(tmp_path / "b.csv")
    assert [(r["mode"], r["swept"], r["value"]) for r in rows] == [
        ("ddp", "seq_len", "16"), ("tp_sp_async", "seq_len", "16"), ("ddp", "seq_len", "32"),
        ("tp_sp_async", "seq_len", "32")]
    assert {r["status"] for r in rows} == {"ok"} and {r["estimate"] for r in rows} == {"True"}
    assert all(float(r["peak_mib"]) > 0 for r in rows)
    assert {r["step_ms"] for r in rows} == {""}  # nothing ran, nothing timed


def test_an_estimated_pipeline_cell_has_every_stage_measured_and_predicted(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(launcher, "run_torchrun", lambda *a, **k: pytest.fail("--estimate launched ranks"))
    assert cli.main(["benchmark", "--pp_size", "2", "--", "--modes", "pp", "--pp_schedule", "gpipe",
                     "--num_microbatches", "3", "--num_hidden_layers", "2", *TINY, "--estimate", *outputs(tmp_path)]) == 0
    row = read_csv(tmp_path / "b.csv")[0]
    stages = row["peak_mib_per_stage"].split()
    assert len(stages) == 2 and stages == row["predicted_mib_per_stage"].split()
    assert float(row["peak_mib"]) == float(row["predicted_mib"]) == pytest.approx(max(map(float, stages)), abs=0.005)
    assert "(predicted " in capsys.readouterr().out


def test_an_estimated_moe_cell_follows_the_given_routing_and_equals_the_prediction(monkeypatch, tmp_path):
    """--routing FILE: the estimate's fake dispatch routes by the histogram (every EP rank's, the
    worst), equal to the prediction for it to the byte, above the balanced one, and says so."""
    monkeypatch.setattr(launcher, "run_torchrun", lambda *a, **k: pytest.fail("--estimate launched ranks"))
    histogram = {"model.layers.0.mlp": [100, 60, 50, 46], "model.layers.1.mlp": [10, 20, 200, 26]}
    (tmp_path / "routing.json").write_text(json.dumps(histogram))
    model = ["--num_hidden_layers", "2", "--hidden_size", "64", "--num_attention_heads", "4", "--num_key_value_heads",
             "2", "--vocab_size", "128", "--num_experts", "4", "--num_experts_per_tok", "2",
             "--moe_intermediate_size", "256", "--seq_len", "32", "--micro_batch_size", "2", "--dtype", "float32"]
    assert cli.main(["benchmark", "--dp_size", "2", "--ep_size", "2", "--", "--modes", "ep", *model, "--routing",
                     str(tmp_path / "routing.json"), "--estimate", *outputs(tmp_path)]) == 0
    row = json.loads((tmp_path / "b.json").read_text())["rows"][0]
    assert row["status"] == "ok" and row["peak_mib"] == row["predicted_mib"], row
    assert row["tokens_per_expert"].startswith("the given histogram"), row["tokens_per_expert"]
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=128, use_moe=True, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=256)
    balanced = predict_memory(config, ParallelConfig(dp=2, ep=2), seq_len=32, micro_batch_size=2, dtype=torch.float32)
    assert row["peak_mib"] > balanced.mib(), (row["peak_mib"], balanced.mib())


def test_an_estimated_moe_cell_follows_a_routing_per_microbatch_and_equals_the_prediction(monkeypatch, tmp_path,
                                                                                         capsys):
    """--routing FILE holding a list of histograms, one per microbatch (ep_pp, M 2): the estimate
    routes each microbatch by its own, equal to the prediction for the list to the byte on every
    stage; a list of another length is refused in one line before launch."""
    monkeypatch.setattr(launcher, "run_torchrun", lambda *a, **k: pytest.fail("--estimate launched ranks"))
    each = [{"model.layers.0.mlp": [100, 60, 50, 46], "model.layers.1.mlp": [10, 20, 200, 26]},
            {"model.layers.0.mlp": [10, 10, 200, 36], "model.layers.1.mlp": [180, 50, 10, 16]}]
    (tmp_path / "routing.json").write_text(json.dumps(each))
    model = ["--num_hidden_layers", "2", "--hidden_size", "64", "--num_attention_heads", "4", "--num_key_value_heads",
             "2", "--vocab_size", "128", "--num_experts", "4", "--num_experts_per_tok", "2",
             "--moe_intermediate_size", "256", "--seq_len", "32", "--micro_batch_size", "2", "--dtype", "float32",
             "--num_microbatches", "2"]
    launch = ["benchmark", "--dp_size", "2", "--pp_size", "2", "--ep_size", "2", "--", "--modes", "ep_pp", *model]
    assert cli.main([*launch, "--routing", str(tmp_path / "routing.json"), "--estimate", *outputs(tmp_path)]) == 0
    row = json.loads((tmp_path / "b.json").read_text())["rows"][0]
    assert row["status"] == "ok" and row["peak_mib"] == row["predicted_mib"], row
    assert row["peak_mib_per_stage"] == row["predicted_mib_per_stage"], row
    assert row["tokens_per_expert"].startswith("the given histograms, one per microbatch"), row["tokens_per_expert"]
    (tmp_path / "three.json").write_text(json.dumps(each + each[:1]))
    capsys.readouterr()
    assert cli.main([*launch, "--routing", str(tmp_path / "three.json"), *outputs(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == ["error: --routing, cell ep_pp:2: routing histograms: one per microbatch, "
                                "num_microbatches=2; got 3"], err


def test_every_row_carries_the_analytic_prediction_and_the_deviation(monkeypatch, tmp_path):
    """Each row's prediction is predict_memory of that row's own cell (its mode, its depth; the
    four cells' predictions all differ), written out here from the command line's values."""
    run, _ = fake_torchrun(oom_cell=None)
    monkeypatch.setattr(launcher, "run_torchrun", run)
    assert cli.main(["benchmark", "--tp_size", "2", "--", "--modes", "ddp", "tp", "--num_hidden_layers", "1", "2",
                     *TINY, *outputs(tmp_path)]) == 0
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [(r["mode"], r["value"]) for r in rows] == [("ddp", 1), ("tp", 1), ("ddp", 2), ("tp", 2)]
    for r in rows:
        config = MiniMindConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                num_hidden_layers=r["value"], tie_word_embeddings=False)
        par = ParallelConfig(dp=2) if r["mode"] == "ddp" else ParallelConfig(tp=2)
        want = predict_memory(config, par, seq_len=16, micro_batch_size=2, dtype=torch.float32, device="cpu")
        assert r["predicted_mib"] == want.peak_bytes / 2**20, (r["mode"], r["value"])
        assert r["deviation_mib"] == pytest.approx(r["peak_mib"] - r["predicted_mib"])
    assert len({r["predicted_mib"] for r in rows}) == len(rows)
    for r in read_csv(tmp_path / "b.csv"):
        assert float(r["deviation_mib"]) == pytest.approx(float(r["peak_mib"]) - float(r["predicted_mib"]), abs=1e-3)


def test_a_real_sweep_under_torchrun_records_an_out_of_memory_cell_and_goes_on(tmp_path):
    r = subprocess.run([sys.executable, "-m", "evaluation.parallel", "benchmark", "--tp_size", "2", "--",
                        "--modes", "tp_sp_async", "ddp", "--num_hidden_layers", "1", *TINY, *outputs(tmp_path),
                        "--inject_oom", "tp_sp_async:1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    rows = read_csv(tmp_path / "b.csv")
    assert [(x["mode"], x["status"]) for x in rows] == [("tp_sp_async", "oom"), ("ddp", "ok")]
    assert "injected out-of-memory" in rows[0]["reason"]
    ddp = rows[1]
    assert float(ddp["step_ms"]) > 0 and float(ddp["tokens_per_s"]) > 0 and float(ddp["peak_mib"]) > 0
    assert ddp["dp"] == "2" and ddp["global_batch"] == "4"  # fixed_per_rank: 2 rows on each of 2 replicas
    assert float(ddp["tokens_per_s"]) == pytest.approx(4 * 16 / (float(ddp["step_ms"]) / 1e3))
    assert 0 < float(ddp["step_ms_min"]) <= float(ddp["step_ms"]) <= float(ddp["step_ms_max"])
    assert "ddp" in r.stdout and "1 of 2 cells ok" in r.stdout
    # The real cell's peak is the analytic prediction and the same cell measured without running
    # it (--estimate), to the byte: nothing the harness keeps across its measured steps counts.
    assert cli.main(["benchmark", "--tp_size", "2", "--", "--modes", "ddp", "--num_hidden_layers", "1", *TINY,
                     "--estimate", "--output_csv", str(tmp_path / "e.csv")]) == 0
    real = json.loads((tmp_path / "b.json").read_text())["rows"][1]
    estimate = json.loads((tmp_path / "e.json").read_text())["rows"][0]
    assert real["peak_mib"] == real["predicted_mib"] == estimate["peak_mib"] and real["deviation_mib"] == 0


# ---------------------------------------------------------------- results: this run's, complete, never lost

KILLED_RANK_LOG = """\
[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
minimind_parallel.worker FAILED
------------------------------------------------------------
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 11)
  error_file: /tmp/torchelastic_x/0/error.json
  traceback : RuntimeError: Connection closed by peer
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 12
============================================================
"""


def test_a_killed_ranks_row_names_the_rank_that_died_not_its_peers_error(tmp_path):
    log = tmp_path / "cell.log"
    log.write_text(KILLED_RANK_LOG)
    status, reason = outputs_module.failure_from_log(str(log), 1)
    assert (status, reason) == ("failed", f"rank 1 was killed by SIGKILL (log: {log})")


def test_a_cpu_allocation_failure_is_recorded_as_out_of_memory(tmp_path):
    error = ("RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
             "you tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)")
    log = tmp_path / "cell.log"
    log.write_text(f"Traceback (most recent call last):\n[rank0]: {error}\n")
    assert outputs_module.failure_from_log(str(log), 1)[0] == "oom"
    row = {}
    outputs_module.fail(row, RuntimeError(error.removeprefix("RuntimeError: ")))
    assert row["status"] == "oom"
    outputs_module.fail(row, RuntimeError("shapes cannot be multiplied"))
    assert row["status"] == "failed"


def test_a_real_cell_whose_rank_is_killed_names_that_rank(tmp_path):
    r = subprocess.run([sys.executable, "-m", "evaluation.parallel", "benchmark", "--tp_size", "2",
                        "--inject_fault", "kill:1", "--", "--modes", "tp", "--num_hidden_layers", "1", *TINY,
                        *outputs(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    row = read_csv(tmp_path / "b.csv")[0]
    assert row["status"] == "failed" and row["reason"].startswith("rank 1 was killed by SIGKILL"), row["reason"]


def test_two_runs_started_in_the_same_second_write_different_files(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(outputs_module.secrets, "token_hex", lambda n: "beef")  # the worst case: same draw
    _, args = cli.parse(["benchmark", "--"])
    first = outputs_module.claim_paths(args, "memory")
    drawn = iter(["beef", "cafe"])
    monkeypatch.setattr(outputs_module.secrets, "token_hex", lambda n: next(drawn))
    second = outputs_module.claim_paths(args, "memory")
    assert first.csv != second.csv and first.logs != second.logs
    assert second.csv.endswith("_cafe.csv")


def test_csv_keeps_enough_digits_to_recompute_tokens_per_second(tmp_path):
    row = dict.fromkeys(outputs_module.COLUMNS)
    row.update(step_ms=12.345678912345, tokens_per_s=64 / 0.012345678912345)
    outputs_module.write_csv(str(tmp_path / "b.csv"), [row])
    back = read_csv(tmp_path / "b.csv")[0]
    assert float(back["tokens_per_s"]) == pytest.approx(64 / (float(back["step_ms"]) / 1e3), rel=1e-9)
    assert os.listdir(tmp_path) == ["b.csv"]  # the temporary file went


def test_concurrent_writers_of_one_file_use_their_own_temporary_files(tmp_path):
    target = str(tmp_path / "b.json")
    with files.atomic_path(target) as a, files.atomic_path(target) as b:
        assert a != b and os.path.dirname(a) == os.path.dirname(b) == str(tmp_path)
        open(a, "w").write("first")
        open(b, "w").write("second")
    assert open(target).read() == "first"  # the outer block ends last
    assert os.listdir(tmp_path) == ["b.json"]


def test_a_second_run_over_the_same_outputs_keeps_the_first_runs_logs(monkeypatch, tmp_path):
    run, _ = fake_torchrun(oom_cell="tp:1")
    monkeypatch.setattr(launcher, "run_torchrun", run)
    argv = ["benchmark", "--tp_size", "2", "--", "--modes", "tp", "--num_hidden_layers", "1", *TINY,
            *outputs(tmp_path)]
    assert cli.main(argv) == 1
    assert cli.main(argv) == 2  # refused: the first run's results are there
    assert cli.main([*argv, "--overwrite"]) == 1
    logs = sorted(os.listdir(tmp_path / "b_logs"))
    assert logs == ["tp_num_hidden_layers1.1.log", "tp_num_hidden_layers1.log"]
    reasons = [r["reason"] for r in read_csv(tmp_path / "b.csv")]
    assert reasons[0].endswith(f"(log: {tmp_path / 'b_logs' / 'tp_num_hidden_layers1.1.log'})")


def test_a_failed_profile_cell_never_reports_an_earlier_runs_profile(monkeypatch, tmp_path, capsys):
    _, args = cli.parse(["benchmark", "--tp_size", "2", "--", "--modes", "tp", "--num_hidden_layers", "1", *TINY,
                         *outputs(tmp_path)])
    stale = os.path.join(cell_dir(str(tmp_path / "b.csv"), sweep_cells(args)[0]), "report.json")
    os.makedirs(os.path.dirname(stale))
    with open(stale, "w") as f:
        json.dump({"summary": {"step_ms": 1.0}, "ranks": []}, f)  # an earlier run's
    monkeypatch.setattr(launcher, "run_torchrun", lambda *a, **k: 1)  # this run's cell fails
    assert cli.main(["benchmark", "--kind", "profile", "--tp_size", "2", "--", "--modes", "tp",
                     "--num_hidden_layers", "1", *TINY, *outputs(tmp_path)]) == 1
    assert "benchmark: no profile finished" in capsys.readouterr().out
    assert read_csv(tmp_path / "b.csv")[0]["step_ms"] == ""
