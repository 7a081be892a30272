"""Starting the ranks: the torchrun (`torch.distributed.run`) command, its environment, and a
run that ends with every process it started, however it ends (docs/failure_behaviour.md).

Each rank runs `python -m minimind_parallel.worker JOB.json`: the job (job.py) this node's launcher
resolved from the command line, written in a temporary directory removed when the run ends. The job's
processes carry a mark in their environment (processes.JOB_ENV); when the run ends -- the ranks
finished or failed, the timeout passed, the rendezvous of a multi-node job timed out, SIGINT or
SIGTERM reached the launcher or torchrun -- every process with the mark still alive is SIGKILLed.
The ranks hold nothing to flush, and torchrun's own SIGTERM path would print a traceback and wait
its shutdown timeout for a stopped rank; killing the job is immediate and silent. A job that
failed ends with one line naming the rank and its error."""
from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time

from torch.distributed.run import get_args_parser

from . import processes
from .job import Job, write_job
from .options import resolve_device

TIMED_OUT = 124  # run_torchrun's exit code when it killed the ranks at the timeout (as timeout(1))
SHUTDOWN_GRACE_S = 3  # torchrun's wait for the other ranks to exit after one failed, before SIGKILL
POLL_S = 0.2
# The signals torchrun turns into its SignalException (a traceback, exit 1). SIGTERM is left out: a
# scheduler's SIGTERM to torchrun ends it outright, and the launcher reports it (exit 143).
TORCHRUN_SIGNALS = "SIGINT"


class LaunchError(RuntimeError):
    """The job could not start (one line: what it waited for and for how long)."""


def torchrun_command(launch, world_size: int, worker_argv: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world_size // launch.nnodes}",
           f"--nnodes={launch.nnodes}", "--max_restarts=0", "--monitor_interval=0.1"]
    if torchrun_accepts("--shutdown_timeout"):  # newer torchrun only; older ones wait their default
        cmd.append(f"--shutdown_timeout={SHUTDOWN_GRACE_S}")
    if torchrun_accepts("--signals_to_handle"):  # newer torchrun only; older ones print SIGTERM's traceback
        cmd.append(f"--signals_to_handle={TORCHRUN_SIGNALS}")
    if launch.nnodes == 1 and launch.master_port is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--node_rank={launch.node_rank}", f"--master_addr={launch.master_addr}",
                f"--master_port={endpoint(launch)[1]}", f"--rdzv_conf=timeout={math.ceil(launch.rdzv_timeout)}"]
    return cmd + ["-m", "minimind_parallel.worker", *worker_argv]


def torchrun_accepts(option: str) -> bool:
    """Whether the installed torchrun has `option` (the CUDA builds users bring may be older)."""
    return any(option in action.option_strings for action in get_args_parser()._actions)


def endpoint(launch) -> tuple[str, int]:
    """Where the nodes of a multi-node job meet (torchrun's static rendezvous)."""
    return launch.master_addr, launch.master_port or 29500


def launch_env(device: str, async_communication: bool) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    if device == "cuda" and async_communication:
        # One hardware queue: the async collective, issued before the wgrad GEMM, is scheduled
        # before it (Megatron-LM, LinearWithGradAccumulationAndAsyncCommunication).
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return env


def run_job(job: Job, *, timeout: float | None = None, log: str | None = None) -> int:
    """Run `job` on its world of ranks (run_torchrun): each reads the job from a file of a temporary
    directory that is removed when they are done."""
    with tempfile.TemporaryDirectory(prefix="minimind-job-") as tmp:
        path = write_job(job, os.path.join(tmp, "job.json"))
        return run_torchrun(job.launch, job.parallel.world_size, [path],
                            async_communication=job.parallel.async_communication, timeout=timeout, log=log)


