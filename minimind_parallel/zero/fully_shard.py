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

What it does not compose with here (refused before launch, `config.check_zero`): pipeline
parallelism (the schedule interleaves microbatches' forwards and backwards across stages, which
FSDP2's per-block gathers and resharding are not wired for here), and expert parallelism
(ep_size > 1, as every zero level).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..distributed import comm
from ..distributed.loaded_types import is_dtensor, is_fsdp_module
from ..groups import ProcessGroups
from .reduction_group import reduction_group

# what the library marks on a Parameter (tensor_parallel.layers, parallel_model, data_parallel):
# its grad is partial over TP, it is a tied embedding copy, it is an expert's weight
MARKS = ("tp_partial_grad", "shared_embedding", "expert_parallel")


def shard_fully(model: nn.Module, groups: ProcessGroups, mesh: DeviceMesh | None = None) -> nn.Module:
    """`model` with every block and then the root under `fully_shard` over the DP x CP mesh
    (`mesh`: that mesh made beforehand, `sharding_mesh`; --estimate makes it outside its fake mode)."""
    from torch.distributed.fsdp import fully_shard  # here: slow to import (DTensor), needed to shard only
    mesh = mesh or sharding_mesh(groups, next(model.parameters()).device.type)
    marks = {name: {k: v for k, v in vars(p).items() if k in MARKS} for name, p in model.named_parameters()}
    layers = model.model.layers
    for block in (layers.values() if isinstance(layers, nn.ModuleDict) else layers):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if is_fsdp_module(module):
            module.set_custom_all_gather(LibraryAllGather())
            module.set_custom_reduce_scatter(LibraryReduceScatter())
    for name, p in model.named_parameters():   # FSDP2's DTensor Parameters carry the marks of the ones they replace
        for key, value in marks[name].items():
            setattr(p, key, value)
    return model


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


def is_fully_sharded(model: nn.Module) -> bool:
    return is_fsdp_module(model)


def local(t):
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if is_dtensor(t) else t


def whole(t):
    """A DTensor gathered whole (collective over its mesh; the tensor itself otherwise)."""
    return t.full_tensor() if is_dtensor(t) else t
