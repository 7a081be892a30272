"""`calibrate`: this machine's rates for the time model, measured in well under a minute: a GEMM
and causal attention of the book's block shapes, an elementwise pass (memory bandwidth), a step of
a model too small to compute anything (what each dispatched op costs beyond its work), and the all-reduce's latency and bandwidth
between two ranks (gloo on CPU, NCCL on GPUs; two processes on one node, a FileStore rendezvous,
both joined before it returns). One rank's threads: one on CPU, as the launcher gives each rank."""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ..config import DTYPES, MiniMindConfig
from .hardware import CPU_DEFAULT, Hardware, Link
from .time_model import OPS_PER_BLOCK

SMALL, LARGE = 1, 4 * 2**20      # all-reduce elements (float32): the latency's, the bandwidth's


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


def compute_rates(device: str, dtype: torch.dtype, *, tokens: int = 1024, hidden: int = 768, inter: int = 2432,
                  heads: int = 8, head_dim: int = 96, seq: int = 1024) -> dict:
    """GEMM and attention FLOP/s, elementwise bytes/s and seconds per dispatched op on this device."""
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    w = torch.randn(inter, hidden, device=device, dtype=dtype)
    gemm_s = _timed(lambda: F.linear(x, w), reps=10, device=device)
    q = torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype)
    attn_s = _timed(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True), reps=5, device=device)
    big = torch.randn(8 * 2**20, device=device, dtype=dtype)
    other = torch.randn_like(big)
    add_s = _timed(lambda: big.add_(other), reps=10, device=device)
    b = big.element_size()
    return dict(gemm_flops=2 * tokens * hidden * inter / gemm_s,
                attention_flops=2 * 2 * seq * seq * heads * head_dim / 2 / attn_s,   # causal: half of QK^T and PV
                memory_bandwidth=3 * big.numel() * b / add_s, op_overhead_s=op_overhead(device, dtype))


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


def _link_rank(rank: int, store_path: str, backend: str, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=2)
    try:
        small = torch.ones(SMALL, device=device)
        large = torch.ones(LARGE, device=device)
        t_small = _timed(lambda: dist.all_reduce(small), reps=50, device=device)
        t_large = _timed(lambda: dist.all_reduce(large), reps=5, device=device)
        if rank == 0:
            with open(out, "w") as f:
                f.write(f"{t_small} {t_large}")
    finally:
        dist.destroy_process_group()


def link_rates(device: str) -> Link:
    """The all-reduce between two ranks: 2 (g-1) (a + n / (g w)) with g = 2 -> latency a from a
    one-element all-reduce, bandwidth w from a 16 MiB one."""
    backend = "nccl" if device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "link")
        # daemonic: ended with this process on any ending (an interrupted calibration leaves nothing)
        mp.spawn(_link_rank, args=(os.path.join(tmp, "store"), backend, out), nprocs=2, join=True, daemon=True)
        with open(out) as f:
            t_small, t_large = (float(v) for v in f.read().split())
    latency = t_small / 2
    nbytes = LARGE * 4
    bandwidth = nbytes / (2 * max(t_large / 2 - latency, 1e-9))
    return Link(latency_s=latency, bandwidth=bandwidth)


def calibrate(device: str, dtype: str = "float32") -> Hardware:
    """This machine's Hardware (`device` cpu or cuda; rates in `dtype`)."""
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        rates = compute_rates(device, DTYPES[dtype])
    finally:
        torch.set_num_threads(threads)
    link = link_rates(device)
    name = f"calibrated {device}" + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else "")
    # the MFU's peak: the CPU default of training/metrics.py unless this core's GEMM is faster; a GPU's reached GEMM rate
    peak = max(CPU_DEFAULT.peak_flops, rates["gemm_flops"]) if device == "cpu" else rates["gemm_flops"]
    return Hardware(name=name, source=f"plan --calibrate on this machine, {time.strftime('%Y-%m-%d %H:%M')}, "
                    f"{dtype}", peak_flops=peak, intra=link, inter=link, async_dispatch=device == "cuda",
                    memory_gib=(torch.cuda.get_device_properties(0).total_memory / 2**30 if device == "cuda" else None),
                    cuda_capability=(torch.cuda.get_device_capability() if device == "cuda" else None), **rates)
