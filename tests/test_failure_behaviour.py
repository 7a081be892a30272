"""However a job ends -- it finishes, a rank fails, a peer stops, the cell times out, the rendezvous
never completes, SIGINT or SIGTERM reaches the launcher -- no process of it is left a few seconds
later, and what finished is kept (docs/failure_behaviour.md).

Each test starts the real command line with real gloo ranks, marked by a unique variable in the
environment that every process of the job inherits, and then looks for any process still
carrying the mark."""
import csv
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import datetime

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from minimind_parallel import ParallelConfig, ProcessGroups, cli, memory, processes
from minimind_parallel.job import write_job
from minimind_parallel.tasks.benchmark.cells import cell_job, cell_run, sweep_cells
from test_train import corpus, data_args  # noqa: F401  (corpus: the fixture)

MARK = "MINIMIND_PARALLEL_TEST_MARK"
TINY = ["--hidden_size", "32", "--num_attention_heads", "4", "--num_key_value_heads", "2", "--vocab_size", "64",
        "--seq_len", "8", "--num_hidden_layers", "1"]
# A benchmark cell that runs far longer than any test waits for it (each step is real work).
LONG_CELL = [*TINY, "--modes", "tp", "--warmup_iters", "0", "--benchmark_iters", "1000000"]


def marked(mark: str) -> dict[int, str]:
    """pid -> command line of every live process carrying `mark`."""
    found = {}
    for pid, env in processes_with(MARK, mark).items():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found[pid] = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return found


def processes_with(name: str, value: str) -> dict[int, bytes]:
    needle = f"{name}={value}".encode()
    out = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            out[int(entry)] = env
    return out