def run_torchrun(launch, world_size: int, worker_argv: list[str], *, async_communication=False,
                 timeout: float | None = None, log: str | None = None) -> int:
    """Run the ranks to completion; `log`: a file that takes their stdout and stderr instead of the terminal.
    After `timeout` seconds every process of the job is killed: -> TIMED_OUT. A failed job on the terminal
    ends with one line (`failure_line`). Raises LaunchError when a multi-node rendezvous does not complete
    within --rdzv_timeout, processes.Interrupted when torchrun was ended by a signal, and passes the
    launcher's processes.Interrupted on; in every case no process of the job is left when it returns."""
    job = processes.new_job_id()
    env = {**launch_env(resolve_device(launch), async_communication), processes.JOB_ENV: job}
    errors: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(log, "w")) if log is not None else None
        # its own session: Ctrl-C at the terminal reaches the launcher only, which ends the job;
        # torchrun dies with the launcher, the ranks with torchrun (processes.die_with_parent)
        # a signal during the fork waits for its end (processes.signals_held), not lost in an after-fork hook
        proc = None
        try:
            with processes.signals_held():
                proc = subprocess.Popen(torchrun_command(launch, world_size, worker_argv), env=env,
                                        start_new_session=True, preexec_fn=processes.parent_death_signal(), stdout=out,
                                        stderr=subprocess.STDOUT if out is not None else None)
            code = wait_for(proc, job, launch, timeout, errors)
        finally:
            processes.kill_job(job)
            if proc is not None:
                proc.wait()
    if code < 0:  # torchrun itself died of a signal (a scheduler's SIGTERM); its ranks are gone with it
        raise processes.Interrupted(-code, who="torchrun")
    if code not in (0, TIMED_OUT) and log is None:
        print(f"{launch.task}: {failure_line(errors)}; every process of the job was ended", file=sys.stderr,
              flush=True)
    return code


def wait_for(proc: subprocess.Popen, job: str, launch, timeout: float | None, errors: dict[str, str]) -> int:
    """torchrun's exit code, or TIMED_OUT after `timeout` s. A multi-node job says what it waits for
    and gives up after --rdzv_timeout (LaunchError). Once a rank has failed with an error (its
    torchelastic error file exists), the ranks still alive SHUTDOWN_GRACE_S later are killed:
    torchrun stops the others itself, but waits 30 s for one that is stopped. `errors` collects
    every rank's error file -> its global rank."""
    start = time.monotonic()
    rendezvous = launch.nnodes > 1
    if rendezvous:
        addr, port = endpoint(launch)
        print(f"launcher: node {launch.node_rank} of {launch.nnodes} waits for the other nodes at {addr}:{port} "
              f"(--rdzv_timeout {launch.rdzv_timeout:g} s)", file=sys.stderr, flush=True)
    failed_at = None
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(timeout=POLL_S)
        now = time.monotonic()
        ranks = {pid: env for pid, env in processes.job_processes(job).items() if pid != proc.pid}
        if rendezvous:
            rendezvous = still_waiting(launch, bool(ranks), now - start)
        errors.update({env["TORCHELASTIC_ERROR_FILE"]: env.get("RANK", "?") for env in ranks.values()
                       if "TORCHELASTIC_ERROR_FILE" in env})
        if failed_at is None and any(os.path.exists(f) for f in errors):
            failed_at = now
        if failed_at is not None and now - failed_at > SHUTDOWN_GRACE_S:
            processes.kill(ranks)
        if timeout is not None and now - start > timeout:
            return TIMED_OUT


def failure_line(errors: dict[str, str]) -> str:
    """What failed, in one line: the first error a rank of this node recorded (its torchelastic
    error file, written by the worker's `record`), else that a rank ended without one."""
    written = sorted((f for f in errors if os.path.exists(f)), key=os.path.getmtime)
    for path in written:
        try:
            with open(path) as f:
                message = json.load(f)["message"]
            text = message["message"] if isinstance(message, dict) else str(message)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        return f"rank {errors[path]} failed: {text.strip().splitlines()[0][:400]}"
    return "a rank ended without an error report (torchrun's summary above names it and its exit code)"


def still_waiting(launch, ranks_started: bool, waited: float) -> bool:
    """Whether this node still waits for the others; raises LaunchError after --rdzv_timeout."""
    if ranks_started:  # torchrun starts this node's ranks once every node has joined
        print(f"launcher: all {launch.nnodes} nodes joined after {waited:.0f} s; ranks started", file=sys.stderr,
              flush=True)
        return False
    if waited > launch.rdzv_timeout:
        addr, port = endpoint(launch)
        raise LaunchError(f"rendezvous timed out after --rdzv_timeout {launch.rdzv_timeout:g} s: node "
                          f"{launch.node_rank} waited at {addr}:{port} and not all {launch.nnodes} nodes joined "
                          f"(start the same command on every node, each with its --node_rank)")
    return True
