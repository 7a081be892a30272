"""What one CPU rank holds before any model: the resident memory of a Python process that has
imported the library (torch with it) and joined a one-rank gloo group, as a rank does before its
task builds a model (`worker.init_distributed`). `options.RANK_PROCESS_BYTES` is this, rounded up.

    python scripts/rank_process_rss.py
"""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from minimind_parallel import tasks, worker  # noqa: F401  (what a rank imports)


def resident_mib() -> float:
    """VmRSS of this process (Linux /proc)."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def main():
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        dist.all_reduce(torch.ones(1))
        print(f"resident after imports, gloo init and one all-reduce: {resident_mib():.0f} MiB "
              f"(torch {torch.__version__})")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
