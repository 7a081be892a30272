"""The distributed optimizer's AdamW states as its slices: each rank writes, and reads back, only
the parts of the parameters it owns, as DCP chunks of the dense tensors; nothing is gathered (as
Megatron-LM's distributed optimizer saves its sharded state, here in
torch.distributed.checkpoint's format).

A part [lo, hi) of a parameter's flattened TP shard (`zero.Piece`) is at most three rectangles of
that shard (the tail of its first row, whole rows, the head of its last row), placed in the dense
tensor at the TP shard's offset. Each state is a ShardedTensor of this rank's rectangles whose
metadata lists the rectangles of every rank that holds a copy of the whole tensor with it (one
exchange of the chunk lists per save or load): DCP writes each rank's own chunks and its index
describes the whole tensor, so a load of any layout reads the chunks it covers from it, and this
one reads a checkpoint of any layout chunk by chunk. A part several ranks hold is written by one:
a TP-replicated parameter's by TP rank 0, a tied embedding's (on two pipeline stages) by the
first stage. AdamW's step is the scalar it is.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import MiniMindConfig, ParallelConfig
from ..groups import ProcessGroups
from ..plan import grad_is_shared_over_stages, plan_of, tp_split_dim
from ..zero import DistributedOptimizer
from .placement import checkpoint_key

SLICED = ("exp_avg", "exp_avg_sq")   # AdamW's states shaped like the parameter (its step is a scalar)


def rectangles(lo: int, hi: int, shape: torch.Size) -> list[tuple[int, list[int], list[int]]]:
    """Elements [lo, hi) of a row-major tensor of `shape` (1-D or 2-D) as rectangles:
    (their first element's place in [lo, hi), offsets, sizes)."""
    if len(shape) == 1:
        return [(0, [lo], [hi - lo])]
    if len(shape) != 2:
        raise ValueError(f"a sliced state of {len(shape)} dimensions (shape {tuple(shape)}) is not supported")
    cols, out = shape[1], []
    row, col = divmod(lo, cols)
    end_row, end_col = divmod(hi, cols)
    if row == end_row:
        return [(0, [row, col], [1, end_col - col])]
    if col:
        out.append((0, [row, col], [1, cols - col]))
        row += 1
    if end_row > row:
        out.append((out[0][2][1] if out else 0, [row, 0], [end_row - row, cols]))
    if end_col:
        out.append((hi - lo - end_col, [end_row, 0], [1, end_col]))
    return out


def _written_here(name: str, config: MiniMindConfig, groups: ProcessGroups) -> bool:
    """Whether this rank writes its parts of `name` (the others who hold the same parts do not)."""
    if tp_split_dim(name, groups.par) is None and groups.tp_rank != 0:
        return False
    return not (grad_is_shared_over_stages(name, config, groups.par) and not groups.is_first_stage)


def _rectangles_here(optimizer: DistributedOptimizer, config: MiniMindConfig, par: ParallelConfig,
                     groups: ProcessGroups, *, writers_only: bool):
    """(key, dense offsets, sizes, its slice (buffer, bucket), where in the slice) of every rectangle
    of this rank's parts (writers_only: only the parts this rank writes)."""
    for b in optimizer.buffers:
        for i, bucket in enumerate(b.layout.buckets):
            for piece in bucket.pieces(b.rank):
                if writers_only and not _written_here(piece.name, config, groups):
                    continue
                local = b.params[piece.name].shape
                shift = [0] * len(local)
                dim = tp_split_dim(piece.name, par)
                if dim is not None:
                    shift[dim] = groups.tp_rank * local[dim]
                for start, offsets, sizes in rectangles(piece.lo, piece.hi, local):
                    yield (checkpoint_key(piece.name, config), [o + s for o, s in zip(offsets, shift)], sizes,
                           (b, i), piece.shard_offset + start)


def _sharded(key: str, mine: list, tensors: list[torch.Tensor], every: list, me: tuple, config: MiniMindConfig,
             par: ParallelConfig, *, same_copy: bool) -> ShardedTensor:
    """A ShardedTensor of `tensors` (this rank's rectangles `mine` of `key`) whose metadata lists the
    rectangles of every rank in `every` (same_copy: only of the ranks on this stage, and for a
    TP-replicated parameter on this TP rank: the ranks that hold one copy of the tensor)."""
    from torch.distributed._shard.metadata import ShardMetadata  # here: slow to import (DTensor), needed to save or load only
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
    listed = []
    for r, (device, stage, tp_rank, theirs) in enumerate(every):
        if same_copy and (stage != me[1] or (tp_split_dim(key, par) is None and tp_rank != me[2])):
            continue
        listed += [ShardMetadata(o, s, f"rank:{r}/{device}") for o, s in theirs.get(key, [])]
    shards = [Shard(t, ShardMetadata(o, s, f"rank:{dist.get_rank()}/{me[0]}")) for (o, s), t in zip(mine, tensors)]
    meta = ShardedTensorMetadata(listed, torch.Size(plan_of(key).shape(config)),   # the dense tensor
                                 TensorProperties(dtype=tensors[0].dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta, process_group=None)


def _exchange(rects: list, device: str, groups: ProcessGroups) -> tuple[list, tuple]:
    """Every rank's (device, stage, TP rank, {key: [(offsets, sizes)]}); this rank's. Collective."""
    me = (device, groups.pp_rank, groups.tp_rank, {})
    for key, offsets, sizes, *_ in rects:
        me[3].setdefault(key, []).append((offsets, sizes))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, me)
    return every, me


def sliced_states(optimizer: DistributedOptimizer, config: MiniMindConfig, par: ParallelConfig,
                  groups: ProcessGroups) -> dict:
    """What a save writes: {checkpoint key: {"step": scalar, "exp_avg" / "exp_avg_sq": ShardedTensor
    of this rank's chunks}} ({} before the first step). Collective over the world."""
    inner = optimizer.inner
    if not inner.state:
        return {}
    rects = list(_rectangles_here(optimizer, config, par, groups, writers_only=True))
    every, me = _exchange(rects, str(optimizer.buffers[0].flat.device), groups)
    out: dict = {}
    for key in me[3]:
        mine = [r for r in rects if r[0] == key]
        slices = [(inner.state[r[3][0].mains[r[3][1]]], r[4], r[2]) for r in mine]   # (its slice's states, at, sizes)
        out[key] = {"step": slices[0][0]["step"]}
        for k in SLICED:
            tensors = [s[k][at:at + _numel(sizes)].view(sizes) for s, at, sizes in slices]
            out[key][k] = _sharded(key, [(r[1], r[2]) for r in mine], tensors, every, me, config, par, same_copy=False)
    return out


def sliced_targets(path: str, optimizer: DistributedOptimizer, config: MiniMindConfig, par: ParallelConfig,
                   groups: ProcessGroups) -> tuple[dict, list]:
    """What a load reads: ({checkpoint key: {"step": scalar, "exp_avg" / "exp_avg_sq": ShardedTensor
    of empty chunks, this rank's parts}}, the rectangles for `assemble`). Collective over the world."""
    rects = list(_rectangles_here(optimizer, config, par, groups, writers_only=False))
    every, me = _exchange(rects, str(optimizer.buffers[0].flat.device), groups)
    import torch.distributed.checkpoint as dcp  # here: slow to import (DTensor), needed to save or load only
    index = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    out, loaded = {}, []
    for key in me[3]:
        mine = [r for r in rects if r[0] == key]
        step = index[f"optim.{key}.step"]
        out[key] = {"step": torch.empty(tuple(step.size), dtype=step.properties.dtype)}
        for k in SLICED:
            dtype = index[f"optim.{key}.{k}"].properties.dtype
            tensors = [torch.empty(r[2], dtype=dtype, device=optimizer.buffers[0].flat.device) for r in mine]
            out[key][k] = _sharded(key, [(r[1], r[2]) for r in mine], tensors, every, me, config, par, same_copy=True)
            loaded += [(r, k, t) for r, t in zip(mine, tensors)]
    return out, loaded


def assemble(optimizer: DistributedOptimizer, targets: dict, loaded: list) -> dict[int, dict[str, torch.Tensor]]:
    """The inner AdamW's state (by its parameter index) from what `sliced_targets` read: each slice
    its rectangles in place, the padding zero, the saved step."""
    step = next(iter(targets.values()))["step"]
    where, index, out = {}, 0, {}
    for b in optimizer.buffers:
        for i, bucket in enumerate(b.layout.buckets):
            out[index] = {"step": step.clone(), **{k: torch.zeros(bucket.shard_numel, dtype=b.flat.dtype,
                                                                  device=b.flat.device) for k in SLICED}}
            where[(id(b), i)] = index
            index += 1
    for (_, _, sizes, (b, i), at), k, values in loaded:
        out[where[(id(b), i)]][k][at:at + _numel(sizes)].copy_(values.reshape(-1))
    return out


def _numel(sizes: list[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n
