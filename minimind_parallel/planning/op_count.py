"""`OpCount`: what a piece of a training step dispatches, counted per aten op under a
TorchDispatchMode, in the categories the time model costs: GEMM FLOPs, fused attention calls,
memory-bound (elementwise, reduction, copy) bytes, views, collectives. `calibrate` divides its
measured times by these counts; the tests check the time model's counts against them.

An elementwise op's bytes are the bytes of its tensor inputs and outputs (what a streaming kernel
reads and writes once); a view moves nothing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm"})
VIEWS = frozenset({"view", "_unsafe_view", "t", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze",
                   "as_strided", "permute", "alias", "detach", "reshape", "split", "split_with_sizes", "unbind",
                   "narrow", "chunk", "view_as", "unflatten", "flatten", "lift_fresh", "_reshape_alias"})
ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention")


# each category's table of op counts
TABLES = dict(collective="collectives", gemm="gemm_ops", attention="attention_calls", view="views",
              elementwise="elementwise_ops")


def category(func) -> str:
    """What the time model costs an aten op as: collective, gemm, attention, view or elementwise
    (every other op: elementwise, a reduction, a copy -- memory-bound)."""
    namespace, name = func.namespace, func._opname   # e.g. ("aten", "mm"), ("c10d", "allreduce_")
    if namespace in ("c10d", "_c10d_functional"):
        return "collective"
    if name in GEMMS:
        return "gemm"
    if any(a in name for a in ATTENTION):
        return "attention"
    return "view" if name in VIEWS else "elementwise"


def _gemm_flops(name: str, args, out) -> float:
    """2 x M x N x K of a matmul (batched: x the batch); addmm/baddbmm's add is elementwise work we ignore."""
    a = args[1] if name in ("addmm", "baddbmm") else args[0]
    return 2.0 * out.numel() * a.shape[-1]


@dataclass
class OpCount(TorchDispatchMode):
    """Counts of the ops run inside `with OpCount() as n:`; `phase` labels what follows (e.g. the
    forward, the backward) so one pass can be split."""

    phase: str = "all"
    gemm_flops: dict = field(default_factory=dict)
    gemm_ops: dict = field(default_factory=dict)
    attention_calls: dict = field(default_factory=dict)
    elementwise_bytes: dict = field(default_factory=dict)
    elementwise_ops: dict = field(default_factory=dict)
    views: dict = field(default_factory=dict)
    collectives: dict = field(default_factory=dict)
    # the seconds inside the memory-bound ops (meaningful on a CPU, where kernels run inline)
    elementwise_seconds: dict = field(default_factory=dict)

    def __post_init__(self):
        super().__init__()

    def _add(self, table: dict, value: float) -> None:
        table[self.phase] = table.get(self.phase, 0) + value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        seconds = time.perf_counter() - t0
        kind = category(func)
        if kind == "gemm":
            self._add(self.gemm_flops, _gemm_flops(func._opname, args, out))
        elif kind == "elementwise":
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self._add(self.elementwise_bytes, sum(t.numel() * t.element_size() for t in tensors))
            self._add(self.elementwise_seconds, seconds)
        self._add(getattr(self, TABLES[kind]), 1)
        return out

    def total(self, table: dict) -> float:
        return sum(table.values())

    def ops(self, phase: str) -> int:
        """Every dispatched op of `phase` (GEMMs, attention, elementwise, views, collectives)."""
        return int(sum(t.get(phase, 0) for t in (self.gemm_ops, self.attention_calls, self.elementwise_ops,
                                                   self.views, self.collectives)))
