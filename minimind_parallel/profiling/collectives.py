"""Collectives counted from the real calls, with the bytes each moves.

`CollectiveLog` is a dispatch mode that sees every `c10d` operator the process issues (the
operators `torch.distributed` runs for every backend, point-to-point included, which
`CommDebugMode` does not count) and records its kind and the bytes of the buffer this rank hands
it (`distributed.c10d_ops`: an all-gather's local shard, a reduce-scatter's full buffer, ...):

    with CollectiveLog() as log:
        y = block(x, cos, sin, layout)
    log.counts() -> {"all_gather": 1}; log.bytes() -> {"all_gather": 2048}
"""
from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

from ..distributed.c10d_ops import kind_and_bytes


class CollectiveLog(TorchDispatchMode):
    """Every c10d operator issued inside the context: `calls` [(kind, bytes)] in issue order."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.calls.append(kind_and_bytes(func, args))
        return func(*args, **(kwargs or {}))

    def counts(self) -> dict[str, int]:
        return dict(Counter(kind for kind, _ in self.calls))

    def bytes(self) -> dict[str, int]:
        out: Counter = Counter()
        for kind, n in self.calls:
            out[kind] += n
        return dict(out)
