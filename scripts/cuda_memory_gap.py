"""Where the CUDA allocator holds more than the tensors the tracker sees (one GPU, world 1).

For each depth: one warm-up step, then one step under the storage tracker, reading
torch.cuda.memory_allocated() after every op. Prints the allocator's peak, the tracker's peak,
the gap (allocated - tracked) at the tracker's peak and the largest gap with the op it follows,
the allocator's own baseline before the step (cuBLAS workspaces and the like), and which
attention kernels ran.

    python scripts/cuda_memory_gap.py [--layers 1 2 4] [--seq_len 2048] [--micro_batch_size 2]
"""
from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

from minimind_parallel import MiniMindConfig, MiniMindForCausalLM, ParallelConfig, ProcessGroups
from minimind_parallel.memory import MemoryMeter, predict_memory
from minimind_parallel.memory.tracker import StorageTracker
from minimind_parallel.training import build_parallel_model, make_optimizer, train_step

MiB = 2**20


class GapTracker(StorageTracker):
    """The storage tracker, also reading the allocator after every op."""

    def __init__(self, *, detail: bool = False):
        super().__init__(detail=detail)
        self.max_gap, self.max_gap_op, self.gap_at_peak, self.kernels = 0, "", 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        name = str(func)
        if "attention" in name:
            self.kernels.add(name)
        gap = torch.cuda.memory_allocated() - self.live_bytes
        if gap > self.max_gap:
            self.max_gap, self.max_gap_op = gap, name
        if self.live_bytes == self.peak_bytes:
            self.gap_at_peak = gap
        return out


class GapMeter(MemoryMeter):
    tracker_type = GapTracker


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--micro_batch_size", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(minutes=5))
    torch.cuda.set_device(0)
    par = ParallelConfig()
    groups = ProcessGroups.build(par)
    print("torch", torch.__version__, torch.cuda.get_device_name(0))
    print(f"{'L':>3} {'allocator':>10} {'tracker':>10} {'model':>10} {'baseline':>9} {'gap@peak':>9} "
          f"{'max gap':>9}  after op")
    for layers in args.layers:
        c = MiniMindConfig(hidden_size=768, num_attention_heads=8, num_key_value_heads=4, vocab_size=6400,
                           tie_word_embeddings=False, num_hidden_layers=layers)
        torch.manual_seed(0)
        model = build_parallel_model(c, par, groups, MiniMindForCausalLM(c).state_dict(), dtype=torch.bfloat16,
                                     device="cuda")
        optimizer = make_optimizer(model, 1e-3)
        ids = torch.randint(0, c.vocab_size, (args.micro_batch_size, args.seq_len), device="cuda")
        train_step(model, optimizer, groups, ids, ids.clone())
        meter = GapMeter("cuda", model, optimizer)
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        with meter:
            train_step(model, optimizer, groups, ids, ids.clone())
        t = meter.tracker
        # everything tracked at entry is the model state; the rest of the baseline is the allocator's
        state = sum(p.numel() * p.element_size() for p in [*model.parameters(), *model.buffers()])
        state += sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                     if v.is_cuda)
        pred = predict_memory(c, par, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                              dtype=torch.bfloat16, device="cuda")
        print(f"{layers:>3} {meter.report().peak_bytes / MiB:>10.2f} {t.peak_bytes / MiB:>10.2f} "
              f"{pred.peak_bytes / MiB:>10.2f} {(baseline - state) / MiB:>9.2f} {t.gap_at_peak / MiB:>9.2f} "
              f"{t.max_gap / MiB:>9.2f}  {t.max_gap_op}")
        print("    attention kernels:", ", ".join(sorted(t.kernels)))
        del model, optimizer, meter
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
