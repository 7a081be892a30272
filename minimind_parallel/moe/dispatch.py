"""Expert-parallel token dispatch: the routed tokens go to their experts' ranks by all-to-all and
come back the same way (Megatron-LM's MoEAlltoAllTokenDispatcher), dropless: every routed token
reaches its expert, whatever the load, so the result is the dense model's exactly.

P ranks in the expert-parallel group, E experts, L = E / P local experts: EP rank r holds the
global experts [r*L, (r+1)*L). One MoE layer's dispatch, per rank:

    dispatch(tokens [N*k, H] sorted by global expert, counts [E])
      1. count exchange   counts.view(P, L) all-to-all -> received [P (source), L]: the rows each
                          source sends to each local expert (the token all-to-all's split sizes)
      2. token all-to-all the rows of rank j's experts (one contiguous block: sorted) go to j
                          -> [M, H], source-major: (source, local expert) chunks
      3. regroup          -> [M, H] expert-major: (local expert, source) chunks, each expert's
                          rows contiguous for its GEMM
      -> (tokens [M, H], counts per local expert [L])
    combine(out [M, H], expert-major)
      the regroup undone, the reverse all-to-all (split sizes swapped) -> [N*k, H] in the order
      dispatch was given

The split sizes are read to the host once per dispatch (all_to_all_single takes Python lists);
backward reuses them: the backward of an all-to-all is the reverse all-to-all (`_AllToAll`).
With a one-rank group (ep = 1) dispatch and combine hand the tokens back unchanged.

On fake tensors (`--estimate`: shapes, no values) the routing has no counts to read; the
dispatch then follows the layer's given routing (`fake_routing.FakeRouting`: the rows each source
sends to each local expert), or the balanced policy (`FakeRouting.balanced`): every rank routes
as many rows to each expert, so each rank sends and receives N*k/P rows per peer, N*k/E per
(peer, expert).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from ..distributed import comm
from .experts import balanced_counts
from .fake_routing import FakeRouting


class _AllToAll(torch.autograd.Function):
    """fwd: rows to their ranks (in_splits sent, out_splits received); bwd: the grads back the
    reverse way (the split sizes swapped)."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return comm.all_to_all_uneven(x, group, out_splits=out_splits, in_splits=in_splits)

    @staticmethod
    def backward(ctx, grad):
        back = comm.all_to_all_uneven(grad, ctx.group, out_splits=ctx.in_splits, in_splits=ctx.out_splits)
        return back, None, None, None


def all_to_all_rows(x: torch.Tensor, group, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Differentiable uneven all-to-all of the rows of `x` [sum(in_splits), ...] -> [sum(out_splits), ...]."""
    return _AllToAll.apply(x, group, out_splits, in_splits) if comm.group_size(group) > 1 else x


@dataclass(frozen=True)
class Route:
    """One dispatch's split sizes and regrouping, kept for its combine."""

    sent: list[int]            # rows sent to each EP rank (in the input's order)
    received: list[int]        # rows received from each EP rank
    to_experts: torch.Tensor   # [M]: the received row at each expert-major position
    to_sources: torch.Tensor   # [M]: the inverse permutation (expert-major row of each received row)


def chunk_permutation(sizes: torch.Tensor) -> torch.Tensor:
    """sizes [P, L] of source-major chunks (chunk (p, l) = rows p sent for local expert l) -> the
    index [M] that reads them expert-major ((l, p) order)."""
    p, l = sizes.shape
    starts = (torch.cumsum(sizes.reshape(-1), 0) - sizes.reshape(-1)).view(p, l)
    pieces = [torch.arange(int(starts[i, j]), int(starts[i, j] + sizes[i, j])) for j in range(l) for i in range(p)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


class AllToAllDispatcher:
    """Dispatch to and combine from the experts of the EP group `group` (None: one rank, no
    communication), `num_experts` experts over its ranks. A dispatch is followed by its combine
    before the next dispatch (one MoE layer's forward)."""

    def __init__(self, group, num_experts: int):
        self.group, self.ranks = group, comm.group_size(group)
        if num_experts % self.ranks:
            raise ValueError(f"num_experts must be divisible by the expert-parallel size; got "
                             f"num_experts={num_experts}, ep_size={self.ranks}")
        self.num_experts, self.local_experts = num_experts, num_experts // self.ranks
        self._route: Route | None = None

    def dispatch(self, tokens: torch.Tensor, counts: torch.Tensor, fake: FakeRouting | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [N*k, H] sorted by global expert, counts [E] (int64) -> (this rank's experts'
        tokens [M, H] sorted by local expert, counts per local expert [L]). `fake`: on fake
        tensors, the rows each source sends to each local expert (None: the balanced policy)."""
        if self.ranks == 1:
            return tokens, counts
        p, l = self.ranks, self.local_experts
        with torch.no_grad():
            received = comm.all_to_all_dim0(counts.reshape(p, l).contiguous(), self.group)   # [P (source), L]
            if is_fake(received):                        # no values (--estimate): the given or balanced sizes
                sent, from_sources, to_experts = self._fake_sizes(tokens, fake)
            else:
                host = received.cpu()
                to_experts = chunk_permutation(host).to(tokens.device)
                sent, from_sources = counts.reshape(p, l).sum(1).tolist(), host.sum(1).tolist()
            to_sources = torch.argsort(to_experts)
        self._route = Route(sent=sent, received=from_sources, to_experts=to_experts, to_sources=to_sources)
        rows = all_to_all_rows(tokens, self.group, self._route.received, sent)   # [M, H] source-major
        return rows.index_select(0, to_experts), received.sum(0)                 # [M, H] expert-major, [L]

    def _fake_sizes(self, tokens: torch.Tensor, fake: FakeRouting | None) -> tuple[list[int], list[int], torch.Tensor]:
        """On fake tensors: (rows sent to each rank, rows received from each, the regroup's index [M]
        as a fake tensor -- no values needed, and torch.tensor would keep a real copy beside it).
        Sent: this rank's N*k rows spread evenly (only their sum shapes a tensor)."""
        p, l = self.ranks, self.local_experts
        routing = fake or FakeRouting.balanced(tokens.shape[0], p, l)
        from_sources = routing.from_sources
        sent = balanced_counts(tokens.shape[0], p) if fake else from_sources   # balanced: as many each way
        return sent, from_sources, torch.empty(sum(from_sources), dtype=torch.long, device=tokens.device)

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """out [M, H] expert-major (the experts' outputs of dispatch's tokens) -> [N*k, H] in the
        order dispatch was given."""
        if self.ranks == 1:
            return out
        route, self._route = self._route, None
        rows = out.index_select(0, route.to_sources)                             # [M, H] source-major
        return all_to_all_rows(rows, self.group, route.sent, route.received)      # [N*k, H]
