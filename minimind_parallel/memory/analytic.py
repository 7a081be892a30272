"""The analytic memory model: bytes by category, activations by saved-tensor kind, and the peak.

Everything is derived from what our code saves for backward (checked with saved-tensor hooks,
see docs/memory.md), per rank, for a micro-batch of B sequences of S tokens:

    b   = bytes per element of the model dtype;  f = bytes of the norms' fp32 upcast (max(b, 4))
    T   = TP size;  N = S*B tokens;  Nn = N/T under SP (norm/residual regions) else N
    h, k = attention / kv heads on this rank (heads/T, kv_heads/T);  d = head_dim;  I_t = I/T
    V_t = V/T with --vocab_parallel, else V;  M = N - B targets (the loss is shifted by one)

Per block (kind: bytes)
    norm_fp32        2 RMSNorms x (x.float() + normed: 2 f Nn H,  rsqrt: f Nn)
    column_input     the input the column-parallel linears save for dW = dY^T X:
                       TP: 2 b N H (q/k/v share one, gate/up one);  basic SP: 5 b N H (one gather
                       per linear);  --shared_sp_gather: 2 b N H;  SP + async (recompute): 2 b N/T H
    qk_norm_fp32     q_norm/k_norm over head_dim: (h + k) N (2 f d + f)
    attention_q      q after RoPE, saved by attention: b N h d   (RoPE itself saves only cos/sin views)
    attention_kv     k, v repeated to h heads for GQA: 2 b N h d  (2 b N d with one kv head per rank:
                     the repeat is then a view)
    attention_out    output (also o_proj's input: a view) b N h d + logsumexp 4 N h
    mlp              gate out, up out, silu(gate), silu*up (down's input): 4 b N I_t
Model level
    embedding        the ids: 8 N  (VP: local ids 8 N + out-of-range mask N)
    final_norm       2 f Nn H + f Nn
    head_input       lm_head's input: b N H  (VP + SP + async: b N/T H)
    logits_loss      replicated head: log-softmax b M V + target copy 8 M + total weight b
                     VP: fp32 softmax f M V_t + local target 8 M + two masks 2 M + count 8

The peak is the largest of a few moments of the step (each a sum of what is alive then):
    head_backward     all activations + the loss gradients of the logits
    final_norm_backward  after lm_head's backward: its grads, the activations but the head's, and the
                      final RMSNorm's backward fp32 temporaries (5 f Nn H)
    mlp_backward      the last block's silu*up backward: down's grad is in, the product freed,
                      three [N, I/T] gradients and the residual gradient live
    forward_end       all activations + the logits and log-softmax before backward frees them
    optimizer         params + grads + states + AdamW's two scratch tensors of the largest parameter
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import MiniMindConfig, ParallelConfig, check_layout
from .tracker import CATEGORIES

BLOCK_KINDS = ("norm_fp32", "column_input", "qk_norm_fp32", "attention_q", "attention_kv", "attention_out", "mlp")
MODEL_KINDS = ("embedding", "final_norm", "head_input", "logits_loss")


@dataclass
class MemoryPrediction:
    peak_bytes: int
    breakdown: dict[str, int]                 # CATEGORIES -> bytes at the predicted peak
    activations_by_kind: dict[str, int]       # "block.<kind>" (one block) and "model.<kind>"
    num_layers: int
    peak_at: str = ""                         # which moment of the step is the peak
    candidates: dict[str, int] = field(default_factory=dict)

    def mib(self) -> float:
        return self.peak_bytes / 2**20

    @property
    def activation_bytes(self) -> int:
        """All activations saved by the end of the forward."""
        return sum(v * (self.num_layers if k.startswith("block.") else 1) for k, v in self.activations_by_kind.items())


def parameter_shapes(c: MiniMindConfig, par: ParallelConfig) -> dict[str, tuple[int, ...]]:
    """This rank's parameters (tied lm_head counted once), as the sharding plan cuts them."""
    t, h, d = par.tp, c.hidden_size, c.head_dim
    q, kv, inter = c.num_attention_heads * d // t, c.num_key_value_heads * d // t, c.intermediate_size // t
    vocab = c.vocab_size // t if par.vocab_parallel else c.vocab_size
    shapes = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter),
                       p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    shapes["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def as_dtype(dtype) -> torch.dtype:
    """A torch.dtype, or its name as the command line spells it ("bfloat16")."""
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def activations_by_kind(c: MiniMindConfig, par: ParallelConfig, *, seq_len: int, micro_batch_size: int,
                        dtype) -> dict[str, int]:
    """Bytes saved for backward: per block ("block.<kind>") and once per model ("model.<kind>")."""
    dtype = as_dtype(dtype)
    b = torch.empty((), dtype=dtype).element_size()
    f = max(b, 4)
    t, sp, vp = par.tp, par.sequence_parallel, par.vocab_parallel
    n, hid = seq_len * micro_batch_size, c.hidden_size
    nn_ = n // t if sp else n
    heads, kv, d = c.num_attention_heads // t, c.num_key_value_heads // t, c.head_dim
    inter, m = c.intermediate_size // t, n - micro_batch_size
    if sp and par.async_communication:
        column = 2 * b * (n // t) * hid
    elif sp and not par.shared_sp_gather:
        column = 5 * b * n * hid
    else:
        column = 2 * b * n * hid
    block = {
        "norm_fp32": 2 * (2 * f * nn_ * hid + f * nn_),
        "column_input": column,
        "qk_norm_fp32": (heads + kv) * n * (2 * f * d + f),
        "attention_q": b * n * heads * d,
        # repeat_kv copies k, v to h heads -- unless this rank holds one kv head: then the repeat
        # is a stride-0 view of it
        "attention_kv": 2 * b * n * (heads if kv > 1 else kv) * d,
        "attention_out": b * n * heads * d + 4 * n * heads,
        "mlp": 4 * b * n * inter,
    }
    if vp:
        head_input = b * (n // t) * hid if (sp and par.async_communication) else b * n * hid
        loss = f * m * (c.vocab_size // t) + 8 * m + 2 * m + 8
        embedding = 8 * n + n
    else:
        head_input = b * n * hid
        loss = b * m * c.vocab_size + 8 * m + b
        embedding = 8 * n
    model = {"embedding": embedding, "final_norm": 2 * f * nn_ * hid + f * nn_,
             "head_input": head_input, "logits_loss": loss}
    return {**{f"block.{k}": v for k, v in block.items()}, **{f"model.{k}": v for k, v in model.items()}}


def predict_memory(model_config: MiniMindConfig, par: ParallelConfig, *, seq_len: int, micro_batch_size: int,
                   dtype=torch.bfloat16, device: str = "cpu") -> MemoryPrediction:
    """Predicted peak of a training step on the worst rank, with the breakdown of CATEGORIES.
    device="cuda" leaves out AdamW's step counters (they live on the CPU there)."""
    c = model_config
    if par.pp > 1 or par.cp > 1:
        raise NotImplementedError("predict_memory: pipeline / context parallelism not modelled yet")
    if not c.flash_attn:
        raise NotImplementedError("predict_memory: only the flash (scaled_dot_product_attention) path is modelled")
    check_layout(c, par, seq_len=seq_len)
    dtype = as_dtype(dtype)
    b = torch.empty((), dtype=dtype).element_size()
    f = max(b, 4)
    t, sp, vp = par.tp, par.sequence_parallel, par.vocab_parallel
    n, hid, bsz = seq_len * micro_batch_size, c.hidden_size, micro_batch_size
    nn_, m = (n // t if sp else n), n - bsz
    vocab = c.vocab_size // t if vp else c.vocab_size

    shapes = parameter_shapes(c, par)
    param_bytes = b * sum(_numel(s) for s in shapes.values())
    buffers = 2 * b * c.max_position_embeddings * c.head_dim          # RoPE cos/sin, cast to dtype
    params = param_bytes + buffers
    states = 2 * param_bytes + (4 * len(shapes) if device == "cpu" else 0)  # exp_avg, exp_avg_sq, step
    ddp_buckets = param_bytes if par.dp > 1 else 0                    # DDP's flat gradient buckets
    kinds = activations_by_kind(c, par, seq_len=seq_len, micro_batch_size=bsz, dtype=dtype)
    acts = sum(v * (c.num_hidden_layers if k.startswith("block.") else 1) for k, v in kinds.items())
    batch = 8 * n if vp else 0   # the ids: saved by the embedding (an activation) unless VP
    labels = 8 * n               # the labels are never saved

    # Each moment: (grads, activations, temporaries)
    moments = {}
    if vp:
        # softmax.clone() in fp32 and its cast to the model dtype; count released
        moments["head_backward"] = (0, acts - 8, (f + b) * m * vocab + batch + labels + 12)
    else:
        # grad of log-softmax, grad of logits [M, V]; target copy and total weight released
        moments["head_backward"] = (0, acts - 8 * m - b, 2 * b * m * vocab + labels + 2 * b)
        pre_loss = acts - kinds["model.logits_loss"]
        moments["forward_end"] = (0, pre_loss, b * n * vocab + b * m * vocab + 8 * m + labels)
    head_grads = b * vocab * hid * (0 if c.tie_word_embeddings else 1) + b * hid
    after_head = acts - kinds["model.logits_loss"] - kinds["model.head_input"] - (f * nn_ * hid + f * nn_)
    scalars = 2 * 4 if vp else 2 * b  # the loss and its gradient seed
    moments["final_norm_backward"] = (head_grads, after_head, 5 * f * nn_ * hid + batch + labels + scalars)
    # the last block's MLP backward, at silu*up's backward: down's weight grad is in, the saved
    # product and everything after the block is freed; grad of down's input and two products live
    mlp_grads = head_grads + b * hid * (c.intermediate_size // t)
    mlp_acts = after_head - f * nn_ * hid - kinds["block.mlp"] // 4
    moments["mlp_backward"] = (mlp_grads, mlp_acts,
                               3 * (kinds["block.mlp"] // 4) + b * nn_ * hid + batch + labels + scalars)
    largest = b * max(_numel(s) for s in shapes.values())
    moments["optimizer"] = (param_bytes, 8 * n if not vp else 0, 2 * largest + batch + labels + scalars)

    totals = {k: params + states + ddp_buckets + sum(v) for k, v in moments.items()}
    peak_at = max(totals, key=totals.get)
    grads, act, temp = moments[peak_at]
    breakdown = dict(zip(CATEGORIES, (params, grads, states, act, temp + ddp_buckets)))
    return MemoryPrediction(peak_bytes=sum(breakdown.values()), breakdown=breakdown, activations_by_kind=kinds,
                            num_layers=c.num_hidden_layers, peak_at=peak_at, candidates=totals)
