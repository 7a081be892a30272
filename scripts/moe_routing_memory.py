"""MoE memory per rank under each routing: the analytic model's worst-rank peak for the balanced
routing (--estimate's policy) and the worst case (every token of the EP group on one EP rank's
experts), at the book's configuration as MiniMind's MoE model (4 experts, top-1, untied as the
benchmark builds it) on 4 data-parallel ranks, the experts over 1, 2 and 4 of them. Prints a
markdown table (README, "MoE and expert parallelism").

    python scripts/moe_routing_memory.py [--layers 8] [--top_k 1]
"""
from __future__ import annotations

import argparse

import torch

from minimind_parallel import MiniMindConfig, ParallelConfig
from minimind_parallel.memory import predict_memory
from minimind_parallel.memory.analytic.moe_sizes import RoutingPolicy

MiB = 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--top_k", type=int, default=1)
    args = ap.parse_args()
    c = MiniMindConfig(num_hidden_layers=args.layers, hidden_size=768, num_attention_heads=8, num_key_value_heads=4,
                       vocab_size=6400, tie_word_embeddings=False, use_moe=True, num_experts=4, num_experts_per_tok=args.top_k)
    kw = dict(seq_len=2048, micro_batch_size=2, dtype=torch.bfloat16)
    print("| ep | routing | peak MiB | activations | peak at |")
    print("|----|---------|----------|-------------|---------|")
    for ep in (1, 2, 4):
        for routing in RoutingPolicy:
            pred = predict_memory(c, ParallelConfig(dp=4, ep=ep), routing=routing, **kw)
            print(f"| {ep} | {routing} | {pred.peak_bytes / MiB:.1f} | {pred.breakdown['activations'] / MiB:.1f} "
                  f"| {pred.peak_at} |")


if __name__ == "__main__":
    main()
