"""A real step on a CPU, fitted by least squares to real training steps of the workload's block
(`plan --calibrate`): one factor on the rates measured in isolation (`work_scale`: the GEMMs,
attention and memory-bound ops inside a step of two ranks sharing the machine run slower than alone),
and what each dispatched op (`Hardware.op_overhead_s`), each collective (`Link.call_s`) and each
FSDP2 all-gather / reduce-scatter (`Hardware.fsdp_collective_s`) costs on the host beyond the work.

Each is the rate of a count the time model makes of a step (its work: FLOPs and bytes; the ops of
its blocks and its optimizer; the collectives of `time_model.collectives_of_step`; FSDP2's 3 L + 2
collectives per microbatch), so on a CPU, where nothing overlaps, a layout's predicted step is
linear in the four: t = t_link + A x, t_link the collectives' latency and bytes alone. The fit
measures FIT_LAYOUTS of IN_STEP_LAYERS blocks -- DDP steps of 1 and 4 rows (the work against the
ops), ZeRO 1, TP plain, with the vocab-parallel loss and under SP (the collectives), ZeRO 3
(FSDP2's) -- as the benchmark runs them (train_step, the median of FIT_STEPS steps taken in turns
after FIT_WARMUP, the slower rank's), takes each one's row of A from the time model itself (its
predicted step at one unit of one term and none of the others, less t_link) and solves
A x = measured - t_link in the least squares, x >= 0. The validated layouts are never among them."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import replace

import numpy as np
import torch

from ..config import MiniMindConfig
from .hardware import Hardware
from .space import Candidate, Workload

IN_STEP_ROWS, IN_STEP_LAYERS = 2, 2          # rows of S per step (the in-step link's), blocks of the workload's
FIT_LAYOUTS = (Candidate(dp=2, micro_batch_size=1), Candidate(dp=2, micro_batch_size=4),
               Candidate(dp=2, zero=1, micro_batch_size=2), Candidate(tp=2, micro_batch_size=2),
               Candidate(tp=2, vocab_parallel=True, micro_batch_size=2),
               Candidate(tp=2, sequence_parallel=True, micro_batch_size=2), Candidate(dp=2, zero=3, micro_batch_size=2))
FIT_WARMUP, FIT_STEPS = 2, 9                 # DDP rebuilds its buckets in its second step
TERMS = ("work_scale", "op_overhead_s", "call_s", "fsdp_collective_s")


def with_costs(hw: Hardware, work_scale: float, op_overhead_s: float, call_s: float,
               fsdp_collective_s: float) -> Hardware:
    """`hw` with its compute rates divided by `work_scale` (0: work costs nothing) and the three host
    costs (a call's on both links: one machine)."""
    def rate(r: float) -> float:
        return r / work_scale if work_scale else math.inf
    return replace(hw, gemm_flops=rate(hw.gemm_flops), attention_flops=rate(hw.attention_flops),
                   blockwise_attention_flops=rate(hw.blockwise_rate), memory_bandwidth=rate(hw.memory_bandwidth),
                   op_overhead_s=op_overhead_s, fsdp_collective_s=fsdp_collective_s,
                   intra=replace(hw.intra, call_s=call_s), inter=replace(hw.inter, call_s=call_s))


def fit_workload(model: MiniMindConfig, seq: int, k: Candidate, dtype: str) -> Workload:
    return Workload(model=model, seq_len=seq, global_batch_size=k.micro_batch_size * k.dp, world_size=2, dtype=dtype)


def timed_steps(model: MiniMindConfig, seq: int, layouts: tuple[Candidate, ...], dtype: torch.dtype) -> list[float]:
    """Per layout, the median wall seconds of FIT_STEPS training steps on this rank's world of 2, as the
    benchmark's cell runs them, the slower rank's (both return it). The layouts' steps take turns
    (after FIT_WARMUP each), so a change of the machine's load falls on all of them alike."""
    import torch.distributed as dist
    steps = [_step_of(model, seq, k, dtype) for k in layouts]
    for step in steps:
        for _ in range(FIT_WARMUP):
            step()
    times = [[] for _ in layouts]
    for _ in range(FIT_STEPS):
        for step, out in zip(steps, times):
            t0 = time.perf_counter()
            step()
            out.append(time.perf_counter() - t0)
    slower = torch.tensor([statistics.median(t) for t in times], dtype=torch.float64)
    dist.all_reduce(slower, op=dist.ReduceOp.MAX)
    return slower.tolist()


def _step_of(model: MiniMindConfig, seq: int, k: Candidate, dtype: torch.dtype):
    """One training step of layout `k` (its micro_batch_size rows per replica), built as the benchmark builds it."""
    from ..context_parallel import ContextLayout
    from ..data.batches import broadcast_batch, cp_tokens, dp_rows
    from ..groups import ProcessGroups
    from ..model import MiniMindForCausalLM
    from ..training import build_parallel_model, make_optimizer, train_step, wrap_data_parallel
    par = k.parallel
    groups = ProcessGroups.build(par)
    torch.manual_seed(0)
    net = build_parallel_model(model, par, groups, MiniMindForCausalLM(model).state_dict(), dtype=dtype, device="cpu")
    net = wrap_data_parallel(net, groups)
    optimizer = make_optimizer(net, 1e-4, groups)
    batch = dp_rows(broadcast_batch(k.micro_batch_size * par.dp, seq, model.vocab_size, 1, "cpu"), groups.dp_rank, par.dp)
    ids, targets = cp_tokens(batch, ContextLayout.of(par, seq), groups.cp_rank)
    return lambda: train_step(net, optimizer, groups, ids, targets)


def cost_rows(hw: Hardware, model: MiniMindConfig, seq: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(t_link, A): each FIT_LAYOUTS step as the time model predicts it with no work and no host cost
    (its collectives' latency and bytes), and its seconds per unit of each term (TERMS): exact, the
    CPU's step being linear in them."""
    from .ranking import evaluate, model_flops_per_token

    def predicted(terms) -> np.ndarray:
        at = with_costs(hw, *terms)
        out = []
        for k in FIT_LAYOUTS:
            w = fit_workload(model, seq, k, dtype)
            out.append(evaluate(k, w, at, "cpu", model_flops_per_token(w)).time.total)
        return np.array(out)

    t_link = predicted((0.0,) * len(TERMS))
    unit = (1.0, 1e-3, 1e-3, 1e-3)
    a = np.stack([(predicted(tuple(unit[i] if j == i else 0.0 for j in range(len(TERMS)))) - t_link) / unit[i]
                  for i in range(len(TERMS))], axis=1)
    return t_link, a


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |A x - b| over x >= 0, by dropping the most negative of the free unknowns until none is
    (exact for the few unknowns here whenever the unconstrained solution's signs settle that way)."""
    free = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        if free:
            x[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
        if (x >= 0).all():
            return x
        free.remove(int(np.argmin(x)))


def fit_costs(hw: Hardware, model: MiniMindConfig, seq: int, dtype: str, measured: list[float]) -> tuple[Hardware, dict]:
    """`hw` (on a CPU) with the work scale and the host costs fitted to the FIT_LAYOUTS steps `measured`
    (seconds), and what the fit saw: each step measured, predicted at `hw`'s rates alone, and fitted."""
    from .ranking import evaluate, model_flops_per_token
    t_link, a = cost_rows(hw, model, seq, dtype)
    x = nonnegative_least_squares(a, np.array(measured) - t_link)
    fitted = with_costs(hw, *map(float, x))
    alone = with_costs(hw, 1.0, 0.0, 0.0, 0.0)
    steps = {}
    for k, m, f in zip(FIT_LAYOUTS, measured, t_link + a @ x):
        w = fit_workload(model, seq, k, dtype)
        steps[k.describe()] = dict(measured_ms=round(1e3 * m, 3), fitted_ms=round(1e3 * f, 3),
                                   rates_alone_ms=round(evaluate(k, w, alone, "cpu", model_flops_per_token(w)).time.total
                                                        * 1e3, 3))
    return fitted, dict(fitted_steps=steps, fitted={name: float(v) for name, v in zip(TERMS, x)})
