"""--zero 3: the parameters sharded too, with PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`),
not a hand-written ZeRO-3 (torchtitan does the same): every block, then the whole model, over a 1-D
device mesh of the DP x CP group (`reduction_group`'s). FSDP2 all-gathers a block's parameters
before its forward and its backward and frees them after, and reduce-scatters (averages) its grads
in backward: each rank keeps 1/W of the parameters, grads and AdamW states, as DTensors
`Shard(0)` of the mesh (dim 0 padded to a multiple of W in FSDP2's own storage).

The rest of the library reads them through `local` (this rank's rows: the grad norm, the memory
tracker) and DCP checkpoints them as they are (a DTensor is a shard of the dense tensor to DCP,
which reshards on load; under TP their rows are gathered into the TP shards the plan places:
checkpoint/placement.py).

Under TP (SP, the async linear, the vocab-parallel head) the mesh is the same DP x CP group, so
FSDP2 shards each rank's TP shard further: the TP layers see whole (TP-local) weights between
FSDP2's all-gather and its free, and keep their own collectives on activations. The library's
marks on a Parameter (`MARKS`: TP-partial grad, tied copy, expert) are copied onto the DTensor
Parameters FSDP2 puts in their place, so `finalize_grads` sums the TP-partial grads over TP on
this rank's rows of them after FSDP2's reduce-scatter (the TP ranks' rows are the same rows of
the same shapes, and a sum of reduce-scattered grads is the reduce-scatter of the sum).

FSDP2's all-gathers and reduce-scatters run through `distributed.comm` (`LibraryAllGather`,
`LibraryReduceScatter`: FSDP2's custom-comm hooks), so a memory meter sees them as it sees the
library's own collectives.

A MoE model at ep_size 1 shards its experts as any parameter: every expert runs on every rank
(on no rows when no token reached it: moe/experts.py), so its grad exists on every rank and
FSDP2's reduce-scatters match; the grad norm sums the experts' shards over their EDP group.
Under expert parallelism (ep_size > 1) each MoE layer's experts are an FSDP2 group of their own,
over the EDP mesh (the ranks that hold the same experts; torchtitan's apply_fsdp does the same),
the block's other parameters over DP x CP: the experts are gathered inside the MoE layer, between
the EP token all-to-all and the combine, and their grads reduce-scattered over EDP divided by
D x C (`shard_experts`). Where the EDP group is one rank (ep = dp x cp) the experts are left out
of FSDP2, whole on their rank and reduced by `finalize_grads` as under DDP. The grad norm sums
the experts' shards over EDP, then over EP.

Under pipeline parallelism (any schedule: 1F1B, GPipe, interleaved, zb) a stage keeps its
parameters gathered from its first forward to the end of the schedule (`reshard_after_forward`
False), no microbatch's backward reduce-scatters, and every group reduce-scatters once after the
last backward (`reduced_after_the_schedule`, as torch.distributed.pipelining's stage and
torchtitan do): the schedule holds several microbatches between their forwards and backwards, and
a zero-bubble W step makes weight grads after its B, which per-microbatch gathers and
reduce-scatters would not follow. Between steps a stage holds 1/W of its parameters and of their
AdamW states; within one it holds the parameters whole and their grads unsharded, as --zero 0
does (memory/analytic/fsdp_pipeline.py).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..distributed import comm
from ..distributed.loaded_types import is_dtensor, is_fsdp_module
from ..groups import ProcessGroups
from ..loss_normalisation import grad_divisor
from ..moe.experts import GroupedExperts
from .reduction_group import reduction_group

# what the library marks on a Parameter (tensor_parallel.layers, parallel_model, data_parallel):
# its grad is partial over TP, it is a tied embedding copy, it is an expert's weight
MARKS = ("tp_partial_grad", "shared_embedding", "expert_parallel")


class Meshes(NamedTuple):
    """The device meshes FSDP2 shards over: the DP x CP group's, and under expert parallelism the
    EDP group's for the experts (None: ep_size 1, the experts sharded with their block; or a
    one-rank EDP group, ep = dp x cp, the experts left out of FSDP2)."""
    dense: DeviceMesh
    experts: DeviceMesh | None


def shard_fully(model: nn.Module, groups: ProcessGroups, meshes: Meshes | None = None) -> nn.Module:
    """`model` with every block and then the root under `fully_shard` over the DP x CP mesh
    (`meshes`: made beforehand, `sharding_meshes`; --estimate makes them outside its fake mode).
    Under expert parallelism each MoE layer's experts first, over their EDP mesh, or left out of
    FSDP2 where the EDP group is one rank (`shard_experts`)."""
    from torch.distributed.fsdp import fully_shard  # here: slow to import (DTensor), needed to shard only
    meshes = meshes or sharding_meshes(groups, next(model.parameters()).device.type)
    # None: FSDP2's default (blocks resharded after forward, the root kept for the backward that follows
    # at once); under PP a stage keeps its parameters gathered over the step's microbatches
    reshard = None if groups.par.pp == 1 else False
    marks = {name: {k: v for k, v in vars(p).items() if k in MARKS} for name, p in model.named_parameters()}
    layers = model.model.layers
    for block in (layers.values() if isinstance(layers, nn.ModuleDict) else layers):
        unsharded = shard_experts(block, groups, meshes.experts)
        fully_shard(block, mesh=meshes.dense, reshard_after_forward=reshard, ignored_params=unsharded or None)
    fully_shard(model, mesh=meshes.dense, reshard_after_forward=reshard,
                ignored_params=set(unsharded_experts(model, groups)) or None)
    for module in model.modules():
        if is_fsdp_module(module):
            module.set_custom_all_gather(LibraryAllGather())
            module.set_custom_reduce_scatter(LibraryReduceScatter())
    for name, p in model.named_parameters():   # FSDP2's DTensor Parameters carry the marks of the ones they replace
        for key, value in marks[name].items():
            setattr(p, key, value)
    return model


def shard_experts(block: nn.Module, groups: ProcessGroups, mesh: DeviceMesh | None) -> set[nn.Parameter]:
    """Under expert parallelism (ep_size > 1), the block's experts under their own `fully_shard`
    over the EDP mesh (torchtitan's apply_fsdp does the same): the ranks that hold the same experts,
    the DP x CP ranks strided by ep. Their grads are divided by D x C as the dense ones (every token of
    the DP x CP ranks reached its expert on one rank of the EDP group: `grad_divisor`), not by the
    EDP size FSDP2 would average over. Returns the expert parameters left out of FSDP2: all of
    them where the EDP group is one rank (ep = dp x cp: nothing to shard over; reduced as under DDP
    by `finalize_grads`). At ep_size 1 the experts are sharded with their block (nothing done here)."""
    if groups.par.ep == 1:
        return set()
    from torch.distributed.fsdp import fully_shard  # loaded already by shard_fully
    experts = [m for m in block.modules() if isinstance(m, GroupedExperts)]
    if mesh is None:
        return {p for m in experts for p in m.parameters()}
    for module in experts:
        fully_shard(module, mesh=mesh, reshard_after_forward=groups.par.pp == 1)
        module.set_gradient_divide_factor(float(grad_divisor(groups.par)))
        module.set_force_sum_reduction_for_comms(True)   # summed, then divided (gloo has no PREMUL_SUM)
    return set()


def unsharded_experts(model: nn.Module, groups: ProcessGroups) -> list[nn.Parameter]:
    """The expert parameters FSDP2 leaves alone (ep = dp x cp: a one-rank EDP group)."""
    if groups.par.ep == 1 or groups.edp is not None:
        return []
    return [p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]


@contextmanager
def reduced_after_the_schedule(model: nn.Module, groups: ProcessGroups):
    """Around a pipeline schedule's microbatches (pp_size > 1; nothing otherwise), as
    torch.distributed.pipelining's stage does with FSDP2 (torchtitan's PP x FSDP): no microbatch's
    backward reduce-scatters nor reshards (`set_requires_gradient_sync(False)`: the grads accumulate
    on the gathered parameters, which `reshard_after_forward=False` kept since the first forward);
    after the last one every FSDP2 group reduce-scatters its grads once and reshards, and FSDP2's
    end-of-backward bookkeeping runs as after a last backward. Collective over each group's mesh,
    the groups in the same order on every rank of the stage."""
    if groups.par.pp == 1 or not is_fully_sharded(model):
        yield
        return
    model.set_is_last_backward(False)
    model.set_reshard_after_backward(False)
    model.set_requires_gradient_sync(False)
    yield
    model.set_is_last_backward(True)
    model.set_reshard_after_backward(True)
    model.set_requires_gradient_sync(True)
    from torch.distributed.fsdp import fully_shard  # loaded already: the model is sharded
    state = fully_shard.state(model)
    for each in state._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


@contextmanager
def resharded_after_the_forwards(model: nn.Module, groups: ProcessGroups):
    """Around a forward-only pass under PP (evaluation; nothing otherwise): `reshard_after_forward`
    False keeps every group gathered after it, so each is resharded here, and a checkpoint or the
    next optimizer step sees FSDP2's shards as after a training step."""
    yield
    if groups.par.pp == 1 or not is_fully_sharded(model):
        return
    for module in model.modules():
        if is_fsdp_module(module):
            module.reshard()


