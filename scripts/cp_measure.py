"""Context parallelism measured on gloo ranks (CPU): the bytes of every CP collective of one
MiniMind-3 block per comm type, and the per-rank attention time of the load-balanced split
against the contiguous one (docs/context_parallel.md).

    python scripts/cp_measure.py [--seq_len 4096] [--cp 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from distributed import run_ranks  # noqa: E402
from minimind_parallel import MiniMindConfig, ParallelConfig, ProcessGroups  # noqa: E402
from minimind_parallel.context_parallel import COMM_TYPES, ContextLayout, context_parallel_attention  # noqa: E402
from minimind_parallel.context_parallel import blockwise, ring  # noqa: E402
from minimind_parallel.model import rope_tables  # noqa: E402
from minimind_parallel.parallel_model import ParallelBlock  # noqa: E402
from minimind_parallel.profiling.collectives import CollectiveLog  # noqa: E402

CONFIG = dict(hidden_size=768, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4, vocab_size=6400)


def block_bytes(cp: int, seq_len: int, batch: int):
    """{comm: (forward {kind: (calls, bytes)}, backward ...)} of one block on CP rank 0."""
    out = {}
    for comm in COMM_TYPES:
        par = ParallelConfig(cp=cp, cp_comm_type=comm)
        groups = ProcessGroups.build(par)
        c = MiniMindConfig(**CONFIG)
        block = ParallelBlock(c, par, groups.tp, groups.cp)
        layout = ContextLayout.of(par, seq_len)
        pos = layout.positions(groups.cp_rank)
        cos, sin = (t[pos] for t in rope_tables(c.head_dim, seq_len, 1e6))
        x = torch.randn(seq_len // cp, batch, c.hidden_size, requires_grad=True)
        with CollectiveLog() as fwd:
            y = block(x, cos, sin, layout)
        with CollectiveLog() as bwd:
            y.sum().backward()
        out[comm] = (_summed(fwd.calls), _summed(bwd.calls))
    return out


def _summed(calls):
    out = {}
    for kind, n in calls:
        k, b = out.get(kind, (0, 0))
        out[kind] = (k + 1, b + n)
    return out


def attention_time(cp: int, seq_len: int, comm: str, balance: bool, reps: int):
    """This rank's CPU seconds (thread time: other jobs on the cores do not count) inside block
    computations (forward + backward of the attention), median
    over `reps`; the waits for peers are outside."""
    busy = [0.0]

    def timed(fn):
        def run(*a, **k):
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                busy[0] += time.thread_time() - t0
        return run

    ring.chunked_forward, ring.chunked_backward = timed(blockwise.chunked_forward), timed(blockwise.chunked_backward)
    group = dist.new_group(list(range(cp)))
    layout = ContextLayout(seq_len=seq_len, cp=cp, load_balance=balance)
    d, b = 96, 1
    g = torch.Generator().manual_seed(0)
    q = torch.randn(seq_len // cp, b, 8, d, generator=g, requires_grad=True)
    k = torch.randn(seq_len // cp, b, 4, d, generator=g, requires_grad=True)
    v = torch.randn(seq_len // cp, b, 4, d, generator=g, requires_grad=True)
    times = []
    for _ in range(reps):
        busy[0] = 0.0
        dist.barrier()
        context_parallel_attention(q, k, v, group=group, layout=layout, comm_type=comm).sum().backward()
        times.append(busy[0])
    return sorted(times)[len(times) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq_len", type=int, default=4096)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    table = run_ranks(block_bytes, args.cp, args.cp, args.seq_len, 1, timeout=1800)[0]
    print(f"one block, S={args.seq_len}, B=1, C={args.cp}, float32, CP rank 0: kind calls bytes")
    for comm, (fwd, bwd) in table.items():
        print(f"  {comm:10s} forward {fwd}  backward {bwd}")
    print(f"ring attention forward + backward, S={args.seq_len}, C={args.cp}: per-rank block compute ms")
    for balance in (True, False):
        ms = [1e3 * t for t in run_ranks(attention_time, args.cp, args.cp, args.seq_len, "ring", balance, args.reps,
                                         timeout=1800)]
        idle = 1 - sum(ms) / (len(ms) * max(ms))
        print(f"  load_balance={balance!s:5s} " + " ".join(f"{m:8.1f}" for m in ms) +
              f"   slowest {max(ms):.1f}, idle share of the others {100 * idle:.0f}%")


if __name__ == "__main__":
    main()
