"""Causal attention over a sequence split across the CP group, three ways (`--cp_comm_type`):

    all_gather  gather every rank's K and V (kv heads only, one collective for both), attend
                with this rank's queries; backward reduce-scatters dK/dV to their owners
    a2a         all-to-all from sequence shards to head shards (DeepSpeed-Ulysses, Jacobs et al.
                2023): each rank attends over the whole sequence with C-th of the heads, then
                all-to-all back; q, k and v travel in one all-to-all
    ring        K/V blocks travel around the ring while the block in hand is computed (ring.py)

In: this rank's tokens after RoPE, sequence-first: q [S/C, B, h, d], k and v [S/C, B, kv, d]
(h, kv: the heads of this TP rank). Out: [S/C, B, h, d]. Which tokens a rank holds, and so the
causal mask, comes from the `ContextLayout`.
"""
from __future__ import annotations

import torch

from ..config import CPCommType
from ..distributed import comm
from .blockwise import ChunkedAttention
from .layout import ContextLayout
from .mappings import gather_kv, heads_to_sequence, sequence_to_heads
from .ring import RingAttention

COMM_TYPES = CPCommType.values()   # the paths by name (`--cp_comm_type`)


def heads_first(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[S, B, heads, d] -> [B, kv, heads/kv, S, d] (a view: GQA groups a kv head's queries)."""
    return x.permute(1, 2, 0, 3).unflatten(1, (kv_heads, -1))


def sequence_first(x: torch.Tensor) -> torch.Tensor:
    """[B, kv, rep, S, d] -> [S, B, kv*rep, d]."""
    return x.flatten(1, 2).permute(2, 0, 1, 3)


def context_parallel_attention(q, k, v, *, group, layout: ContextLayout, comm_type: CPCommType) -> torch.Tensor:
    paths = {CPCommType.ALL_GATHER: _all_gather, CPCommType.A2A: _all_to_all, CPCommType.RING: _ring}
    if comm_type not in paths:
        raise ValueError(f"cp_comm_type must be one of {', '.join(CPCommType.values())}; got {comm_type!r}")
    return paths[comm_type](q, k, v, group, layout)


def _all_gather(q, k, v, group, layout: ContextLayout):
    rank, c, kv_heads = comm.rank_in(group), comm.group_size(group), k.shape[2]
    kv = gather_kv(torch.cat([k, v], dim=-1), group)          # [S/C, B, kv, 2d] -> [S, B, kv, 2d]
    k_all, v_all = kv.chunk(2, dim=-1)
    every_chunk = [chunk for r in range(c) for chunk in layout.chunks(r)]  # rank order
    out = ChunkedAttention.apply(heads_first(q, kv_heads), heads_first(k_all, kv_heads),
                                 heads_first(v_all, kv_heads), layout.chunks(rank), every_chunk)
    return sequence_first(out)


def _all_to_all(q, k, v, group, layout: ContextLayout):
    c, h, kv_heads = comm.group_size(group), q.shape[2], k.shape[2]
    if h % c or kv_heads % c:
        raise ValueError(f"a2a needs the heads of each TP rank divisible by cp_size; got {h} query and "
                         f"{kv_heads} kv heads, cp_size={c}")
    # [S/C, B, heads, d] -> [S/C, B, C, heads/C, d]: head group g goes to CP rank g
    packed = torch.cat([x.unflatten(2, (c, -1)) for x in (q, k, v)], dim=3)
    mine = sequence_to_heads(packed, group)                  # [S, B, (h + 2kv)/C, d]
    q_, k_, v_ = mine.split([h // c, kv_heads // c, kv_heads // c], dim=2)
    every_chunk = [chunk for r in range(c) for chunk in layout.chunks(r)]
    out = ChunkedAttention.apply(heads_first(q_, kv_heads // c), heads_first(k_, kv_heads // c),
                                 heads_first(v_, kv_heads // c), every_chunk, every_chunk)
    back = heads_to_sequence(sequence_first(out), group)     # [S/C, B, C, h/C, d]
    return back.flatten(2, 3)                                 # [S/C, B, h, d]


def _ring(q, k, v, group, layout: ContextLayout):
    if comm.group_size(group) == 1:
        raise ValueError("ring attention needs a CP group of at least 2 ranks")
    kv_heads = k.shape[2]
    out = RingAttention.apply(heads_first(q, kv_heads), heads_first(k, kv_heads), heads_first(v, kv_heads),
                              group, layout)
    return sequence_first(out)
