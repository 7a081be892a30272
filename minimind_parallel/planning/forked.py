"""`forked_map`: a pure function over a long list in forked processes, the results in order.

The planner predicts tens of thousands of layouts, each on its own and to the same value wherever
it runs (nothing it remembers changes a result: tests/test_planning.py). On a machine with more
than one CPU the list is cut into contiguous parts (contiguous: neighbouring layouts share the
sizes the memory model remembers, so each process makes most of its own), each part after the
first evaluated in a child forked from this process (it starts with this process's memory: nothing
imported or remembered again) that sends its results back pickled through a pipe, while this
process evaluates the first. The parts are only where each process starts: their costs are
estimates, so a process done with its own part takes the last items of the part with the most
left, a run at a time (the parts' bounds not yet taken are shared, `_Parts`), and the processes
end together. Each process can pass its results through a second function (`then`, a batch at a
time: the JSON's text of each planned layout, made where it was predicted). A child's error is
raised here; on every ending no child is left running: an error or an interrupt here kills and
reaps them (a SIGINT or SIGTERM during a fork is held until the child is registered,
`processes.signals_held`), and a SIGKILL of this process kills them too
(`processes.parent_death_signal`).
"""
from __future__ import annotations

import contextlib
import mmap
import multiprocessing
import os
import pickle
import signal
import struct
from typing import Callable, Iterator, Sequence

from .. import processes


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


# items a process takes at a time from a part (its own, or the last ones of another's)
RUN = 16
# results a process makes before it applies `then` to them: the JSON's text of each layout made
# right after its prediction, run by run, cost more CPU than made in batches (docs/planning.md,
# "The done-when checks"); a batch is short beside a process's part
THEN_BATCH = 1024


def forked_map(fn: Callable, items: Sequence, bounds: list[int], then: Callable | None = None) -> list:
    """[then(fn(x)) for x in items] (`then`: none, [fn(x) ...]); part i, items[bounds[i]:bounds[i + 1]],
    evaluated first by process i (the first here, each other one in a forked child), each process
    done with its own taking the last RUN items of the part with the most left until none is. A
    process applies `then` to its results THEN_BATCH at a time (and to the last ones at its end)."""
    if len(bounds) <= 2 or not hasattr(os, "fork"):
        values = [fn(x) for x in items]
        return values if then is None else [then(v) for v in values]
    parts = _Parts(bounds)
    children: list[tuple[int, int]] = []
    try:
        for i in range(1, len(bounds) - 1):
            _fork(lambda own: _evaluate(fn, then, items, parts, own), [i], children, with_parent=True)
        runs = _evaluate(fn, then, items, parts, 0)
        while children:
            runs += _collect(*children.pop(0))[0]
    finally:
        for pid, fd in children:   # an error or an interrupt here: end the others
            os.close(fd)
            _end(pid)
    results = [None] * len(items)
    for start, values in runs:
        results[start:start + len(values)] = values
    return results


def _evaluate(fn: Callable, then: Callable | None, items: Sequence, parts: "_Parts",
              own: int) -> list[tuple[int, list]]:
    """The runs one process evaluates, [(first index, [then(fn(x)) ...])], its own part's first."""
    runs, first, pending = [], 0, 0   # runs[first:]: not through `then` yet, `pending` items
    while (run := parts.take(own)) is not None:
        runs.append((run[0], [fn(x) for x in items[run[0]:run[1]]]))
        pending += run[1] - run[0]
        if then is not None and pending >= THEN_BATCH:
            first, pending = _then(then, runs, first), 0
    if then is not None:
        _then(then, runs, first)
    return runs


def _then(then: Callable, runs: list[tuple[int, list]], first: int) -> int:
    """`then` applied to each value of runs[first:], in place -> len(runs)."""
    for _, values in runs[first:]:
        values[:] = [then(v) for v in values]
    return len(runs)