def assert_none_left(mark: str, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of the job outlived it: {left}"


def start(*argv, mark: str) -> subprocess.Popen:
    """The launcher in a process group of its own, as a shell runs a foreground job."""
    return subprocess.Popen([sys.executable, "-m", "evaluation.parallel", *argv], env={**os.environ, MARK: mark},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_ranks(mark: str, n: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Until `n` ranks run (torchrun started them), then a moment for them to be inside the task."""
    deadline = time.monotonic() + timeout
    while sum("minimind_parallel.worker" in c and "torch.distributed.run" not in c
              for c in marked(mark).values()) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.1)
    time.sleep(1.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_on_failure(proc: subprocess.Popen, mark: str) -> None:
    """Cleanup for a test whose assertions failed: nothing of it may stay behind."""
    if proc.poll() is None:
        proc.kill()
    processes.kill(marked(mark))


@pytest.fixture
def mark():
    value = uuid.uuid4().hex
    yield value
    processes.kill(marked(value))


# ---------------------------------------------------------------- signals to the launcher

@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_validate_ends_every_rank_and_prints_one_line(signum, mark):
    proc = start("validate", "--tp_size", "2", "--", *TINY, "--optimizer_steps", "1000000", mark=mark)
    wait_for_ranks(mark, 2, proc)
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground process group
    else:
        proc.send_signal(signal.SIGTERM)  # kill, timeout(1), a scheduler: the launcher's pid only
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, out + err
    assert err.strip().splitlines() == [f"validate: interrupted by {signum.name}; every process of the job was ended"]
    assert "PASSED" not in out and "Traceback" not in out + err
    assert_none_left(mark)


def test_sigterm_to_torchrun_ends_the_job_with_one_line(mark):
    """A scheduler may signal torchrun rather than the launcher: torchrun ends at once (it is not
    given SIGTERM to handle), the launcher ends the rest of the job and says what happened."""
    proc = start("validate", "--tp_size", "2", "--", *TINY, "--optimizer_steps", "1000000", mark=mark)
    try:
        wait_for_ranks(mark, 2, proc)
        torchrun = [pid for pid, cmd in marked(mark).items() if "torch.distributed.run" in cmd]
        assert len(torchrun) == 1, marked(mark)
        os.kill(torchrun[0], signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_on_failure(proc, mark)
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    assert err.strip().splitlines() == ["validate: torchrun interrupted by SIGTERM; every process of the job was ended"]
    assert "Traceback" not in out + err
    assert_none_left(mark)



def test_a_ctrl_c_during_the_launchers_fork_is_raised_after_it_not_lost_in_an_after_fork_hook():
    """Ctrl-C landing while the launcher forks torchrun runs the handler inside the parent's
    after-fork hooks, where Python prints and ignores what it raises: the sweep went on and exited
    0. In processes.signals_held the signal is recorded and raised at the block's end."""
    from helpers import sigint_after_the_next_fork
    armed = sigint_after_the_next_fork()
    child = None
    with pytest.raises(processes.Interrupted, match="SIGINT"):
        with processes.signals_raise():
            with processes.signals_held():
                armed[-1] = True   # the fork below signals from its after-fork hook
                child = subprocess.Popen(["true"], preexec_fn=processes.parent_death_signal())
            child.wait()   # not reached: the held SIGINT is raised as the block ends
    assert child is not None and child.wait() == 0


def test_ctrl_c_during_a_sweep_records_the_cell_as_interrupted_and_keeps_finished_rows(mark, tmp_path):
    csv_path = tmp_path / "b.csv"
    proc = start("benchmark", "--tp_size", "2", "--", *TINY, "--modes", "ddp", "tp", "--warmup_iters", "0",
                 "--benchmark_iters", "1", "--output_csv", str(csv_path), mark=mark)
    try:
        deadline = time.monotonic() + 120
        while not (csv_path.exists() and len(list(csv.DictReader(open(csv_path)))) == 1):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # the second cell (tp) is starting or running
        out, err = proc.communicate(timeout=60)
    finally:
        kill_on_failure(proc, mark)
    assert proc.returncode == 130, out + err
    rows = list(csv.DictReader(open(csv_path)))
    assert [(r["mode"], r["status"]) for r in rows] == [("ddp", "ok"), ("tp", "interrupted")], out + err
    assert float(rows[0]["step_ms"]) > 0 and "interrupted by SIGINT" in rows[1]["reason"]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == \
        "benchmark: interrupted by SIGINT; every process of the job was ended"
    assert (tmp_path / "b.json").exists() and (tmp_path / "b.png").exists()
    assert_none_left(mark)


def test_sigterm_during_an_estimate_records_the_cell_as_interrupted(monkeypatch, tmp_path, capsys):
    """--estimate runs in the launcher's process: no ranks, but the same record of the cell."""
    real, before = memory.estimate_step_memory, signal.getsignal(signal.SIGTERM)
    calls = []

    def estimate_then_terminated(*a, **k):
        calls.append(1)
        if len(calls) == 2:  # the second cell: the signal arrives while it is measured
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
        return real(*a, **k)
    monkeypatch.setattr("minimind_parallel.memory.estimate_step_memory", estimate_then_terminated)
    code = cli.main(["benchmark", "--tp_size", "2", "--", *TINY, "--modes", "ddp", "tp", "--estimate",
                     "--num_hidden_layers", "1", "--output_csv", str(tmp_path / "b.csv")])
    assert code == 128 + signal.SIGTERM
    rows = list(csv.DictReader(open(tmp_path / "b.csv")))
    assert [(r["mode"], r["status"]) for r in rows] == [("ddp", "ok"), ("tp", "interrupted")]
    assert signal.getsignal(signal.SIGTERM) == before  # the launcher's handler is gone again
    assert "benchmark: interrupted by SIGTERM" in capsys.readouterr().err


# ---------------------------------------------------------------- timeouts

def test_a_cell_timeout_kills_every_rank_of_the_cell(mark, tmp_path):
    r = subprocess.run([sys.executable, "-m", "evaluation.parallel", "benchmark", "--tp_size", "2", "--", *LONG_CELL,
                        "--cell_timeout", "8", "--output_csv", str(tmp_path / "b.csv")],
                       env={**os.environ, MARK: mark}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    rows = list(csv.DictReader(open(tmp_path / "b.csv")))
    assert [(x["mode"], x["status"]) for x in rows] == [("tp", "timeout")]
    assert_none_left(mark, within=2.0)


def _unanswered_collectives(par: ParallelConfig) -> dict:
    """Rank 0 all-reduces over each of its groups, which no peer joins: -> group -> (seconds, error)."""
    groups = ProcessGroups.build(par, timeout=datetime.timedelta(seconds=1))
    waited = {}
    if dist.get_rank() == 0:
        for name in ("tp", "pp", "cp", "dp", "embed", "dp_cp"):
            group = getattr(groups, name)
            if group is None:
                continue
            start = time.monotonic()
            try:
                dist.all_reduce(torch.ones(1), group=group)
                waited[name] = (time.monotonic() - start, "")
            except RuntimeError as e:
                waited[name] = (time.monotonic() - start, str(e))
    dist.barrier()  # the peers wait here (the default group) until rank 0 has tried every group
    return waited


@pytest.mark.parametrize("par", [ParallelConfig(dp=2, cp=2), ParallelConfig(tp=2, pp=2)], ids=["dp_cp", "tp_pp"])
def test_every_process_group_waits_at_most_the_collective_timeout(par):
    waited = run_ranks(_unanswered_collectives, 4, par, timeout=120)[0]
    expected = {"dp", "cp", "dp_cp"} if par.dp > 1 else {"tp", "pp", "embed"}
    assert set(waited) == expected
    for name, (seconds, error) in waited.items():
        assert "timed out" in error.lower() and seconds < 20, (name, seconds, error)


def test_a_stopped_peer_ends_the_job_after_the_collective_timeout(mark):
    """Rank 1 stops (alive, silent): rank 0's collective gives up after --collective_timeout and says so."""
    r = subprocess.run([sys.executable, "-m", "evaluation.parallel", "validate", "--tp_size", "2",
                        "--collective_timeout", "4", "--inject_fault", "stop:1", "--", *TINY],
                       env={**os.environ, MARK: mark}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "CollectiveTimeoutError: rank 0: a collective did not complete within --collective_timeout 4 s" in r.stderr
    assert_none_left(mark)


def rank_pid(mark: str, rank: int) -> int:
    """The pid of global rank `rank` of the marked job (torchrun gives each rank RANK in its environment)."""
    for pid, env in processes_with(MARK, mark).items():
        if f"RANK={rank}".encode() in env.split(b"\0") and "torch.distributed.run" not in marked(mark).get(pid, ""):
            return pid
    raise AssertionError(f"no rank {rank} among {marked(mark)}")


def test_a_stopped_rank_ends_a_train_job_within_the_collective_timeout(corpus, tmp_path, mark):  # noqa: F811
    """Rank 1 is stopped mid-training: rank 0 waits in the data-parallel gradient reduction (the
    DP x CP group; no log line, so no collective of the default group per step) and gives up
    after --collective_timeout; the job ends with one line naming it."""
    timeout = 5
    out_dir = tmp_path / "out"
    proc = start("train", "--dp_size", "2", "--collective_timeout", str(timeout), "--",
                 *data_args(corpus, dtype="float32", accumulation_steps=1, log_interval=1000000, max_steps=1000000,
                            out_dir=out_dir), mark=mark)
    try:
        deadline = time.monotonic() + 120
        while not ((out_dir / "metrics.jsonl").exists() and '"run"' in (out_dir / "metrics.jsonl").read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        time.sleep(1.0)  # well into the steps
        os.kill(rank_pid(mark, 1), signal.SIGSTOP)
        stopped = time.monotonic()
        out, err = proc.communicate(timeout=timeout + 40)
        ended = time.monotonic() - stopped
    finally:
        kill_on_failure(proc, mark)
    assert proc.returncode == 1, out + err
    assert ended < timeout + 30, ended
    assert err.strip().splitlines()[-1].startswith(
        f"train: rank 0 failed: CollectiveTimeoutError: rank 0: a collective did not complete within "
        f"--collective_timeout {timeout} s (a peer stopped or is gone)"), err[-2000:]
    assert err.strip().endswith("; every process of the job was ended")
    assert_none_left(mark)


def test_a_rank_that_dies_silently_ends_the_job(mark):
    r = subprocess.run([sys.executable, "-m", "evaluation.parallel", "validate", "--tp_size", "2",
                        "--inject_fault", "exit:1", "--", *TINY],
                       env={**os.environ, MARK: mark}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "exitcode  : 3" in r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("validate: a rank ended without an error report (torchrun's "
                                                "summary above names it and its exit code); every process of "
                                                "the job was ended")
    assert_none_left(mark)


def test_a_multi_node_job_says_what_it_waits_for_and_gives_up_after_the_rendezvous_timeout(mark):
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "evaluation.parallel", "validate", "--tp_size", "2", "--nnodes", "2",
                        "--master_port", str(port), "--rdzv_timeout", "3", "--", *TINY],
                       env={**os.environ, MARK: mark}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert lines[0] == f"launcher: node 0 of 2 waits for the other nodes at 127.0.0.1:{port} (--rdzv_timeout 3 s)"
    assert lines[-1].startswith(f"error: rendezvous timed out after --rdzv_timeout 3 s: node 0 waited at "
                                f"127.0.0.1:{port} and not all 2 nodes joined")
    assert len(lines) == 2, r.stderr
    assert_none_left(mark)


# ---------------------------------------------------------------- the launcher's own process tree

def test_a_launcher_killed_outright_takes_the_job_along(mark):
    """SIGKILL cannot be handled: torchrun dies with the launcher, the ranks with torchrun."""
    proc = start("validate", "--tp_size", "2", "--", *TINY, "--optimizer_steps", "1000000", mark=mark)
    try:
        wait_for_ranks(mark, 2, proc)
        proc.kill()
        proc.communicate(timeout=30)
        assert_none_left(mark, within=30.0)  # as in test_a_rank_dies_with_torchrun
    finally:
        kill_on_failure(proc, mark)


def long_cell_job(path) -> str:
    """The job file of LONG_CELL's one cell at --tp_size 2, as the benchmark's launcher writes it."""
    job = cli.resolve(["benchmark", "--tp_size", "2", "--", *LONG_CELL])
    run = cell_run(job, sweep_cells(job.task)[0])
    return write_job(cell_job(job, run, report=None, profile_dir=None), str(path))


def test_a_rank_dies_with_torchrun(mark, tmp_path):
    """torchrun SIGKILLed (the kernel's out-of-memory killer, kill -9): its ranks go with it, whether
    they were still starting (their parent is not of the job) or running (PR_SET_PDEATHSIG)."""
    env = {**os.environ, MARK: mark, processes.JOB_ENV: processes.new_job_id(), "OMP_NUM_THREADS": "1"}
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 "-m", "minimind_parallel.worker", long_cell_job(tmp_path / "job.json")],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_ranks(mark, 2, torchrun)
        torchrun.kill()
        torchrun.wait()
        # a rank still importing torch notices when it gets to die_with_parent: seconds on a busy machine
        assert_none_left(mark, within=30.0)
    finally:
        kill_on_failure(torchrun, mark)


def test_a_child_forked_before_its_exec_ignores_the_launchers_ctrl_c():
    """Ctrl-C reaches the whole process group, also a child subprocess has forked and not yet
    exec'd (torchrun starting): the launcher's handler raises only in the launcher itself."""
    with processes.signals_raise():
        pid = os.fork()
        if pid == 0:  # the child, still running the launcher's handler
            try:
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):   # let the handler run (it runs between bytecodes)
                    time.sleep(0.0001)
            except BaseException:
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


# Two ranks that end normally (the interpreter finalizes). Rank 0's group is held only by a
# reference cycle; a collective on it is still in flight when rank 0 tears down, and finishes while
# rank 0's Python keeps the GIL (a long switch interval: what a loaded machine's scheduler can do
# to a backend thread by chance), so rank 0's gloo thread, dropping the tensor Python let go of,
# asks for the GIL just before the interpreter finalizes.
_LATE_COLLECTIVE = """
import sys, time, torch, torch.distributed as dist
from minimind_parallel.distributed.teardown import destroy_process_groups
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
cycle = [dist.new_group([0, 1])]
cycle.append(cycle)
x = torch.ones(1 << 16)
dist.barrier(group=cycle[0])
if rank == 1:
    time.sleep(0.5)
    dist.all_reduce(x, group=cycle[0])
else:
    sys.setswitchinterval(100.0)
    work = dist.all_reduce(x, group=cycle[0], async_op=True)
    del x, work, cycle
destroy_process_groups()
t0 = time.monotonic()
while time.monotonic() - t0 < 1.5:   # no I/O, no sleep: nothing lets go of the GIL
    pass
"""


def test_a_rank_whose_group_a_cycle_holds_ends_cleanly_when_a_collective_finishes_at_exit():
    """What a --zero 2 rank met at exit under load (its buffer's hooks held the DP x CP group in a
    cycle): the group destroyed only in the interpreter's finalization, its gloo thread ended there
    while dropping a finished collective's work -- `terminate called without an active exception`,
    SIGABRT. `destroy_process_groups` destroys the group while the interpreter is whole: both
    ranks exit 0. (Without its collection, rank 0 aborts here every time.)"""
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # this checkout's package
    ranks = [subprocess.Popen([sys.executable, "-c", _LATE_COLLECTIVE, str(r), port], env=env, cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in ranks] == [0, 0], outputs


_RANK_WITH_AN_OPTIMIZER = """
import datetime, sys
sys.path.insert(0, "tests")
import torch
from helpers import gloo_threads
from minimind_parallel import worker
from minimind_parallel.distributed.teardown import destroy_process_groups
worker.init_distributed("cpu", datetime.timedelta(seconds=60))
torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=1e-3)   # torch._dynamo's first use
destroy_process_groups()
print(gloo_threads())
"""


def _gloo_threads_left_by(script: str) -> str:
    """The gloo threads a one-rank `script` finds alive after its teardown (the last word it prints)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[-1]


def test_a_rank_with_an_optimizer_destroys_its_default_group_with_its_threads():
    """torch._dynamo imported after the default group exists (an optimizer's first use imports it)
    keeps that group alive past destroy_process_group, its gloo threads into the interpreter's
    finalization; the worker imports it first, so a rank's teardown leaves no gloo thread."""
    assert _gloo_threads_left_by(_RANK_WITH_AN_OPTIMIZER) == "0"


_RANK_WITH_FSDP2 = """
import datetime, sys
sys.path.insert(0, "tests")
import torch
from helpers import gloo_threads
from minimind_parallel import MiniMindConfig, ParallelConfig, worker
from minimind_parallel.distributed.teardown import destroy_process_groups
from minimind_parallel.groups import ProcessGroups
from minimind_parallel.parallel_model import ParallelMiniMindForCausalLM
from minimind_parallel.zero.fully_shard import Meshes, shard_fully
from torch.distributed.device_mesh import DeviceMesh
worker.init_distributed("cpu", datetime.timedelta(seconds=60))
par = ParallelConfig(zero=3)
groups = ProcessGroups.build(par)
config = MiniMindConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=64)
mesh = DeviceMesh.from_group(torch.distributed.new_group([0]), "cpu")   # one rank's (a world of one has no DP group)
model = shard_fully(ParallelMiniMindForCausalLM(config, par, groups), groups, Meshes(mesh, None))
ids = torch.randint(0, 64, (1, 8))
model(ids, targets=ids).loss.backward()
del model, groups, mesh
destroy_process_groups()
print(gloo_threads())
"""


def test_a_rank_that_sharded_with_fsdp2_destroys_its_meshs_group_with_its_threads():
    """FSDP2's DTensor parameters leave their device mesh -- and the mesh its process group -- in
    DTensor's sharding propagation caches; a rank's teardown clears them, so no gloo thread of the
    mesh's group outlives destroy_process_group (3 did before)."""
    assert _gloo_threads_left_by(_RANK_WITH_FSDP2) == "0"
