"""`estimate_step_memory`: the tracker of a real run, on fake tensors with a fake process group.

One process stands in for the worst rank of a dp*pp*cp*tp world: the model, optimizer and batch
are FakeTensors (shapes and dtypes, no data), collectives go to PyTorch's fake backend, no
kernel runs. The steps are the real `train_step`, so the tensors that live and die are those of
a real run, and a 64-layer seq-2048 configuration is measured in seconds on a laptop.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from ..config import MiniMindConfig, ParallelConfig, check_layout
from ..groups import ProcessGroups
from ..parallel_model import ParallelMiniMindForCausalLM
from ..training import make_optimizer, train_step
from .meter import MemoryMeter
from .tracker import MemoryReport


def _to_dtype(model, dtype):
    """model.to(dtype) as in a real run (floating buffers too, tied weights stay tied). Fake
    parameters cannot be swapped in place, so the cast puts new ones in their slots."""
    cast = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if p not in cast:
                    cast[p] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                module._parameters[name] = cast[p]
        for name, b in module._buffers.items():
            if b is not None and b.is_floating_point():
                module._buffers[name] = b.to(dtype)
    return model


def ddp_gradient_buckets(model: nn.Module) -> list[torch.Tensor]:
    """What DistributedDataParallel adds to memory: its flat gradient buckets, one element per
    parameter element, in the parameters' dtype, held for the model's lifetime (the grads are
    copied in, all-reduced, copied back: nothing else stays). DDP itself cannot wrap fake
    parameters, and its all-reduce changes no shape, so the estimate runs the bare model with
    these buckets beside it."""
    sizes: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.requires_grad:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    return [torch.empty(n, dtype=dt) for dt, n in sizes.items()]


def estimate_step_memory(model_config: MiniMindConfig, par: ParallelConfig, *, seq_len: int,
                         micro_batch_size: int, dtype=torch.bfloat16, iters: int = 2, warmup: int = 1,
                         rank: int = 0) -> MemoryReport:
    """Peak memory of `iters` training steps (after `warmup`) of global rank `rank`, without kernels.
    Every TP/DP rank holds the same shapes, so rank 0 stands in for the worst one."""
    if par.pp > 1 or par.cp > 1:
        raise NotImplementedError("estimate_step_memory: pipeline / context parallelism not supported yet")
    check_layout(model_config, par, seq_len=seq_len)
    if dist.is_initialized():
        raise RuntimeError("estimate_step_memory needs its own (fake) process group; "
                           "call it from a process without torch.distributed initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=par.world_size)
    try:
        groups = ProcessGroups.build(par)  # real (fake-backend) groups, built outside the fake mode
        with FakeTensorMode():
            model = _to_dtype(ParallelMiniMindForCausalLM(model_config, par, groups), dtype)
            optimizer = make_optimizer(model, lr=1e-3)
            buckets = ddp_gradient_buckets(model) if par.dp > 1 else []
            ids = torch.randint(0, model_config.vocab_size, (micro_batch_size, seq_len))
            labels = ids.clone()
            for _ in range(warmup):
                train_step(model, optimizer, groups, ids, labels)
            meter = MemoryMeter("cpu", model, optimizer)
            for bucket in buckets:
                meter.tracker.mark(bucket, "temporaries")
            with meter:
                for _ in range(iters):
                    train_step(model, optimizer, groups, ids, labels)
        return meter.report()
    finally:
        dist.destroy_process_group()
