"""Ring attention (Liu et al. 2023; Megatron-LM's p2p context parallelism): K/V blocks travel
around the CP ring while the block in hand is computed.

Forward, C steps on CP rank i: at step s it holds the K/V of rank (i - s) mod C; it posts the
send of that block to rank i+1 and the receive of the next one from rank i-1 (one batched
exchange), merges the block's attention into its running output by log-sum-exp, then waits.
Only the kv heads travel (GQA is a broadcast in the math, never a repeated copy), packed as one
buffer [2, B, kv, 1, S/C, d]. Two buffers are alive at once: the block in hand and the one
arriving.

Backward, the same ring again: K/V circulate as in forward, and beside them an accumulator of
dK/dV (float32) for the block's owner. At step s rank i adds its grads for the block of rank
(i - s) to the accumulator received from rank i-1 and sends it on; after C steps every
accumulator is back home holding the sum over every rank's queries. Each exchange overlaps the
next block's computation: K/V transfers are waited on after the block is computed, the dK/dV
transfer after the next block.

Under the load-balanced split every rank computes the same work at every step after the first
(half of the block); blocks a rank's queries cannot see are skipped, not masked (blockwise.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed import comm
from ..distributed.ranges import span
from .blockwise import chunked_backward, chunked_forward, finish, work_dtype
from .layout import ContextLayout

KV_TAG, DKV_TAG = 1, 2   # two exchanges may be in flight between the same peers
# profiler names of the two transfers (`comm:<kind>` at issue, `wait:<kind>` when waited on): the
# overlap report measures each from its issue to the end of its wait, its time in flight
KINDS = {KV_TAG: "ring_kv", DKV_TAG: "ring_dkv"}


class _Ring:
    """This rank's neighbours in the CP group (global ranks) and one ring step of transfers."""

    def __init__(self, group, layout: ContextLayout):
        self.group, self.layout = group, layout
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def owner(self, step: int) -> int:
        """The CP rank whose K/V this rank holds at `step`."""
        return (self.rank - step) % self.size

    def pass_on(self, buf: torch.Tensor, tag: int):
        """Send `buf` to the next rank, receive its like from the previous: -> (received, handle)."""
        incoming = torch.empty_like(buf)
        handle = comm.send_recv(self.group, sends=[(buf, self.next)], recvs=[(incoming, self.prev)], tag=tag,
                                async_op=True, kind=KINDS[tag])
        return incoming, handle


class RingAttention(torch.autograd.Function):
    """q [B, kv, rep, S/C, d], k, v [B, kv, 1, S/C, d] of this CP rank -> out like q."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout: ContextLayout):
        ring = _Ring(group, layout)
        w = work_dtype(q.dtype)
        mine, qw = layout.chunks(ring.rank), q.to(w)
        kv, acc = torch.stack([k, v]), None                    # [2, B, kv, 1, S/C, d]
        for step in range(ring.size):
            if step < ring.size - 1:
                incoming, handle = ring.pass_on(kv, KV_TAG)    # overlaps the block below
            with span("ring.block_forward"):
                acc = chunked_forward(qw, kv[0].to(w), kv[1].to(w), mine, layout.chunks(ring.owner(step)), acc)
            if step < ring.size - 1:
                with span("wait:ring_kv"):
                    handle.wait()
                kv = incoming
        out, lse = finish(acc)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout = group, layout
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group, ctx.layout)
        w = work_dtype(q.dtype)
        mine, qw, dout = ctx.layout.chunks(ring.rank), q.to(w), dout.to(w)
        delta = (dout * out.to(w)).sum(-1)                      # [B, kv, rep, S/C]
        dq = torch.zeros_like(qw)
        kv, dkv_in, dkv_handle = torch.stack([k, v]), None, None
        for step in range(ring.size):
            if step < ring.size - 1:
                incoming, kv_handle = ring.pass_on(kv, KV_TAG)
            with span("ring.block_backward"):
                gq, gk, gv = chunked_backward(qw, kv[0].to(w), kv[1].to(w), dout, delta, lse, mine,
                                              ctx.layout.chunks(ring.owner(step)))
            dq += gq
            dkv = torch.stack([gk, gv])                         # [2, B, kv, 1, S/C, d], this rank's share
            if dkv_handle is not None:
                with span("wait:ring_dkv"):
                    dkv_handle.wait()
                dkv += dkv_in                                   # the shares of the ranks before
            dkv_in, dkv_handle = ring.pass_on(dkv, DKV_TAG)     # on to the next rank; home after C steps
            if step < ring.size - 1:
                with span("wait:ring_kv"):
                    kv_handle.wait()
                kv = incoming
        with span("wait:ring_dkv"):
            dkv_handle.wait()
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None
