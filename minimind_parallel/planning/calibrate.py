"""`calibrate`: this machine's rates for the time model, measured in well under a minute, forward
and backward at the workload's shapes (`Shapes`: its block, one row of its sequence): a linear of
its MLP's width, causal SDPA of its heads (no CP), CP's blockwise attention, the memory-bound ops of
its block (bytes counted by `OpCount`), a step of a model too small to compute anything (what each
dispatched op costs beyond its work), and the all-reduce's latency and bandwidth between two ranks
(gloo on CPU, NCCL on GPUs; two ranks on one node launched by torchrun, both ended before it
returns). One rank's threads: one on CPU, as the launcher gives each rank.

On a CPU the rates measured alone are not a real step's: a gloo collective issued between a step's
ops costs several times the same collective back to back (on this machine a 1 KB all-reduce about
1 ms against 0.05-0.1 ms; scripts/step_breakdown.py --collectives), FSDP2's hooks and copies around
each of its collectives cost milliseconds, and the work of two ranks sharing the machine runs slower
than one process's alone. So the calibration also runs real training steps of the workload's block
(step_costs.FIT_LAYOUTS: DDP, ZeRO 1, TP, ZeRO 3) and fits one factor on the rates and the per-op,
per-call and per-FSDP2-collective costs to them (`step_costs.fit_costs`). It still times each
all-reduce of TP steps after both ranks had issued it (`in_step_all_reduces`, `collective_clock`)
and keeps that excess over back to back in the file's `extra` (what the clock sees of a call's
cost; the fitted `call_s` is what the steps pay)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import DTYPES, MiniMindConfig
from ..files import atomic_path
from .hardware import CPU_DEFAULT, Hardware, Link
from .op_count import OpCount
from .step_costs import FIT_LAYOUTS, IN_STEP_LAYERS, IN_STEP_ROWS, fit_costs, timed_steps
from .time_model import OPS_PER_BLOCK, blockwise_attention_flops, causal_attention_flops

SMALL, LARGE = 1, 4 * 2**20      # all-reduce elements (float32): the latency's, the bandwidth's
IN_STEP_STEPS = 3                # the in-step all-reduces' timed TP steps (of IN_STEP_LAYERS blocks, IN_STEP_ROWS rows)


def _timed(fn, *, reps: int, device: str) -> float:
    """Median seconds of fn() over `reps` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass(frozen=True)
class Shapes:
    """What the compute rates are measured at: one row of the workload's sequence through its block
    (the book's block at S 1024 when no workload is given)."""

    model: MiniMindConfig = field(default_factory=lambda: MiniMindConfig(hidden_size=768, intermediate_size=2432,
                                                                         num_hidden_layers=1))
    seq: int = 1024

    def describe(self) -> str:
        c = self.model
        return (f"S {self.seq}, H {c.hidden_size}, I {c.intermediate_size}, {c.num_attention_heads} heads "
                f"({c.num_key_value_heads} kv) x {c.head_dim}")


