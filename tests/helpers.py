"""Helpers shared by the test files: the relative-L2 error of the numeric checks, the one-line
refusal check, and the stdlib corpus the data and train tests start from (conftest.py's
`stdlib_corpus` fixture writes it once per session), and the count of gloo's threads in this
process (a process group not destroyed keeps its threads), and an after-fork hook that
signals the parent (the signal-over-a-fork tests)."""
import os
import signal
import subprocess
import sys

import torch

MAX_DOCS = 200  # documents of the stdlib corpus the tests train and tokenise on


def gloo_threads() -> int:
    """Threads of gloo in this process (its worker loops `pt_gloo_runloop`, its transport's
    `gloo_tcp_loop`), read from /proc: a gloo group's go only when the group is destroyed."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:   # ended meanwhile
            continue
    return sum(name.startswith(("pt_gloo", "gloo_")) for name in names)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| in float64, b the reference."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm()).item()


def one_line_error(exc_type, fn, *args, **kwargs) -> str:
    """Call fn, expect exc_type, return its message after checking that it is one line."""
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        message = str(e)
        assert "\n" not in message, message
        return message
    raise AssertionError(f"{fn.__name__} did not raise {exc_type.__name__}")


def write_stdlib_corpus(path, max_docs: int = MAX_DOCS):
    """The corpus command, in its own process (its imports stay out of the test process)."""
    r = subprocess.run([sys.executable, "-m", "minimind_parallel.data.corpus", "--out", str(path),
                        "--max_docs", str(max_docs)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return path


def sigint_after_the_next_fork(armed=[]):  # noqa: B006  (registered once per process)
    """Arm (once per process) an after-fork hook that sends this process SIGINT in the parent after a
    fork: -> the list to set the last item of to True, to make the next fork signal."""
    def hook():
        if armed.pop():   # armed: signal this once
            os.kill(os.getpid(), signal.SIGINT)
        armed.append(False)

    if not armed:
        armed.append(False)
        os.register_at_fork(after_in_parent=hook)
    return armed
