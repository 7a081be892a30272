"""What autograd saves for backward, by kind: per block and once per model (bytes per rank).

Checked with saved-tensor hooks (docs/memory.md), for a micro-batch of B sequences of S tokens:

    b   = bytes per element of the model dtype;  f = bytes of the norms' fp32 upcast (max(b, 4))
    T   = TP size;  N = S*B tokens;  Nn = N/T under SP (norm/residual regions) else N
    h, k = attention / kv heads on this rank (heads/T, kv_heads/T);  d = head_dim;  I_t = I/T
    V_t = V/T with --vocab_parallel, else V;  the loss runs over all N positions (the targets are
    shifted in the batch, data.batches: a row's last position is an ignored target, not a slice)

Per block (kind: bytes)
    norm_fp32        2 RMSNorms x (x.float() + normed: 2 f Nn H,  rsqrt: f Nn)
    column_input     the input the column-parallel linears save for dW = dY^T X:
                       TP: 2 b N H (q/k/v share one, gate/up one);  basic SP: 5 b N H (one gather
                       per linear);  --shared_sp_gather: 2 b N H;  SP + async (recompute): 2 b N/T H;
                       --recompute selective under TP or SP + async: 0 (the norm output itself,
                       re-made in backward: recompute/norm_recompute.py)
    qk_norm_fp32     q_norm/k_norm over head_dim: (h + k) N (2 f d + f)
    attention_q      q after RoPE, saved by attention: b N h d   (RoPE itself saves only cos/sin views)
    attention_kv     k, v repeated to h heads for GQA: 2 b N h d  (2 b N d with one kv head per rank:
                     the repeat is then a view)
    attention_out    output (also o_proj's input: a view) b N h d + logsumexp 4 N h
    mlp              gate out, up out, silu(gate), silu*up (down's input): 4 b N I_t
    moe              (--use_moe, instead of mlp; Nm = Nn, the tokens this rank routes, E experts,
                     top-k, I_e = moe_intermediate_size, R = N_m k routed rows)
                       softmax scores b Nm E, top-k indices 8 Nm k, renormalisation (norm_topk_prob)
                       b Nm + b Nm k, the sort's two int64 indices 16 R, the sorted tokens, the
                       experts' output and the weighted output 3 b R H, each expert's gate out, up
                       out, silu, product 4 b R I_e, the sorted weights b R, the aux loss's N and
                       load f + f E (under SP the all-reduced [2E + 1] f (2E + 1) + f E)
Model level
    embedding        the ids: 8 N  (VP: local ids 8 N + out-of-range mask N)
    final_norm       2 f Nn H + f Nn
    head_input       lm_head's input: b N H  (VP + SP + async: b N/T H)
    logits_loss      replicated head: log-softmax b N V + target copy 8 N (B > 1) + total weight b
                     VP: fp32 softmax f N V_t + local target 8 N + two masks 2 N + count 8

Context parallelism (C ranks): N = S/C*B tokens per rank, the attention kinds of the comm type
(`_attention_kinds`) and RoPE's gathered cos/sin (model.rope).
"""
from __future__ import annotations

import torch

from ...config import DTYPES, CPCommType, MiniMindConfig, ParallelConfig, Recompute
from .moe_sizes import moe_column_input, moe_saved


def as_dtype(dtype) -> torch.dtype:
    """A torch.dtype, or its name as the command line spells it ("bfloat16")."""
    return DTYPES[dtype] if isinstance(dtype, str) else dtype


def target_copy(micro_batch_size: int, tokens: int) -> int:
    """The loss's int64 targets targets.t().reshape(-1), [B, S] -> [S, B] -> [N]: a copy, except
    with one sequence, where that is a view of the targets."""
    return 8 * tokens if micro_batch_size > 1 else 0


def norm_output_recomputed(par: ParallelConfig) -> bool:
    """--recompute selective where the column-parallel linears save the norm output itself (plain
    TP, SP + async): it is re-made from the norm's input in backward, not kept."""
    return par.recompute == Recompute.SELECTIVE and (not par.sequence_parallel or par.async_communication)


