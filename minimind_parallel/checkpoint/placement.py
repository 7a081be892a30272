"""Checkpoint tensors described by their placement in the parallel plan.

Every tensor of a checkpoint is keyed by its dense parameter name and described as a shard of
the dense tensor: a DTensor over this rank's TP group with `Shard(dim)` where the plan splits it
(column / row / vocab-parallel under the layout) and `Replicate()` otherwise. Pipeline stages
hold different keys; DP (and CP) replicas hold identical shards of the same keys, which
`torch.distributed.checkpoint` (DCP) writes once. With tp = 1 a tensor is held whole, and a plain
tensor says exactly that to DCP. Loading builds the same description for the target layout and
DCP reads the pieces of the saved chunks that each rank's shard covers (resharding).
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..config import MiniMindConfig, ParallelConfig
from ..distributed.loaded_types import is_dtensor
from ..groups import ProcessGroups
from ..plan import plan_of, tp_split_dim

TIED_KEY = "model.embed_tokens.weight"   # the name a tied embedding / lm_head pair is saved under


def checkpoint_key(name: str, config: MiniMindConfig) -> str:
    """The checkpoint key of parameter `name`: its own name, except that the lm_head copy of a tied
    pair (the last pipeline stage's) is the embedding's, so the pair is saved once and loads into both."""
    return TIED_KEY if plan_of(name).tied and config.tie_word_embeddings else name


def tp_mesh(groups: ProcessGroups, device_type: str) -> DeviceMesh | None:
    """A 1-D mesh over this rank's TP group (None for tp = 1: tensors are held whole)."""
    return None if groups.tp is None else DeviceMesh.from_group(groups.tp, device_type)


def placed(local: torch.Tensor, name: str, config: MiniMindConfig, par: ParallelConfig,
           mesh: DeviceMesh | None) -> torch.Tensor:
    """This rank's shard `local` of parameter `name` (or of an optimizer state shaped like it) as a
    shard of the dense tensor: a DTensor with the plan's placement, or `local` itself when whole.
    Under --zero 3 `local` is FSDP2's DTensor: held whole over TP it is itself a shard of the dense
    tensor (DCP writes its rows); under TP its rows are gathered into the TP shard first."""
    if mesh is None:
        return local
    from torch.distributed.tensor import DTensor, Replicate, Shard  # here: slow to import, needed with TP only
    if isinstance(local, DTensor):   # --zero 3 under TP: FSDP2's rows of the TP shard, gathered over DP x CP
        local = local.full_tensor()
    dim = tp_split_dim(name, par)
    shape = torch.Size(plan_of(name).shape(config))
    stride = torch.empty(shape, device="meta").stride()   # the dense tensor, contiguous
    return DTensor.from_local(local, mesh, [Replicate() if dim is None else Shard(dim)], run_check=False,
                              shape=shape, stride=stride)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of a checkpoint tensor made by `placed`."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def as_held(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A loaded checkpoint tensor as parameter `like` holds it (or its optimizer state shaped like
    it): under --zero 3 with TP, FSDP2's rows of the TP shard `placed` loaded (a DTensor placed as
    `like`, no collective); otherwise `tensor` itself."""
    if not is_dtensor(like):
        return tensor
    from torch.distributed.tensor import DTensor, distribute_tensor  # loaded already: `like` is one
    if isinstance(tensor, DTensor) and tensor.device_mesh != like.device_mesh:
        tensor = tensor.to_local()   # the TP shard, whole over DP x CP
    if isinstance(tensor, DTensor) or tensor.shape != like.shape:
        return tensor
    return distribute_tensor(tensor, like.device_mesh, like.placements, src_data_rank=None)
