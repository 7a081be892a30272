"""The CUDA caching allocator's block rounding at the predicted peak, estimated from the analytic
model's saved tensors (no fake tensors, no replay).

`max_memory_allocated` counts blocks, not requests (memory/allocator.py, from PyTorch's
c10/cuda/CUDACachingAllocator.cpp): a request is rounded to 512 bytes, and a large one that gets a
block whose rest is 1 MiB or less keeps that rest (`should_split`). The estimate: every activation
a held block saves gets the block a fresh segment would give it (`fresh_block`): a [N, I/T] SwiGLU
tensor of 19 MiB takes a 20 MiB segment whole, a 12 MiB one takes exactly its 6 x 2 MiB. What the
real order of allocations and frees does (best-fit reuse of cached blocks, merges) is not followed:
`benchmark --estimate --device cuda` (each layout's `estimate_command`) replays it exactly.

The tensors of a block's kinds (saved_kinds.py): the SwiGLU's four (two with lean recompute)
[N, I/T] outputs, the column-parallel inputs (one [N, H] or [N/T, H] each), k and v; every other
kind counts as one tensor.
"""
from __future__ import annotations

import functools

from ..config import ParallelConfig, Recompute
from ..memory import MemoryPrediction
from ..memory.allocator import SMALL_SIZE, round_size, segment_size


def fresh_block(nbytes: int) -> int:
    """The block a request of `nbytes` gets from a new segment: the rounded size, or the whole
    segment of a large request whose rest (1 MiB or less) the allocator does not split."""
    size = round_size(nbytes)
    if size <= SMALL_SIZE:
        return size
    segment = segment_size(size)
    return segment if segment - size <= SMALL_SIZE else size


def _tensors(kind: str, recompute: Recompute, basic_sp: bool) -> int:
    """How many equal tensors the block kind `kind` is (`basic_sp`: SP without a shared or async gather)."""
    if kind == "block.mlp":
        return 2 if recompute.lean else 4
    if kind == "block.attention_kv":
        return 2
    if kind == "block.column_input":   # basic SP gathers once per linear, else one per region
        return 5 if basic_sp else 2
    return 1


def block_excess(kinds: dict[str, int], par: ParallelConfig) -> int:
    """Bytes the blocks of one held block's saved tensors hold beyond them (`fresh_block`), remembered
    on the kinds' bytes and the flags it reads: the planner's layouts share a few thousand."""
    basic_sp = par.sequence_parallel and not (par.shared_sp_gather or par.async_communication)
    return _block_excess(tuple(kinds.items()), par.recompute, basic_sp)


@functools.lru_cache(maxsize=1 << 14)
def _block_excess(kinds: tuple, recompute: Recompute, basic_sp: bool) -> int:
    held = [(k, v) for k, v in kinds if k == "block.checkpoint_input"] if recompute == Recompute.FULL else \
        [(k, v) for k, v in kinds if k.startswith("block.")]
    excess = 0
    for kind, nbytes in held:
        count = _tensors(kind, recompute, basic_sp)
        if nbytes and nbytes % count == 0:
            excess += count * (fresh_block(nbytes // count) - nbytes // count)
    return excess


def rounding_bytes(pred: MemoryPrediction, par: ParallelConfig) -> int:
    """The estimated rounding at the peak: each held block's excess, for every layer of the stage and
    every microbatch in flight there."""
    return max(pred.held_at_peak, 1) * pred.num_layers * block_excess(pred.activations_by_kind, par)
