"""The layout of one flat buffer of parameters (one dtype, one reduction group), as in Megatron-LM's
distributed optimizer (its `_ParamAndGradBuffer`): parameters placed one after another in the
order backward produces their grads (`backward_rank`: the reverse of the model's order, blocks
from the top down, inside a block the order autograd accumulates them), grouped into buckets of whole parameters of at least `bucket_numel` elements (None: one bucket), each bucket
padded to a multiple of the group's size W, so that rank r owns the slice

    bucket.start + r * bucket.shard_numel  ...  bucket.start + (r + 1) * bucket.shard_numel

of every bucket. A parameter whose gradient is summed over the embedding group (the tied
embedding / lm_head copies of the first and last pipeline stages) is a bucket of its own: both
copies then sit at the same offsets of their stages' buffers, and the sum runs over the slices.

The layout depends only on the parameters' shapes, so the ranks of a TP group (equal shapes)
have the same layout and the slices of a TP-partial grad can be summed over TP too.
"""
from __future__ import annotations

import itertools

from dataclasses import dataclass

import torch

from ..memo import cached_property

DEFAULT_BUCKET_MB = 25.0   # --bucket_size_mb: DDP's default bucket (its bucket_cap_mb)

# The order in which one block's backward accumulates its parameters' grads (recorded from
# autograd's post-accumulate-grad hooks): the MLP's, the post-attention norm's, o_proj's, the q/k
# norms', v, k, q, then the input norm's.
_BLOCK_BACKWARD = ("mlp.down_proj.", "mlp.up_proj.", "mlp.gate_proj.", "post_attention_layernorm.",
                   "self_attn.o_proj.", "self_attn.k_norm.", "self_attn.q_norm.", "self_attn.v_proj.",
                   "self_attn.k_proj.", "self_attn.q_proj.", "input_layernorm.")


def backward_rank(name: str) -> tuple:
    """Where backward produces parameter `name`'s grad: lm_head, the final norm, the blocks from
    the top down (each in `_BLOCK_BACKWARD`'s order; a parameter it does not list, as a MoE
    layer's, with the MLP's), other names (in the reverse of the model's order), the embedding."""
    if name.startswith("lm_head."):
        return (0,)
    if name.startswith("model.norm."):
        return (1,)
    if name.startswith("model.layers."):
        layer, rest = name[len("model.layers."):].split(".", 1)
        return (2, -int(layer), next((i for i, p in enumerate(_BLOCK_BACKWARD) if rest.startswith(p)), 0))
    return (4,) if name.startswith("model.embed_tokens.") else (3,)


@dataclass(frozen=True)
class Piece:
    """Where the part of parameter `name` that a rank owns lies: elements [lo, hi) of the
    parameter (flattened), at `shard_offset` in the rank's slice of its bucket."""

    name: str
    lo: int
    hi: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Bucket:
    """Parameters `names` (with `numels`) at `offsets` of the buffer; `start` + `padded_numel`."""

    names: tuple[str, ...]
    numels: tuple[int, ...]
    offsets: tuple[int, ...]      # in the buffer
    start: int
    padded_numel: int             # a multiple of the group's size
    world: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[lo, hi) of the buffer that `rank` of the group owns in this bucket."""
        lo = self.start + rank * self.shard_numel
        return lo, lo + self.shard_numel

    def pieces(self, rank: int) -> list[Piece]:
        """The parts of this bucket's parameters that `rank` owns (each parameter at most one)."""
        lo, hi = self.shard_range(rank)
        out = []
        for name, offset, numel in zip(self.names, self.offsets, self.numels):
            a, b = max(offset, lo), min(offset + numel, hi)
            if a < b:
                out.append(Piece(name, a - offset, b - offset, a - lo))
        return out


@dataclass(frozen=True)
class BufferLayout:
    buckets: tuple[Bucket, ...]

    @cached_property
    def numel(self) -> int:
        """Elements of the whole buffer, padding included (summed once: the memory model reads it for
        every stage of every --zero layout the planner predicts)."""
        return sum(b.padded_numel for b in self.buckets)

    @cached_property
    def shard_numel(self) -> int:
        """Elements a rank owns: its slice of every bucket (summed once)."""
        return sum(b.shard_numel for b in self.buckets)

    def bucket_of(self, name: str) -> int:
        return next(i for i, b in enumerate(self.buckets) if name in b.names)


def bucket_numel(bucket_size_mb: float, dtype: torch.dtype) -> int:
    """Elements of `dtype` in a bucket of `bucket_size_mb` MiB (at least one)."""
    return max(int(bucket_size_mb * 2**20) // torch.empty((), dtype=dtype).element_size(), 1)


def padded(numel: int, world: int) -> int:
    """`numel` rounded up to a multiple of `world` (at least `world`: every rank owns something)."""
    return max(-(-numel // world), 1) * world


def plan_buffer(params: list[tuple[str, int, bool]], world: int, bucket_numel: int | None) -> BufferLayout:
    """`params`: (name, numel, alone) in the model's order; `alone`: the parameter is a bucket of
    its own (an embedding-group copy). -> the buffer's buckets, in the order of `backward_rank`
    (see the module's docstring)."""
    buckets, open_names, start, open_numel = [], [], 0, 0

    def close():
        nonlocal start, open_names, open_numel
        if not open_names:
            return
        names, numels = zip(*open_names)
        offsets = tuple(start + before for before in itertools.accumulate(numels[:-1], initial=0))
        bucket = Bucket(names=names, numels=numels, offsets=offsets, start=start,
                        padded_numel=padded(open_numel, world), world=world)
        buckets.append(bucket)
        start += bucket.padded_numel
        open_names, open_numel = [], 0

    for name, numel, alone in sorted(reversed(params), key=lambda p: backward_rank(p[0])):
        if alone:
            close()
        open_names.append((name, numel))
        open_numel += numel
        if alone or (bucket_numel is not None and open_numel >= bucket_numel):
            close()
    close()
    return BufferLayout(tuple(buckets))
