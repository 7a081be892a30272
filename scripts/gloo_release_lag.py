"""How often gloo still holds a finished collective's tensors when the call returns: the lag that
`distributed.comm._Release` waits out while a memory meter measures (docs/memory.md, "Live-storage
tracker").

Two gloo ranks on the CPU run each kind of collective of `distributed.comm` `--calls` times under
the storage tracker, dropping the tensors right after each call, once with the release wait off (a
tracker that does not ask for it) and once with it on (the tracker as a meter runs it). Prints,
per kind and rank, after how many calls the dropped tensor was still alive. How often depends on
the machine's load; on two shared, loaded cores, between none and about one call in five per kind
(40 of 200 for the async all-reduce), and none with the wait.

    python scripts/gloo_release_lag.py [--calls 200]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from distributed import run_ranks  # noqa: E402
from minimind_parallel.distributed import comm  # noqa: E402
from minimind_parallel.memory import StorageTracker  # noqa: E402

KINDS = ("all_reduce", "all_gather_dim0", "reduce_scatter_dim0", "all_to_all_dim0", "send_recv",
         "async_all_reduce", "async_all_gather_dim0", "async_reduce_scatter_dim0")


class NoReleaseTracker(StorageTracker):
    """The storage tracker without the release wait: what a meter would see without it."""

    waits_for_release = False


def one_collective(kind: str, x: torch.Tensor, group):
    """One collective of `kind` on x; returns what the caller would keep."""
    peer = 1 - dist.get_rank()
    if kind == "send_recv":
        y = torch.empty_like(x)
        comm.send_recv(group, sends=[(x, peer)], recvs=[(y, peer)])
        return y
    if kind.startswith("async_"):
        out, handle = getattr(comm, kind[len("async_"):])(x, group, async_op=True)
        handle.wait()
        return out
    return getattr(comm, kind)(x, group)


def late_frees(calls: int, tracker_type) -> dict[str, int]:
    """Per kind: after how many of `calls` collectives a tensor dropped right after the call was
    still alive (the tracker's live bytes above what they were before the call)."""
    late = dict.fromkeys(KINDS, 0)
    with tracker_type() as tracker:
        for kind in KINDS:
            for _ in range(calls):
                base = tracker.live_bytes
                x = torch.randn(1024)
                out = one_collective(kind, x, dist.group.WORLD)
                del x, out
                late[kind] += tracker.live_bytes != base
    return late


def measure(calls: int) -> dict[str, dict[str, int]]:
    return {"without the wait": late_frees(calls, NoReleaseTracker), "with the wait": late_frees(calls, StorageTracker)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200, help="collectives of each kind")
    args = p.parse_args()
    ranks = run_ranks(measure, 2, args.calls, timeout=1800)
    print(f"tensors still alive after the call returned, of {args.calls} calls (rank 0 / rank 1)")
    print(f"| kind | {' | '.join(ranks[0])} |")
    print("|---|" + "---|" * len(ranks[0]))
    for kind in KINDS:
        print(f"| {kind} | " + " | ".join(f"{ranks[0][w][kind]} / {ranks[1][w][kind]}" for w in ranks[0]) + " |")


if __name__ == "__main__":
    main()
