"""Sharded data parallelism at the book's configuration on 8 ranks: the worst rank's peak and its
params / grads / optimizer categories, from --estimate (fake tensors, the real step) and the
analytic model, for DDP (dp 8), --zero 1, 2 and 3 (dp 8) and TP+SP+async with --zero 1 and with
--zero 3 (tp 2 x dp 4). Prints a markdown table (used in docs/memory.md).

    python scripts/zero_memory_table.py [--layers 8 16 32 64] [--bucket_size_mb 25] [--modes zero3 ...]
"""
from __future__ import annotations

import argparse
import time

import torch

from minimind_parallel import MiniMindConfig, ParallelConfig
from minimind_parallel.memory import estimate_step_memory, predict_memory

BOOK = dict(hidden_size=768, num_attention_heads=8, num_key_value_heads=4, vocab_size=6400, tie_word_embeddings=False)
MiB = 2**20
MODES = {
    "ddp (dp 8)": ParallelConfig(dp=8),
    "zero1 (dp 8)": ParallelConfig(dp=8, zero=1),
    "zero2 (dp 8)": ParallelConfig(dp=8, zero=2),
    "tp_sp_async + zero1 (tp 2 x dp 4)": ParallelConfig(tp=2, dp=4, sequence_parallel=True, async_communication=True,
                                                        zero=1),
    "zero3 (dp 8)": ParallelConfig(dp=8, zero=3),
    "tp_sp_async + zero3 (tp 2 x dp 4)": ParallelConfig(tp=2, dp=4, sequence_parallel=True, async_communication=True,
                                                        zero=3),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--bucket_size_mb", type=float, default=25.0)
    ap.add_argument("--modes", nargs="+", default=None, metavar="WORD",
                    help="only the modes whose name starts with one of these (default: every mode)")
    args = ap.parse_args()
    t0 = time.time()
    print(f"S 2048, B 2, H 768, 8 heads, 4 kv heads, V 6400, untied, bf16, 8 ranks, buckets of "
          f"{args.bucket_size_mb:g} MiB; MiB of the worst rank\n")
    print("| L | mode | peak `--estimate` | peak model | params | grads | optimizer | activations | temporaries |")
    print("|---|---|---|---|---|---|---|---|---|")
    for layers in args.layers:
        c = MiniMindConfig(num_hidden_layers=layers, **BOOK)
        kw = dict(seq_len=2048, micro_batch_size=2, dtype=torch.bfloat16, bucket_size_mb=args.bucket_size_mb)
        for name, par in MODES.items():
            if args.modes and not any(name.startswith(m) for m in args.modes):
                continue
            est = estimate_step_memory(c, par, iters=1, **kw)
            try:
                model = f"{predict_memory(c, par, **kw).peak_bytes / MiB:.2f}"
            except NotImplementedError:
                model = "not modelled"
            cats = " | ".join(f"{est.breakdown[k] / MiB:.2f}"
                              for k in ("params", "grads", "optimizer", "activations", "temporaries"))
            print(f"| {layers} | {name} | {est.peak_bytes / MiB:.2f} | {model} | {cats} |", flush=True)
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
