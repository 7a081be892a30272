"""Lining up a rank's clock with its device and with the other ranks, for timing steps."""
from __future__ import annotations

import torch
import torch.distributed as dist


def synchronize(device, *, barrier: bool = True) -> None:
    """Wait until the kernels queued on `device` have run (CUDA; CPU runs them eagerly) and, with
    `barrier`, until every rank of the default group has got here too."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if barrier and dist.is_initialized():
        dist.barrier()
