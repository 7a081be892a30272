"""Context parallelism: the moment inside a block's attention backward, per comm type.

C ranks hold N = S/C*B tokens each; the attention Function's backward
(`chunked_attention_backward` for all_gather / a2a, `ring_attention_backward` for ring) is one
more moment of the top block, beside the CP loss's count and scaled loss (stage_sizes.py) and
DDP over DP x CP: docs/memory.md, "Context parallelism".
"""
from __future__ import annotations

from ...config import CPCommType
from ...context_parallel.blockwise import visible_pairs
from .stage_sizes import StageSizes, top_block_saved


def _residual_grads(s: StageSizes) -> int:
    """The residual stream's grad [Nn, H] while a block's attention runs its backward; on an
    earlier stage the grad received from the next stage too (bound by the schedule)."""
    return s.b * s.nn * s.hid * (1 if s.last else 2)


def _rank_chunks(s: StageSizes, rank: int) -> tuple[int, ...]:
    c = s.par.cp
    return (rank, 2 * c - 1 - rank) if s.par.cp_load_balance else (rank,)


def _attention_grads_acts(s: StageSizes) -> tuple[int, int, int]:
    """Grads, activations and re-made tensors (full) when the top block's attention begins its
    backward: the MLP's (or MoE layer's), the post-attention norm's and o_proj's grads in; their
    activations freed
    (o_proj's input included, a copy under CP; the MoE layer's router input in place of gate/up's)."""
    b = s.b
    o_proj_input = b * s.n * s.heads * s.head_dim
    grads = s.head_grads + s.ffn_w_grads + b * s.hid + b * s.hid * s.heads * s.head_dim
    column = s.router_input if s.top_k else s.gate_up_input   # the MoE layer's router input, or gate/up's
    acts, redone = top_block_saved(s, s.ffn_saved + s.kinds["block.norm_fp32"] // 2 + column + o_proj_input)
    return grads, acts, redone


def _block_backward_peak(s: StageSizes, h_fn: int, kv_fn: int, pairs: int) -> int:
    """The largest moment of `blockwise.block_backward` (work dtype, f) on a block of Lc query
    and Lc key tokens at h_fn query and kv_fn kv heads: at the ds subtraction three score-sized
    tensors and the block's dv, or at dk's head sum two of them, dv, dq, dk's matmul and its sum.
    From the second visible block on, the previous block's gq, gk, gv are still bound."""
    f, lc, d, bsz = s.f, s.chunk_len, s.head_dim, s.bsz
    score, q_blk, kv_blk = f * bsz * h_fn * lc * lc, f * bsz * h_fn * lc * d, f * bsz * kv_fn * lc * d
    inside = max(3 * score + kv_blk, 2 * score + kv_blk + 2 * q_blk + kv_blk)
    return inside + (q_blk + 2 * kv_blk if pairs > 1 else 0)


def chunked_attention_backward(s: StageSizes) -> tuple[int, int, int]:
    """CP all_gather / a2a (`context_parallel.blockwise.ChunkedAttention`) inside a block's
    backward (`_block_backward_peak`) beside the accumulators dq, dk, dv, delta, the incoming grad
    and (half precision) the work-dtype copies of dout, q, k and v. all_gather: k, v of the whole
    sequence at the kv heads; a2a: q, k, v of the whole sequence at h/C, kv/C heads."""
    b, f, n, c = s.b, s.f, s.n, s.par.cp
    h, kv, d = s.heads, s.kv_heads, s.head_dim
    upcast = b != f
    gather = s.par.cp_comm_type == CPCommType.ALL_GATHER
    kv_elems = (c * n * kv * d) if gather else n * kv * d   # k (or v) of the Function
    h_fn, kv_fn = (h, kv) if gather else (h // c, kv // c)
    chunks = 2 * c if s.par.cp_load_balance else c
    pairs = len(visible_pairs(_rank_chunks(s, s.cp_rank) if gather else tuple(range(chunks)), tuple(range(chunks))))
    work = (f * (n * h * d + 2 * kv_elems) if upcast else 0) + (f * n * h * d if upcast else 0)
    grads_qkv = f * (n * h * d + 2 * kv_elems)          # dq, dk, dv: per chunk, then concatenated
    last_block = f * s.bsz * s.chunk_len * d * (h_fn + 2 * kv_fn)   # the last block's gq, gk, gv
    peak = max(_block_backward_peak(s, h_fn, kv_fn, pairs), grads_qkv + last_block)
    grads, acts, redone = _attention_grads_acts(s)
    temps = _residual_grads(s) + b * n * h * d + work + grads_qkv + f * n * h + peak + s.waiting + redone
    return grads, acts, temps


def ring_attention_backward(s: StageSizes) -> tuple[int, int, int]:
    """CP ring (`context_parallel.ring.RingAttention`) at the rank's largest ring step:
    beside dq, delta and (half precision) the work-dtype q and dout, the K/V block in hand and
    the one arriving (model dtype, [2, B, kv, 1, S/C, d] each) and, from the second step on, the
    previous step's gq, gk, gv, the dK/dV accumulator it sent and the one it received; inside
    the step `chunked_backward` over the visible blocks (its per-chunk dq, dk, dv, then their
    concatenation)."""
    b, f, n, c = s.b, s.f, s.n, s.par.cp
    h, kv, d = s.heads, s.kv_heads, s.head_dim
    upcast = b != f
    q_elems, kv_elems = n * h * d, n * kv * d
    fixed = (2 * f * q_elems if upcast else 0) + f * n * h + f * q_elems + 2 * b * kv_elems
    g = f * (q_elems + 2 * kv_elems)                       # one step's dq, dk, dv
    mine, worst = _rank_chunks(s, s.cp_rank), 0
    for step in range(c):
        pairs = len(visible_pairs(mine, _rank_chunks(s, (s.cp_rank - step) % c)))
        last_block = f * s.bsz * s.chunk_len * d * (h + 2 * kv) if pairs else 0
        inner = g + max(_block_backward_peak(s, h, kv, pairs) if pairs else 0, g + last_block)
        step_bytes = (fixed + (2 * b * kv_elems if step < c - 1 else 0) + (2 * f * kv_elems if upcast else 0)
                      + (g + 2 * 2 * f * kv_elems if step else 0) + inner)
        worst = max(worst, step_bytes)
    grads, acts, redone = _attention_grads_acts(s)
    return grads, acts, _residual_grads(s) + b * q_elems + worst + s.waiting + redone
