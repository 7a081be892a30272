"""The analytic memory model: bytes by category, activations by saved-tensor kind, and the peak.

Everything is derived from what our code saves for backward (checked with saved-tensor hooks,
see docs/memory.md), per rank, for a micro-batch of B sequences of S tokens:

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
Model level
    embedding        the ids: 8 N  (VP: local ids 8 N + out-of-range mask N)
    final_norm       2 f Nn H + f Nn
    head_input       lm_head's input: b N H  (VP + SP + async: b N/T H)
    logits_loss      replicated head: log-softmax b N V + target copy 8 N (B > 1) + total weight b
                     VP: fp32 softmax f N V_t + local target 8 N + two masks 2 N + count 8

Alive all step: params and RoPE buffers, AdamW states, the batch (ids and targets [M B, S] int64
and the fp32 loss weights [M]), DDP's flat gradient buckets (pp = 1, dp > 1).

The peak is the largest of a few moments of the step, each a sum of what is alive then. A stage
runs its forwards F and backwards B in its schedule's order (`schedule_order`). At each one, the
microbatches still held keep what their forward saved (per microbatch: the stage's blocks, plus
on later stages the received input, on earlier ones the sent output deallocated to one element,
on the last the final norm, head input and loss). The first B finds no grads; every later one
accumulates into all of them. Within one microbatch's backward:
    head_backward        the loss gradients of the logits [N, V(/T)]
    head_mm_backward     lm_head's backward: the grad of the logits [N, V(/T)], the grads of its
                         weight and input (VP + SP + async: the re-gathered input too)
    final_norm_backward  the final RMSNorm's fp32 temporaries (5 f Nn H)
    down_backward        the last block's down_proj: grad of its output (gathered under SP), of its
                         input [N, I/T] and of its weight
    mlp_backward         silu*up's backward: down's grad in, the product freed, three [N, I/T] live
    post_norm_backward   the block's post-attention RMSNorm (the peak where I/T is small against H)
    ...(first block)     the last three in the stage's first block, the grads of all blocks above in
                         (a few tokens per microbatch: a block's weights outweigh its activations)
    embedding_backward   the dense [V(/T), H] weight grad (+ tied_grad_sum: a weight tied within
                         the stage adds the head's grad that waited in autograd's buffer)
and at the end of a forward: the last stage's loss (replicated head: its scaling; VP: inside the
loss, with the fp32 copy of the logits), an earlier stage's last residual add. Around them: the
last stage's loss per finished forward and the backward's seed (1F1B's loop drops each received
grad, sent input grad and finished loss as soon as it is dead). Last,
the optimizer step: all grads, and AdamW's sqrt and denom of the largest parameter while the
previous parameter's denom is still bound.

--loss_chunks K: the head's moments become the chunked loss's forward and backward
(`_chunked_loss_forward`, `_chunked_loss_backward`). --recompute full: a block holds its input
(`_Stage.block`); its backward re-makes the rest (`_Stage.recomputed`, temporaries to the tracker).

Context parallelism (C ranks): N = S/C*B tokens per rank and the attention kinds of the comm
type (`_attention_kinds`), RoPE's gathered cos/sin (model.rope), the CP loss's count and scaled
loss, DDP over DP x CP, and one more moment, inside a block's attention backward
(`_chunked_attention_backward`, `_ring_attention_backward`): docs/memory.md, "Context parallelism".

So 1F1B's first stage holds min(P, M) microbatches at its peak and GPipe's holds M. The moments
are those the tracker found on every configuration tried; tests/test_memory.py checks the model
against it to the byte, peak and breakdown, stage by stage.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import MiniMindConfig, ParallelConfig, check_layout
from ..context_parallel.blockwise import visible_pairs
from ..plan import is_first_stage, is_last_stage, stage_layers, stage_parameters
from .tracker import CATEGORIES

BLOCK_KINDS = ("norm_fp32", "column_input", "qk_norm_fp32", "attention_q", "attention_kv", "attention_out", "mlp",
               "checkpoint_input")
MODEL_KINDS = ("embedding", "final_norm", "head_input", "logits_loss", "rope")


@dataclass
class MemoryPrediction:
    peak_bytes: int
    breakdown: dict[str, int]                 # CATEGORIES -> bytes at the predicted peak
    activations_by_kind: dict[str, int]       # "block.<kind>" (one block) and "model.<kind>"
    num_layers: int                           # layers on this stage
    peak_at: str = ""                         # which moment of the step is the peak
    candidates: dict[str, int] = field(default_factory=dict)
    per_stage: list[int] = field(default_factory=list)   # peak bytes of each pipeline stage
    held_per_microbatch: int = 0   # what one microbatch keeps on this stage from its forward to its backward
    held_at_peak: int = 0          # microbatches whose activations are held at the peak

    def mib(self) -> float:
        return self.peak_bytes / 2**20


def as_dtype(dtype) -> torch.dtype:
    """A torch.dtype, or its name as the command line spells it ("bfloat16")."""
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def target_copy(micro_batch_size: int, tokens: int) -> int:
    """The loss's int64 targets targets.t().reshape(-1), [B, S] -> [S, B] -> [N]: a copy, except
    with one sequence, where that is a view of the targets."""
    return 8 * tokens if micro_batch_size > 1 else 0


def norm_output_recomputed(par: ParallelConfig) -> bool:
    """--recompute selective where the column-parallel linears save the norm output itself (plain
    TP, SP + async): it is re-made from the norm's input in backward, not kept."""
    return par.recompute == "selective" and (not par.sequence_parallel or par.async_communication)


