"""What a person sees of a training run: the log line, the metrics file, the loss-curve PNG, and the
numbers behind them (model FLOPs, the peak FLOPs assumed, utilisation, peak memory).

Model FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B): 6 N + 12 L S h d, forward and
backward, where N counts every weight matrix the tokens pass through (attention, MLP and lm_head,
also when tied; not the embedding lookup) and 12 L S h d the attention scores and weighted values
over the full S x S square (no causal discount), h d = heads x head_dim. Every position counts as
a token, padding included: the hardware computes it. MFU = model FLOPs per second / (ranks x peak).

The metrics file is JSONL, one object per line, only ever appended to: a "run" record when a
process starts (with what it resumed from), a "train" record every --log_interval steps, an
"eval" record every --eval_interval steps. A resumed run appends to the same file; the curve
drops the steps past the checkpoint it resumed from.
"""
from __future__ import annotations

import json
import os
import resource
import sys

import torch

from ..config import MiniMindConfig
from ..files import atomic_path

# Dense bf16/fp16 tensor-core peaks per GPU (vendor data sheets, SXM parts), TFLOP/s.
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "L4": 121.0,
                   "V100": 125.0, "4090": 165.0}
# One CPU rank is one thread on one core: 2 FMA units x 8 float32 lanes (AVX2) x 2 FLOPs at ~3 GHz.
CPU_PEAK_TFLOPS = 0.1


def model_flops_per_token(config: MiniMindConfig, seq_len: int) -> float:
    """Forward + backward FLOPs of one token of a row of `seq_len` (6 N + 12 L S h d), N the
    matrix parameters a token passes through: with MoE its k experts of moe_intermediate_size and
    the router's [E, H] (as Megatron-LM's num_floating_point_operations counts them), not all E."""
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = c.hidden_size * (2 * q + 2 * kv) + ffn_matrix_params_per_token(c)
    matrices = c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size
    return 6 * matrices + 12 * c.num_hidden_layers * seq_len * q


def ffn_matrix_params_per_token(c: MiniMindConfig) -> int:
    """The feed-forward's matrix parameters one token passes through in one layer: the SwiGLU's
    three, or the router's and its k experts' (each a SwiGLU of moe_intermediate_size)."""
    if not c.use_moe:
        return 3 * c.hidden_size * c.intermediate_size
    return c.hidden_size * c.num_experts + c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size


def peak_tflops(device, given: float | None) -> tuple[float | None, str]:
    """-> (the peak TFLOP/s of one rank assumed for MFU, where that number comes from)."""
    if given is not None:
        return given, "--peak_tflops"
    if torch.device(device).type == "cpu":
        return CPU_PEAK_TFLOPS, "CPU default (one AVX2 core, float32)"
    name = torch.cuda.get_device_name(device)
    for key, tflops in GPU_PEAK_TFLOPS.items():
        if key in name:
            return tflops, f"{name} dense bf16 peak"
    return None, f"unknown GPU {name!r}: pass --peak_tflops for MFU"


def peak_memory_bytes(device) -> int:
    """This process's peak: the CUDA allocator's high-water mark, or on CPU the peak resident set."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib if sys.platform == "darwin" else kib * 1024  # macOS reports bytes, Linux KiB


def mfu(flops_per_token: float, tokens_per_s: float, ranks: int, peak: float | None) -> float | None:
    return None if peak is None else flops_per_token * tokens_per_s / (ranks * peak * 1e12)


def interval_rates(*, steps: int, seconds: float, data_seconds: float, rows_per_replica: int, dp: int, seq_len: int,
                   ranks: int, flops_per_token: float, peak: float | None) -> dict:
    """The speed numbers of a "train" record over `steps` optimizer steps that took `seconds`
    (`data_seconds` of them loading batches, on one rank). A step trains every DP replica's
    `rows_per_replica` rows of `seq_len` positions: tokens/s counts the whole world's (the global
    batch), MFU divides its FLOPs by all `ranks`' peak; loading is one replica's rows (each
    replica loads its own)."""
    tokens = steps * rows_per_replica * dp * seq_len
    tokens_per_s = tokens / seconds
    return {"tokens_per_s": tokens_per_s, "mfu": mfu(flops_per_token, tokens_per_s, ranks, peak),
            "step_ms": 1e3 * seconds / steps, "data_ms": 1e3 * data_seconds / steps,
            "data_share": data_seconds / seconds, "loading_tokens_per_s": tokens / dp / max(data_seconds, 1e-9)}


def format_line(r: dict) -> str:
    """A "train" record as one log line."""
    mfu_text = "n/a" if r.get("mfu") is None else f"{100 * r['mfu']:.2f}%"
    aux = f" | aux loss {r['aux_loss']:.4g}" if "aux_loss" in r else ""
    return (f"step {r['step']}/{r['total_steps']} epoch {r['epoch']} | loss {r['loss']:.4f}{aux} | lr {r['lr']:.3e} | "
            f"grad norm {r['grad_norm']:.3f} | {r['tokens_per_s']:,.0f} tok/s | MFU {mfu_text} | "
            f"peak mem {r['peak_mem_mib']:.1f} MiB | data {r['data_share'] * 100:.1f}% of step time")


def format_eval(r: dict) -> str:
    return f"step {r['step']} | held-out loss {r['eval_loss']:.4f} | perplexity {r['eval_ppl']:.2f}"


class MetricsFile:
    """The run's JSONL metrics (append-only) and its loss curve."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def append(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def records(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]


def curves(records: list[dict]) -> dict[str, dict[int, float]]:
    """{"train": {step: loss}, "eval": {step: loss}} as the run now stands: a resumed run's
    "run" record drops what earlier processes logged past the step it resumed from."""
    out = {"train": {}, "eval": {}}
    for r in records:
        if r["kind"] == "run":
            for curve in out.values():
                for step in [s for s in curve if s > r["resumed_from"]]:
                    del curve[step]
        elif r["kind"] == "train":
            out["train"][r["step"]] = r["loss"]
        elif r["kind"] == "eval":
            out["eval"][r["step"]] = r["eval_loss"]
    return out


def write_loss_plot(records: list[dict], path: str, *, title: str = "") -> None:
    """Training and held-out loss against the step, as a PNG (written atomically)."""
    import matplotlib  # here, not at the top: matplotlib is optional and slow to import, needed for a plot only
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = curves(records)
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, style in (("train", "-"), ("eval", "o-")):
        steps = sorted(lines[kind])
        if steps:
            ax.plot(steps, [lines[kind][s] for s in steps], style, label=f"{kind} loss", markersize=3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats per target token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
