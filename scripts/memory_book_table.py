"""The book's two memory derivations (chapter 4.2.2 and 4.4.2), from --estimate and the analytic
model, next to the book's measured numbers. Prints a markdown table (used in docs/memory.md).

    python scripts/memory_book_table.py [--max_layers 64]
"""
from __future__ import annotations

import argparse
import time

import torch

from minimind_parallel import MiniMindConfig, ParallelConfig
from minimind_parallel.memory import estimate_step_memory, predict_memory

SEED = dict(hidden_size=768, num_attention_heads=8, num_key_value_heads=4, vocab_size=6400, tie_word_embeddings=False)
MiB = 2**20
TP = ParallelConfig(tp=2)
SP = ParallelConfig(tp=2, sequence_parallel=True)
RECOMPUTE = ParallelConfig(tp=2, sequence_parallel=True, async_communication=True)
SHARED = ParallelConfig(tp=2, sequence_parallel=True, shared_sp_gather=True)
SEED_SP = {8: 61.54, 16: 109.50, 32: 203.95, 64: 396.00}                   # 4.2.2, TP only - TP+SP
SEED_RECOMPUTE = {2: 95.35, 4: 190.13, 8: 383.00, 16: 768.00, 32: 1536.69}  # 4.4.2, SP - SP+recompute


def peaks(layers: int, mb: int, pars) -> tuple[list[float], list[float]]:
    c = MiniMindConfig(num_hidden_layers=layers, **SEED)
    kw = dict(seq_len=2048, micro_batch_size=mb, dtype=torch.bfloat16)
    est = [estimate_step_memory(c, p, iters=1, **kw).peak_bytes / MiB for p in pars]
    model = [predict_memory(c, p, **kw).peak_bytes / MiB for p in pars]
    return est, model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max_layers", type=int, default=64)
    ap.add_argument("--part", choices=("sp", "recompute", "both"), default="both")
    args = ap.parse_args()
    t0 = time.time()
    if args.part in ("sp", "both"):
        sp_table(args)
    if args.part in ("recompute", "both"):
        recompute_table(args)
    print(f"\n({time.time() - t0:.0f} s)")


def sp_table(args):
    print("TP only - TP+SP (basic), S 2048, B 2, H 768, T 2, bf16; formula 6L + 12 MiB\n")
    print("| L | formula | --estimate | model | seed measured | TP / TP+SP / SP+shared (estimate) |")
    print("|---|---|---|---|---|---|")
    for L, seed in SEED_SP.items():
        if L > args.max_layers:
            continue
        (tp, sp, sh), (mtp, msp, _) = peaks(L, 2, [TP, SP, SHARED])
        print(f"| {L} | {6 * L + 12} MiB | {tp - sp:.2f} MiB | {mtp - msp:.2f} MiB | {seed:.2f} MiB "
              f"| {tp:.2f} / {sp:.2f} / {sh:.2f} MiB |", flush=True)


def recompute_table(args):
    print("\nTP+SP (basic) - TP+SP+recompute (--async_communication), B 4; formula 48L MiB\n")
    print("| L | formula | --estimate | model | seed measured | SP / SP+recompute (estimate) |")
    print("|---|---|---|---|---|---|")
    for L, seed in SEED_RECOMPUTE.items():
        if L > args.max_layers:
            continue
        (sp, rc), (msp, mrc) = peaks(L, 4, [SP, RECOMPUTE])
        print(f"| {L} | {48 * L} MiB | {sp - rc:.2f} MiB | {msp - mrc:.2f} MiB | {seed:.2f} MiB "
              f"| {sp:.2f} / {rc:.2f} MiB |", flush=True)


if __name__ == "__main__":
    main()
