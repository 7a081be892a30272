"""`estimate_step_memory`: the tracker of a real run, on fake tensors with a fake process group.

One process stands in for the worst rank of a dp*pp*cp*tp world: the model, optimizer and batch
are FakeTensors (shapes and dtypes, no data), collectives go to PyTorch's fake backend, no
kernel runs. The steps are the real `train_step`, so the tensors that live and die are those of
a real run, and a 64-layer seq-2048 configuration is measured in seconds on a laptop
(scripts/memory_book_table.py prints how long its table, up to 64 layers, takes).

The fake backend's store is PyTorch's private `torch.testing._internal.distributed.fake_pg`; this
module alone imports it (`fake_process_group`), and a torch build without it refuses with one line.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ..collector import paused_collector
from ..config import ConfigError, MiniMindConfig, ParallelConfig, check_layout
from ..context_parallel import ContextLayout
from ..data.batches import Batch, cp_tokens, shift_labels
from ..groups import ProcessGroups
from ..moe.feed_forward import set_fake_routing
from ..moe.placement import expert_of
from ..parallel_model import ParallelMiniMindForCausalLM
from ..pipeline_parallel import Schedule
from ..training import make_optimizer, train_step
from ..zero.buckets import DEFAULT_BUCKET_MB
from ..zero.fully_shard import shard_fully, sharding_meshes
from .analytic import as_dtype
from .fake_memo import RememberingFakeTensorMode
from .analytic.moe_sizes import Routing, RoutingPolicy, is_per_microbatch, microbatch_routings, stage_expert_rows
from .meter import MemoryMeter
from .tracker import MemoryReport


def _fake_store():
    """The fake backend's store. Imported here, not at the top: the module is private to PyTorch's
    tests and may be missing from a torch build, which should cost --estimate only."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # private, maybe missing: see above
    except ImportError:
        raise ConfigError("--estimate needs PyTorch's fake process group (torch.testing._internal.distributed"
                          f".fake_pg), which this torch build ({torch.__version__}) lacks") from None
    return FakeStore()


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    """torch.distributed initialised on PyTorch's fake backend as `rank` of `world_size` for the
    block, destroyed after: no peers, every collective returns at once and a receive gets an empty
    buffer of its shape."""
    dist.init_process_group("fake", store=_fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _to_dtype(model, dtype):
    """model.to(dtype) as in a real run (floating buffers too, tied weights stay tied). Fake
    parameters cannot be swapped in place, so the cast puts new ones in their slots, with the
    marks the model set on the old ones (partial over TP, shared over the embedding group)."""
    cast = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if p not in cast:
                    cast[p] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                    cast[p].__dict__.update(p.__dict__)
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
    these buckets beside it. The experts' weights are not DDP's (`data_parallel.wrap_data_parallel`)."""
    sizes: dict[torch.dtype, int] = {}
    for name, p in model.named_parameters():
        if p.requires_grad and expert_of(name) is None:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    return [torch.empty(n, dtype=dt) for dt, n in sizes.items()]


def _create_optimizer_states(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """What a warm-up step leaves behind (AdamW's states), without its forward and backward. A
    plain AdamW makes its states in `_init_group`, the first part of its step, before the update
    itself: that part alone is run (the update changes no tensor's size, and here moves no value
    that matters). Any other optimizer (the distributed one under --zero 1/2) takes a whole step."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    if type(optimizer) is torch.optim.AdamW:
        for group in optimizer.param_groups:
            optimizer._init_group(group, [], [], [], [], [], [])   # torch's own state creation
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@paused_collector()   # no tensor of a step is in a reference cycle (tests/test_fake_memo.py): the collector frees none
def estimate_step_memory(model_config: MiniMindConfig, par: ParallelConfig, *, seq_len: int,
                         micro_batch_size: int, dtype=torch.bfloat16, iters: int = 2, warmup: bool = True,
                         num_microbatches: int = 1, schedule: Schedule = Schedule.ONE_F_ONE_B, stage: int = 0,
                         cp_rank: int = 0, tracker_type=None, on_step=None,
                         bucket_size_mb: float = DEFAULT_BUCKET_MB, memo: dict | None = None,
                         remember: bool = True, routing: Routing = RoutingPolicy.BALANCED,
                         ep_rank: int = 0) -> MemoryReport:
    """Peak memory of `iters` training steps, each of `num_microbatches` microbatches of
    `micro_batch_size` sequences, on one rank of pipeline stage `stage`, without kernels.
    warmup: the optimizer states exist before the window, as after the warm-up steps of a real run.
    Every TP/DP rank of a stage holds the same shapes, so the stage's first one stands in for
    the worst. Every CP rank holds S/C tokens and the same buffers; with the load-balanced split
    the same attention blocks too, with the contiguous split the later ranks see more blocks, so
    `cp_rank` picks the CP rank measured (predict_memory's cp_rank=None is the worst one). Under
    PP the fake backend answers every receive at once (an empty buffer of the boundary's shape),
    so a stage runs its schedule alone, in the order of a real run.
    tracker_type / on_step(tracker), called after each step: to watch more than the report
    (memory/allocator.py records the allocation sequence this way). Under --zero (`par.zero`) the
    distributed optimizer runs as it does on real ranks (buckets of `bucket_size_mb` MiB).
    remember: the fake dispatch remembers what each op made and makes it again without asking
    FakeTensorMode (memory/fake_memo.py: the same report, to the byte, in about half the time);
    `memo` may carry what it remembered from one call to the next (the benchmark's sweep).
    Python's cyclic collector is paused meanwhile (`collector.paused_collector`): every tensor of
    a step is freed by its last reference going, none by the collector (no tensor is ever in a
    cycle's garbage: tests/test_fake_memo.py), so the measurement is the same without it; each of
    its full collections walked every object alive (the memo, the model, torch's modules), a
    fifth of the benchmark's --estimate sweep.

    MoE: fake tensors have no routing to read, so each MoE layer's dispatch and experts split their
    rows by `routing` (predict_memory's: balanced, the worst case, or a histogram of tokens per
    expert per layer, or a list of them, one per microbatch) as EP rank `ep_rank` receives them
    (moe/fake_routing.py)."""
    if not 0 <= stage < par.pp:
        raise ValueError(f"stage must be in [0, pp); got stage={stage}, pp={par.pp}")
    if not 0 <= cp_rank < par.cp:
        raise ValueError(f"cp_rank must be in [0, cp); got cp_rank={cp_rank}, cp={par.cp}")
    if not 0 <= ep_rank < par.ep:
        raise ValueError(f"ep_rank must be in [0, ep); got ep_rank={ep_rank}, ep={par.ep}")
    check_layout(model_config, par, seq_len=seq_len)
    dtype = as_dtype(dtype)
    if dist.is_initialized():
        raise RuntimeError("estimate_step_memory needs its own (fake) process group; "
                           "call it from a process without torch.distributed initialised")
    rank = (stage * par.cp + cp_rank) * par.tp  # the grid is (dp, pp, cp, tp): dp and tp rank 0
    with fake_process_group(rank, par.world_size):
        groups = ProcessGroups.build(par)  # real (fake-backend) groups, built outside the fake mode
        meshes = sharding_meshes(groups, "cpu") if par.zero == 3 else None   # so are --zero 3's device meshes
        with RememberingFakeTensorMode(memo) if remember else FakeTensorMode() as fake:
            model = _to_dtype(ParallelMiniMindForCausalLM(model_config, par, groups), dtype)
            if model_config.use_moe and routing != RoutingPolicy.BALANCED:
                rows = [stage_expert_rows(model_config, par, r, stage, seq_len=seq_len, micro_batch_size=micro_batch_size,
                                          ep_rank=ep_rank) for r in microbatch_routings(routing, num_microbatches)]
                set_fake_routing(model, rows if is_per_microbatch(routing) else rows[0], par.ep)
            if par.zero == 3:   # FSDP2 shards fake tensors as real ones, over the fake backend's mesh
                model = shard_fully(model, groups, meshes)
            optimizer = make_optimizer(model, 1e-3, groups, bucket_size_mb, schedule)
            # DDP over DP x CP; none under PP, nor under --zero
            buckets = ddp_gradient_buckets(model) if par.dp * par.cp > 1 and par.pp == 1 and not par.zero else []
            ids = torch.randint(0, model_config.vocab_size, (micro_batch_size * num_microbatches, seq_len))
            ids, targets = cp_tokens(Batch(ids, shift_labels(ids)), ContextLayout.of(par, seq_len),
                                     groups.cp_rank)                     # [M B, S/C]
            if warmup:
                _create_optimizer_states(model, optimizer)
            meter = MemoryMeter("cpu", model, optimizer, also_alive=tuple(buckets), tracker_type=tracker_type,
                                answer=fake.answer if remember else None)
            with meter:
                for _ in range(iters):
                    train_step(model, optimizer, groups, ids, targets, num_microbatches=num_microbatches,
                               schedule=schedule)
                    if on_step is not None:
                        on_step(meter.tracker)
        return meter.report()
