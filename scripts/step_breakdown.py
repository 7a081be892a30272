"""Where one training step's time goes on CPU, by the time model's categories, against the time
model's own terms for the same layout: the step runs as the benchmark runs it (train_step, gloo
ranks of one thread each), one step under `planning.op_count.OpCount`-style timing of every aten op
(each op's thread CPU time, so another job's load on the cores distorts it less than wall time),
grouped into GEMMs, attention, memory-bound ops (with their bytes), views, collectives, and the
optimizer's step.

    OMP_NUM_THREADS=1 python scripts/step_breakdown.py --layout dp2 --calibration results/cpu_calibration.json

Layouts (world 2, the validation model of docs/planning.md: H 128, L 4, 8 heads, 4 kv heads,
V 1024, S 256, global batch 4): dp2, dp2_zero3, pp2, cp2_*, tp2_* (see LAYOUTS).

`--collectives`: every collective of one (otherwise untimed) step timed on both ranks by
`planning.collective_clock.CollectiveClock` (issue and return on the system-wide monotonic clock,
the waits of async ones too), paired across the ranks by order: of each one's wall time, the share
spent waiting for the other rank to arrive (skew: the other's compute, not the link) and the share
after both had arrived (the copies in and out, the backend's threads and the link). DDP's own
all-reduce does not go through the library's collectives and is not among them.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minimind_parallel.config import MiniMindConfig, ParallelConfig  # noqa: E402
from minimind_parallel.planning.op_count import category  # noqa: E402
from minimind_parallel.planning.collective_clock import Call, CollectiveClock, after_all_arrived  # noqa: E402

MODEL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=1024,
             tie_word_embeddings=False)
SEQ, BATCH = 256, 4
# name: (the layout, rows per microbatch, microbatches); the plan's Candidate flags
LAYOUTS = {
    "dp2": (dict(dp=2), 2, 1),
    "dp2_zero3": (dict(dp=2, zero=3), 2, 1),
    "pp2": (dict(pp=2, loss_chunks=8), 1, 4),
    "cp2_ring_full": (dict(cp=2, cp_comm_type="ring", recompute="full", zero=1), 4, 1),
    "cp2_all_gather_full": (dict(cp=2, cp_comm_type="all_gather", recompute="full"), 4, 1),
    "cp2_ring_selective": (dict(cp=2, cp_comm_type="ring", recompute="selective", zero=2, loss_chunks=8), 4, 1),
    "cp2_a2a": (dict(cp=2, cp_comm_type="a2a", zero=1, loss_chunks=8), 4, 1),
    "tp2_async": (dict(tp=2, async_communication=True, recompute="selective", loss_chunks=8), 4, 1),
    "tp2_sp_shared_vp": (dict(tp=2, sequence_parallel=True, shared_sp_gather=True, vocab_parallel=True,
                              recompute="selective", loss_chunks=8), 4, 1),
    "tp2_vp": (dict(tp=2, vocab_parallel=True, recompute="selective", loss_chunks=8), 4, 1),
}


class Breakdown(TorchDispatchMode):
    """Thread CPU seconds, op counts and memory-bound bytes per (phase, category) of the ops run inside."""

    def __init__(self):
        super().__init__()
        self.phase, self.seconds, self.ops, self.bytes = "step", defaultdict(float), defaultdict(int), defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.thread_time()
        out = func(*args, **(kwargs or {}))
        key = (self.phase, category(func))
        self.seconds[key] += time.thread_time() - t0
        self.ops[key] += 1
        if key[1] == "elementwise":
            self.bytes[key] += sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves((args, kwargs, out))
                                   if isinstance(t, torch.Tensor))
        return out


def _rank(rank: int, store: str, name: str, out_dir: str) -> None:
    from minimind_parallel.context_parallel import ContextLayout
    from minimind_parallel.data.batches import broadcast_batch, cp_tokens, dp_rows
    from minimind_parallel.groups import ProcessGroups
    from minimind_parallel.model import MiniMindForCausalLM
    from minimind_parallel.training import build_parallel_model, make_optimizer, train_step, wrap_data_parallel
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        layout, rows, m = LAYOUTS[name]
        par, config = ParallelConfig(**layout), MiniMindConfig(**MODEL)
        groups = ProcessGroups.build(par)
        torch.manual_seed(0)
        dense = MiniMindForCausalLM(config).state_dict()
        model = wrap_data_parallel(build_parallel_model(config, par, groups, dense, dtype=torch.float32, device="cpu"),
                                   groups)
        optimizer = make_optimizer(model, 1e-4, groups)
        batch = dp_rows(broadcast_batch(rows * m * par.dp, SEQ, config.vocab_size, 1, "cpu"), groups.dp_rank, par.dp)
        ids, targets = cp_tokens(batch, ContextLayout.of(par, SEQ), groups.cp_rank)
        mode = Breakdown()
        inner = optimizer.step

        def step_in_phase(*a, **kw):
            mode.phase = "optimizer"
            try:
                return inner(*a, **kw)
            finally:
                mode.phase = "step"
        optimizer.step = step_in_phase

        def step():
            train_step(model, optimizer, groups, ids, targets, num_microbatches=m)
        step()
        plain = []
        for _ in range(3):
            t0, c0 = time.perf_counter(), time.thread_time()
            step()
            plain.append((time.perf_counter() - t0, time.thread_time() - c0))
        with mode:
            step()
        with CollectiveClock() as clock:
            t0 = time.monotonic()
            step()
            t1 = time.monotonic()
        torch.save({"wall": statistics.median(p[0] for p in plain), "cpu": statistics.median(p[1] for p in plain),
                    "seconds": dict(mode.seconds), "ops": dict(mode.ops), "bytes": dict(mode.bytes),
                    "collectives": [dataclasses.astuple(c) for c in clock.calls], "timed_step": (t0, t1)},
                   os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def collective_report(ranks: list[dict]) -> None:
    """Each kind's calls (by their bytes) paired across the two ranks by order: wall time in the call,
    of it the wait for the later rank's arrival (skew) and the rest after both arrived (copies and the
    link)."""
    calls = [[Call(*c) for c in x["collectives"]] for x in ranks]
    def kind(c: Call) -> str:                 # a pipeline's transfer is a send on one rank, a receive on the other
        return "p2p" if c.kind in ("send", "recv") else c.kind
    if len(calls[0]) != len(calls[1]) or any(kind(a) != kind(b) for a, b in zip(*calls)):
        print(f"  collectives: {len(calls[0])} / {len(calls[1])} calls, not in the same order on both ranks")
        return
    for r, mine in enumerate(calls):
        step = ranks[r]["timed_step"][1] - ranks[r]["timed_step"][0]
        total, after, count = defaultdict(float), defaultdict(float), defaultdict(int)
        for c, a in zip(mine, after_all_arrived(mine, [calls[1 - r]])):
            kind = f"{c.kind} {c.nbytes / 1e3:.1f} KB" if c.nbytes else c.kind
            total[kind] += c.end - c.start
            after[kind] += a
            count[kind] += 1
        skew = sum(total.values()) - sum(after.values())
        print(f"  rank {r}: timed step {1e3 * step:.1f} ms; in collectives {1e3 * sum(total.values()):.1f} ms "
              f"(waiting for the other rank {1e3 * skew:.1f}, after both arrived {1e3 * sum(after.values()):.1f})")
        for kind in sorted(total, key=lambda k: -total[k]):
            print(f"    {kind:<22} {count[kind]:>4} calls {1e3 * total[kind]:8.2f} ms: skew "
                  f"{1e3 * (total[kind] - after[kind]):7.2f}, after both arrived {1e3 * after[kind]:7.2f} "
                  f"({1e6 * after[kind] / count[kind]:.0f} us each)")


def predicted(name: str, calibration: str | None) -> dict:
    from minimind_parallel.planning import Candidate, Workload
    from minimind_parallel.planning.hardware import CPU_DEFAULT, load_calibration
    from minimind_parallel.planning.ranking import evaluate, model_flops_per_token
    layout, rows, m = LAYOUTS[name]
    w = Workload(model=MiniMindConfig(**MODEL), seq_len=SEQ, global_batch_size=BATCH, world_size=2, dtype="float32")
    hw = load_calibration(calibration) if calibration else CPU_DEFAULT
    k = Candidate(**layout, micro_batch_size=rows, num_microbatches=m)
    return evaluate(k, w, hw, "cpu", model_flops_per_token(w)).time.as_ms()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", choices=sorted(LAYOUTS), action="append", help="default: every one")
    p.add_argument("--calibration", default=None, help="plan --calibrate's file (the predicted terms' rates)")
    p.add_argument("--collectives", action="store_true", help="each collective's wait for the other rank and the rest")
    args = p.parse_args()
    for name in args.layout or LAYOUTS:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_rank, args=(os.path.join(tmp, "store"), name, tmp), nprocs=2, join=True, daemon=True)
            ranks = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(2)]
        print(f"== {name} (load average {os.getloadavg()[0]:.1f})")
        for r, x in enumerate(ranks):
            print(f"  rank {r}: step {1e3 * x['wall']:.1f} ms wall, {1e3 * x['cpu']:.1f} ms thread CPU; one step's ops:")
            for key in sorted(x["seconds"], key=lambda k: -x["seconds"][k]):
                extra = f", {x['bytes'][key] / 1e6:.1f} MB" if key in x["bytes"] else ""
                print(f"    {key[0]:<9} {key[1]:<11} {x['ops'][key]:>5} ops {1e3 * x['seconds'][key]:8.2f} ms{extra}")
        if args.collectives:
            collective_report(ranks)
        print("  predicted (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in predicted(name, args.calibration).items() if v))


if __name__ == "__main__":
    main()
