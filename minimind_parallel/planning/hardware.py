"""The rates the time model reads, per device and per link, from a built-in profile (vendor
datasheets, with the share of peak assumed to be reached) or from a calibration file written by
`plan --calibrate` (this machine, measured)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..config import ConfigError
from ..files import atomic_path


@dataclass(frozen=True, kw_only=True)
class Link:
    """One collective's cost over this link: latency per message step + bytes / bandwidth
    (bytes per second one rank moves, the ring algorithm's bus bandwidth), and `call_s` per call
    issued inside a step beyond the same call back to back (a CPU's gloo: its threads woken after the
    step's ops; measured by plan --calibrate; 0 on a GPU's stream-queued NCCL)."""

    latency_s: float
    bandwidth: float   # bytes / s
    call_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """What one rank computes and moves per second. `gemm_flops` / `attention_flops` are the rates
    reached (not the peak), `memory_bandwidth` the elementwise ops' and the optimizer's, `op_overhead_s`
    what each dispatched op costs beyond its work (Python and launch), `peak_flops` the MFU's
    denominator; `intra` links ranks of one node, `inter` ranks of different nodes."""

    name: str
    source: str
    gemm_flops: float
    attention_flops: float
    memory_bandwidth: float
    op_overhead_s: float
    peak_flops: float
    intra: Link
    inter: Link
    async_dispatch: bool = True     # a GPU: kernels queued ahead (see `dispatched`)
    # a GPU: communication runs on its own streams beside compute (the overlaps the time model counts);
    # on a CPU gloo's collectives run on the cores the rank computes on, and every one is exposed
    overlaps_communication: bool = True
    # CP's blockwise attention (matmuls and an explicit softmax per chunk pair); None: attention_flops
    blockwise_attention_flops: float | None = None
    # FSDP2's host work around each of its all-gathers and reduce-scatters (hooks, copy-in, copy-out;
    # fitted by plan --calibrate on a CPU; 0 in the GPU profiles: not measured on one)
    fsdp_collective_s: float = 0.0
    memory_gib: float | None = None
    cuda_capability: tuple[int, int] | None = None
    extra: dict = field(default_factory=dict)

    def dispatched(self, work_s: float, dispatch_s: float) -> float:
        """Ops whose kernels take `work_s` and whose dispatch takes `dispatch_s`: on a GPU the host
        queues kernels ahead of the device (the longer of the two), on a CPU it runs them (the sum)."""
        return max(work_s, dispatch_s) if self.async_dispatch else work_s + dispatch_s

    @property
    def blockwise_rate(self) -> float:
        return self.blockwise_attention_flops or self.attention_flops

    def hidden(self, comm_s: float, behind_s: float) -> float:
        """The exposed part of communication `comm_s` that can overlap `behind_s` of compute: what is left
        of it on a GPU, all of it on a CPU (see `overlaps_communication`)."""
        return max(0.0, comm_s - behind_s) if self.overlaps_communication else comm_s

    def link(self, inter_node: bool) -> Link:
        return self.inter if inter_node else self.intra

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: dict) -> "Hardware":
        d = dict(data)
        d["intra"], d["inter"] = Link(**d["intra"]), Link(**d["inter"])
        if d.get("cuda_capability") is not None:
            d["cuda_capability"] = tuple(d["cuda_capability"])
        return Hardware(**d)


# What a training step reaches of a datasheet's peak (assumed, stated in docs/planning.md): dense
# GEMMs 70 %, flash attention 50 %, HBM 80 %, NCCL's bus bandwidth 80 % of the link's.
GEMM_SHARE, ATTENTION_SHARE, HBM_SHARE, BUS_SHARE = 0.7, 0.5, 0.8, 0.8
GPU_LAUNCH_S = 8e-6          # a kernel launch plus the eager op's Python, per op
NVLINK_LATENCY_S = 10e-6     # one NCCL ring step within a node
IB_LATENCY_S = 15e-6         # across nodes
# Across nodes: one 400 Gb/s NDR InfiniBand port per GPU (NVIDIA ConnectX-7 datasheet) = 50 GB/s.
IB_NDR_BYTES = 50e9


def _gpu(name: str, source: str, *, tflops: float, hbm_tbs: float, link_gbs: float, memory_gib: float,
         capability: tuple[int, int], link_latency: float = NVLINK_LATENCY_S) -> Hardware:
    """A profile from the datasheet's dense bf16 peak (TFLOP/s), memory bandwidth (TB/s), the
    per-direction bandwidth of the GPU's link within a node (GB/s) and its memory."""
    return Hardware(name=name, source=source, gemm_flops=GEMM_SHARE * tflops * 1e12,
                    attention_flops=ATTENTION_SHARE * tflops * 1e12, memory_bandwidth=HBM_SHARE * hbm_tbs * 1e12,
                    op_overhead_s=GPU_LAUNCH_S, peak_flops=tflops * 1e12,
                    intra=Link(latency_s=link_latency, bandwidth=BUS_SHARE * link_gbs * 1e9),
                    inter=Link(latency_s=IB_LATENCY_S, bandwidth=BUS_SHARE * IB_NDR_BYTES),
                    memory_gib=memory_gib, cuda_capability=capability)


GPU_PROFILES = {p.name: p for p in (
    _gpu("H200", "NVIDIA H200 Tensor Core GPU datasheet (SXM): 989 TFLOPS dense BF16, 4.8 TB/s HBM3e, "
         "141 GB, NVLink 900 GB/s (450 GB/s each way)",
         tflops=989, hbm_tbs=4.8, link_gbs=450, memory_gib=141 * 1e9 / 2**30, capability=(9, 0)),
    _gpu("H100", "NVIDIA H100 Tensor Core GPU datasheet (SXM): 989 TFLOPS dense BF16, 3.35 TB/s HBM3, "
         "80 GB, NVLink 900 GB/s (450 GB/s each way)",
         tflops=989, hbm_tbs=3.35, link_gbs=450, memory_gib=80 * 1e9 / 2**30, capability=(9, 0)),
    _gpu("A100", "NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB): 312 TFLOPS dense BF16, 2.039 TB/s "
         "HBM2e, NVLink 600 GB/s (300 GB/s each way)",
         tflops=312, hbm_tbs=2.039, link_gbs=300, memory_gib=80 * 1e9 / 2**30, capability=(8, 0)),
    _gpu("RTX4090", "NVIDIA Ada GPU architecture whitepaper (GeForce RTX 4090): 165.2 TFLOPS dense "
         "FP16/BF16 with FP32 accumulate, 1008 GB/s GDDR6X, 24 GB; no NVLink: PCIe 4.0 x16, 32 GB/s each way",
         tflops=165.2, hbm_tbs=1.008, link_gbs=32, memory_gib=24, capability=(8, 9), link_latency=20e-6),
    _gpu("RTX3090", "NVIDIA Ampere GA102 GPU architecture whitepaper (GeForce RTX 3090): 71 TFLOPS dense "
         "FP16 tensor with FP32 accumulate, 936 GB/s GDDR6X, 24 GB; PCIe 4.0 x16, 32 GB/s each way",
         tflops=71, hbm_tbs=0.936, link_gbs=32, memory_gib=24, capability=(8, 6), link_latency=20e-6),
)}

# No calibration and --device cpu: one thread per rank on one core (training/metrics.py's CPU peak),
# gloo over loopback. Rough: `plan --calibrate` measures the real ones.
CPU_DEFAULT = Hardware(name="cpu", source="assumed: one AVX2 core per rank (100 GFLOP/s peak), gloo over loopback; "
                       "run plan --calibrate for this machine's", gemm_flops=50e9, attention_flops=20e9,
                       memory_bandwidth=5e9, op_overhead_s=15e-6, peak_flops=100e9,
                       intra=Link(latency_s=50e-6, bandwidth=2e9), inter=Link(latency_s=100e-6, bandwidth=1e9),
                       async_dispatch=False, overlaps_communication=False, blockwise_attention_flops=10e9)


def gpu_profile(name: str) -> Hardware:
    key = name.upper().replace(" ", "").replace("RTX-", "RTX")
    if key not in GPU_PROFILES:
        raise ConfigError(f"unknown --gpu {name!r}; expected one of: {', '.join(GPU_PROFILES)} "
                          f"(or --calibration FILE)")
    return GPU_PROFILES[key]


def save_calibration(hw: Hardware, path: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(hw.to_json(), f, indent=1)


def load_calibration(path: str) -> Hardware:
    try:
        with open(path) as f:
            return Hardware.from_json(json.load(f))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"--calibration {path}: not a calibration file written by plan --calibrate ({e})") from None
