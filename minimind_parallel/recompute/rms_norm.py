"""Lean RMSNorm: MiniMind's RMSNorm, saving the input in the model dtype and the fp32 rsqrt.

MiniMind's RMSNorm (`model.RMSNorm`) upcasts to fp32 and lets autograd save what its ops need:
x.float() (by pow), x * rsqrt (by the weight's mul) and rsqrt [.., 1] -- two fp32 copies of the
input per norm. This Function computes the same forward with the same ops and saves only x (the
model dtype: half of one fp32 copy in bf16, and in fp32 the input itself) and rsqrt (fp32, one
number per row); backward recomputes x.float() and x * rsqrt from them:

    n  = xf * r,   r = (mean(xf^2) + eps)^-1/2,   y = (w * n).type_as(x)
    dw = sum over rows of g * n                   (g = dy in fp32)
    dx = r * (g w) - xf * r^3 * mean(g w xf)      (cast to x's dtype)

float64 stays float64, as in MiniMind's module here.
"""
from __future__ import annotations

import torch

from ..model import RMSNorm


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm's forward ops: the output and the fp32 rsqrt. The lean norm runs them, and
    `norm_recompute` runs them again to re-make an output bit for bit."""
    # x: [..., D] (model dtype), weight: [D] -> [..., D] (x's dtype), rsqrt [..., 1] fp32
    xf = _upcast(x)
    rsqrt = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * (xf * rsqrt)).type_as(x), rsqrt


class _LeanRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        out, rsqrt = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rsqrt)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rsqrt = ctx.saved_tensors
        g = _upcast(grad)
        normed = _upcast(x) * rsqrt                                       # recomputed [..., D] fp32
        dweight = (g * normed).reshape(-1, normed.shape[-1]).sum(0).to(weight.dtype)
        gw = g * weight
        del g
        dot = (gw * normed).mean(-1, keepdim=True)                        # [..., 1]
        dx = normed.mul_(dot).neg_().add_(gw).mul_(rsqrt)                 # r (gw - n mean(gw n)), in place
        del gw
        return dx.to(x.dtype), dweight, None


def lean_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _LeanRMSNorm.apply(x, weight, eps)


class LeanRMSNorm(RMSNorm):
    """RMSNorm with the same parameter (`weight`) and forward, and the lean backward above."""

    def forward(self, x):
        return lean_rms_norm(x, self.weight, self.eps)


def make_rms_norm(dim: int, eps: float, *, lean: bool) -> RMSNorm:
    """MiniMind's RMSNorm, or the lean one (`--recompute selective|full`)."""
    return LeanRMSNorm(dim, eps=eps) if lean else RMSNorm(dim, eps=eps)
