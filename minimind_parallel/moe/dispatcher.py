"""How the tokens, sorted by expert, reach the experts that process them and come back.

The interface (`MOEFeedForward` calls it; expert parallelism replaces it with an all-to-all):

    dispatch(tokens [N*k, H] sorted by expert, counts [E], fake) -> (this rank's experts' tokens
             [T, H] sorted by local expert, counts per local expert [E_local]); `fake`: on fake
             tensors, the split sizes to follow (fake_routing.FakeRouting; None: balanced)
    combine(expert_out [T, H]) -> [N*k, H] in the order `dispatch` received

`LocalDispatcher` is the single-device one: every expert is local, nothing moves.
"""
from __future__ import annotations

import torch


class LocalDispatcher:
    """Every expert on this rank: dispatch and combine are the identity."""

    def dispatch(self, tokens: torch.Tensor, counts: torch.Tensor, fake=None) -> tuple[torch.Tensor, torch.Tensor]:
        return tokens, counts

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        return expert_out
