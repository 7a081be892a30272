"""ZeRO 1 and 2 as a distributed optimizer (Megatron-LM's `DistributedOptimizer`; Rajbhandari et
al. 2020): every rank of a parameter's reduction group (DP x CP) updates only its slice of it.

Per (reduction group, dtype), one flat buffer (`buckets.BufferLayout`):

    params     the parameters' own storage: each parameter is a view of the flat buffer
               [numel padded], so the all-gather after the step writes them in place
    mains      this rank's slice of every bucket, as the parameter AdamW steps (a view of the
               flat buffer: under mixed precision the parameters are float32, so these are the
               float32 master weights, of this slice only, as Megatron-LM's fp32 parameters)
    grads      --zero 1: a flat grad buffer [numel padded] of which every parameter's .grad is a
               view; after the last microbatch each bucket is reduce-scattered in place into this
               rank's slice, the mains' grads.
               --zero 2: only this rank's slices [numel padded / W], and staging buffers allocated
               once, up front (`staging.staging_plan`: a pool of `IN_FLIGHT` + 1 of the largest
               bucket, as DeepSpeed's ZeRO stage 2 keeps its gradient buckets, and under
               interleaved and zb one of its own for each bucket that may fill across actions of
               the order): a post-accumulate-grad hook on every parameter
               copies its grad into its bucket's staging buffer (adds it, if it came before in the
               same filling) and frees it at once; when every parameter of a bucket has come,
               whatever their order (the buffer follows backward's order, so under gpipe and 1f1b
               one bucket fills at a time), its reduce-scatter starts asynchronously, at most `IN_FLIGHT` at a
               time (the oldest is waited for, added to the slice and its buffer freed for the
               next bucket; a bucket filling again waits for its own); after the last microbatch the buckets still filling are reduced with
               the missing grads zeroed (interleaved, zb), and the rest waited for before the step (a
               bucket some of whose parameters got no grad in the whole step is an error). So no parameter's grad
               outlives its hook, and what the grads cost is constant: the slices and the buffers.
    optimizer  AdamW over the mains: its states are 1/W of the replicated optimizer's.

After the reduce-scatter the slices are divided by the replicas (`loss_normalisation.grad_divisor`,
as DDP averages), then the slices of grads that are partial over TP (norms under SP, q/k norms)
are summed over TP (the TP ranks' layouts are the same) and the embedding-group copies (a bucket of
their own, at the same offsets on both stages) over the embedding group: what `finalize_grads`
does to whole grads, done to the slices. The step updates the mains, then every bucket is
all-gathered in place, so every parameter is whole again for the next forward.
"""
from __future__ import annotations

import weakref

from collections import deque

import torch
from torch import nn

from ..distributed import comm
from ..groups import ProcessGroups
from ..loss_normalisation import grad_divisor
from ..moe.placement import expert_of
from .buckets import BufferLayout, Piece, plan_buffer
from .reduction_group import reduction_group
from .staging import IN_FLIGHT, StagingPlan, staging_plan


