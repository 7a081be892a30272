"""The sizes the planner's layouts share, made once: a stage's (`stage_kind`) across the zero
levels that leave it unchanged, and each kind of model chunk's (`chunk_kinds`), with what the
replays derive from them (a backward's moments, a chunk's terms).

A stage's sizes read the zero level and dp only for DDP's flat buckets (`StageSizes.ddp_buckets`:
none under a pipeline or under --zero), so the layouts that differ only there -- a pipeline's
zero levels, one stage's --zero 1 and 2 -- are one kind. Under a pipeline of model chunks, the
virtual stages that are neither the first nor the last and have as many layers have the same
sizes (their parameters' names aside): one kind for every such chunk of a layout. Remembered on
the model (memo.Frozen) and the layout with the zero level (and dp, for a chunk) set to the one
of its kind, so each `StageSizes.par` is that layout's.
"""
from __future__ import annotations

import functools

from ...config import MiniMindConfig, ParallelConfig
from ...memo import Frozen
from ...plan import stage_layers
from .backward_moments import backward_moments
from .posted_replay import UnitTerms, unit_terms
from .stage_sizes import StageSizes, stage_sizes


class SizesKind:
    """One kind of stage or model chunk: its sizes, and made once from them its backward's moments
    and its terms (by whether B defers the weight grads)."""

    __slots__ = ("sizes", "_backward", "_terms", "derived")

    def __init__(self, sizes: StageSizes):
        self.sizes, self._backward, self._terms = sizes, None, {}
        self.derived: dict = {}     # what a replay makes of them, by its own key

    @property
    def backward(self) -> dict:
        if self._backward is None:
            self._backward = backward_moments(self.sizes)
        return self._backward

    def terms(self, zb: bool) -> UnitTerms:
        if zb not in self._terms:
            self._terms[zb] = unit_terms(self.sizes, zb)
        return self._terms[zb]


def stage_kind(c: MiniMindConfig, par: ParallelConfig, stage: int, memo: dict, **kw) -> SizesKind:
    """stage_sizes(c, par, stage, **kw), one object for the layouts whose zero level leaves it the
    same (not --zero 3: its replay reads other sizes). `memo`: one layout's."""
    if "stage" not in memo:
        zero = 0 if par.pp > 1 else min(par.zero, 1)     # DDP's buckets: only one stage, without --zero
        memo["stage"] = (model_key(c, memo), Frozen(par, zero=zero))
    model, shape = memo["stage"]
    return _stage_kind(model, shape, stage, tuple(sorted(kw.items())))


def model_key(c: MiniMindConfig, memo: dict) -> Frozen:
    """The model's key, made once per layout (`memo`: its own)."""
    if "model" not in memo:
        memo["model"] = Frozen(c)
    return memo["model"]


@functools.lru_cache(maxsize=1 << 15)   # a few grids of kinds: a grid's zero levels are thousands apart
def _stage_kind(model: Frozen, par: Frozen, stage: int, kw: tuple) -> SizesKind:
    return SizesKind(stage_sizes(model.config, par.config, stage, **dict(kw), model=model))


def chunk_kinds(c: MiniMindConfig, par: ParallelConfig, stage: int, memo: dict, *, cp_rank: int = 0,
                **kw) -> tuple[SizesKind, ...]:
    """stage_sizes.chunk_sizes of stage `stage`, one object per kind of virtual stage (first, last,
    its layers). `memo`: one layout's, kept across its stages. A chunk is read only through its
    terms (posted_replay.unit_terms), which read neither the step's microbatches (only the stage's
    own terms do: the batch) nor, but on the virtual stage that holds them, the loss's
    (--loss_chunks, --vocab_parallel: the head on the last) and the embedding's (--vocab_parallel:
    the first): so a kind is remembered without them (`chunk_shape`), and the layouts that differ
    only there share it. A stage's list is remembered on the layout without what no chunk reads
    (the zero level, dp: `chunk_shape` sets them), so a grid's zero levels and dps ask it once."""
    if "chunked" not in memo:
        memo["chunked"] = (model_key(c, memo), Frozen(par, zero=0, dp=1),
                           tuple(sorted({**kw, "num_microbatches": 1}.items())))
    model, shape, rest = memo["chunked"]
    return _chunk_kinds(model, shape, stage, cp_rank, rest)


@functools.lru_cache(maxsize=1 << 14)
def _chunk_kinds(model: Frozen, shape: Frozen, stage: int, cp_rank: int, rest: tuple) -> tuple[SizesKind, ...]:
    par = shape.config
    chunks = _virtual_stages(model.config.num_hidden_layers, par.pp, par.virtual_stages, stage)
    shapes: dict = {}   # each (first, last)'s layout of its kind (chunk_shape), made once
    for _, (first, last, _) in chunks:
        if (first, last) not in shapes:
            shapes[first, last] = Frozen(par, **chunk_shape(par, first, last))
    return tuple(_stage_kind(model, shapes[first, last], vs, (("cp_rank", cp_rank), *rest))
                 for vs, (first, last, _) in chunks)


def chunk_shape(par: ParallelConfig, first: bool, last: bool) -> dict:
    """What a chunk's kind is remembered on, as changes to its layout `par`: the chunk a stage of
    the pipeline of P V stages (no DDP, no --zero), the loss's flags only on the last virtual
    stage, --vocab_parallel on the first and the last (the embedding, the head)."""
    chunked = dict(pp=par.pp * par.virtual_stages, virtual_stages=1, zero=0, dp=1)
    if last:
        return chunked
    return {**chunked, "loss_chunks": 1, "vocab_parallel": par.vocab_parallel and first}


@functools.lru_cache(maxsize=4096)
def _virtual_stages(layers: int, pp: int, virtual_stages: int, stage: int) -> tuple:
    """Each chunk's virtual stage of `stage` and its kind: (first, last, its layers); a middle one
    (neither first nor last) as the first middle virtual stage of as many layers, whose sizes are
    its own (their parameters' names aside)."""
    total = pp * virtual_stages
    kinds = [(vs == 0, vs == total - 1, len(stage_layers(layers, total, vs))) for vs in range(total)]
    return tuple((kinds.index(kinds[vs]), kinds[vs]) for vs in (v * pp + stage for v in range(virtual_stages)))
