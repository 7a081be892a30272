"""Two nodes on this one machine: two launchers, `--nnodes 2 --node_rank 0/1 --master_addr
127.0.0.1` and a free port, each starting its node's ranks, meeting in one rendezvous
(docs/multinode.md). validate, train (saved, then resumed), generate and a benchmark cell end with
exit 0 on both nodes, and give what one node gives; a benchmark sweep is refused before launch."""
import csv
import os
import subprocess
import sys

import pytest

from minimind_parallel import cli
from test_cli import assert_refused_before_launch
from test_failure_behaviour import MARK, TINY, assert_none_left, free_port, mark  # noqa: F401  (mark: the fixture)
from test_train import checkpointed, corpus, data_args, losses, train_in_ranks  # noqa: F401  (fixtures)

PROMPT = "Return the"


def two_nodes(task: str, launcher_args: list[str], task_args, tmp_path, mark: str, timeout: float = 300):
    """Both nodes' launchers of one job -> [node 0's, node 1's] CompletedProcess. `task_args`: a list,
    or a function of the node rank (each node its own outputs)."""
    port = free_port()
    procs, files = [], []
    for node in (1, 0):   # node 1 first: it waits for node 0, as a node started early does
        node_args = task_args(node) if callable(task_args) else task_args
        argv = [sys.executable, "-m", "evaluation.parallel", task, *launcher_args, "--nnodes", "2", "--node_rank",
                str(node), "--master_addr", "127.0.0.1", "--master_port", str(port), "--rdzv_timeout", "120",
                "--", *node_args]
        out, err = open(tmp_path / f"node{node}.out", "w+"), open(tmp_path / f"node{node}.err", "w+")
        files.append((out, err))
        procs.append(subprocess.Popen(argv, env={**os.environ, MARK: mark}, stdout=out, stderr=err, text=True))
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    done = []
    for p, (out, err) in zip(procs, files):
        out.seek(0), err.seek(0)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
        out.close(), err.close()
    assert_none_left(mark)
    return done[::-1]


def assert_both_ok(nodes) -> None:
    for node, r in enumerate(nodes):
        assert r.returncode == 0, f"node {node}: exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"


def test_validate_passes_on_both_nodes(tmp_path, mark):  # noqa: F811
    node0, node1 = two_nodes("validate", ["--tp_size", "2"], [*TINY, "--sequence_parallel"], tmp_path, mark)
    assert_both_ok([node0, node1])
    assert "validate: PASSED (" in node0.stdout
    assert node1.stdout == "validate: PASSED on node 1 of 2 (node 0 prints the report)\n"


def test_train_saves_and_resumes_on_two_nodes_as_on_one(corpus, tmp_path, mark):  # noqa: F811
    flags = dict(dtype="float32", max_steps=4, save_interval=2)
    train_in_ranks(["--dp_size", "2"], data_args(corpus, out_dir=tmp_path / "whole", **flags))
    save_dir = tmp_path / "ckpt"
    first = two_nodes("train", ["--dp_size", "2"], data_args(corpus, save_dir=save_dir, stop_at_step=2, **flags),
                      tmp_path, mark)
    assert_both_ok(first)
    assert sorted(losses(save_dir)) == [1, 2]
    resumed = two_nodes("train", ["--dp_size", "2"], data_args(corpus, save_dir=save_dir, resume=True, **flags),
                        tmp_path, mark)
    assert_both_ok(resumed)
    assert "starting at step 2" in resumed[0].stdout
    got, want = losses(save_dir), losses(tmp_path / "whole")
    assert sorted(got) == [1, 2, 3, 4]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6), step
    assert (save_dir / "step_00000004" / "meta.json").exists()


def test_generate_with_tp2_on_two_nodes_prints_what_one_process_prints(corpus, checkpointed, tmp_path, mark,  # noqa: F811
                                                                      capsys):
    args = ["--checkpoint", str(checkpointed), "--tokenizer_path", str(corpus / "tokenizer"), "--prompt", PROMPT,
            "--max_new_tokens", "8", "--dtype", "float32"]
    assert cli.main(["generate", "--device", "cpu", "--", *args]) == 0   # the dense model, in this process
    dense = capsys.readouterr().out
    assert dense.startswith(PROMPT)
    node0, node1 = two_nodes("generate", ["--tp_size", "2", "--device", "cpu"], args, tmp_path, mark)
    assert_both_ok([node0, node1])
    assert node0.stdout == dense and node1.stdout == ""


def test_a_benchmark_cell_runs_on_two_nodes(tmp_path, mark):  # noqa: F811
    def task_args(node):
        return [*TINY, "--modes", "tp", "--warmup_iters", "0", "--benchmark_iters", "2",
                "--output_csv", str(tmp_path / f"node{node}.csv")]
    nodes = two_nodes("benchmark", ["--tp_size", "2"], task_args, tmp_path, mark)
    assert_both_ok(nodes)
    rows = [list(csv.DictReader(open(tmp_path / f"node{node}.csv"))) for node in (0, 1)]
    assert [[(r["mode"], r["status"]) for r in node_rows] for node_rows in rows] == [[("tp", "ok")]] * 2
    assert float(rows[0][0]["step_ms"]) > 0 and rows[0][0]["step_ms"] == rows[1][0]["step_ms"]  # one measurement


def test_a_benchmark_sweep_on_two_nodes_is_refused_before_launch(monkeypatch, capsys):
    assert_refused_before_launch(
        ["benchmark", "--tp_size", "2", "--nnodes", "2", "--", *TINY, "--modes", "ddp", "tp"],
        "on several nodes a benchmark runs one cell (one rendezvous of every node): give one mode and one value per "
        "command; got --nnodes 2 and 2 cells (ddp:1 tp:1)", monkeypatch, capsys)
    assert_refused_before_launch(["benchmark", "--tp_size", "2", "--nnodes", "2", "--kind", "profile", "--", *TINY],
                                 "--kind profile runs on one node", monkeypatch, capsys)
