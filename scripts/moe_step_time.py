"""Step time of the dense model, the MoE model with grouped experts, and MiniMind's loop, on the
same tokens: one process, one device, fp32 by default.

    dense      MiniMind-3 with its SwiGLU MLP
    grouped    --use_moe: tokens sorted by expert, one GEMM per expert (`moe/experts.py`:
               torch._grouped_mm where the dtype and device have it, else a loop of F.linear)
    minimind   the same MoE weights with every layer's MoE block swapped for the faithful
               reimplementation of MiniMind's MOEFeedForward (tests/minimind_moe_reference.py:
               a Python loop over the experts, a gather and an index_add_ each)

Each step is forward, backward of loss + aux loss, and an AdamW step on one batch of random
tokens (the same for the three); the median over --iters steps after --warmup is printed, with
the min-max spread, and each model's time relative to the dense one. MiniMind's README says its
MoE trains about 50% slower than dense.

    python scripts/moe_step_time.py [--hidden_size 256] [--num_hidden_layers 4] [--seq_len 256]
        [--batch 4] [--num_experts 4] [--num_experts_per_tok 1] [--iters 10] [--device cpu]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from minimind_parallel import MiniMindConfig, MiniMindForCausalLM
from minimind_parallel.config import DTYPES
from minimind_parallel.data.batches import random_batch
from minimind_parallel.training import make_optimizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from minimind_moe_reference import reference_aux_loss, reference_model  # noqa: E402


def step_times(model, batch, aux_of, *, warmup: int, iters: int, device) -> list[float]:
    opt = make_optimizer(model, 1e-4)
    times = []
    for i in range(warmup + iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = model(batch.input_ids, targets=batch.targets)
        loss = out.loss if aux_of is None else out.loss + aux_of(model, out)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--num_attention_heads", type=int, default=8)
    p.add_argument("--num_key_value_heads", type=int, default=4)
    p.add_argument("--vocab_size", type=int, default=6400)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--num_experts", type=int, default=4)
    p.add_argument("--num_experts_per_tok", type=int, default=1)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()
    device, dtype = torch.device(a.device), DTYPES[a.dtype]
    sizes = dict(hidden_size=a.hidden_size, num_hidden_layers=a.num_hidden_layers,
                 num_attention_heads=a.num_attention_heads, num_key_value_heads=a.num_key_value_heads,
                 vocab_size=a.vocab_size, max_position_embeddings=max(a.seq_len, 64))
    dense_config = MiniMindConfig(**sizes)
    moe_config = MiniMindConfig(**sizes, use_moe=True, num_experts=a.num_experts,
                                num_experts_per_tok=a.num_experts_per_tok)
    batch = random_batch(0, a.batch, a.seq_len, a.vocab_size, device)
    torch.manual_seed(0)
    dense = MiniMindForCausalLM(dense_config).to(device=device, dtype=dtype)
    grouped = MiniMindForCausalLM(moe_config).to(device=device, dtype=dtype)
    loop = reference_model(moe_config).to(device=device, dtype=dtype)
    loop.load_state_dict(grouped.state_dict(), strict=True)
    runs = {"dense": (dense, None), "grouped": (grouped, lambda m, out: out.aux_loss),
            "minimind": (loop, lambda m, out: reference_aux_loss(m).to(out.loss.device))}
    print(f"step time, {a.batch} x {a.seq_len} tokens, hidden {a.hidden_size}, {a.num_hidden_layers} layers, "
          f"{a.num_experts} experts top-{a.num_experts_per_tok}, {a.dtype} on {device} "
          f"(threads {torch.get_num_threads()}), median of {a.iters} after {a.warmup}")
    base = None
    for name, (model, aux_of) in runs.items():
        t = step_times(model, batch, aux_of, warmup=a.warmup, iters=a.iters, device=device)
        med = statistics.median(t)
        base = base or med
        print(f"{name:<9} {1e3 * med:9.1f} ms  ({1e3 * min(t):.1f}-{1e3 * max(t):.1f})  {med / base:5.2f} x dense")


if __name__ == "__main__":
    main()
