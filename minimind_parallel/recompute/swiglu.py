"""SwiGLU recompute: down_proj(silu(gate) * up) saving gate and up only.

Autograd of `down_proj(F.silu(gate) * up)` keeps four [N, I/T] tensors per block: gate (by
silu), silu(gate) and up (by the product) and the product itself (down_proj's input, for its
weight gradient). This Function keeps gate and up (and the weight) and recomputes silu(gate) and
the product in backward:

    p = silu(gate) * up,  y = p W^T                 (W: down_proj's [H, I/T] shard)
    dW = dy^T p,  dp = dy W,  dup = dp silu(gate),  dgate = silu_backward(dp up, gate)

(the ops autograd runs for the dense expression, in the same order: the same numbers).

The output is down_proj's partial product; the row-parallel layer's exit (all-reduce or
reduce-scatter) follows it as usual.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class _SwiGLULinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, weight):
        # gate, up: [S, B, I/T]; weight [H, I/T] -> [S, B, H] (partial over TP)
        ctx.save_for_backward(gate, up, weight)
        return F.linear(F.silu(gate) * up, weight)

    @staticmethod
    def backward(ctx, grad):
        gate, up, weight = ctx.saved_tensors
        silu = F.silu(gate)
        product = silu * up                                                 # recomputed
        dweight = grad.reshape(-1, grad.shape[-1]).t() @ product.reshape(-1, product.shape[-1])
        del product
        dproduct = grad.matmul(weight)                                      # [S, B, I/T]
        dup = dproduct * silu
        del silu
        dgate = torch.ops.aten.silu_backward(dproduct.mul_(up), gate)       # at most three [S, B, I/T] live
        return dgate, dup, dweight


def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _SwiGLULinear.apply(gate, up, weight)