def activations_by_kind(c: MiniMindConfig, par: ParallelConfig, *, seq_len: int, micro_batch_size: int,
                        dtype) -> dict[str, int]:
    """Bytes saved for backward: per block ("block.<kind>") and once per model ("model.<kind>")."""
    dtype = as_dtype(dtype)
    b = dtype.itemsize
    f = max(b, 4)
    t, sp, vp = par.tp, par.sequence_parallel, par.vocab_parallel
    n, hid = seq_len // par.cp * micro_batch_size, c.hidden_size     # under CP: this rank's S/C tokens
    nn_ = n // par.sequence_shards
    heads, kv, d = c.num_attention_heads // t, c.num_key_value_heads // t, c.head_dim
    inter = c.intermediate_size // t
    if norm_output_recomputed(par):
        column = 0            # the norm outputs, re-made in backward (recompute/norm_recompute.py)
    elif sp and par.async_communication:
        column = 2 * b * (n // t) * hid
    elif sp and not par.shared_sp_gather:
        column = 5 * b * n * hid
    else:
        column = 2 * b * n * hid
    if c.use_moe:
        column = moe_column_input(par, column, b=b, n=n, nn_=nn_, hid=hid)
    lean = par.recompute.lean
    block = {
        # lean: the input in the model dtype and the fp32 rsqrt per row, not the two fp32 copies
        "norm_fp32": 2 * (b * nn_ * hid + f * nn_) if lean else 2 * (2 * f * nn_ * hid + f * nn_),
        "column_input": column,
        "qk_norm_fp32": (heads + kv) * n * (b * d + f) if lean else (heads + kv) * n * (2 * f * d + f),
        **_attention_kinds(par, b=b, f=f, n=n, heads=heads, kv=kv, d=d, lean=lean),
        **({"moe": moe_saved(c, par, b=b, f=f, tokens=nn_)} if c.use_moe else
           {"mlp": (2 if lean else 4) * b * n * inter}),       # lean: gate and up
        # full: what a block keeps between its forward and its backward (the kinds above are then
        # what the block re-creates while its backward runs)
        "checkpoint_input": b * nn_ * hid if par.recompute == Recompute.FULL else 0,
    }
    if vp:
        head_input = b * (n // t) * hid if (sp and par.async_communication) else b * n * hid
        loss = f * n * (c.vocab_size // t) + 8 * n + 2 * n + 8
        embedding = 8 * n + n
    else:
        head_input = b * n * hid
        loss = b * n * c.vocab_size + target_copy(micro_batch_size, n) + b
        embedding = 8 * n
    if par.loss_chunks > 1:   # the head's whole input, the lse per row, the targets, the count
        head_input, loss = b * n * hid, f * n + target_copy(micro_batch_size, n) + 8
    if par.cp > 1 and not vp and par.loss_chunks == 1:
        loss += 8               # the target count the sum is divided by (int64, saved by the division)
    final_norm = b * nn_ * hid + f * nn_ if lean else 2 * f * nn_ * hid + f * nn_
    model = {"embedding": embedding, "final_norm": final_norm,
             "head_input": head_input, "logits_loss": loss,
             # CP: RoPE's cos/sin of this rank's global positions, gathered from the tables (saved
             # by RoPE's multiplications, shared by every block); without CP views of the tables
             "rope": 2 * b * (seq_len // par.cp) * d if par.cp > 1 else 0}
    return {**{f"block.{k}": v for k, v in block.items()}, **{f"model.{k}": v for k, v in model.items()}}


def _attention_kinds(par: ParallelConfig, *, b: int, f: int, n: int, heads: int, kv: int, d: int,
                     lean: bool) -> dict[str, int]:
    """What attention saves for one block, n = this rank's tokens.

    Without CP: SDPA's q after RoPE, k and v (repeat_kv's copies at h heads, unless this rank
    holds one kv head: the repeat is a stride-0 view; lean, enable_gqa: at their own heads), its
    output (also o_proj's input: a view) and fp32 logsumexp.
    CP (context_parallel/attention.py): the attention Function saves q, k, v, its output and
    the lse (work dtype, f), and o_proj saves the output brought back to sequence-first [S/C, B,
    h*d] (a copy). all_gather: k and v of the whole sequence (C n tokens, kv heads, one gathered
    storage); a2a: q, k, v of the whole sequence at h/C, kv/C heads (one all-to-all output, the
    same bytes as the local q, k, v); ring: the local q, k and v at their kv heads."""
    if par.cp == 1:
        return {"attention_q": b * n * heads * d,
                "attention_kv": 2 * b * n * (heads if kv > 1 and not lean else kv) * d,
                "attention_out": b * n * heads * d + 4 * n * heads}
    kv_tokens = n * par.cp if par.cp_comm_type == CPCommType.ALL_GATHER else n
    return {"attention_q": b * n * heads * d,
            "attention_kv": 2 * b * kv_tokens * kv * d,
            "attention_out": 2 * b * n * heads * d + f * n * heads}
