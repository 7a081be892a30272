"""Causal attention computed block by block and merged by log-sum-exp (the online softmax of
Milakov & Gimelshein 2018, as used by FlashAttention, Dao et al. 2022, and Ring Attention,
Liu et al. 2023). Every context-parallel path is built from these pieces.

Layout (heads-first, GQA without copies): q [B, kv, rep, L, d] where query head kv_i * rep + r
reads kv head kv_i, as `repeat_kv` orders them; k, v [B, kv, 1, L, d]. The matmuls broadcast
over `rep`, so no repeated copy of k or v exists.

Sequences are cut into equal chunks of global index c (see layout.py). A query chunk a sees a key
chunk b fully when b < a, causally when b == a, and not at all when b > a: such a block is
skipped, not masked. Scores, the softmax and the outputs are float32 (float64 stays float64).
"""
from __future__ import annotations

import math

import torch

Partial = tuple[torch.Tensor, torch.Tensor]   # (out [B, kv, rep, L, d], lse [B, kv, rep, L])


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _scores(q, k, causal: bool) -> torch.Tensor:
    """softmax scale x q k^T: [B, kv, rep, Lq, Lk], future keys -inf on a diagonal block."""
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def block_forward(q, k, v, *, causal: bool) -> Partial:
    """One block: the attention output of q over these keys alone, and its log-sum-exp."""
    s = _scores(q, k, causal)
    lse = torch.logsumexp(s, dim=-1)                             # [B, kv, rep, Lq]
    return torch.exp(s - lse[..., None]) @ v, lse


def merge(acc: Partial | None, new: Partial) -> Partial:
    """Two partial softmaxes over disjoint keys -> the softmax over their union."""
    if acc is None:
        return new
    (out_a, lse_a), (out_b, lse_b) = acc, new
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None], lse


def block_backward(q, k, v, dout, delta, lse, *, causal: bool):
    """Grads of one block given the merged lse and delta = rowsum(dout * out) of the whole row
    (FlashAttention's backward): -> dq [B, kv, rep, Lq, d], dk, dv [B, kv, 1, Lk, d]."""
    p = torch.exp(_scores(q, k, causal) - lse[..., None])       # this block's softmax weights
    dv = (p.transpose(-1, -2) @ dout).sum(2, keepdim=True)       # summed over the heads sharing it
    ds = p * (dout @ v.transpose(-1, -2) - delta[..., None])
    scale = 1.0 / math.sqrt(q.shape[-1])
    dq = (ds @ k) * scale
    dk = (ds.transpose(-1, -2) @ q).sum(2, keepdim=True) * scale
    return dq, dk, dv


def visible_pairs(q_chunks, k_chunks) -> list[tuple[int, int, bool]]:
    """(i, j, causal): local query chunk i sees local key chunk j; blocks that see nothing are absent."""
    return [(i, j, a == b) for i, a in enumerate(q_chunks) for j, b in enumerate(k_chunks) if b <= a]


def chunked_forward(q, k, v, q_chunks, k_chunks, acc: list | None = None) -> list:
    """Merge the blocks of these keys into `acc` (one Partial or None per query chunk)."""
    qs, ks, vs = q.chunk(len(q_chunks), -2), k.chunk(len(k_chunks), -2), v.chunk(len(k_chunks), -2)
    acc = list(acc) if acc is not None else [None] * len(q_chunks)
    for i, j, causal in visible_pairs(q_chunks, k_chunks):
        acc[i] = merge(acc[i], block_forward(qs[i], ks[j], vs[j], causal=causal))
    return acc


def finish(acc: list) -> Partial:
    """Per-chunk partials -> out [B, kv, rep, L, d], lse [B, kv, rep, L] in local token order."""
    return torch.cat([a[0] for a in acc], dim=-2), torch.cat([a[1] for a in acc], dim=-1)


def chunked_backward(q, k, v, dout, delta, lse, q_chunks, k_chunks):
    """The grads these keys receive, and their share of dq: -> dq, dk, dv (work dtype)."""
    nq, nk = len(q_chunks), len(k_chunks)
    qs, dos, ds_, ls = q.chunk(nq, -2), dout.chunk(nq, -2), delta.chunk(nq, -1), lse.chunk(nq, -1)
    ks, vs = k.chunk(nk, -2), v.chunk(nk, -2)
    dq = [torch.zeros_like(x) for x in qs]
    dk = [torch.zeros_like(x) for x in ks]
    dv = [torch.zeros_like(x) for x in vs]
    for i, j, causal in visible_pairs(q_chunks, k_chunks):
        gq, gk, gv = block_backward(qs[i], ks[j], vs[j], dos[i], ds_[i], ls[i], causal=causal)
        dq[i] += gq
        dk[j] += gk
        dv[j] += gv
    return torch.cat(dq, dim=-2), torch.cat(dk, dim=-2), torch.cat(dv, dim=-2)


class ChunkedAttention(torch.autograd.Function):
    """Causal attention of this rank's query chunks over keys whose chunks are all present (the
    all-gather and all-to-all paths). Saves q, k, v, the output and the lse, like FlashAttention."""

    @staticmethod
    def forward(ctx, q, k, v, q_chunks, k_chunks):
        w = work_dtype(q.dtype)
        out, lse = finish(chunked_forward(q.to(w), k.to(w), v.to(w), q_chunks, k_chunks))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunks = (q_chunks, k_chunks)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        w = work_dtype(q.dtype)
        dout = dout.to(w)
        delta = (dout * out.to(w)).sum(-1)                      # [B, kv, rep, L]
        dq, dk, dv = chunked_backward(q.to(w), k.to(w), v.to(w), dout, delta, lse, *ctx.chunks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None
