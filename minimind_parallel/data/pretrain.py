"""MiniMind's pretraining rows on the token cache, the data-parallel sampler, and loading speed.

Row i (MiniMind's dataset/lm_dataset.py, PretrainDataset):

    input_ids = [bos] + document i truncated to max_seq_len - 2 + [eos] + [pad] * (rest)   # [S]
    labels    = input_ids with -100 where input_ids == pad                                   # [S]

Labels are unshifted, as MiniMind returns them; the loss shifts them into next-token targets.

The sampler shuffles all rows once per epoch with a generator seeded by (seed, epoch). Step s of an
epoch is the global batch order[s*G:(s+1)*G], G = dp_size * batch_size, and DP rank d takes its
contiguous share [d*B:(d+1)*B]; the ranks of one TP/CP/PP group share a dp rank and so read the same
rows, and the global batch of a step does not depend on how it is split over DP ranks. An epoch has
num_rows // G steps: the last num_rows % G rows of each epoch's order are left out (different rows
every epoch), so every rank runs the same number of full batches.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..config import ConfigError
from .batches import IGNORE_INDEX
from .token_cache import TokenCache, build_token_cache
from .tokenizer import LoadedTokenizer, load_tokenizer



def check_fits_model(*, tokenizer_vocab: int, model_vocab: int, max_seq_len: int, max_positions: int) -> None:
    """The tokenizer's ids must index the model's embedding; rows must fit its positions (RoPE table)."""
    if tokenizer_vocab > model_vocab:
        raise ConfigError(f"tokenizer vocab must be <= the model's vocab_size; "
                          f"got tokenizer vocab={tokenizer_vocab}, vocab_size={model_vocab}")
    if max_seq_len > max_positions:
        raise ConfigError(f"max_seq_len must be <= max_position_embeddings; "
                          f"got max_seq_len={max_seq_len}, max_position_embeddings={max_positions}")
    if max_seq_len < 3:
        raise ConfigError(f"max_seq_len must hold bos, one text token and eos (>= 3); got max_seq_len={max_seq_len}")


class PretrainDataset:
    """Fixed-length rows built from a TokenCache (no tokenising at training time)."""

    def __init__(self, cache: TokenCache, *, max_seq_len: int, bos_id: int, eos_id: int, pad_id: int):
        self.cache, self.max_seq_len = cache, max_seq_len
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id

    @classmethod
    def from_tokenizer(cls, cache: TokenCache, tok: LoadedTokenizer, *, max_seq_len: int) -> "PretrainDataset":
        return cls(cache, max_seq_len=max_seq_len, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)

    def __len__(self) -> int:
        return len(self.cache)

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `indices` -> (input_ids, labels), both int64 [len(indices), max_seq_len]."""
        ids = np.full((len(indices), self.max_seq_len), self.pad_id, dtype=np.int64)
        for r, i in enumerate(indices):
            text = self.cache.document(int(i))[:self.max_seq_len - 2]
            ids[r, 0] = self.bos_id
            ids[r, 1:1 + len(text)] = text
            ids[r, 1 + len(text)] = self.eos_id
        input_ids = torch.from_numpy(ids)
        return input_ids, input_ids.masked_fill(input_ids == self.pad_id, IGNORE_INDEX)


class PretrainSampler:
    """This DP rank's row indices, batch after batch, epoch after epoch; its position is checkpointable."""

    def __init__(self, num_rows: int, *, batch_size: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0):
        if batch_size < 1 or not 0 <= dp_rank < dp_size:
            raise ConfigError(f"sampler needs batch_size >= 1 and 0 <= dp_rank < dp_size; "
                              f"got batch_size={batch_size}, dp_rank={dp_rank}, dp_size={dp_size}")
        if num_rows < batch_size * dp_size:
            raise ConfigError(f"dataset must hold one global batch (dp_size * batch_size rows); got {num_rows} rows, "
                              f"dp_size={dp_size}, batch_size={batch_size}")
        self.num_rows, self.batch_size, self.dp_rank, self.dp_size, self.seed = (
            num_rows, batch_size, dp_rank, dp_size, seed)
        self.epoch = self.step = 0  # the position of the next batch
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, its permutation), computed once per epoch

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.dp_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_rows // self.global_batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of all rows for `epoch` (the same on every rank)."""
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_rows))
        return self._order[1]

    def indices(self, epoch: int, step: int) -> np.ndarray:
        """This rank's rows of batch `step` of `epoch`: [batch_size]."""
        start = step * self.global_batch_size + self.dp_rank * self.batch_size
        return self.epoch_order(epoch)[start:start + self.batch_size]

    def __iter__(self) -> "PretrainSampler":
        return self

    def __next__(self) -> np.ndarray:
        rows = self.indices(self.epoch, self.step)
        self.step += 1
        if self.step == self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        return rows

    def state_dict(self) -> dict:
        """The position of the next batch, and what it is a position in (plain ints, JSON-safe)."""
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "num_rows": self.num_rows,
                "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; the data, seed and global batch must be those it was saved with."""
        mine = self.state_dict()
        for key in ("seed", "num_rows", "global_batch_size"):
            if state[key] != mine[key]:
                raise ConfigError(f"saved data position is for {key}={state[key]}; this run has {key}={mine[key]}")
        if not 0 <= state["step"] < self.steps_per_epoch:
            raise ConfigError(f"saved data position step={state['step']} is outside an epoch of "
                              f"{self.steps_per_epoch} steps")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])


def iterate_batches(dataset: PretrainDataset, sampler: PretrainSampler) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) [batch_size, max_seq_len] for this rank, forever; the sampler holds the position."""
    for rows in sampler:
        yield dataset.batch(rows)


@dataclass(frozen=True, kw_only=True)
class LoadingSpeed:
    tokens_per_s: float  # row tokens (padding included) a rank loads per second
    seconds_per_batch: float


def measure_loading(dataset: PretrainDataset, *, batch_size: int, batches: int = 200, seed: int = 0) -> LoadingSpeed:
    """Time building `batches` batches as a training rank does (from a fresh sampler), for comparison
    with the step time: the loader keeps up when seconds_per_batch is far below a step's time."""
    sampler = PretrainSampler(len(dataset), batch_size=batch_size, seed=seed)
    start = time.perf_counter()
    for _, (input_ids, _) in zip(range(batches), iterate_batches(dataset, sampler)):
        pass
    elapsed = time.perf_counter() - start
    return LoadingSpeed(tokens_per_s=batches * input_ids.numel() / elapsed, seconds_per_batch=elapsed / batches)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build (or reuse) the token cache of a jsonl and measure loading.")
    parser.add_argument("--data", required=True)
    parser.add_argument("--tokenizer", required=True, help="directory with tokenizer.json")
    parser.add_argument("--max_seq_len", type=int, default=340)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        tok = load_tokenizer(args.tokenizer)
        cache = build_token_cache(args.data, tok)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{'tokenised' if cache.built else 'reused'} {cache.tokens_path}: {len(cache)} documents, "
          f"{int(cache.offsets[-1])} tokens in {time.perf_counter() - start:.2f} s")
    speed = measure_loading(PretrainDataset.from_tokenizer(cache, tok, max_seq_len=args.max_seq_len),
                            batch_size=args.batch_size, batches=args.batches)
    print(f"loading: {speed.tokens_per_s:,.0f} tokens/s, {speed.seconds_per_batch * 1e3:.3f} ms per batch of "
          f"{args.batch_size} x {args.max_seq_len}")


if __name__ == "__main__":
    main()
