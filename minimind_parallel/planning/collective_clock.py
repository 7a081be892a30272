"""`CollectiveClock`: when each collective of a real step ran, and how much of that was the link.

A collective's wall time inside a step has two parts: waiting for the other ranks to arrive (their
compute, not the link: the time model counts it once, as compute) and what runs once every rank is
there (the copies in and out, the backend's threads, the link). The clock is an observer of
`distributed.comm.collective` (it has `collective_region()`), so it sees every collective the
library issues and the waits of the asynchronous ones: each one's bytes (the c10d operators inside
it, as `distributed.c10d_ops` counts them) and its issue and return on the
system-wide monotonic clock, which the ranks of one machine share. `after_all_arrived` pairs the
ranks' calls by order (every rank of a group issues its collectives in the same order) and keeps
the part after the last rank arrived.

    with CollectiveClock() as clock:
        train_step(...)
    clock.calls -> [Call(kind="all_reduce", nbytes=524288, start=..., end=...), ...]
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from torch.utils._python_dispatch import TorchDispatchMode

from ..distributed.c10d_ops import kind_and_bytes


@dataclass(frozen=True)
class Call:
    kind: str           # the c10d operator's kind ("all_reduce", "all_gather", ...; "wait": an async handle's)
    nbytes: int         # this rank's buffer
    start: float        # time.monotonic() at its issue
    end: float          # and at its return


class CollectiveClock(TorchDispatchMode):
    """Every collective (and async wait) run inside the context: `calls` in issue order."""

    def __init__(self):
        super().__init__()
        self.calls: list[Call] = []
        self._inside: list[tuple[str, int]] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and self._inside is not None:
            self._inside.append(kind_and_bytes(func, args))
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def collective_region(self):
        """Entered by `distributed.comm.collective` around a collective, and around an async one's wait."""
        outer, self._inside = self._inside, []
        start = time.monotonic()
        try:
            yield
        finally:
            end = time.monotonic()
            inside, self._inside = self._inside, outer
            kind = inside[0][0] if inside else "wait"
            self.calls.append(Call(kind, sum(n for _, n in inside), start, end))


def after_all_arrived(mine: list[Call], others: list[list[Call]]) -> list[float]:
    """Seconds of each of this rank's calls after the last rank of its group had issued it (the
    calls of every rank paired by order: the same collectives in the same order)."""
    if any(len(o) != len(mine) for o in others):
        raise ValueError(f"the ranks ran different numbers of collectives: {len(mine)} and "
                         f"{[len(o) for o in others]}")
    return [max(0.0, c.end - max([c.start] + [o[i].start for o in others])) for i, c in enumerate(mine)]
