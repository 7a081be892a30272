"""What each rank runs under torchrun: `python -m minimind_parallel.worker <task> ... -- ...`."""
from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from . import tasks
from .cli import parse
from .options import resolve_device


def init_distributed(device: str) -> torch.device:
    """gloo on CPU, NCCL on CUDA; one torch thread per rank on CPU (ranks share the cores)."""
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10))
        return torch.device("cuda", local)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    return torch.device("cpu")


@record
def main(argv: list[str]) -> int:
    launch, args = parse(argv)
    device = init_distributed(resolve_device(launch))
    try:
        code = tasks.get(launch.task).run_rank(launch, args, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
