"""The distributed optimizer's AdamW states written as its slices: each rank writes the parts of
the parameters it owns as DCP chunks of the dense tensors, nothing gathered (as Megatron-LM's
distributed optimizer saves its sharded state, here in torch.distributed.checkpoint's format).

A part [lo, hi) of a parameter's flattened TP shard (`zero.Piece`) is at most three rectangles of
that shard (the tail of its first row, whole rows, the head of its last row), placed in the dense
tensor at the TP shard's offset. Each state is a ShardedTensor whose metadata lists every rank's
chunks (one exchange of the chunk lists per save), so DCP writes each rank's own and its index
describes the whole tensor: loading reads any layout from it (a plain or TP-placed tensor, the
chunks it covers), as it reads a checkpoint of whole states. A part that other ranks hold as well
is written by one of them: a TP-replicated parameter by TP rank 0, a tied embedding held on two
pipeline stages by the first stage.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

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


def sliced_states(optimizer: DistributedOptimizer, config: MiniMindConfig, par: ParallelConfig,
                  groups: ProcessGroups) -> dict:
    """{checkpoint key: {"step": scalar, "exp_avg" / "exp_avg_sq": ShardedTensor of this rank's
    chunks}} ({} before the first step). Collective over the world (the chunk lists)."""
    inner = optimizer.inner
    if not inner.state:
        return {}
    chunks: dict[str, list] = {}     # key -> [(offsets, sizes, {state: values})]
    steps: dict[str, torch.Tensor] = {}
    for b in optimizer.buffers:
        for main, bucket in zip(b.mains, b.layout.buckets):
            state = inner.state[main]
            for piece in bucket.pieces(b.rank):
                if not _written_here(piece.name, config, groups):
                    continue
                key, local = checkpoint_key(piece.name, config), b.params[piece.name].shape
                steps[key] = state["step"]
                shift = [0] * len(local)
                dim = tp_split_dim(piece.name, par)
                if dim is not None:
                    shift[dim] = groups.tp_rank * local[dim]
                for start, offsets, sizes in rectangles(piece.lo, piece.hi, local):
                    at = piece.shard_offset + start
                    n = sizes[0] * (sizes[1] if len(sizes) > 1 else 1)
                    chunks.setdefault(key, []).append(
                        ([o + s for o, s in zip(offsets, shift)], sizes,
                         {k: state[k][at:at + n].view(sizes) for k in SLICED}))
    device = str(next(iter(inner.state.values()))["exp_avg"].device)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (device, {key: [(o, s) for o, s, _ in c] for key, c in chunks.items()}))
    out = {}
    for key, mine in chunks.items():
        listed = [ShardMetadata(o, s, f"rank:{r}/{dev}") for r, (dev, theirs) in enumerate(every)
                  for o, s in theirs.get(key, [])]
        out[key] = {"step": steps[key]}
        for k in SLICED:
            local_shards = [Shard(v[k], ShardMetadata(o, s, f"rank:{dist.get_rank()}/{device}")) for o, s, v in mine]
            meta = ShardedTensorMetadata(listed, torch.Size(plan_of(key).shape(config)),   # the dense tensor
                                         TensorProperties(dtype=mine[0][2][k].dtype))
            out[key][k] = ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, meta,
                                                                                    process_group=None)
    return out