def compute_rates(device: str, dtype: torch.dtype, shapes: Shapes = Shapes()) -> dict:
    """GEMM and attention FLOP/s, elementwise bytes/s and seconds per dispatched op on this device, each
    measured forward and backward together at the workload's shapes (a GEMM's and attention's rate
    depend on them: small head dims and widths run far below a large GEMM's)."""
    c, s = shapes.model, shapes.seq
    x = torch.randn(s, c.hidden_size, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(c.intermediate_size, c.hidden_size, device=device, dtype=dtype, requires_grad=True)
    gemm_s = _timed(lambda: _backward(F.linear(x, w)), reps=10, device=device)
    op_s = op_overhead(device, dtype)
    return dict(gemm_flops=3 * 2 * s * c.hidden_size * c.intermediate_size / gemm_s,   # forward, dgrad, wgrad
                attention_flops=fused_attention_rate(c, s, device, dtype),
                blockwise_attention_flops=blockwise_attention_rate(c, s, device, dtype),
                memory_bandwidth=elementwise_rate(c, s, device, dtype), op_overhead_s=op_s)


def _backward(y: torch.Tensor) -> None:
    y.backward(torch.ones_like(y))


def fused_attention_rate(c: MiniMindConfig, s: int, device: str, dtype: torch.dtype) -> float:
    """Causal SDPA (the model's path without CP; k and v repeated to every head) forward and backward:
    3 x its forward FLOPs (half of QK^T and PV) per second."""
    q, k, v = (torch.randn(1, c.num_attention_heads, s, c.head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    t = _timed(lambda: _backward(F.scaled_dot_product_attention(q, k, v, is_causal=True)), reps=5, device=device)
    return 3 * causal_attention_flops(1, s, c.num_attention_heads * c.head_dim) / t


def blockwise_attention_rate(c: MiniMindConfig, s: int, device: str, dtype: torch.dtype) -> float:
    """Context parallelism's blockwise attention (context_parallel/blockwise.py: matmuls and an explicit
    softmax per chunk pair, merged by log-sum-exp) forward and backward, as CP rank 0 of 2 under the
    load-balanced split runs it: its chunks 0 and 3 over all four; 3 x the forward FLOPs of its
    visible chunk pairs (time_model.blockwise_attention_flops) per second, from the time it adds
    between 1 and 4 rows (so without its per-op cost, which the time model counts on its own)."""
    from ..context_parallel.blockwise import ChunkedAttention
    kv, rep, d = c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads, c.head_dim

    def seconds(rows: int) -> float:
        q = torch.randn(rows, kv, rep, s // 2, d, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(rows, kv, 1, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        return _timed(lambda: _backward(ChunkedAttention.apply(q, k, v, (0, 3), (0, 1, 2, 3))), reps=3, device=device)

    one, four = seconds(1), seconds(4)
    flops = 3 * blockwise_attention_flops(3, s, c.num_attention_heads * c.head_dim, cp=2, load_balance=True)
    return flops / max(four - one, one / 10)     # a loaded machine's noise: never faster than 10 x one row's


def elementwise_rate(c: MiniMindConfig, s: int, device: str, dtype: torch.dtype) -> float:
    """Bytes per second of the memory-bound ops (elementwise, reductions, copies) of the workload's
    block, forward and backward: on a CPU the time inside those ops of one row of S tokens, against
    their counted bytes (`OpCount`); on a GPU, where kernels run asynchronously, a large add."""
    if device == "cuda":
        big = torch.randn(8 * 2**20, device=device, dtype=dtype)
        other = torch.randn_like(big)
        return 3 * big.numel() * big.element_size() / _timed(lambda: big.add_(other), reps=10, device=device)
    from ..model import MiniMindBlock, rope_tables
    block = MiniMindBlock(replace(c, use_moe=False)).to(device=device, dtype=dtype)
    cos, sin = rope_tables(c.head_dim, s, c.rope_theta, device=device)
    h = torch.randn(1, s, c.hidden_size, device=device, dtype=dtype, requires_grad=True)
    _backward(block(h, cos, sin))
    counts = []
    for _ in range(3):
        with OpCount() as n:
            _backward(block(h, cos, sin))
        counts.append(n.total(n.elementwise_bytes) / n.total(n.elementwise_seconds))
    return statistics.median(counts)


def op_overhead(device: str, dtype: torch.dtype, layers: int = 4) -> float:
    """What one dispatched op costs beyond its work, where it runs: a training step (forward,
    backward) of a MiniMind model so small that its kernels take nothing, per op of its blocks
    (time_model.OPS_PER_BLOCK each)."""
    from ..model import MiniMindForCausalLM
    config = MiniMindConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                            vocab_size=32)
    model = MiniMindForCausalLM(config).to(device=device, dtype=dtype)
    ids = torch.randint(0, 32, (1, 8), device=device)

    def step():
        logits = model(ids)
        logits = logits if isinstance(logits, torch.Tensor) else logits.logits
        logits.float().sum().backward()

    return _timed(step, reps=5, device=device) / (layers * OPS_PER_BLOCK)


def link_rank(backend: str, out: str, shapes: Shapes, dtype: str) -> None:
    """One of the two ranks (under torchrun: its env:// rendezvous, as a benchmark cell's ranks):
    the back-to-back all-reduces; on a CPU the in-step ones and the step_costs.FIT_LAYOUTS steps."""
    torch.set_num_threads(1)
    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    try:
        small = torch.ones(SMALL, device=device)
        large = torch.ones(LARGE, device=device)
        t_small = _timed(lambda: dist.all_reduce(small), reps=50, device=device)
        t_large = _timed(lambda: dist.all_reduce(large), reps=5, device=device)
        in_step = in_step_all_reduces(shapes) if device == "cpu" else []
        steps = timed_steps(in_step_model(shapes), shapes.seq, FIT_LAYOUTS, DTYPES[dtype]) if device == "cpu" else []
        with atomic_path(f"{out}.{dist.get_rank()}") as tmp, open(tmp, "w") as f:
            json.dump(dict(standalone=(t_small, t_large), in_step=in_step, steps=steps), f)
    finally:
        dist.destroy_process_group()


def in_step_model(shapes: Shapes) -> MiniMindConfig:
    """The in-step link's model: the workload's block, IN_STEP_LAYERS of them, dense, with kv heads TP 2
    can split."""
    c = replace(shapes.model, num_hidden_layers=IN_STEP_LAYERS, use_moe=False)
    if c.num_key_value_heads % 2 or c.num_attention_heads % 2:
        c = replace(c, num_attention_heads=2, num_key_value_heads=2, head_dim=c.hidden_size // 2)
    return c


def in_step_all_reduces(shapes: Shapes) -> list[tuple[int, float]]:
    """(bytes, seconds after both ranks had issued it) of every all-reduce of IN_STEP_STEPS training
    steps of the workload's block under TP 2 with the vocab-parallel loss, as the benchmark runs them
    (after one warm-up step); on this process's rank of a two-rank world."""
    from ..config import ParallelConfig
    from ..groups import ProcessGroups
    from ..model import MiniMindForCausalLM
    from ..training import build_parallel_model, make_optimizer, train_step
    from .collective_clock import CollectiveClock, after_all_arrived
    c, par = in_step_model(shapes), ParallelConfig(tp=2, vocab_parallel=True)
    groups = ProcessGroups.build(par)
    torch.manual_seed(0)                                       # the same model and rows on both ranks
    model = build_parallel_model(c, par, groups, MiniMindForCausalLM(c).state_dict())
    optimizer = make_optimizer(model, 1e-4, groups)
    ids = torch.randint(0, c.vocab_size, (IN_STEP_ROWS, shapes.seq))
    targets = ids.roll(-1, dims=1)
    train_step(model, optimizer, groups, ids, targets)
    with CollectiveClock() as clock:
        for _ in range(IN_STEP_STEPS):
            train_step(model, optimizer, groups, ids, targets)
    starts = torch.tensor([call.start for call in clock.calls], dtype=torch.float64)
    both = [torch.empty_like(starts) for _ in range(2)]
    dist.all_gather(both, starts)
    others = [[replace(call, start=float(t)) for call, t in zip(clock.calls, both[1 - dist.get_rank()])]]
    after = after_all_arrived(clock.calls, others)
    return [(call.nbytes, s) for call, s in zip(clock.calls, after) if call.kind == "all_reduce"]


def per_call_overhead(times: list[tuple[int, float]], link: Link) -> float:
    """What a collective costs inside a step beyond the same one back to back on `link`: the median
    over the measured all-reduces (bytes, seconds) of their time less 2 (a + n / (2 w)), at least 0.
    One value per call, whatever its size: on this CPU a 256 B and a 256 KB all-reduce of a TP step
    both take about 1 ms more than back to back (the backend's threads woken after the step's ops, not
    the bytes), and so do its all-gathers and reduce-scatters (scripts/step_breakdown.py --collectives)."""
    return max(0.0, statistics.median(t - 2 * (link.latency_s + n / (2 * link.bandwidth)) for n, t in times))


def link_rates(device: str, shapes: Shapes = Shapes(), dtype: str = "float32") -> tuple[Link, dict, list[float]]:
    """The all-reduce between two ranks, 2 (g-1) (a + n / (g w)) with g = 2, what it was fitted from,
    and (on a CPU) the step_costs.FIT_LAYOUTS steps' measured seconds. Back to back (a GPU's: NCCL
    queues its kernels on the stream): latency a from a one-element all-reduce, bandwidth w from a
    16 MiB one. On a CPU each in-step all-reduce's time after both ranks had issued it beyond that
    (`in_step_all_reduces`, `per_call_overhead`: what the clock sees, kept in `extra`)."""
    backend = "nccl" if device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "link")
        run_ranks(backend, out, shapes, dtype)
        ranks = []
        for r in range(2):
            with open(f"{out}.{r}") as f:
                ranks.append(json.load(f))
    t_small, t_large = ranks[0]["standalone"]
    latency = t_small / 2
    nbytes = LARGE * 4
    standalone = Link(latency_s=latency, bandwidth=nbytes / (2 * max(t_large / 2 - latency, 1e-9)))
    if device == "cuda":
        return standalone, {}, []
    in_step = [tuple(x) for r in ranks for x in r["in_step"]]
    return standalone, dict(in_step_all_reduce_ms={str(n): round(1e3 * statistics.median(t for m, t in in_step if m == n), 3)
                                                   for n in sorted({n for n, _ in in_step})},
                            in_step_after_arrival_call_us=round(1e6 * per_call_overhead(in_step, standalone), 3)), \
        ranks[0]["steps"]


def run_ranks(backend: str, out: str, shapes: Shapes, dtype: str) -> None:
    """`link_rank` on two ranks launched by torchrun, as a benchmark cell's are (fresh interpreters, an
    env:// rendezvous: on this machine the same steps run up to twice as fast in processes forked from
    a warm one, so the calibration measures them where the cells run); waited for, and on any ending
    of this process ended (torchrun ends its ranks on SIGTERM)."""
    spec = json.dumps(dict(backend=backend, out=out, model=asdict(shapes.model), seq=shapes.seq, dtype=dtype))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1", "--standalone",
           "--max_restarts=0", "--monitor_interval=0.1", "-m", "minimind_parallel.planning.calibrate", spec]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"plan --calibrate: the link's ranks failed (exit {proc.returncode}): "
                           f"{(err or '').strip().splitlines()[-1:]}")


def calibrate(device: str, dtype: str = "float32", shapes: Shapes = Shapes()) -> Hardware:
    """This machine's Hardware (`device` cpu or cuda; rates in `dtype`, at `shapes`)."""
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        rates = compute_rates(device, DTYPES[dtype], shapes)
    finally:
        torch.set_num_threads(threads)
    link, measured, steps = link_rates(device, shapes, dtype)
    name = f"calibrated {device}" + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else "")
    # the MFU's peak: the CPU default of training/metrics.py unless this core's GEMM is faster; a GPU's reached GEMM rate
    peak = max(CPU_DEFAULT.peak_flops, rates["gemm_flops"]) if device == "cpu" else rates["gemm_flops"]
    hw = Hardware(name=name, source=f"plan --calibrate on this machine, {time.strftime('%Y-%m-%d %H:%M')}, "
                  f"{dtype}, {shapes.describe()}", peak_flops=peak, intra=link, inter=link,
                  async_dispatch=device == "cuda", overlaps_communication=device == "cuda",
                  memory_gib=(torch.cuda.get_device_properties(0).total_memory / 2**30 if device == "cuda" else None),
                  cuda_capability=(torch.cuda.get_device_capability() if device == "cuda" else None), extra=measured,
                  **rates)
    if device == "cuda":
        return hw
    # a CPU: the per-op, per-call and per-FSDP2-collective costs fitted to real steps (step_costs.py)
    fitted, fit = fit_costs(hw, in_step_model(shapes), shapes.seq, dtype, steps)
    return replace(fitted, extra={**measured, "isolated_op_overhead_us": round(1e6 * rates["op_overhead_s"], 3), **fit})


def rank_main(argv: list[str]) -> None:
    """A rank of run_ranks: its one argument the JSON of what to measure."""
    spec = json.loads(argv[0])
    link_rank(spec["backend"], spec["out"], Shapes(model=MiniMindConfig(**spec["model"]), seq=spec["seq"]), spec["dtype"])


if __name__ == "__main__":
    rank_main(sys.argv[1:])