class LibraryAllGather:
    """FSDP2's all-gather (its `AllGather` interface: `allocate` its buffer, run it) through
    `distributed.comm`, so that it is a marked collective as the library's own are: a memory meter
    then counts gloo's copies of the buffers as the library's collectives' (not at all) and
    waits for the backend to release them. Blocking, and so on a GPU ordered on FSDP2's stream."""

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        comm.all_gather_into(output_tensor, input_tensor, group)
        return None   # done: FSDP2 waits only on a Work


class LibraryReduceScatter(LibraryAllGather):
    """FSDP2's reduce-scatter of a block's grads (its `ReduceScatter` interface), as LibraryAllGather."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        comm.reduce_scatter_into(output_tensor, input_tensor, group, op)
        return None


def sharding_mesh(groups: ProcessGroups, device_type: str) -> DeviceMesh:
    """The 1-D device mesh of the DP x CP group (`reduction_group`'s) that FSDP2 shards over."""
    return DeviceMesh.from_group(reduction_group(groups, ""), device_type)


def sharding_meshes(groups: ProcessGroups, device_type: str) -> Meshes:
    """The DP x CP mesh, and under expert parallelism the EDP group's (the DP x CP ranks that hold
    the same experts; none where that group is one rank)."""
    experts = groups.edp is not None and groups.par.ep > 1
    return Meshes(sharding_mesh(groups, device_type),
                  DeviceMesh.from_group(groups.edp, device_type) if experts else None)


def is_fully_sharded(model: nn.Module) -> bool:
    return is_fsdp_module(model)


def local(t):
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if is_dtensor(t) else t


def whole(t):
    """A DTensor gathered whole (collective over its mesh; the tensor itself otherwise)."""
    return t.full_tensor() if is_dtensor(t) else t
