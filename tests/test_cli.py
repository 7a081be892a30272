"""The command line: validate end to end under torchrun, bad input refused before launch,
and a rank that raises ending the whole job."""
import argparse
import enum
import json
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
from torch.distributed.run import get_args_parser

from minimind_parallel import cli, launcher, options, tasks
from minimind_parallel.job import TaskOptions, read_job, write_job

TINY = ["--hidden_size", "64", "--num_attention_heads", "4", "--num_key_value_heads", "2", "--vocab_size", "128",
        "--seq_len", "16", "--num_hidden_layers", "2", "--optimizer_steps", "2"]


def run(*argv, timeout=240):
    return subprocess.run([sys.executable, "-m", "evaluation.parallel", *argv], capture_output=True, text=True,
                          timeout=timeout)


def test_validate_passes_end_to_end():
    r = run("validate", "--tp_size", "2", "--pp_size", "1", "--", *TINY, "--dtype", "float32",
            "--sequence_parallel", "--async_communication", "--vocab_parallel")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "validate: PASSED" in r.stdout
    assert "grad model.layers.1.mlp.down_proj.weight" in r.stdout


def test_validate_fails_on_a_perturbed_shard():
    r = run("validate", "--tp_size", "2", "--", *TINY, "--perturb", "model.layers.0.self_attn.o_proj.weight")
    assert r.returncode != 0
    assert "validate: FAILED" in r.stdout
    assert "NO" in r.stdout


def test_a_rank_that_raises_ends_the_job_with_its_error():
    # Rank 1 raises before its first collective, so rank 0 would wait in one forever on its own.
    r = run("validate", "--tp_size", "2", "--inject_fault", "raise:1", "--", *TINY, timeout=120)
    assert r.returncode != 0
    assert "RuntimeError" in r.stderr and "injected fault on rank 1" in r.stderr
    # the last line says what failed where (torchrun's report above it)
    assert r.stderr.strip().splitlines()[-1] == \
        "validate: rank 1 failed: RuntimeError: injected fault on rank 1; every process of the job was ended"


def assert_refused_before_launch(argv, message, monkeypatch, capsys):
    """The launcher answers bad input with exit 2 and one line containing `message`, launching nothing."""
    launched = []
    monkeypatch.setattr(launcher, "run_torchrun", lambda *a, **k: launched.append(a) or 0)
    code = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and not launched
    assert len(err.splitlines()) == 1 and message in err, err


