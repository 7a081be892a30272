"""Which tokens of a sequence each context-parallel rank holds.

The sequence of S tokens is cut into equal chunks. With causal load balancing (the default) there
are 2C chunks and CP rank i holds chunks i and 2C-1-i: under the causal mask the early chunk has
little to attend to and the late one much, so every rank does the same attention work (the
"zigzag" split of Megatron-LM's context parallelism and of ring-attention implementations).
Without it (the MiniMind Parallelism Book's split) there are C chunks and rank i holds chunk i,
so the last rank attends to the whole sequence and the first only to its own chunk.

A rank's tokens are its chunks concatenated in the order of `chunks`; RoPE, the causal mask and
the loss use each token's global position (`positions`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class ContextLayout:
    seq_len: int          # S, the whole sequence
    cp: int               # C, ranks in the context-parallel group
    load_balance: bool = True

    @property
    def num_chunks(self) -> int:
        return 2 * self.cp if self.load_balance else self.cp

    @property
    def chunk_len(self) -> int:
        return self.seq_len // self.num_chunks

    def chunks(self, rank: int) -> tuple[int, ...]:
        """The global chunk indices CP rank `rank` holds, in its local order."""
        if self.load_balance:
            return (rank, 2 * self.cp - 1 - rank)
        return (rank,)

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """Global positions of the rank's tokens, in local order: [S/C] int64."""
        n = self.chunk_len
        return torch.cat([torch.arange(c * n, (c + 1) * n, device=device) for c in self.chunks(rank)])

    def split(self, x: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
        """The rank's tokens of `x` along `dim` (length S), as a fresh contiguous tensor."""
        parts = x.chunk(self.num_chunks, dim=dim)
        return torch.cat([parts[c] for c in self.chunks(rank)], dim=dim)

    @classmethod
    def of(cls, par, seq_len: int) -> "ContextLayout":
        """The layout of a ParallelConfig (`cp`, `cp_load_balance`) for sequences of `seq_len`."""
        return cls(seq_len=seq_len, cp=par.cp, load_balance=par.cp_load_balance)

    def merge(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Inverse of `split`: every rank's tokens (rank order) -> the whole sequence along `dim`."""
        ordered: dict[int, torch.Tensor] = {}
        for rank, part in enumerate(parts):
            for c, piece in zip(self.chunks(rank), part.chunk(len(self.chunks(rank)), dim=dim)):
                ordered[c] = piece
        return torch.cat([ordered[c] for c in range(self.num_chunks)], dim=dim)