def activations_by_kind(c: MiniMindConfig, par: ParallelConfig, *, seq_len: int, micro_batch_size: int,
                        dtype) -> dict[str, int]:
    """Bytes saved for backward: per block ("block.<kind>") and once per model ("model.<kind>")."""
    dtype = as_dtype(dtype)
    b = torch.empty((), dtype=dtype).element_size()
    f = max(b, 4)
    t, sp, vp = par.tp, par.sequence_parallel, par.vocab_parallel
    n, hid = seq_len // par.cp * micro_batch_size, c.hidden_size     # under CP: this rank's S/C tokens
    nn_ = n // t if sp else n
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
    lean = par.recompute != "none"
    block = {
        # lean: the input in the model dtype and the fp32 rsqrt per row, not the two fp32 copies
        "norm_fp32": 2 * (b * nn_ * hid + f * nn_) if lean else 2 * (2 * f * nn_ * hid + f * nn_),
        "column_input": column,
        "qk_norm_fp32": (heads + kv) * n * (b * d + f) if lean else (heads + kv) * n * (2 * f * d + f),
        **_attention_kinds(par, b=b, f=f, n=n, heads=heads, kv=kv, d=d, lean=lean),
        "mlp": (2 if lean else 4) * b * n * inter,       # lean: gate and up
        # full: what a block keeps between its forward and its backward (the kinds above are then
        # what the block re-creates while its backward runs)
        "checkpoint_input": b * nn_ * hid if par.recompute == "full" else 0,
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
    kv_tokens = n * par.cp if par.cp_comm_type == "all_gather" else n
    return {"attention_q": b * n * heads * d,
            "attention_kv": 2 * b * kv_tokens * kv * d,
            "attention_out": 2 * b * n * heads * d + f * n * heads}


def schedule_order(pp: int, stage: int, num_microbatches: int, schedule: str) -> list[tuple[str, int]]:
    """This stage's forwards ("F", i) and backwards ("B", i) in the order it runs them (see
    pipeline_parallel.schedules): GPipe all F then all B; 1F1B a warm-up of P-p-1 forwards, then
    one F one B, then the remaining B. One stage is plain gradient accumulation: F B F B .."""
    m = num_microbatches
    if schedule == "gpipe" and pp > 1:
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(pp - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(warmup, m):
        order += [("F", i), ("B", i - warmup)]
    return order + [("B", i) for i in range(m - warmup, m)]


def predict_memory(model_config: MiniMindConfig, par: ParallelConfig, *, seq_len: int, micro_batch_size: int,
                   dtype=torch.bfloat16, device: str = "cpu", num_microbatches: int = 1, schedule: str = "1f1b",
                   stage: int | None = None, cp_rank: int | None = None) -> MemoryPrediction:
    """Predicted peak of a training step of `num_microbatches` microbatches of `micro_batch_size`
    sequences on the worst rank of pipeline stage `stage` (None: of the worst stage), with the
    breakdown of CATEGORIES. device="cuda" leaves out AdamW's step counters (they live on the CPU
    there). The prediction of every stage is in `per_stage`. Under CP `cp_rank` picks the CP rank
    (None: the worst; with the load-balanced split every CP rank holds the same bytes, with the
    contiguous one the later ranks' attention sees more blocks)."""
    c = model_config
    if not c.flash_attn:
        raise NotImplementedError("predict_memory: only the flash (scaled_dot_product_attention) path is modelled")
    check_layout(c, par, seq_len=seq_len)
    if cp_rank is not None and not 0 <= cp_rank < par.cp:
        raise ValueError(f"cp_rank must be in [0, cp); got cp_rank={cp_rank}, cp={par.cp}")
    cp_ranks = [cp_rank] if cp_rank is not None else range(1 if par.cp_load_balance else par.cp)
    stages = [max((_predict_stage(c, par, p, seq_len=seq_len, micro_batch_size=micro_batch_size,
                                  num_microbatches=num_microbatches, schedule=schedule, dtype=dtype, device=device,
                                  cp_rank=r) for r in cp_ranks), key=lambda s: s.peak_bytes)
              for p in range(par.pp)]
    pick = stages[stage] if stage is not None else max(stages, key=lambda s: s.peak_bytes)
    pick.per_stage = [s.peak_bytes for s in stages]
    return pick


@dataclass(frozen=True, kw_only=True)
class _Stage:
    """The sizes every moment of one stage's step is a sum of (bytes, unless a count or a flag)."""

    par: ParallelConfig
    b: int                     # bytes per element of the model dtype
    f: int                     # bytes of the norms' fp32 upcast, max(b, 4)
    n: int                     # N = S*B tokens per microbatch (and rows of the loss)
    nn: int                    # tokens in the norm/residual regions: N/T under SP, else N
    hid: int                   # H
    inter: int                 # I/T
    vocab: int                 # V/T with --vocab_parallel, else V
    bsz: int                   # sequences per microbatch
    mb: int                    # microbatches per step
    first: bool
    last: bool
    gpipe: bool                # GPipe with a pipeline (else 1F1B / gradient accumulation)
    tied_here: bool            # a weight tied within this stage (embedding and lm_head both here)
    shapes: dict               # this rank's parameters (plan.stage_parameters)
    kinds: dict                # activations_by_kind
    layers: int                # layers on this stage
    block_params: int          # the parameters of one block
    heads: int = 0             # h, kv: attention / kv heads on this rank; d: head_dim
    kv_heads: int = 0
    head_dim: int = 0
    chunk_len: int = 0         # CP: tokens of one sequence chunk (context_parallel.ContextLayout)
    cp_rank: int = 0           # CP: this rank's place in the CP group (which chunks it holds)

    @property
    def param_bytes(self) -> int:
        return self.b * sum(_numel(s) for s in self.shapes.values())

    @property
    def block(self) -> int:
        """One block's activations of one microbatch, held to its backward (full: its input)."""
        if self.par.recompute == "full":
            return self.kinds["block.checkpoint_input"]
        return sum(v for k, v in self.kinds.items() if k.startswith("block."))

    @property
    def recomputed(self) -> int:
        """--recompute full: what a block's re-run forward saves again, alive in its backward
        (kept by the checkpoint's own saved-tensor hooks: temporaries to the tracker)."""
        if self.par.recompute != "full":
            return 0
        # the input norm's saved input is the block's input: the checkpoint's, already held
        return (sum(v for k, v in self.kinds.items() if k.startswith("block.") and k != "block.checkpoint_input")
                - self.kinds["block.checkpoint_input"])

    @property
    def batch(self) -> int:
        """Alive all step, on every stage: the ids and targets [M*B, S] (split into microbatches
        there) and the microbatches' loss weights (fp32 [M])."""
        return 16 * self.n * self.mb + 4 * self.mb

    @property
    def loss_scalar(self) -> int:
        """The last stage keeps one loss per forward (the report)."""
        return 4 if (self.par.vocab_parallel or self.par.loss_chunks > 1) else self.b

    @property
    def weight(self) -> int:
        """The loss weight cast to the loss dtype, saved by the scaling (nothing when fp32)."""
        return self.loss_scalar if self.loss_scalar != 4 else 0

    @property
    def held_temps(self) -> int:
        """Not saved for backward, so temporaries to the tracker: the received input (the first
        norm saves its fp32 copy instead) and the sent output, deallocated to one element."""
        b = self.b
        # the lean norm saves the received input itself (an activation, in its kind)
        upcast_only = b != self.f and self.par.recompute == "none"
        sent = self.cp_scaled_loss if self.last else b
        return (b * self.nn * self.hid if not self.first and upcast_only else 0) + sent

    @property
    def cp_scaled_loss(self) -> int:
        """The last stage under CP: the loss scaled by cp for backward (the schedule's grad_scale),
        held until its backward."""
        return self.loss_scalar if self.last and self.par.cp > 1 else 0

    @property
    def held(self) -> int:
        """What one microbatch keeps from the end of its forward to its backward."""
        k = self.kinds
        held = self.layers * self.block + self.held_temps + k["model.rope"]
        if self.first and self.par.vocab_parallel:
            held += 9 * self.n              # local ids and out-of-range mask (the ids are in `batch`)
        if self.last:
            held += k["model.final_norm"] + k["model.head_input"] + k["model.logits_loss"] + self.weight
        return held

    @property
    def mlp_out(self) -> int:
        """One [N, I/T] tensor of the MLP."""
        return self.b * self.n * self.inter

    @property
    def mlp_w_grad(self) -> int:
        """down_proj's weight grad [H, I/T]."""
        return self.b * self.hid * self.inter

    @property
    def head_w_grad(self) -> int:
        return self.b * self.vocab * self.hid if self.last else 0

    @property
    def head_grads(self) -> int:
        """The grads the head's backward leaves: the final norm's, and lm_head's unless tied here."""
        return self.b * self.hid + (0 if self.tied_here else self.head_w_grad) if self.last else 0

    @property
    def waiting(self) -> int:
        """A tied weight's grad waits in autograd's buffer for the embedding's contribution."""
        return self.head_w_grad if self.tied_here else 0

    @property
    def ddp_buckets(self) -> int:
        """DDP's flat gradient buckets (no DDP under a pipeline)."""
        return self.param_bytes if self.par.dp * self.par.cp > 1 and self.par.pp == 1 else 0


def _stage_sizes(c: MiniMindConfig, par: ParallelConfig, stage: int, *, seq_len: int, micro_batch_size: int,
                 num_microbatches: int, schedule: str, dtype, cp_rank: int = 0) -> _Stage:
    b = torch.empty((), dtype=dtype).element_size()
    t, n = par.tp, seq_len // par.cp * micro_batch_size
    first, last = is_first_stage(stage), is_last_stage(stage, par.pp)
    shapes = stage_parameters(c, par, stage)
    layers_at = stage_layers(c.num_hidden_layers, par.pp, stage)
    top = f"model.layers.{layers_at[0]}."
    return _Stage(par=par, b=b, f=max(b, 4), n=n, nn=n // t if par.sequence_parallel else n,
                  hid=c.hidden_size, inter=c.intermediate_size // t,
                  vocab=c.vocab_size // t if par.vocab_parallel else c.vocab_size, bsz=micro_batch_size,
                  mb=num_microbatches, first=first, last=last, gpipe=schedule == "gpipe" and par.pp > 1,
                  tied_here=c.tie_word_embeddings and first and last, shapes=shapes,
                  kinds=activations_by_kind(c, par, seq_len=seq_len, micro_batch_size=micro_batch_size, dtype=dtype),
                  layers=len(layers_at),
                  block_params=b * sum(_numel(s) for k, s in shapes.items() if k.startswith(top)),
                  heads=c.num_attention_heads // t, kv_heads=c.num_key_value_heads // t, head_dim=c.head_dim,
                  chunk_len=seq_len // (2 * par.cp if par.cp_load_balance else par.cp), cp_rank=cp_rank)


# One microbatch's backward at its largest moments, each (grads it adds, its activations, temporaries).

def _head_backward(s: _Stage) -> tuple[int, int, int]:
    """The loss gradients of the logits [N, V(/T)]."""
    b, f, n, v = s.b, s.f, s.n, s.vocab
    if s.par.vocab_parallel:   # the fp32 softmax clone and its cast to the model dtype; the count released
        return 0, s.held - 8 - s.weight, f * n * v + (b * n * v if b != f else 0) + 4
    # grads of log-softmax and logits [N, V]; target copy and weight (CP: the target count) released
    count = 8 if s.par.cp > 1 else 0
    return 0, s.held - target_copy(s.bsz, n) - b - s.weight - count, 2 * b * n * v


def _chunk_rows(n: int, chunks: int) -> list[int]:
    """Rows of each chunk of `torch.tensor_split(n rows, chunks)`: the first n % chunks one longer."""
    return [n // chunks + (1 if i < n % chunks else 0) for i in range(chunks)]


def _chunked_loss_backward(s: _Stage) -> tuple[int, int, int]:
    """--loss_chunks K (`recompute.chunked_loss`): the head input's grad [N, H] and the weight's
    [V(/T), H] allocated, a chunk's recomputed logits [r, V(/T)] and their work-dtype softmax
    while the previous chunk's logits grad (model dtype) and its target index and masks (int64,
    two bools per row) are still bound; the target count released, the loss's grad (f) in."""
    b, f, v = s.b, s.f, s.vocab
    rows = _chunk_rows(s.n, s.par.loss_chunks)
    prev_g = b if b != f else f                  # g = softmax.to(model dtype): the softmax itself in fp32

    def chunk(r: int) -> int:
        return b * r * v + (f * r * v if b != f else 0)

    # fp32: the logits are the softmax, so the largest moment is the target masks' making (19 r
    # bytes: `chunked_loss._targets`, the previous chunk's still bound)
    masks = 19 if b == f else 0
    worst = max([chunk(rows[0]) + masks * rows[0]]
                + [chunk(r) + masks * r + prev_g * p * v + 10 * p for p, r in zip(rows, rows[1:])])
    return 0, s.held - 8 - s.weight, b * s.n * s.hid + b * v * s.hid + worst + f


def _head_mm_backward(s: _Stage) -> tuple[int, int, int]:
    """lm_head's backward: the grad of the logits [S, B, V(/T)], then the grads of its weight (a
    .grad once accumulated) and of its input (VP + SP + async: the input re-gathered from the
    saved shard, the input grad's reduce-scatter issued before the weight grad)."""
    b, n, hid, par = s.b, s.n, s.hid, s.par
    regather = b * n * hid + b * s.nn * hid if (par.vocab_parallel and par.sequence_parallel
                                                and par.async_communication) else 0
    return 0, s.held - s.weight - s.kinds["model.logits_loss"], b * n * s.vocab + s.head_w_grad + b * n * hid + regather


def _final_norm_backward(s: _Stage) -> tuple[int, int, int]:
    """The final RMSNorm's fp32 temporaries (5 f Nn H)."""
    f, nn_, hid = s.f, s.nn, s.hid
    if s.par.recompute != "none":
        # lean (one Function): its input and rsqrt still saved; the incoming grad bound through
        # its backward; 3 f Nn H, the row means and its weight grad (not yet a .grad)
        grad_in = s.b * nn_ * hid
        return (s.head_grads - s.b * hid, _top_block_acts(s) + s.kinds["model.final_norm"],
                grad_in + 3 * f * nn_ * hid + f * nn_ + s.b * hid + s.waiting)
    return s.head_grads, _top_block_acts(s) + f * nn_ * hid, 5 * f * nn_ * hid + s.waiting


def _top_block_acts(s: _Stage) -> int:
    """The activations alive when the stage's last block begins its backward: on the last stage
    the loss, the head's input and the final norm's are freed by then."""
    if not s.last:
        return s.held
    k, f, nn_, hid = s.kinds, s.f, s.nn, s.hid
    head = s.held - s.weight - k["model.logits_loss"] - k["model.head_input"]
    if s.par.recompute != "none":
        return head - k["model.final_norm"]
    return head - (f * nn_ * hid + f * nn_) - f * nn_ * hid


def _down_backward(s: _Stage) -> tuple[int, int, int]:
    """The last block's down_proj: the grad of its output (gathered to the full sequence under
    SP), the grads of its input and weight (the latter a .grad only after both mms)."""
    b, hid = s.b, s.hid
    gathered = b * s.n * hid if s.par.sequence_parallel else 0
    return s.head_grads, _top_block_acts(s), gathered + b * s.nn * hid + s.mlp_out + s.mlp_w_grad + s.waiting


def _mlp_backward(s: _Stage) -> tuple[int, int, int]:
    """At silu*up's backward: down's grad is in, the saved product freed, three [N, I/T] live."""
    return (s.head_grads + s.mlp_w_grad, _top_block_acts(s) - s.mlp_out,
            3 * s.mlp_out + s.b * s.nn * s.hid + s.waiting)


def _post_norm_backward(s: _Stage) -> tuple[int, int, int]:
    """The post-attention RMSNorm's backward (the peak where I/T is small against H): the MLP's
    grads in, its activations and its share of the column inputs freed, the norm's fp32
    temporaries and the residual grad live."""
    par, b, f, nn_, hid = s.par, s.b, s.f, s.nn, s.hid
    column = s.kinds["block.column_input"]
    basic_sp = par.sequence_parallel and not par.shared_sp_gather and not par.async_communication
    gate_up_input = column * 2 // 5 if basic_sp else column // 2   # basic SP: one gather per linear
    return (s.head_grads + 3 * s.mlp_w_grad + b * hid,
            _top_block_acts(s) - 4 * s.mlp_out - gate_up_input - (f * nn_ * hid + f * nn_),
            5 * f * nn_ * hid + b * nn_ * hid + s.waiting)


def _top_block_saved(s: _Stage, freed: int) -> tuple[int, int]:
    """In the top block's backward, `freed` bytes of its saved tensors released: (activations,
    re-made tensors). --recompute full: the block's re-run saved them, under the checkpoint's
    own hooks, so they are temporaries to the tracker; otherwise activations."""
    if s.par.recompute == "full":
        return _top_block_acts(s), s.recomputed - freed
    return _top_block_acts(s) - freed, 0


def _lean_post_norm_rest(s: _Stage, saved: tuple[int, int]) -> tuple[int, int]:
    acts, redone = saved
    f, b, nn_, hid = s.f, s.b, s.nn, s.hid
    return acts, 3 * f * nn_ * hid + f * nn_ + b * hid + 2 * b * nn_ * hid + s.waiting + redone


def _swiglu_backward(s: _Stage) -> tuple[int, int, int]:
    """Lean MLP (`recompute.swiglu_linear`): inside its backward, down's output grad (gathered
    under SP) and the residual grad in, down's weight grad made, three [N, I/T] live (the grad of
    the product, reused in place, dup and dgate); gate and up still saved."""
    b, hid = s.b, s.hid
    gathered = b * s.n * hid if s.par.sequence_parallel else 0
    acts, redone = _top_block_saved(s, 0)
    return s.head_grads, acts, gathered + b * s.nn * hid + 3 * s.mlp_out + s.mlp_w_grad + s.waiting + redone


def _lean_post_norm_backward(s: _Stage) -> tuple[int, int, int]:
    """Lean post-attention RMSNorm (`recompute.lean_rms_norm`) at its largest: the recomputed
    normed input, g w and their product (3 f Nn H), the row means (f Nn) and its weight grad
    (b H), the grads of its output and of the residual stream ([Nn, H] each); the MLP's grads
    in, its activations and its share of the column inputs freed, the norm's own input and rsqrt
    still saved."""
    par, b, hid = s.par, s.b, s.hid
    column = s.kinds["block.column_input"]
    basic_sp = par.sequence_parallel and not par.shared_sp_gather and not par.async_communication
    gate_up_input = column * 2 // 5 if basic_sp else column // 2
    # under SP one more [H] grad is in by then (measured with the tracker, not derived)
    return (s.head_grads + 3 * s.mlp_w_grad + (b * hid if par.sequence_parallel else 0),
            *_lean_post_norm_rest(s, _top_block_saved(s, 2 * s.mlp_out + gate_up_input)))


def _attention_grads_acts(s: _Stage) -> tuple[int, int, int]:
    """Grads, activations and re-made tensors (full) when the top block's attention begins its
    backward: the MLP's, the post-attention norm's and o_proj's grads in; their activations freed
    (o_proj's input included, a copy under CP)."""
    par, b = s.par, s.b
    column = s.kinds["block.column_input"]
    basic_sp = par.sequence_parallel and not par.shared_sp_gather and not par.async_communication
    gate_up_input = column * 2 // 5 if basic_sp else column // 2
    o_proj_input = b * s.n * s.heads * s.head_dim
    grads = s.head_grads + 3 * s.mlp_w_grad + b * s.hid + b * s.hid * s.heads * s.head_dim
    acts, redone = _top_block_saved(s, s.kinds["block.mlp"] + s.kinds["block.norm_fp32"] // 2 + gate_up_input
                                    + o_proj_input)
    return grads, acts, redone


def _block_backward_peak(s: _Stage, h_fn: int, kv_fn: int, pairs: int) -> int:
    """The largest moment of `blockwise.block_backward` (work dtype, f) on a block of Lc query
    and Lc key tokens at h_fn query and kv_fn kv heads: at the ds subtraction three score-sized
    tensors and the block's dv, or at dk's head sum two of them, dv, dq, dk's matmul and its sum.
    From the second visible block on, the previous block's gq, gk, gv are still bound."""
    f, lc, d, bsz = s.f, s.chunk_len, s.head_dim, s.bsz
    score, q_blk, kv_blk = f * bsz * h_fn * lc * lc, f * bsz * h_fn * lc * d, f * bsz * kv_fn * lc * d
    inside = max(3 * score + kv_blk, 2 * score + kv_blk + 2 * q_blk + kv_blk)
    return inside + (q_blk + 2 * kv_blk if pairs > 1 else 0)


def _chunked_attention_backward(s: _Stage) -> tuple[int, int, int]:
    """CP all_gather / a2a (`context_parallel.blockwise.ChunkedAttention`) inside a block's
    backward (`_block_backward_peak`) beside the accumulators dq, dk, dv, delta, the incoming grad
    and (half precision) the work-dtype copies of dout, q, k and v. all_gather: k, v of the whole
    sequence at the kv heads; a2a: q, k, v of the whole sequence at h/C, kv/C heads."""
    b, f, n, c = s.b, s.f, s.n, s.par.cp
    h, kv, d = s.heads, s.kv_heads, s.head_dim
    upcast = b != f
    gather = s.par.cp_comm_type == "all_gather"
    kv_elems = (c * n * kv * d) if gather else n * kv * d   # k (or v) of the Function
    h_fn, kv_fn = (h, kv) if gather else (h // c, kv // c)
    chunks = 2 * c if s.par.cp_load_balance else c
    pairs = len(visible_pairs(_rank_chunks(s, s.cp_rank) if gather else tuple(range(chunks)), tuple(range(chunks))))
    work = (f * (n * h * d + 2 * kv_elems) if upcast else 0) + (f * n * h * d if upcast else 0)
    grads_qkv = f * (n * h * d + 2 * kv_elems)          # dq, dk, dv: per chunk, then concatenated
    last_block = f * s.bsz * s.chunk_len * d * (h_fn + 2 * kv_fn)   # the last block's gq, gk, gv
    peak = max(_block_backward_peak(s, h_fn, kv_fn, pairs), grads_qkv + last_block)
    grads, acts, redone = _attention_grads_acts(s)
    temps = _residual_grads(s) + b * n * h * d + work + grads_qkv + f * n * h + peak + s.waiting + redone
    return grads, acts, temps


def _ring_attention_backward(s: _Stage) -> tuple[int, int, int]:
    """CP ring (`context_parallel.ring.RingAttention`) at the rank's largest ring step:
    beside dq, delta and (half precision) the work-dtype q and dout, the K/V block in hand and
    the one arriving (model dtype, [2, B, kv, 1, S/C, d] each) and, from the second step on, the
    previous step's gq, gk, gv, the dK/dV accumulator it sent and the one it received; inside
    the step `chunked_backward` over the visible blocks (its per-chunk dq, dk, dv, then their
    concatenation)."""
    b, f, n, c = s.b, s.f, s.n, s.par.cp
    h, kv, d = s.heads, s.kv_heads, s.head_dim
    upcast = b != f
    q_elems, kv_elems = n * h * d, n * kv * d
    fixed = (2 * f * q_elems if upcast else 0) + f * n * h + f * q_elems + 2 * b * kv_elems
    g = f * (q_elems + 2 * kv_elems)                       # one step's dq, dk, dv
    mine, worst = _rank_chunks(s, s.cp_rank), 0
    for step in range(c):
        pairs = len(visible_pairs(mine, _rank_chunks(s, (s.cp_rank - step) % c)))
        last_block = f * s.bsz * s.chunk_len * d * (h + 2 * kv) if pairs else 0
        inner = g + max(_block_backward_peak(s, h, kv, pairs) if pairs else 0, g + last_block)
        step_bytes = (fixed + (2 * b * kv_elems if step < c - 1 else 0) + (2 * f * kv_elems if upcast else 0)
                      + (g + 2 * 2 * f * kv_elems if step else 0) + inner)
        worst = max(worst, step_bytes)
    grads, acts, redone = _attention_grads_acts(s)
    return grads, acts, _residual_grads(s) + b * q_elems + worst + s.waiting + redone


def _residual_grads(s: _Stage) -> int:
    """The residual stream's grad [Nn, H] while a block's attention runs its backward; on an
    earlier stage the grad received from the next stage too (bound by the schedule)."""
    return s.b * s.nn * s.hid * (1 if s.last else 2)


def _rank_chunks(s: _Stage, rank: int) -> tuple[int, ...]:
    c = s.par.cp
    return (rank, 2 * c - 1 - rank) if s.par.cp_load_balance else (rank,)


def _in_first_block(s: _Stage, moment: tuple[int, int, int], received_counted: bool) -> tuple[int, int, int]:
    """A moment of the top block, in the stage's first block: every block above has added its
    grads and freed its activations. The top block holds the peak unless a block's parameters
    outweigh one microbatch's activations of it (a few tokens per microbatch, or --recompute
    full). On an earlier stage the top block's residual grad is the received grad itself; lower
    down it is another tensor, the received one still bound by the schedule (unless the moment
    counts both already: `received_counted`)."""
    grads, acts, temps = moment
    deeper = s.layers - 1
    received = s.b * s.nn * s.hid if not s.last and not received_counted else 0
    return grads + deeper * s.block_params, acts - deeper * s.block, temps + received


def _embedding_backward(s: _Stage) -> tuple[int, int, int]:
    """The embedding's dense weight grad [V(/T), H] (a .grad once accumulated), the grad of its
    output [N, H] (gathered from the sequence shards under SP) and the received grad."""
    b, hid = s.b, s.hid
    emb_w_grad = b * s.vocab * hid
    acts = (9 * s.n if s.par.vocab_parallel else 0) + s.held_temps   # (the first stage's: the sent output)
    return (s.param_bytes - emb_w_grad, acts,
            emb_w_grad + b * s.n * hid + s.waiting + (0 if s.last else b * s.nn * hid))


def _tied_grad_sum(s: _Stage) -> tuple[int, int, int]:
    """A weight tied within the stage adds the waiting head grad to the embedding's: three [V, H]
    (the VP masks freed)."""
    emb_w_grad = s.b * s.vocab * s.hid
    return s.param_bytes - emb_w_grad, s.cp_scaled_loss, 3 * emb_w_grad


def _backward_moments(s: _Stage) -> dict[str, tuple[int, int, int]]:
    """One microbatch's backward at its largest moments, in the order they happen."""
    inner = {}
    if s.last and s.par.loss_chunks > 1:
        inner.update(chunked_loss_backward=_chunked_loss_backward(s), final_norm_backward=_final_norm_backward(s))
    elif s.last:
        inner.update(head_backward=_head_backward(s), head_mm_backward=_head_mm_backward(s),
                     final_norm_backward=_final_norm_backward(s))
    if s.par.recompute != "none":
        top = {"swiglu_backward": _swiglu_backward(s), "post_norm_backward": _lean_post_norm_backward(s)}
    else:
        top = {"down_backward": _down_backward(s), "mlp_backward": _mlp_backward(s),
               "post_norm_backward": _post_norm_backward(s)}
    if s.par.cp > 1:
        top["attention_backward"] = (_ring_attention_backward(s) if s.par.cp_comm_type == "ring"
                                     else _chunked_attention_backward(s))
    inner.update(top)
    if s.layers > 1:
        inner.update({f"{name}(first block)": _in_first_block(s, moment, name == "attention_backward")
                      for name, moment in top.items()})
    if s.first:
        inner["embedding_backward"] = _embedding_backward(s)
    if s.first and s.tied_here:
        inner["tied_grad_sum"] = _tied_grad_sum(s)
    return inner


def _last_forward_end(s: _Stage) -> tuple[int, int]:
    """The end of the last stage's forward, logits alive: (activations, temporaries).
    Replicated head: the loss's scaling by its weight -- everything saved, the loss and its scaled
    copy live (the weight cast to the loss dtype too). VP: inside the loss, its fp32 copy of the
    logits (the later softmax) and nine [N] vectors (max, masks, local target, target logit, sum
    of exp, its log, their difference), and the final norm's local output under basic/shared SP,
    still bound in the model's forward."""
    b, f, n, v, par = s.b, s.f, s.n, s.vocab, s.par
    if par.vocab_parallel:
        local_h = b * s.nn * s.hid if par.sequence_parallel and not par.async_communication else 0
        # (this microbatch's loss is not scaled yet: its held_temps are counted as moved)
        return (s.held - s.weight - s.kinds["model.logits_loss"],
                b * n * v + f * n * v + 30 * n + target_copy(s.bsz, n) + local_h - s.cp_scaled_loss)
    return s.held - s.weight, b * n * v + 2 * b + s.weight


def _chunked_loss_forward(s: _Stage) -> tuple[int, int]:
    """--loss_chunks K: inside the loss's forward (`recompute.chunked_loss`), at a chunk's logits
    [r, V(/T)] made and cast to the work dtype (fp32: at its target masks, 19 r bytes), the
    previous chunk's work-dtype logits, target index, masks, target logit and row max still bound,
    the lse of the chunks so far, the running total (and the previous chunk's loss). The head's
    input (gathered under SP: the final norm's local output still bound), the target copy and the
    lse are not saved yet: (activations, temporaries)."""
    b, f, v, k = s.b, s.f, s.vocab, s.kinds
    rows = _chunk_rows(s.n, s.par.loss_chunks)

    def chunk(i: int) -> int:
        r = rows[i]
        made = b * r * v + f * r * v if b != f else f * r * v + 19 * r
        if i == 0:
            return made
        p = rows[i - 1]
        return made + f * p * v + 10 * p + 2 * f * p + f * sum(rows[:i]) + (f if i == 1 else 2 * f)

    local_h = b * s.nn * s.hid if s.par.sequence_parallel else 0
    unsaved = k["model.head_input"] + k["model.logits_loss"] - 8 - f * s.n     # the head input and target copy
    acts = s.held - s.weight - k["model.logits_loss"] - k["model.head_input"]
    return acts, unsaved + local_h + max(chunk(i) for i in range(len(rows))) - s.cp_scaled_loss


def _earlier_forward_end(s: _Stage) -> tuple[int, int]:
    """The end of an earlier stage's forward, at its last residual add: everything saved, plus
    down_proj's output, the sum, and in half precision the block's input and middle residual
    stream (their fp32 copies are what the norms save; a received input is counted as held)."""
    residual = 2 + (0 if s.b == s.f else 2 - (1 if not s.first and s.layers == 1 else 0))
    return s.held - s.held_temps, residual * s.b * s.nn * s.hid


def _batch_saved(s: _Stage) -> int:
    """The tracker files a storage under activations from the first time autograd saves it: the
    ids once the embedding saves them (and the targets, when the replicated head's loss saves a
    view of them: one sequence)."""
    vp = s.par.vocab_parallel
    return (8 * s.n * s.mb if s.first and not vp else 0) + (8 * s.n * s.mb if s.last and not vp and s.bsz == 1 else 0)


def _forward_moment(s: _Stage, n_held: int, grads: int, saved: int, extra: int) -> tuple[int, int, int]:
    """The end of a forward, `n_held` microbatches held before it. The schedule's loop binds
    nothing of earlier microbatches (it drops each received grad, sent input grad and loss once
    dead: pipeline_parallel.schedules.one_f_one_b)."""
    b = s.b
    if not s.last:
        # this microbatch's output is not sent yet (no one-element stand-in for it)
        acts, temps = _earlier_forward_end(s)
        return grads, saved + (n_held + 1) * acts, extra + (n_held + 1) * s.held_temps - b + temps
    acts, temps = _chunked_loss_forward(s) if s.par.loss_chunks > 1 else _last_forward_end(s)
    moved = (n_held + 1) * s.held_temps
    return grads, saved + n_held * s.held + acts - moved, extra + temps + moved


def _replay_schedule(s: _Stage, stage: int, schedule: str) -> tuple[dict, dict]:
    """Every moment of the stage's schedule -> (grads, activations, temporaries), and how many
    microbatches each finds in flight."""
    moments, in_flight, n_held, n_fwd, n_bwd = {}, {}, 0, 0, 0
    inner, batch_saved = _backward_moments(s), _batch_saved(s)
    for kind, i in schedule_order(s.par.pp, stage, s.mb, schedule):
        grads = s.param_bytes if n_bwd else 0      # after the first backward every grad exists
        # the fp32 loss weights are filed as activations once a loss scaling saves them
        saved = batch_saved + (4 * s.mb if s.last and s.weight == 0 and n_fwd else 0)
        # the last stage's losses so far (and a backward's seed, d loss / d loss)
        extra = s.batch - saved + s.ddp_buckets + (n_fwd * s.loss_scalar if s.last else 0)
        extra += s.loss_scalar if kind == "B" and s.last else 0
        if kind == "F":
            moments[f"forward_end[{i}]"] = _forward_moment(s, n_held, grads, saved, extra)
            in_flight[f"forward_end[{i}]"] = n_held + 1
            n_held, n_fwd = n_held + 1, n_fwd + 1
            continue
        moved = n_held * s.held_temps
        for name, (new_grads, a, temp) in inner.items():
            moments[f"{name}[{i}]"] = (grads or new_grads, saved + (n_held - 1) * s.held + a - moved,
                                       extra + temp + moved)
            in_flight[f"{name}[{i}]"] = n_held
        n_held, n_bwd = n_held - 1, n_bwd + 1
    return moments, in_flight


def _optimizer_step(s: _Stage) -> tuple[int, int, int]:
    """AdamW (one tensor at a time): sqrt(exp_avg_sq) and denom of one parameter while the
    previous parameter's denom is still bound; the schedule's loss weights are gone, its reported
    loss not."""
    sizes = [0] + [s.b * _numel(shape) for shape in s.shapes.values()]
    scratch = max(2 * sizes[i] + sizes[i - 1] for i in range(1, len(sizes)))
    saved = _batch_saved(s)
    return (s.param_bytes, saved, scratch + s.batch - 4 * s.mb - saved + s.ddp_buckets
            + (s.loss_scalar if s.last else 0))


def _predict_stage(c: MiniMindConfig, par: ParallelConfig, stage: int, *, seq_len: int, micro_batch_size: int,
                   num_microbatches: int, schedule: str, dtype, device: str, cp_rank: int = 0) -> MemoryPrediction:
    """One pipeline stage (or the whole model when pp = 1) over a step, on CP rank `cp_rank`:
    every moment of the schedule that can hold the peak, each a sum of what is alive then."""
    s = _stage_sizes(c, par, stage, seq_len=seq_len, micro_batch_size=micro_batch_size,
                     num_microbatches=num_microbatches, schedule=schedule, dtype=as_dtype(dtype), cp_rank=cp_rank)
    params = s.param_bytes + 2 * s.b * c.max_position_embeddings * c.head_dim   # RoPE cos/sin, cast to dtype
    states = 2 * s.param_bytes + (4 * len(s.shapes) if device == "cpu" else 0)  # exp_avg, exp_avg_sq, step
    moments, in_flight = _replay_schedule(s, stage, schedule)
    moments["optimizer"] = _optimizer_step(s)
    totals = {k: params + states + sum(v) for k, v in moments.items()}
    peak_at = max(totals, key=totals.get)
    grads, act, temp = moments[peak_at]
    breakdown = dict(zip(CATEGORIES, (params, grads, states, act, temp)))
    return MemoryPrediction(peak_bytes=sum(breakdown.values()), breakdown=breakdown, activations_by_kind=s.kinds,
                            num_layers=s.layers, peak_at=peak_at, candidates=totals, held_per_microbatch=s.held,
                            held_at_peak=in_flight.get(peak_at, 0))
