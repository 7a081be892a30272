"""What each rank runs under torchrun: `python -m minimind_parallel.worker JOB.json`, the job its
node's launcher resolved (job.py); the rank parses no command line.

A rank dies with torchrun (processes.die_with_parent), and a collective that waits longer than
--collective_timeout (a peer stopped, or gone without its connection closing) fails the rank with
one line saying so, which ends the job (docs/failure_behaviour.md). Such an error, or bad input
found inside the ranks (ConfigError), is recorded in the rank's torchelastic error file without a
traceback of the rank's own; the launcher prints it as the job's last line."""
from __future__ import annotations

import datetime
import os
import signal
import sys

import torch
import torch._dynamo  # noqa: F401  before the default group exists: imported after it (as the first
# optimizer does), it keeps that group alive past destroy_process_group (distributed/teardown.py)
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from . import processes, tasks
from .config import ConfigError
from .distributed.teardown import destroy_process_groups
from .job import read_job
from .options import collective_timeout, resolve_device


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within --collective_timeout."""


def init_distributed(device: str, timeout: datetime.timedelta) -> torch.device:
    """gloo on CPU, NCCL on CUDA; one torch thread per rank on CPU (ranks share the cores).
    A collective of the default group waits at most `timeout` (the tasks give their groups the same)."""
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout)
        return torch.device("cuda", local)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")


def timed_out(error: BaseException) -> bool:
    """gloo ("Timed out waiting 5000ms for recv"), the store ("Timed out after 6 seconds waiting for
    clients") and NCCL's watchdog ("Watchdog caught collective operation timeout") all say so."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def inject_fault(spec: str | None) -> None:
    """Test hook `--inject_fault KIND:RANK`: on that rank, `raise` raises, `stop` stops the process
    (SIGSTOP: alive, silent, never answering its peers), `exit` exits at once without a word, `kill`
    is SIGKILLed (as by the kernel's out-of-memory killer)."""
    if spec is None:
        return
    kind, rank = spec.split(":")
    if dist.get_rank() != int(rank):
        return
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank}")
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "exit":
        os._exit(3)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


@record
def main(argv: list[str]) -> int:
    """-> the rank's exit code; an error the launcher reports in one line is recorded here (exit 1),
    any other is raised (its traceback, recorded by `record`)."""
    try:
        return run(argv)
    except (CollectiveTimeoutError, ConfigError) as e:
        get_error_handler().record_exception(e)
        return 1


def run(argv: list[str]) -> int:
    processes.die_with_parent()
    (path,) = argv
    job = read_job(path, lambda name: tasks.get(name).parser())
    launch = job.launch
    device = init_distributed(resolve_device(launch), collective_timeout(launch))
    try:
        inject_fault(launch.inject_fault)
        return tasks.get(launch.task).run_rank(job, device)
    except Exception as e:
        if timed_out(e) and not isinstance(e, ConfigError):
            raise CollectiveTimeoutError(
                f"rank {dist.get_rank()}: a collective did not complete within --collective_timeout "
                f"{launch.collective_timeout:g} s (a peer stopped or is gone): {str(e).splitlines()[0][:200]}") from e
        raise
    finally:
        destroy_process_groups()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
