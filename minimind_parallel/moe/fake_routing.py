"""The routing an MoE layer follows on fake tensors (`--estimate`), where the router's top-k has
no values to read.

A real dispatch reads its split sizes from the routing (moe/dispatch.py: the counts' all-to-all,
then the rows each source sends to each local expert); on fake tensors there are none, so each
MoE layer takes them from a `FakeRouting` set on it (feed_forward.set_fake_routing), or, without
one, the balanced policy (every source sends N*k / E rows to every expert: `balanced`). Only the
sizes matter on fake tensors: the rows this rank's experts receive, M, from each source, and how
many each local expert gets (the experts' loop splits its rows by them).

    rows[p][l]   rows source p (an EP rank) sends to local expert l      [P][L]
    M            sum of all of them: the rows this rank's experts receive
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .experts import balanced_counts


@dataclass(frozen=True)
class FakeRouting:
    rows: tuple[tuple[int, ...], ...]      # [P sources][L local experts]

    @classmethod
    def of_expert_rows(cls, per_expert: Sequence[int], sources: int) -> "FakeRouting":
        """Each local expert's rows (M in all), spread as evenly as they go over the P sources."""
        split = [balanced_counts(m, sources) for m in per_expert]           # [L][P]
        return cls(rows=tuple(tuple(col[p] for col in split) for p in range(sources)))

    @classmethod
    def balanced(cls, rows: int, sources: int, local_experts: int) -> "FakeRouting":
        """Every source routes `rows` (its N*k, as on every rank) evenly over the P x L experts (the
        first ones one more where it does not divide): each source sends this rank's experts the
        same as it receives from this rank."""
        flat = balanced_counts(rows, sources * local_experts)
        return cls(rows=tuple(tuple(flat[p * local_experts:(p + 1) * local_experts]) for p in range(sources)))

    @property
    def per_expert(self) -> list[int]:
        """The rows each local expert receives, summed over the sources: [L]."""
        return [sum(col) for col in zip(*self.rows)]

    @property
    def from_sources(self) -> list[int]:
        """The rows received from each source: [P] (the token all-to-all's output splits)."""
        return [sum(r) for r in self.rows]