class _Parts:
    """Each part's bounds not yet taken (lo, hi), in a shared anonymous mapping that the forked
    processes inherit, read and changed under one lock."""

    def __init__(self, bounds: list[int]):
        self.count = len(bounds) - 1
        self.lock = multiprocessing.get_context("fork").Lock()
        self.shared = mmap.mmap(-1, 16 * self.count)   # MAP_SHARED: one memory for every process forked after
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            struct.pack_into("qq", self.shared, 16 * i, lo, hi)

    def take(self, own: int) -> tuple[int, int] | None:
        """The next run of part `own`, else the last RUN items of the part with the most left; None: all taken."""
        with self.lock:
            lo, hi = struct.unpack_from("qq", self.shared, 16 * own)
            if lo < hi:
                struct.pack_into("q", self.shared, 16 * own, min(lo + RUN, hi))
                return lo, min(lo + RUN, hi)
            left = [struct.unpack_from("qq", self.shared, 16 * i) for i in range(self.count)]
            most = max(range(self.count), key=lambda i: left[i][1] - left[i][0])
            lo, hi = left[most]
            if lo >= hi:
                return None
            struct.pack_into("q", self.shared, 16 * most + 8, max(lo, hi - RUN))
            return max(lo, hi - RUN), hi


@contextlib.contextmanager
def forked_worker(prepare: Callable[[], None], fn: Callable, fork: bool = True) -> Iterator["_Worker"]:
    """fn(*args) in a child forked now (`fork`, where the system forks; else here), which runs
    prepare() at once (an import, while this process goes on) and then waits for the args: yields
    the worker, whose send(*args) hands them over (pickled) and result() waits for fn's result (its
    error raised here). Where this process ends first without sending, the child reads the end of
    its pipe and ends without calling fn; where it fails after sending, the child is let finish (a
    file it writes is written whole, or its own error removes its temporary); either way it is
    reaped."""
    if not fork or not hasattr(os, "fork"):
        yield _Here(prepare, fn)
        return
    read, write = os.pipe()

    def serve(_):
        os.close(write)
        prepare()
        with os.fdopen(read, "rb") as f:
            data = f.read()
        return fn(*pickle.loads(data)) if data else None

    worker = _Worker(write)
    try:
        try:
            _fork(serve, [None], worker.child)
        finally:
            os.close(read)
        yield worker
    finally:
        worker.close()
        if worker.child:   # not waited for: an error or an interrupt here
            with contextlib.suppress(BaseException):
                _collect(*worker.child.pop())


class _Worker:
    """forked_worker's child: the pipe its args go through; `child`: [(its pid, the pipe its result comes
    back through)] once forked, [] once waited for."""

    def __init__(self, args_fd: int):
        self.args_fd, self.child = args_fd, []

    def send(self, *args) -> None:
        with os.fdopen(self.args_fd, "wb") as f:
            self.args_fd = None
            pickle.dump(args, f, protocol=pickle.HIGHEST_PROTOCOL)

    def result(self):
        return _collect(*self.child.pop())[0]

    def close(self) -> None:
        if self.args_fd is not None:
            os.close(self.args_fd)
            self.args_fd = None


class _Here:
    """forked_worker without a fork: fn(*args) run here when its result is asked for."""

    def __init__(self, prepare: Callable[[], None], fn: Callable):
        self.prepare, self.fn, self.args = prepare, fn, ()

    def send(self, *args) -> None:
        self.args = args

    def result(self):
        self.prepare()
        return self.fn(*self.args)


def _fork(fn: Callable, part: Sequence, started: list, with_parent: bool = False) -> None:
    """A child evaluating `part`, (its pid, the pipe its results come through) appended to `started`.
    SIGINT and SIGTERM are held over the fork (processes.signals_held: one landing in an after-fork
    hook would be lost) and until the child is in `started` (raised then, the caller's cleanup
    finds it). `with_parent`: the child is killed when this process ends, however it ends (a
    SIGKILL too: processes.parent_death_signal), and ends at once if this process is gone already."""
    read, write = os.pipe()
    parent, arm = os.getpid(), processes.parent_death_signal() if with_parent else None
    with processes.signals_held():
        pid = os.fork()
        if pid == 0:
            _child(fn, part, read, write, parent, arm)
        started.append((pid, read))
    os.close(write)


def _child(fn: Callable, part: Sequence, read: int, write: int, parent: int, arm: Callable | None) -> None:
    """The forked child: its results (or its error) pickled through `write`, then out at once
    (os._exit: none of the parent's exit handlers, no teardown of its objects)."""
    try:
        os.close(read)
        if arm is not None:
            arm()
            if os.getppid() != parent:   # the parent ended before the signal was armed
                return
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
    """A child's results (its error raised here), unpickled as it writes them (its pickling and this
    one overlap); the child ended and reaped on every ending."""
    try:
        with os.fdopen(fd, "rb") as f:
            try:
                ok, value = pickle.load(f)
            except EOFError:
                raise RuntimeError(f"a planning process (pid {pid}) ended without its results") from None
    finally:
        _end(pid)
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
