"""What a `c10d` operator is, as the project counts collectives: its kind and the bytes of the buffer
this rank hands it (profiling.collectives.CollectiveLog, planning.collective_clock.CollectiveClock):

    all_gather      the local shard sent to every peer          ([S/C, ...])
    reduce_scatter  the full buffer reduced                     ([S, ...])
    all_reduce      the buffer reduced
    all_to_all      the buffer split among the ranks            (its part c goes to rank c)
    send / recv     the tensor sent / received
"""
from __future__ import annotations

# c10d operator name (without overload) -> kind; its argument holding this rank's buffer
_OPS = {
    "_allgather_base_": ("all_gather", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "allreduce_": ("all_reduce", 0),
    "alltoall_base_": ("all_to_all", 1),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    "broadcast_": ("broadcast", 0),
}


def _nbytes(x) -> int:
    tensors = x if isinstance(x, (list, tuple)) else [x]
    return sum(t.numel() * t.element_size() for t in tensors)


def kind_and_bytes(func, args) -> tuple[str, int]:
    """(kind, this rank's buffer bytes) of the c10d operator `func` called with `args`."""
    name = func.__name__.split(".")[0]
    kind, arg = _OPS.get(name, (name, None))
    return kind, (_nbytes(args[arg]) if arg is not None else 0)
