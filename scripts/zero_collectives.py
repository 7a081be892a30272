"""Collectives of one training step under DDP and --zero 1 / 2 / 3, counted from the real calls.

Spawns W gloo ranks (data-parallel, one thread each), takes a warm-up step, then one step inside
`profiling.CollectiveLog` (every c10d operator with the bytes this rank hands it), split into the
forward + backward and what follows it (the grads' reduction, the step, the parameters'
all-gather), and prints rank 0's counts and bytes per kind, plus the step time (median of
`--iters` steps, max over ranks) of each level measured in the same run.

    python scripts/zero_collectives.py [--world 2] [--bucket_size_mb 0.25] [--layers 4] [--iters 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minimind_parallel import MiniMindConfig, ParallelConfig, ProcessGroups
from minimind_parallel.data.batches import dp_rows, random_batch, split_microbatches
from minimind_parallel.model import MiniMindForCausalLM
from minimind_parallel.pipeline_parallel import forward_backward
from minimind_parallel.profiling.collectives import CollectiveLog
from minimind_parallel.training import build_parallel_model, finalize_grads, make_optimizer, train_step
from minimind_parallel.training import wrap_data_parallel

LEVELS = (0, 1, 2, 3)


def _rank(rank: int, world: int, store: str, args, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    config = MiniMindConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                            num_key_value_heads=4, vocab_size=args.vocab, tie_word_embeddings=False)
    for level in LEVELS:
        par = ParallelConfig(dp=world, zero=level)
        groups = ProcessGroups.build(par)
        torch.manual_seed(0)
        model = wrap_data_parallel(build_parallel_model(config, par, groups, MiniMindForCausalLM(config).state_dict()),
                                   groups)
        optimizer = make_optimizer(model, 1e-3, groups, args.bucket_size_mb)
        ids, targets = dp_rows(random_batch(0, 2 * world, args.seq, args.vocab), rank, world)
        train_step(model, optimizer, groups, ids, targets)
        with CollectiveLog() as backward:
            forward_backward(model, groups, split_microbatches(ids, targets, 1))
        with CollectiveLog() as after:
            finalize_grads(model, groups, optimizer)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        times = []
        for _ in range(args.iters):
            dist.barrier()
            t0 = time.perf_counter()
            train_step(model, optimizer, groups, ids, targets)
            times.append(time.perf_counter() - t0)
        slowest = torch.tensor(statistics.median(times))
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            buckets = sum(len(b.layout.buckets) for b in getattr(optimizer, "buffers", []))
            out[level] = dict(backward=(backward.counts(), backward.bytes()), after=(after.counts(), after.bytes()),
                              step_ms=1e3 * slowest.item(), buckets=buckets,
                              params=sum(p.numel() for p in model.parameters()))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--bucket_size_mb", type=float, default=0.25)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(args.world, os.path.join(tmp, "store"), args, out), nprocs=args.world)
        results = dict(out)
    print(f"dp={args.world} layers={args.layers} hidden={args.hidden} vocab={args.vocab} seq={args.seq} "
          f"bucket_size_mb={args.bucket_size_mb} float32; parameters per rank {results[0]['params']:,} "
          f"({4 * results[0]['params']:,} B)")
    print(f"{'zero':>4}  {'buckets':>7}  {'phase':<18} {'collective':<15} {'calls':>5} {'bytes (rank 0 hands)':>21}"
          f"  {'step ms':>8}")
    for level in LEVELS:
        r = results[level]
        for phase in ("backward", "after"):
            counts, nbytes = r[phase]
            for kind in sorted(counts):
                label = "forward + backward" if phase == "backward" else "reduce/step/gather"
                print(f"{level:>4}  {r['buckets']:>7}  {label:<18} {kind:<15} {counts[kind]:>5} {nbytes[kind]:>21,}"
                      f"  {r['step_ms']:8.1f}")


if __name__ == "__main__":
    main()
