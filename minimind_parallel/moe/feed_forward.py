"""MiniMind's `MOEFeedForward`, computed over tokens sorted by expert.

    x [..., H] -> flat [N, H]
    route: scores [N, E], weights / indices [N, k]                       (router.route)
    sort:  the N*k (token, slot) pairs by expert (stable: by token within an expert)
           tokens [N*k, H] (token t's row repeated for each of its k experts), counts [E]
    dispatch -> this rank's experts' tokens [T, H], counts [E_local]    (dispatcher)
    experts  -> [T, H]                                                   (experts.GroupedExperts)
    combine  -> [N*k, H] back in sorted order                            (dispatcher)
    y[t] += weight * out, per pair in expert order (MiniMind's index_add_ order) -> [..., H]

The aux loss (training mode with router_aux_loss_coef > 0, as MiniMind's; 0 otherwise) is the
load-balancing loss of the statistics of these N tokens after `reduce_stats` (the identity, or
a sum over the groups that split the batch's tokens): `aux_loss.py`. Like MiniMind's module it
is left in `self.aux_loss` after each forward, and the model sums the layers' after its forward.

On fake tensors (`--estimate`) the routing has no values: dispatch and experts split the rows by
`fake_routing` (fake_routing.py; None: the balanced policy).
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from ..config import MiniMindConfig
from .aux_loss import RouterStats, StatsReduction, load_balancing_loss, local_stats
from .dispatcher import LocalDispatcher
from .experts import GroupedExperts, LinearBuilder, plain_linear
from .fake_routing import FakeRouting
from .router import route, tokens_per_expert


class MOEFeedForward(nn.Module):
    """`gate` (Linear H -> E, no bias) and `experts` (`expert_ids`: all E by default; a rank's
    slice under expert parallelism, with its `dispatcher`). `linear` builds each Linear from its
    key below the layer and dense shape (the parallel model passes the plan's layers)."""

    def __init__(self, c: MiniMindConfig, *, expert_ids: range | None = None, dispatcher=None,
                 reduce_stats: StatsReduction = local_stats, linear: LinearBuilder = plain_linear):
        super().__init__()
        self.num_experts, self.top_k = c.num_experts, c.num_experts_per_tok
        self.norm_topk_prob, self.coef = c.norm_topk_prob, c.router_aux_loss_coef
        self.gate = linear("gate.weight", (c.num_experts, c.hidden_size))     # [E, H]
        self.experts = GroupedExperts(c.hidden_size, c.moe_intermediate_size,
                                      range(c.num_experts) if expert_ids is None else expert_ids, linear)
        self.dispatcher = dispatcher or LocalDispatcher()
        self.reduce_stats = reduce_stats
        self.aux_loss = None
        self.tokens_per_expert = None     # [E] int64, this module's tokens of its last forward (no grad)
        self.fake_routing: FakeRouting | None = None   # on fake tensors: the rows its experts receive (None: balanced)
        self.fake_routings: tuple[FakeRouting, ...] = ()   # or one per microbatch, in the step's order
        self._fake_calls = [0, 0]   # forwards, and re-runs inside backward (--recompute full), on fake tensors

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])                                   # [N, H]
        r = route(self.gate(flat), self.top_k, self.norm_topk_prob)
        pairs = r.indices.reshape(-1)                                     # [N*k] expert of each (token, slot)
        order = torch.argsort(pairs, stable=True)                         # [N*k] pairs sorted by expert
        token_of = order // self.top_k                                    # [N*k] the token of each sorted pair
        counts = tokens_per_expert(r.indices, self.num_experts)           # [E]
        fake = self._fake_routing() if is_fake(flat) else None            # no values to route by (--estimate)
        local, local_counts = self.dispatcher.dispatch(flat[token_of], counts, fake=fake)   # [T, H], [E_local]
        out = self.dispatcher.combine(self.experts(local, local_counts,   # [N*k, H] sorted order
                                                   fake_rows=fake.per_expert if fake else None))
        weighted = (out * r.weights.reshape(-1)[order, None]).to(flat.dtype)
        y = torch.zeros_like(flat).index_add_(0, token_of, weighted)      # [N, H]
        self.aux_loss = self._aux_loss(r.scores, counts)
        self.tokens_per_expert = counts.detach()
        return y.view(shape)

    def _fake_routing(self) -> FakeRouting | None:
        """The routing of this forward on fake tensors: the one given, or of a list one per
        microbatch the next in turn (a step forwards its microbatches in order, and backward, which
        re-runs a checkpointed block's forward, takes them in order too)."""
        if not self.fake_routings:
            return self.fake_routing
        rerun = torch._C._current_graph_task_id() != -1     # inside autograd's backward
        n = self._fake_calls[rerun]
        self._fake_calls[rerun] += 1
        return self.fake_routings[n % len(self.fake_routings)]

    def _aux_loss(self, scores, counts):
        if not (self.training and self.coef > 0):
            return scores.new_zeros(())
        return load_balancing_loss(self.reduce_stats(RouterStats.of(scores, counts)), self.coef)


def routing_histogram(model: nn.Module) -> dict[str, list[int]]:
    """{MoE layer's module name: tokens routed to each expert in its last forward (N x k in all)}."""
    return {name: m.tokens_per_expert.tolist() for name, m in model.named_modules()
            if isinstance(m, MOEFeedForward) and m.tokens_per_expert is not None}


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def set_fake_routing(model: nn.Module, per_layer: Mapping[int, Sequence[int]] | Sequence[Mapping[int, Sequence[int]]],
                     sources: int) -> None:
    """On fake tensors (--estimate): give each MoE layer of `model` the rows each of its local
    experts receives in one microbatch, `per_layer` {global layer index: [L]} (or a list of them,
    one per microbatch of the step), spread over the `sources` EP ranks (fake_routing.py); a layer
    of `model` missing from `per_layer` is refused."""
    each = list(per_layer) if isinstance(per_layer, (list, tuple)) else [per_layer]
    for name, m in model.named_modules():
        if isinstance(m, MOEFeedForward):
            layer = int(_LAYER.search(name).group(1))
            missing = [rows for rows in each if layer not in rows]
            if missing:
                raise ValueError(f"fake routing: no rows for MoE layer {layer} ({name}); got layers {sorted(missing[0])}")
            routings = tuple(FakeRouting.of_expert_rows(rows[layer], sources) for rows in each)
            m.fake_routing = routings[0]
            m.fake_routings = routings if isinstance(per_layer, (list, tuple)) else ()
