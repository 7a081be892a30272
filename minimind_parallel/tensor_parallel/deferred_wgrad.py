"""Deferred weight gradients: the W step of a zero-bubble pipeline schedule (ZB-H1, Qi et al.
2023, "Zero Bubble Pipeline Parallelism"; the zero-bubble Megatron-LM fork's WeightGradStore).

A linear's backward is two GEMMs: dgrad = dY W (what the previous layer, and the previous stage,
wait for) and wgrad = dY^T X (what only the optimizer waits for). While a `WeightGradStore`
collects (the schedule's B step of one microbatch), every linear that holds the store -- the
column- and row-parallel linears, the async linear, the replicated lm_head -- computes dgrad
and queues a closure of (dY, X, its weight) instead of returning wgrad; the schedule's W step
runs that microbatch's closures, each accumulating into its weight's .grad as autograd would.
Outside a collecting B (every other schedule, forwards without the store) the linears compute
both at once, as before. What stays in B: the norms' and the embedding's weight grads (reductions
over the tokens, no GEMM), and the weights inside fused recompute Functions (SwiGLU recompute's
down_proj, the chunked loss's lm_head).

The W-pending tensors, per deferred linear until its W: dY [S, B, N] and X (the saved input; under
SP + async the local shard [S/T, B, H], gathered again in W).
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn


class WeightGradStore:
    """The weight-grad closures of each (microbatch, chunk) whose B ran and W did not."""

    def __init__(self):
        self.queues: dict = {}
        self.unit = None          # the (microbatch, chunk) whose B is running, while collecting

    @contextmanager
    def collecting(self, unit):
        """Every deferrable linear's wgrad in this block's backward goes to `unit`'s queue."""
        self.unit, self.queues[unit] = unit, []
        try:
            yield
        finally:
            self.unit = None

    @property
    def deferring(self) -> bool:
        return self.unit is not None

    def defer(self, closure) -> None:
        self.queues[self.unit].append(closure)

    def run(self, unit) -> None:
        """The W step of `unit`: its closures, in the order its B queued them, without grad
        tracking (as inside autograd's backward, where they were made)."""
        queue = self.queues.pop(unit)
        with torch.no_grad():
            while queue:
                queue.pop(0)()    # each closure's dY and X die as it finishes


def defers(store: WeightGradStore | None) -> bool:
    return store is not None and store.deferring


def accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    """param.grad += grad, as autograd's AccumulateGrad (the first grad becomes .grad), which then
    runs the parameter's post-accumulate-grad hooks (a memory meter files the new .grad as a grad
    there; --zero 2 counts the parameter's bucket ready)."""
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)
    for hook in (param._post_accumulate_grad_hooks or {}).values():
        hook(param)


def wgrad(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = dY^T X over all tokens: [.., N], [.., H] -> [N, H]."""
    return grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


def autocast_of(x: torch.Tensor) -> dict:
    """The autocast state the forward ran under, for backward (and a deferred W) to run under
    the same (what torch.amp.custom_fwd/custom_bwd do, for whichever device x is on)."""
    device = x.device.type
    enabled = torch.is_autocast_enabled(device)
    return dict(device_type=device, enabled=enabled, dtype=torch.get_autocast_dtype(device) if enabled else None)


def _deferred_wgrad(param, grad_out, x, autocast: dict) -> None:
    with torch.autocast(**autocast):
        accumulate(param, wgrad(grad_out, x))


class _LinearWithDeferrableWgrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        """x [.., H], weight [N, H] -> [.., N]; saves x and weight, as F.linear does."""
        ctx.save_for_backward(x, weight)
        ctx.param, ctx.store, ctx.has_bias, ctx.autocast = weight, store, bias is not None, autocast_of(x)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.autocast(**ctx.autocast):
            dgrad = grad.matmul(weight)
            bgrad = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
            if defers(ctx.store):
                ctx.store.defer(partial(_deferred_wgrad, ctx.param, grad, x, ctx.autocast))
                return dgrad, None, bgrad, None
            return dgrad, wgrad(grad, x), bgrad, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None, store: WeightGradStore | None = None) -> torch.Tensor:
    """F.linear, whose weight grad goes to `store` while it collects (None: plain F.linear)."""
    if store is None:
        return F.linear(x, weight, bias)
    return _LinearWithDeferrableWgrad.apply(x, weight, bias, store)


def attach_weight_grad_store(model: nn.Module, store: WeightGradStore | None) -> None:
    """Hand `store` (None: take it back) to every module of `model` that can defer its wgrad."""
    for module in model.modules():
        if hasattr(module, "weight_grad_store"):
            module.weight_grad_store = store
