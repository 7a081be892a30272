"""Starting the ranks: the torchrun (`torch.distributed.run`) command, its environment, and a
run that can be timed out (the launcher and every rank it started killed together).

Each rank runs `python -m minimind_parallel.worker` with the command line it was given."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from .options import resolve_device

TIMED_OUT = 124  # run_torchrun's exit code when it killed the ranks at the timeout (as timeout(1))


def torchrun_command(launch, world_size: int, worker_argv: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world_size // launch.nnodes}",
           f"--nnodes={launch.nnodes}", "--max_restarts=0", "--monitor_interval=0.1"]
    if launch.nnodes == 1 and launch.master_port is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--node_rank={launch.node_rank}", f"--master_addr={launch.master_addr}",
                f"--master_port={launch.master_port or 29500}"]
    return cmd + ["-m", "minimind_parallel.worker", *worker_argv]


def launch_env(device: str, async_communication: bool) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    if device == "cuda" and async_communication:
        # One hardware queue: the async collective, issued before the wgrad GEMM, is scheduled
        # before it (Megatron-LM, LinearWithGradAccumulationAndAsyncCommunication).
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return env


def run_torchrun(launch, world_size: int, worker_argv: list[str], *, async_communication=False,
                 timeout: float | None = None, log: str | None = None) -> int:
    """Run the ranks to completion; `log`: a file that takes their stdout and stderr instead of the terminal.
    After `timeout` seconds the launcher and every rank it started are killed: -> TIMED_OUT."""
    cmd = torchrun_command(launch, world_size, worker_argv)
    env = launch_env(resolve_device(launch), async_communication)
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(log, "w")) if log is not None else None
        # its own session: on a timeout the whole group goes, ranks included
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=out,
                                stderr=subprocess.STDOUT if out is not None else None)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return TIMED_OUT
        except BaseException:  # Ctrl-C: take the ranks down too
            os.killpg(proc.pid, signal.SIGKILL)
            raise
