"""The processes of a job and how they end together.

torchrun (torch.distributed.elastic) starts every rank in a session of its own, so a signal to the
launcher's process group never reaches the ranks. Three things make sure none outlives the job:

  * the job mark: the launcher gives every job an id in the environment (JOB_ENV); every process
    the job starts inherits it, so `job_pids` finds them all, reparented or not, and `kill_job`
    SIGKILLs them (a stopped process too);
  * `die_with_parent`, called by each rank first: the kernel SIGKILLs the rank when torchrun dies
    (Linux PR_SET_PDEATHSIG), and a watchdog thread exits when the parent changes (elsewhere); the
    launcher starts torchrun the same way (`parent_death_signal`), so even a SIGKILLed launcher
    takes the job along;
  * `signals_raise`: SIGINT and SIGTERM to the launcher raise `Interrupted`, so the launcher ends
    the job before it exits instead of dying (SIGTERM) or leaving it behind (Ctrl-C).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator

JOB_ENV = "MINIMIND_PARALLEL_JOB"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the launcher, or (`who`) another process of the job died of a signal
    (a BaseException, like KeyboardInterrupt, so that no `except Exception` swallows it)."""

    def __init__(self, signum: int, who: str | None = None):
        self.signum = signum
        super().__init__(f"{who + ' ' if who else ''}interrupted by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process that died of the signal


@contextlib.contextmanager
def signals_raise(signums=(signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Within the block, the first of `signums` raises Interrupted in the main thread; later ones
    are ignored (the job is being ended already). Does nothing outside the main thread. A child
    forked in the block (subprocess's fork before its exec) that receives the signal -- Ctrl-C
    reaches the whole process group -- ignores it: it is about to exec, and raising there would
    only print an ignored traceback from its after-fork hooks."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired, owner = [], os.getpid()

    def handler(signum, frame):
        if os.getpid() == owner and not fired:
            fired.append(signum)
            raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in signums}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextlib.contextmanager
def signals_held(signums=(signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Within the block `signums` are only recorded; at its end each is handed to the handler
    before it (`signals_raise`'s raises then). Around a fork: the parent's after-fork hooks
    (logging's) run Python code, and an Interrupted raised there is printed and ignored, so a
    Ctrl-C landing in the fork would be lost. Does nothing outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in signums}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for signum in dict.fromkeys(held):   # each once, in the order they came
            signal.raise_signal(signum)


def new_job_id() -> str:
    return uuid.uuid4().hex


def job_processes(job_id: str) -> dict[int, dict[str, str]]:
    """Every live process whose environment carries the job's mark (zombies have none) -> its environment."""
    mark = f"{JOB_ENV}={job_id}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:  # gone meanwhile, or not ours
            continue
        if mark in env:
            found[int(entry)] = dict(v.decode(errors="replace").partition("=")[::2] for v in env if v)
    return found


def job_pids(job_id: str) -> list[int]:
    return list(job_processes(job_id))


def kill(pids) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def kill_job(job_id: str, *, wait: float = 10.0) -> list[int]:
    """SIGKILL every process of the job until none is left (at most `wait` seconds); -> the pids
    still alive then (empty unless a process is stuck in the kernel)."""
    deadline = time.monotonic() + wait
    while True:
        pids = job_pids(job_id)
        kill(pids)
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.05)


def carries_mark(pid: int, job_id: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{JOB_ENV}={job_id}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def parent_death_signal():
    """-> a function that makes the calling process be SIGKILLed when its parent ends (Linux's
    PR_SET_PDEATHSIG; None elsewhere). Resolved here, so that calling it between fork and exec
    (subprocess's preexec_fn) loads nothing."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def die_with_parent() -> None:
    """End this process when its parent (torchrun) ends, however it ends. A rank of a marked job
    whose parent is not of the job any more (torchrun died before this ran) ends at once."""
    parent = os.getppid()
    arm = parent_death_signal()
    if arm is not None:
        arm()
    job = os.environ.get(JOB_ENV)
    orphaned = job is not None and os.path.isdir("/proc") and not carries_mark(parent, job)
    if orphaned or os.getppid() != parent:
        os._exit(1)

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()
