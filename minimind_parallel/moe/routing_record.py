"""Each microbatch's tokens per expert over a step. `MOEFeedForward` keeps only its last forward's
(`tokens_per_expert`, the memory model's int64 [E] per layer); `recorded_routing` hooks every MoE
layer's forward and copies that tensor to a host list after each forward -- not the re-runs inside
backward (--recompute full re-runs a checkpointed block there) -- so no tensor outlives its
forward and the step's memory is unchanged (one host read per layer and microbatch). The i-th
forward of a layer is microbatch i: every schedule forwards each layer's microbatches in order
(each model chunk holds its own layers)."""
from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .feed_forward import MOEFeedForward

Histogram = dict[str, list[int]]


@contextmanager
def recorded_routing(model: nn.Module) -> Iterator[list[Histogram]]:
    """`with recorded_routing(model) as each: <a step>`: afterwards `each[i]` is microbatch i's
    {MoE layer's module name: tokens routed to each of its experts} (routing_histogram's form);
    empty for a model without MoE layers."""
    seen: dict[str, list[list[int]]] = {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, MOEFeedForward):
            handles.append(m.register_forward_hook(functools.partial(_record, seen.setdefault(name, []))))
    each: list[Histogram] = []
    try:
        yield each
    finally:
        for h in handles:
            h.remove()
        count = max((len(v) for v in seen.values()), default=0)
        each.extend({name: counts[i] for name, counts in seen.items() if i < len(counts)} for i in range(count))


def _record(seen: list[list[int]], module: MOEFeedForward, args, output) -> None:
    if torch._C._current_graph_task_id() != -1:   # a re-run inside autograd's backward
        return
    seen.append(module.tokens_per_expert.tolist())
