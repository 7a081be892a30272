"""--zero 2's staging buffers, fixed up front: which buckets of a flat buffer fill in one action
of the pipeline order and which may stay filling across actions.

Backward makes a bucket's grads one after another; under gpipe and 1f1b all of a bucket's grads
come in one backward, the buckets fill one at a time, and a pool of `IN_FLIGHT` + 1 buffers of
the largest bucket serves them (the oldest reduce-scatter waited for when none is free). Under
the orders that post their steps (interleaved's model chunks, zb's W steps) a bucket whose
parameters' grads come in different actions -- parameters of two model chunks, or (zb) a weight
whose grad its linear defers to W beside one made in B -- stays filling from the first of them
to the last, while other buckets fill: such a bucket gets a staging buffer of its own (its
padded size), made with the others at the start, so that every step holds the same buffers
(Megatron-LM's distributed optimizer allocates its grad buffers once, up front, too). Under zb
every bucket of several parameters is taken as one such (a block's bucket holds B's and W's
weights), a bucket of one parameter fills in one action; under interleaved a bucket is one such
where its parameters span two model chunks.

The memory model counts the same buffers (memory/analytic/zero_sizes.staging_bytes).
"""
from __future__ import annotations

from dataclasses import dataclass

from .buckets import BufferLayout

IN_FLIGHT = 2   # --zero 2: buckets whose reduce-scatter may run while the next one fills (each holds a staging buffer)


def chunk_of(name: str, layer_chunks: dict[int, int], chunks: int) -> int:
    """The model chunk of parameter `name` (`layer_chunks`: each of the stage's layers' chunk): the
    embedding's is the first, the final norm's and lm_head's the last."""
    if name.startswith("model.layers."):
        return layer_chunks[int(name.split(".")[2])]
    return 0 if name.startswith("model.embed_tokens.") else chunks - 1


@dataclass(frozen=True)
class StagingPlan:
    """A flat buffer's staging: the buckets with a buffer of their own, the shared pool's size."""

    own: tuple[bool, ...]   # per bucket
    pool: int               # buffers in the pool
    pool_numel: int         # elements of each: the largest padded bucket of the pool's

    def numel(self, layout: BufferLayout) -> int:
        """Elements of every staging buffer."""
        return sum(b.padded_numel for b, mine in zip(layout.buckets, self.own) if mine) + self.pool * self.pool_numel


def staging_plan(layout: BufferLayout, *, weight_steps: bool, layer_chunks: dict[int, int], chunks: int
                 ) -> StagingPlan:
    """The buckets of `layout` that keep a staging buffer of their own (see the module's docstring)
    under an order with W steps (`weight_steps`: zb) or with `chunks` model chunks per stage
    (`layer_chunks`: each layer's), and the pool of the rest."""
    def spans(names: tuple[str, ...]) -> bool:
        if weight_steps:
            return len(names) > 1
        return chunks > 1 and len({chunk_of(n, layer_chunks, chunks) for n in names}) > 1

    own = tuple(spans(b.names) for b in layout.buckets)
    pooled = [b.padded_numel for b, mine in zip(layout.buckets, own) if not mine]
    return StagingPlan(own=own, pool=min(IN_FLIGHT + 1, len(pooled)), pool_numel=max(pooled, default=0))