def staging_buffers(layout: BufferLayout, plan: StagingPlan, like: torch.Tensor
                    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
    """--zero 2: each bucket's own staging buffer (None: the pool's), and the pool, in `like`'s
    dtype and device, all made now."""
    own = [torch.zeros(b.padded_numel, dtype=like.dtype, device=like.device) if mine else None
           for b, mine in zip(layout.buckets, plan.own)]
    return own, [torch.zeros(plan.pool_numel, dtype=like.dtype, device=like.device) for _ in range(plan.pool)]


class FlatBuffer:
    """The parameters of one (reduction group, dtype), laid out by `plan_buffer`."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], group, *, level: int, bucket_numel: int | None,
                 groups: ProcessGroups, weight_steps: bool = False, layer_chunks: list[list[int]] | None = None):
        """`weight_steps`: the order has W steps (zb); `layer_chunks`: the stage's layers of each model
        chunk (None: one chunk) -- which buckets may fill across actions (`staging.staging_plan`)."""
        self.group, self.level, self.groups = group, level, groups
        self.params = dict(named)
        # the experts' own buffer (over EDP); at ep_size 1 they share the DP x CP one with the rest
        self.experts = groups.par.ep > 1 and expert_of(named[0][0]) is not None
        self.rank, world = comm.rank_in(group), comm.group_size(group)
        self.layout: BufferLayout = plan_buffer(
            [(n, p.numel(), bool(getattr(p, "shared_embedding", False)) and groups.embed is not None)
             for n, p in named], world, bucket_numel)
        self._offsets = {n: o for b in self.layout.buckets for n, o in zip(b.names, b.offsets)}
        self.flat = self._adopt_parameters()                                                 # [numel padded]
        self.mains = [nn.Parameter(self.flat[slice(*b.shard_range(self.rank))]) for b in self.layout.buckets]
        self.grad_flat = self._slice_grads()
        if level == 2:
            self._arrived: list[set] = [set() for _ in self.layout.buckets]   # names in each filling bucket
            self._came: list[set] = [set() for _ in self.layout.buckets]      # names seen this step, per bucket
            self._pending: list = []      # (bucket, its reduced slice, the work, its staging buffer, pooled)
            self._filling: dict = {}      # bucket -> (its staging buffer, the bucket's view of it)
            chunks = layer_chunks or [[]]
            self.staging = staging_plan(self.layout, weight_steps=weight_steps, chunks=len(chunks),
                                        layer_chunks={i: c for c, layers in enumerate(chunks) for i in layers})
            self._own, pool = staging_buffers(self.layout, self.staging, self.flat)
            self._free = deque(pool)
            self._bucket_of = {n: i for i, b in enumerate(self.layout.buckets) for n in b.names}
            self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready(name)) for name, p in named]
        self.zero_grad()

    def _adopt_parameters(self) -> torch.Tensor:
        """The flat parameter buffer [numel padded], every parameter's values copied in and the
        parameter made a view of it (the padding stays zero)."""
        first = next(iter(self.params.values()))
        flat = torch.zeros(self.layout.numel, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for name, p in self.params.items():
                view = self.view(flat, name)
                view.copy_(p)
                p.data = view
        return flat

    def _slice_grads(self) -> torch.Tensor | None:
        """The mains' grads: --zero 1 slices of a whole flat grad buffer (returned, [numel padded]);
        --zero 2 slices of one tensor of this rank's slices only ([numel padded / W]; None returned)."""
        if self.level == 1:
            whole = torch.zeros_like(self.flat)
            for main, b in zip(self.mains, self.layout.buckets):
                main.grad = whole[slice(*b.shard_range(self.rank))]
            return whole
        slices, offset = torch.zeros(self.layout.shard_numel, dtype=self.flat.dtype, device=self.flat.device), 0
        for main, b in zip(self.mains, self.layout.buckets):
            main.grad = slices[offset:offset + b.shard_numel]
            offset += b.shard_numel
        return None

    def view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """Parameter `name`'s elements of a flat tensor laid out as this buffer, shaped like it."""
        p = self.params[name]
        return flat[self._offsets[name]:self._offsets[name] + p.numel()].view_as(p)

    # -- grads ---------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero the slices (and --zero 1's whole buffer, the parameters' .grad views)."""
        for main in self.mains:
            main.grad.zero_()
        if self.level == 1:
            self.grad_flat.zero_()
            for name, p in self.params.items():
                p.grad = self.view(self.grad_flat, name)
        else:
            assert not self._pending and not self._filling, "zero_grad with reduce-scatters in flight"
            self._arrived = [set() for _ in self.layout.buckets]
            self._came = [set() for _ in self.layout.buckets]
            for p in self.params.values():
                p.grad = None

    def _grad_ready(self, name: str):
        """Parameter `name`'s post-accumulate-grad hook. It holds the buffer weakly: the parameters
        must not keep it (and its process group) alive in a reference cycle, else the group
        outlives the rank's `destroy_process_group` and its backend's threads are torn down
        during the interpreter's finalization (see distributed/teardown.py)."""
        owner = weakref.ref(self)

        def hook(param: nn.Parameter) -> None:
            buffer = owner()
            if buffer is not None and param.grad is not None:   # None: a zb B step's deferred weight
                buffer._take_grad(name, param)
        return hook

    def _take_grad(self, name: str, param: nn.Parameter) -> None:
        """--zero 2: parameter `name`'s grad copied (added) into its bucket's staging buffer and
        freed; the bucket's reduce-scatter started once all its parameters' grads have come."""
        i = self._bucket_of[name]
        b = self.layout.buckets[i]
        staging = self._filling[i][1] if i in self._filling else self._open(i)
        start = self._offsets[name] - b.start
        rows = staging[start:start + param.numel()]
        arrived = self._arrived[i]
        self._came[i].add(name)
        # a grad that comes again before its bucket is complete (a later microbatch's, under an
        # order whose chunks or W steps interleave microbatches) adds to the one already there
        if name in arrived:
            rows.add_(param.grad.reshape(-1))
        else:
            rows.copy_(param.grad.reshape(-1))
            arrived.add(name)
        param.grad = None
        if len(arrived) == len(b.names):
            arrived.clear()
            self._start_reduce(i)

    def _open(self, i: int) -> torch.Tensor:
        """--zero 2: a staging buffer for bucket i: its own (its last reduce-scatter waited for, if
        still running), or one of the pool (the oldest reduce-scatters waited for until one is
        free). The buffers are the ones made at the start: a bucket that finds none is an error."""
        if self._own[i] is not None:
            while any(entry[0] == i for entry in self._pending):
                self._finish(self._pending.pop(0))
            buffer = self._own[i]
        else:
            while not self._free and any(entry[4] for entry in self._pending):
                self._finish(self._pending.pop(0))
            if not self._free:
                raise RuntimeError(f"--zero 2: more buckets filling at once than the {self.staging.pool} "
                                   f"staging buffers of the pool (bucket {i} of {len(self.layout.buckets)})")
            buffer = self._free.popleft()
        b = self.layout.buckets[i]
        staging = buffer[:b.padded_numel]                    # [bucket padded]
        staging[sum(b.numels):].zero_()                      # the padding
        self._filling[i] = (buffer, staging)
        return staging

    def _flush_partial(self) -> None:
        """--zero 2, after the last microbatch: the buckets still filling (under an interleaved or zb
        order a bucket completes before the last microbatch's grads of some of its parameters
        come, which then fill it again without the others) reduce-scattered with the grads that
        did not come again zeroed, so every grad is summed exactly once."""
        for i in sorted(self._filling):
            b, staging = self.layout.buckets[i], self._filling[i][1]
            for name, offset in zip(b.names, b.offsets):
                if name not in self._arrived[i]:
                    start = offset - b.start
                    staging[start:start + self.params[name].numel()].zero_()
            self._arrived[i].clear()
            self._start_reduce(i)

    def _start_reduce(self, i: int) -> None:
        """--zero 2: bucket i's staging buffer reduce-scattered asynchronously."""
        buffer, staging = self._filling.pop(i)
        while len(self._pending) >= IN_FLIGHT:
            self._finish(self._pending.pop(0))
        shard, work = comm.reduce_scatter_flat(staging, self.group, async_op=True)
        self._pending.append((i, shard, work, buffer, self._own[i] is None))

    def _finish(self, entry) -> None:
        i, shard, work, buffer, pooled = entry
        work.wait()
        self.mains[i].grad.add_(shard)
        if pooled:
            self._free.append(buffer)

    def reduce(self) -> None:
        """After the last microbatch: every bucket's grads summed into this rank's slices and averaged."""
        if self.level == 1:
            for b in self.layout.buckets:
                comm.reduce_scatter_flat(self.grad_flat[b.start:b.start + b.padded_numel], self.group)
        else:
            # a bucket some of whose parameters got a grad this step and others none (an unused
            # parameter): its slices would silently hold zeros for them
            partial = [i for i, came in enumerate(self._came) if came and len(came) < len(self.layout.buckets[i].names)]
            if partial:
                b = self.layout.buckets[partial[0]]
                raise RuntimeError("a bucket's grads were not all produced by backward: "
                                   f"{sorted(set(b.names) - self._came[partial[0]])[:3]} got none")
            self._flush_partial()
            while self._pending:
                self._finish(self._pending.pop(0))
        replicas = grad_divisor(self.groups.par)
        for main in self.mains:
            main.grad.div_(replicas)
        self._sum_partial_grads()

    def _sum_partial_grads(self) -> None:
        """The slices of TP-partial grads summed over TP, the embedding-group copies over that group."""
        partial = [g for name, g in self.named_grads() if getattr(self.params[name], "tp_partial_grad", False)]
        if partial and self.groups.tp is not None:
            flat = torch.cat(partial)
            comm.all_reduce(flat, self.groups.tp)
            offset = 0
            for g in partial:
                g.copy_(flat[offset:offset + g.numel()])
                offset += g.numel()
        for main, b in zip(self.mains, self.layout.buckets):
            if getattr(self.params[b.names[0]], "shared_embedding", False) and self.groups.embed is not None:
                comm.all_reduce(main.grad, self.groups.embed)

    def pieces(self) -> list[tuple[Piece, int]]:
        """(piece, its bucket) of every parameter part this rank owns."""
        return [(piece, i) for i, b in enumerate(self.layout.buckets) for piece in b.pieces(self.rank)]

    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        """(parameter name, the reduced grad of its part this rank owns: a flat view of a slice)."""
        return [(piece.name, self.mains[i].grad[piece.shard_offset:piece.shard_offset + piece.numel])
                for piece, i in self.pieces()]

    # -- parameters ----------------------------------------------------------------------------
    def gather(self) -> None:
        """Every rank's updated slices into every bucket: the parameters whole again."""
        self.gather_into(self.flat)

    def gather_into(self, flat: torch.Tensor) -> None:
        """Every rank's slices of `flat` (laid out as this buffer) all-gathered into it, in place."""
        for b in self.layout.buckets:   # one at a time: each bucket is a view of the one flat tensor
            comm.all_gather_flat(flat[b.start:b.start + b.padded_numel], self.group)


class DistributedOptimizer:
    """AdamW (MiniMind's hyper-parameters, `training.make_optimizer`) over this rank's slices of
    the parameters of `model`; the step's parts are called by `training.step` (`reduce_grads`,
    the grad norm over `named_grads`, `step`, `zero_grad`). `param_groups` and `state` are the
    inner AdamW's (the train task sets the learning rate there)."""

    def __init__(self, model: nn.Module, groups: ProcessGroups, *, lr: float, weight_decay: float = 0.01,
                 bucket_numel: int | None = None, weight_steps: bool = False):
        """`weight_steps`: the pipeline order has W steps (zb), for --zero 2's staging buffers (with
        the model's chunks: `staging.staging_plan`)."""
        level = groups.par.zero
        if level not in (1, 2):
            raise ValueError(f"a distributed optimizer shards at --zero 1 or 2; got zero={level}")
        by_key: dict = {}
        for name, p in model.named_parameters():
            by_key.setdefault((reduction_group(groups, name), p.dtype), []).append((name, p))
        chunks = [[int(i) for i in names] for names in getattr(getattr(model, "model", None), "chunks", [[]])]
        self.buffers = [FlatBuffer(named, group, level=level, bucket_numel=bucket_numel, groups=groups,
                                   weight_steps=weight_steps, layer_chunks=chunks)
                        for (group, _), named in by_key.items()]
        self.inner = torch.optim.AdamW([m for b in self.buffers for m in b.mains], lr=lr,
                                       weight_decay=weight_decay, foreach=False)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def register_step_post_hook(self, hook):
        return self.inner.register_step_post_hook(hook)

    def reduce_grads(self) -> None:
        for b in self.buffers:
            b.reduce()

    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        return [item for b in self.buffers for item in b.named_grads()]

    def grads_by_group(self) -> list[tuple[tuple, list[tuple[str, torch.Tensor]]]]:
        """(the groups to sum over, this rank's (name, grad part)) of every buffer: the grad norm sums
        the squares of a buffer's parts over its reduction group and, for the experts' buffer under
        expert parallelism, then over EP (the other ranks' experts)."""
        return [((b.group, b.groups.ep) if b.experts else (b.group,), b.named_grads()) for b in self.buffers]

    def main_grads(self) -> list[torch.Tensor]:
        """Every slice's grad (unscaling and clipping scale these)."""
        return [m.grad for b in self.buffers for m in b.mains]

    def step(self) -> None:
        self.inner.step()
        for b in self.buffers:
            b.gather()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the slices (the buffers are kept: `set_to_none` is accepted for torch's signature)."""
        del set_to_none
        for b in self.buffers:
            b.zero_grad()
