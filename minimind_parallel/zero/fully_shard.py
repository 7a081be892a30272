"""--zero 3: the parameters sharded too, with PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`),
not a hand-written ZeRO-3 (torchtitan does the same): every block, then the whole model, over a 1-D
device mesh of the DP x CP group (`reduction_group`'s). FSDP2 all-gathers a block's parameters
before its forward and its backward and frees them after, and reduce-scatters (averages) its grads
in backward: each rank keeps 1/W of the parameters, grads and AdamW states, as DTensors
`Shard(0)` of the mesh (dim 0 padded to a multiple of W in FSDP2's own storage).

The rest of the library reads them through `local` (this rank's rows: the grad norm, the memory
tracker) and DCP checkpoints them as they are (a DTensor is a shard of the dense tensor to DCP,
which reshards on load: checkpoint/state.py).

What it does not compose with here (refused before launch, `config.check_zero`): tensor
parallelism (the project's TP layers mark TP-partial grads on their Parameters, which FSDP2
replaces by DTensors, and `finalize_grads` sums those over TP on whole grads) and pipeline
parallelism (the schedule interleaves microbatches' forwards and backwards across stages, which
FSDP2's per-module gathers and resharding are not wired for here).
"""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from ..groups import ProcessGroups
from .reduction_group import reduction_group


def shard_fully(model: nn.Module, groups: ProcessGroups) -> nn.Module:
    """`model` with every block and then the root under `fully_shard` over the DP x CP mesh."""
    device_type = next(model.parameters()).device.type
    mesh = DeviceMesh.from_group(reduction_group(groups, ""), device_type)
    layers = model.model.layers
    for block in (layers.values() if isinstance(layers, nn.ModuleDict) else layers):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_fully_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def local(t):
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def whole(t):
    """A DTensor gathered whole (collective over its mesh; the tensor itself otherwise)."""
    return t.full_tensor() if isinstance(t, DTensor) else t