def test_bad_input_from_the_shell_is_one_line():
    r = run("validate", "--tp_size", "2", "--", "--seq_len", "15", "--sequence_parallel", timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: seq_len must be divisible by tp_size with --sequence_parallel; got seq_len=15, tp_size=2"]


def test_launcher_sets_one_cuda_connection_for_async_only(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)  # only what the launcher sets
    assert launcher.launch_env("cuda", True)["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    for device, async_communication in (("cuda", False), ("cpu", True), ("cpu", False)):
        assert "CUDA_DEVICE_MAX_CONNECTIONS" not in launcher.launch_env(device, async_communication), \
            (device, async_communication)


def test_torchrun_launches_world_size_ranks_of_the_worker():
    class L:
        nnodes, node_rank, master_addr, master_port = 1, 0, "127.0.0.1", None
    cmd = launcher.torchrun_command(L, 4, ["validate", "--tp_size", "4"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--nproc_per_node=4" in cmd
    assert cmd[-4:] == ["minimind_parallel.worker", "validate", "--tp_size", "4"]


def parser_of(task: str) -> argparse.ArgumentParser:
    return tasks.get(task).parser()


def test_the_ranks_are_handed_the_resolved_job_not_a_command_line(monkeypatch, tmp_path):
    """The launcher resolves the command once (the preset applied there) and the ranks get one file:
    the job, equal to the launcher's after its JSON round trip, in a directory removed at the end."""
    argv = ["validate", "--tp_size", "2", "--", *TINY, "--mode", "tp_sp_async"]
    handed = []

    def run_torchrun(launch, world, worker_argv, **kwargs):
        (path,) = worker_argv
        handed.append((path, world, kwargs["async_communication"], read_job(path, parser_of)))
        return 1
    monkeypatch.setattr(launcher, "run_torchrun", run_torchrun)
    assert cli.main(argv) == 1
    (path, world, async_communication, job), = handed
    assert path.endswith(".json") and not os.path.exists(path) and world == 2 and async_communication
    assert job.report is not None and job == replace(cli.resolve(argv), report=job.report)
    assert job.argv == tuple(argv)
    assert job.parallel.sequence_parallel and job.task.sequence_parallel and job.parallel.tp == 2
    with pytest.raises(AttributeError, match="frozen"):
        job.task.sequence_parallel = False


class Colour(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


def test_a_jobs_enums_are_written_by_value_and_rebuilt_by_type(tmp_path):
    job = cli.resolve(["benchmark", "--tp_size", "2", "--", "--modes", "tp"])
    job = replace(job, task=job.task.replace(colour=Colour.BLUE, colours=[Colour.RED]))
    path = write_job(job, str(tmp_path / "job.json"))
    with open(path) as f:
        assert json.load(f)["task"]["colour"] == "blue"
    p = argparse.ArgumentParser()
    p.add_argument("--colour", type=Colour)
    p.add_argument("--colours", type=Colour, nargs="+")
    read = read_job(path, lambda task: p)
    assert read.task.colour is Colour.BLUE and read.task.colours == [Colour.RED] and read == job
    assert isinstance(read.task, TaskOptions) and read.parallel == job.parallel and read.launch == job.launch


def test_a_rank_reads_the_task_options_modes_back_as_the_members_the_launcher_resolved(tmp_path):
    """The task parsers take modes as `type=X.parse`: read back with the task's own parser (as
    worker.py does), every mode option is its member again, not its text."""
    job = cli.resolve(["benchmark", "--tp_size", "2", "--", "--modes", "tp", "--recompute", "selective",
                       "--cp_comm_type", "ring", "--pp_schedule", "gpipe"])
    read = read_job(write_job(job, str(tmp_path / "job.json")), lambda name: tasks.get(name).parser())
    for name in ("recompute", "cp_comm_type", "pp_schedule", "kind"):
        resolved, back = getattr(job.task, name), getattr(read.task, name)
        assert isinstance(resolved, enum.Enum) and back is resolved, (name, back)


@pytest.mark.parametrize("nnodes", [1, 2])
def test_the_torchrun_command_parses_under_the_installed_torchrun(nnodes):
    """Every launcher flag is one the installed torchrun knows (CUDA builds users bring may be
    older than the pinned CPU build; an unknown flag ends every job before it starts)."""
    class L:
        node_rank, master_addr, master_port, rdzv_timeout = 0, "127.0.0.1", 29512, 30.0
    L.nnodes = nnodes
    cmd = launcher.torchrun_command(L, 2 * nnodes, ["validate"])
    args = get_args_parser().parse_args(cmd[3:])
    assert (args.nnodes, args.nproc_per_node, args.max_restarts) == (str(nnodes), "2", 0)
    assert launcher.torchrun_accepts("--nnodes") and not launcher.torchrun_accepts("--no_such_option")


# ---------------------------------------------------------------- a new user's first commands

def test_task_help_lists_the_task_arguments_with_their_defaults():
    for argv in (["train", "--help"], ["train", "--tp_size", "2", "--", "--help"]):
        r = run(*argv, timeout=60)
        assert r.returncode == 0 and not r.stderr, r.stderr
        out = r.stdout
        assert out.startswith("usage: python -m evaluation.parallel train [launcher args] -- [task args]"), out
        assert "--data_path" in out and "--tp_size" in out            # the task's and the launcher's
        assert re.search(r"--epochs EPOCHS\s+default: 1\n", out) and re.search(r"--tp_size TP_SIZE\s+default: 1", out)
    r = run("--help", timeout=60)
    assert r.returncode == 0 and "--tp_size" in r.stdout and "--data_path" not in r.stdout


def test_messages_name_the_program_as_it_was_typed_and_hint_where_arguments_go():
    r = subprocess.run([sys.executable, "-m", "minimind_parallel", "train", "--data_path", "d.jsonl", "--",
                        "--tokenizer_path", "t"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: python -m minimind_parallel: unrecognized arguments: --data_path d.jsonl (task arguments go after --: "
        "python -m minimind_parallel train [launcher args] -- --data_path d.jsonl)"]
    assert options.program_name("/usr/lib/python3/site-packages/evaluation/parallel.py") == "python -m evaluation.parallel"
    assert options.program_name("/src/minimind_parallel/__main__.py") == "python -m minimind_parallel"
    assert options.program_name("/usr/local/bin/minimind-parallel") == "minimind-parallel"


def test_launcher_arguments_after_the_separator_get_a_hint(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["/x/evaluation/parallel.py"])
    assert_refused_before_launch(["validate", "--", "--tp_size", "2"], "error: python -m evaluation.parallel validate: "
                                 "unrecognized arguments: --tp_size 2 (launcher arguments go before --: python -m "
                                 "evaluation.parallel validate --tp_size 2 -- [task args])", monkeypatch, capsys)
    assert_refused_before_launch(["validate", "--no_such_flag", "--"],
                                 "unrecognized arguments: --no_such_flag", monkeypatch, capsys)

