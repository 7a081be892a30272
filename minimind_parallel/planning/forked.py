"""`forked_map`: a pure function over a long list in forked processes, the results in order.

The planner predicts tens of thousands of layouts, each on its own and to the same value wherever
it runs (nothing it remembers changes a result: tests/test_planning.py). On a machine with more
than one CPU the list is cut into contiguous parts (contiguous: neighbouring layouts share the
sizes the memory model remembers, so each process makes most of its own), each part after the
first evaluated in a child forked from this process (it starts with this process's memory: nothing
imported or remembered again) that sends its results back pickled through a pipe, while this
process evaluates the first. A child's error is raised here; on every ending (an error, an
interrupt) no child is left running.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
from typing import Callable, Iterator, Sequence


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def split(weights: Sequence[float], parts: int) -> list[int]:
    """The bounds (parts + 1 of them, 0 first, len last) that cut `weights` into `parts` contiguous
    runs of about equal sums."""
    total, bounds, run = sum(weights), [0], 0.0
    for i, w in enumerate(weights):
        run += w
        if len(bounds) < parts and run >= total * len(bounds) / parts:
            bounds.append(i + 1)
    return bounds + [len(weights)] * (parts + 1 - len(bounds))


def forked_map(fn: Callable, items: Sequence, bounds: list[int]) -> list:
    """[fn(x) for x in items], items[bounds[i]:bounds[i + 1]] evaluated by part i: the first here,
    each other one in a forked child."""
    if len(bounds) <= 2 or not hasattr(os, "fork"):
        return [fn(x) for x in items]
    children: list[tuple[int, int]] = []
    try:
        for lo, hi in zip(bounds[1:-1], bounds[2:]):
            children.append(_fork(fn, items[lo:hi]))
        results = [fn(x) for x in items[bounds[0]:bounds[1]]]
        while children:
            results += _collect(*children.pop(0))
        return results
    finally:
        for pid, fd in children:   # an error or an interrupt here: end the others
            os.close(fd)
            _end(pid)


@contextlib.contextmanager
def forked_call(fn: Callable, fork: bool = True) -> Iterator[Callable]:
    """fn() in a forked child while this process goes on (`fork`, where the system forks; else
    here, when its result is asked for): yields the function that waits for its result (its error
    raised here). Where this process fails first, the child is let finish (a file it writes is
    written whole, or its own error removes its temporary) and reaped, its result dropped."""
    if not fork or not hasattr(os, "fork"):
        yield fn
        return
    child: list = [_fork(lambda _: fn(), [None])]

    def result():
        pid, fd = child.pop()
        return _collect(pid, fd)[0]

    try:
        yield result
    finally:
        for pid, fd in child:   # not waited for: an error or an interrupt here
            with contextlib.suppress(BaseException):
                _collect(pid, fd)


def _fork(fn: Callable, part: Sequence) -> tuple[int, int]:
    """A child evaluating `part` -> (its pid, the pipe its results come through)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write)
        return pid, read
    os.close(read)          # the child: its results (or its error) pickled, then out at once
    try:
        try:
            out = (True, [fn(x) for x in part])
        except BaseException as e:   # noqa: BLE001 -- sent to the parent, which raises it
            out = (False, e)
        with os.fdopen(write, "wb") as f:
            try:
                pickle.dump(out, f, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:   # an error that does not pickle
                pickle.dump((False, RuntimeError(f"{type(out[1]).__name__}: {out[1]}")), f)
    finally:
        os._exit(0)


def _collect(pid: int, fd: int) -> list:
    """A child's results (its error raised here); the child ended and reaped on every ending."""
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read()
    finally:
        _end(pid)
    if not data:
        raise RuntimeError(f"a planning process (pid {pid}) ended without its results")
    ok, value = pickle.loads(data)
    if not ok:
        raise value
    return value


def _end(pid: int) -> None:
    """End child `pid` (done or not) and reap it."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
