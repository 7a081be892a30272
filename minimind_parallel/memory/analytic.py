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
    logits_loss      replicated head: log-softmax b M V + target copy 8 M (B > 1) + total weight b
                     VP: fp32 softmax f M V_t + local target 8 M + two masks 2 M + count 8

Alive all step: params and RoPE buffers, AdamW states, the batch (ids and labels [M B, S] int64
and the fp32 loss weights [M]), DDP's flat gradient buckets (pp = 1, dp > 1).

The peak is the largest of a few moments of the step, each a sum of what is alive then. A stage
runs its forwards F and backwards B in its schedule's order (`schedule_order`). At each one, the
microbatches still held keep what their forward saved (per microbatch: the stage's blocks, plus
on later stages the received input, on earlier ones the sent output deallocated to one element,
on the last the final norm, head input and loss). The first B finds no grads; every later one
accumulates into all of them. Within one microbatch's backward:
    head_backward        the loss gradients of the logits [M, V(/T)]
    head_mm_backward     lm_head's backward: grad of the logits padded to [N, V(/T)], the grads of
                         its weight and input (VP + SP + async: the re-gathered input too)
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
last stage's loss per finished forward and the backward's seed; 1F1B's loop keeps the grads it
received and sent last and the previous loss (whose graph keeps that microbatch's input). Last,
the optimizer step: all grads, and AdamW's sqrt and denom of the largest parameter while the
previous parameter's denom is still bound.

So 1F1B's first stage holds min(P, M) microbatches at its peak and GPipe's holds M. The moments
are those the tracker found on every configuration tried; tests/test_memory.py checks the model
against it to the byte, peak and breakdown, stage by stage.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import MiniMindConfig, ParallelConfig, check_layout
from ..plan import is_first_stage, is_last_stage, stage_layers, stage_parameters
from .tracker import CATEGORIES

BLOCK_KINDS = ("norm_fp32", "column_input", "qk_norm_fp32", "attention_q", "attention_kv", "attention_out", "mlp")
MODEL_KINDS = ("embedding", "final_norm", "head_input", "logits_loss")


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


def target_copy(micro_batch_size: int, targets: int) -> int:
    """The replicated head's int64 targets labels.t()[1:].reshape(-1): a copy, except with one
    sequence, where that is a view of the labels."""
    return 8 * targets if micro_batch_size > 1 else 0


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
        loss = b * m * c.vocab_size + target_copy(micro_batch_size, m) + b
        embedding = 8 * n
    model = {"embedding": embedding, "final_norm": 2 * f * nn_ * hid + f * nn_,
             "head_input": head_input, "logits_loss": loss}
    return {**{f"block.{k}": v for k, v in block.items()}, **{f"model.{k}": v for k, v in model.items()}}


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
                   stage: int | None = None) -> MemoryPrediction:
    """Predicted peak of a training step of `num_microbatches` microbatches of `micro_batch_size`
    sequences on the worst rank of pipeline stage `stage` (None: of the worst stage), with the
    breakdown of CATEGORIES. device="cuda" leaves out AdamW's step counters (they live on the CPU
    there). The prediction of every stage is in `per_stage`."""
    c = model_config
    if par.cp > 1:
        raise NotImplementedError("predict_memory: context parallelism not modelled yet")
    if not c.flash_attn:
        raise NotImplementedError("predict_memory: only the flash (scaled_dot_product_attention) path is modelled")
    check_layout(c, par, seq_len=seq_len)
    stages = [_predict_stage(c, par, p, seq_len=seq_len, micro_batch_size=micro_batch_size,
                             num_microbatches=num_microbatches, schedule=schedule, dtype=dtype, device=device)
              for p in range(par.pp)]
    pick = stages[stage] if stage is not None else max(stages, key=lambda s: s.peak_bytes)
    pick.per_stage = [s.peak_bytes for s in stages]
    return pick


def _predict_stage(c: MiniMindConfig, par: ParallelConfig, stage: int, *, seq_len: int, micro_batch_size: int,
                   num_microbatches: int, schedule: str, dtype, device: str) -> MemoryPrediction:
    """One pipeline stage (or the whole model when pp = 1) over a step: every moment of the
    schedule that can hold the peak, each a sum of what is alive then."""
    dtype = as_dtype(dtype)
    b = torch.empty((), dtype=dtype).element_size()
    f = max(b, 4)
    t, sp, vp = par.tp, par.sequence_parallel, par.vocab_parallel
    n, hid, bsz, mb = seq_len * micro_batch_size, c.hidden_size, micro_batch_size, num_microbatches
    nn_, m = (n // t if sp else n), n - bsz
    vocab = c.vocab_size // t if vp else c.vocab_size
    first, last = is_first_stage(stage), is_last_stage(stage, par.pp)
    gpipe = schedule == "gpipe" and par.pp > 1

    shapes = stage_parameters(c, par, stage)
    param_bytes = b * sum(_numel(s) for s in shapes.values())
    buffers = 2 * b * c.max_position_embeddings * c.head_dim          # RoPE cos/sin, cast to dtype
    params = param_bytes + buffers
    states = 2 * param_bytes + (4 * len(shapes) if device == "cpu" else 0)  # exp_avg, exp_avg_sq, step
    ddp_buckets = param_bytes if par.dp > 1 and par.pp == 1 else 0    # DDP's flat gradient buckets
    kinds = activations_by_kind(c, par, seq_len=seq_len, micro_batch_size=bsz, dtype=dtype)
    layers_at = stage_layers(c.num_hidden_layers, par.pp, stage)
    layers = len(layers_at)
    block = sum(v for k, v in kinds.items() if k.startswith("block."))
    # Alive all step, on every stage: the ids and labels [M*B, S] (split into microbatches there)
    # and the microbatches' loss weights (fp32 [M])
    batch = 16 * n * mb + 4 * mb
    loss_scalar = 4 if vp else b            # the last stage keeps one loss per forward (the report)
    weight = loss_scalar if loss_scalar != 4 else 0  # its loss weight cast to the loss dtype, saved

    # What one microbatch keeps from the end of its forward to its backward
    held = layers * block
    if first and vp:
        held += 9 * n                       # local ids and out-of-range mask (the ids are in `batch`)
    if last:
        held += kinds["model.final_norm"] + kinds["model.head_input"] + kinds["model.logits_loss"] + weight
    # not saved for backward, so temporaries to the tracker: the received input (the first norm saves
    # its fp32 copy instead) and the sent output, deallocated to one element
    held_temps = (b * nn_ * hid if not first and b != f else 0) + (0 if last else b)
    held += held_temps

    # One microbatch's backward at its largest moments: (grads it adds, its activations, temporaries)
    tied_here = c.tie_word_embeddings and first and last
    mlp_out, mlp_w_grad = kinds["block.mlp"] // 4, b * hid * (c.intermediate_size // t)  # [N, I/T]; down's W
    inner, head_grads, waiting, acts = {}, 0, 0, held
    if last:
        head_w_grad = b * vocab * hid
        # a tied weight's grad waits in autograd's buffer for the embedding's contribution
        head_grads, waiting = b * hid + (0 if tied_here else head_w_grad), (head_w_grad if tied_here else 0)
        if vp:   # the fp32 softmax clone and its cast to the model dtype; the count released
            inner["head_backward"] = (0, held - 8 - weight, f * m * vocab + (b * m * vocab if b != f else 0) + 4)
        else:    # grads of log-softmax and logits [M, V]; target copy and weight released
            inner["head_backward"] = (0, held - target_copy(bsz, m) - b - weight, 2 * b * m * vocab)
        # lm_head's backward: the grad of the logits padded back to [S, B, V(/T)], then the grads
        # of its weight (a .grad once accumulated) and of its input
        # (VP + SP + async: the input re-gathered from the saved shard, the input grad's
        # reduce-scatter issued before the weight grad)
        regather = b * n * hid + b * nn_ * hid if (vp and sp and par.async_communication) else 0
        inner["head_mm_backward"] = (0, held - weight - kinds["model.logits_loss"],
                                     b * n * vocab + head_w_grad + b * n * hid + regather)
        acts = held - weight - kinds["model.logits_loss"] - kinds["model.head_input"] - (f * nn_ * hid + f * nn_)
        inner["final_norm_backward"] = (head_grads, acts, 5 * f * nn_ * hid + waiting)
        acts -= f * nn_ * hid
    # the last block's down_proj backward: the grad of its output (gathered to the full sequence
    # under SP), the grads of its input and weight (the latter a .grad only after both mms)
    inner["down_backward"] = (head_grads, acts, (b * n * hid if sp else 0) + b * nn_ * hid + mlp_out + mlp_w_grad
                              + waiting)
    # at silu*up's backward: down's grad is in, the saved product freed, three [N, I/T] live
    inner["mlp_backward"] = (head_grads + mlp_w_grad, acts - mlp_out, 3 * mlp_out + b * nn_ * hid + waiting)
    # the post-attention RMSNorm's backward (the peak where I/T is small against H): the MLP's
    # grads in, its activations and its share of the column inputs freed, the norm's fp32
    # temporaries and the residual grad live
    basic_sp = sp and not par.shared_sp_gather and not par.async_communication   # one gather per linear
    gate_up_input = kinds["block.column_input"] * 2 // 5 if basic_sp else kinds["block.column_input"] // 2
    inner["post_norm_backward"] = (head_grads + 3 * mlp_w_grad + b * hid,
                                   acts - 4 * mlp_out - gate_up_input - (f * nn_ * hid + f * nn_),
                                   5 * f * nn_ * hid + b * nn_ * hid + waiting)
    # The same moments in the stage's first block: every block above has added its grads and freed
    # its activations. The top block holds the peak unless a block's parameters outweigh one
    # microbatch's activations of it (a few tokens per microbatch, or later backwards: never).
    block_params = b * sum(_numel(s) for k, s in shapes.items() if k.startswith(f"model.layers.{layers_at[0]}."))
    if len(layers_at) > 1:
        deeper = len(layers_at) - 1
        for name in ("down_backward", "mlp_backward", "post_norm_backward"):
            g, a, temp = inner[name]
            inner[f"{name}(first block)"] = (g + deeper * block_params, a - deeper * block, temp)
    if first:
        # the embedding's backward: its dense weight grad [V(/T), H] (a .grad once accumulated), the
        # grad of its output [N, H] (gathered from the sequence shards under SP), the received grad;
        # a weight tied within the stage then adds the waiting head grad to it (three [V, H])
        emb_w_grad = b * vocab * hid
        acts = (9 * n if vp else 0) + (0 if last else b)
        inner["embedding_backward"] = (param_bytes - emb_w_grad, acts, emb_w_grad + b * n * hid + waiting
                                       + (0 if last else b * nn_ * hid))
        if tied_here:
            inner["tied_grad_sum"] = (param_bytes - emb_w_grad, 0, 3 * emb_w_grad)  # the VP masks freed
    # the end of the last stage's forward, logits alive:
    #   replicated head: the loss's scaling by its weight -- everything saved, the loss and its
    #   scaled copy live (the weight cast to the loss dtype too);
    #   VP: inside the loss, its fp32 copy of the logits (the later softmax) and nine [M] vectors
    #   (max, masks, local target, target logit, sum of exp, its log, their difference), and the
    #   final norm's local output under basic/shared SP, still bound in the model's forward
    fwd_end = None
    if last and vp:
        local_h = b * nn_ * hid if sp and not par.async_communication else 0
        fwd_end = (held - weight - kinds["model.logits_loss"],
                   b * n * vocab + f * m * vocab + 30 * m + target_copy(bsz, m) + local_h)
    elif last:
        fwd_end = (held - weight, b * n * vocab + 2 * b + weight)

    # the end of an earlier stage's forward, at its last residual add: everything saved, plus
    # down_proj's output, the sum, and in half precision the block's input and middle residual
    # stream (their fp32 copies are what the norms save; a received input is counted as held)
    residual = 2 + (0 if b == f else 2 - (1 if not first and layers == 1 else 0))
    stage_end = None if last else (held - held_temps, residual * b * nn_ * hid)

    # The tracker files a storage under activations from the first time autograd saves it: the
    # ids once the embedding saves them, the fp32 loss weights once a loss scaling saves them
    batch_saved = 8 * n * mb if first and not vp else 0
    # (and the labels, when the replicated head's loss saves a view of them: one sequence)
    batch_saved += 8 * n * mb if last and not vp and bsz == 1 else 0
    moments, in_flight, n_held, n_fwd, n_bwd = {}, {}, 0, 0, 0
    for kind, i in schedule_order(par.pp, stage, mb, schedule):
        grads = param_bytes if n_bwd else 0      # after the first backward every grad exists
        saved = batch_saved + (4 * mb if last and weight == 0 and n_fwd else 0)
        # the last stage's losses so far (and a backward's seed, d loss / d loss); 1F1B keeps the
        # input grad it sent last until the next backward replaces it
        extra = batch - saved + ddp_buckets + (n_fwd * loss_scalar if last else 0)
        extra += loss_scalar if kind == "B" and last else 0
        extra += b * nn_ * hid if (n_bwd and not first and not gpipe) else 0
        if kind == "F":
            if stage_end is not None:
                # 1F1B's loop still binds the grad it received last
                previous_grad = b * nn_ * hid if (n_bwd and not gpipe) else 0
                # (this microbatch's output is not sent yet: no one-element stand-in for it)
                moments[f"forward_end[{i}]"] = (grads, saved + (n_held + 1) * stage_end[0],
                                                extra + (n_held + 1) * held_temps - b + stage_end[1] + previous_grad)
                in_flight[f"forward_end[{i}]"] = n_held + 1
            if fwd_end is not None:
                # 1F1B's loop still binds the previous loss: its graph keeps that microbatch's input
                # (saved for backward, so an activation, when the first norm's upcast is itself)
                previous = b * nn_ * hid if (n_bwd and not first and not gpipe) else 0
                previous_acts = previous if b == f else 0
                moved = (n_held + 1) * held_temps
                moments[f"forward_end[{i}]"] = (grads, saved + n_held * held + fwd_end[0] - moved + previous_acts,
                                                extra + fwd_end[1] + previous - previous_acts + moved)
                in_flight[f"forward_end[{i}]"] = n_held + 1
            n_held, n_fwd = n_held + 1, n_fwd + 1
            continue
        moved = n_held * held_temps
        for name, (new_grads, a, temp) in inner.items():
            moments[f"{name}[{i}]"] = (grads or new_grads, saved + (n_held - 1) * held + a - moved, extra + temp + moved)
            in_flight[f"{name}[{i}]"] = n_held
        n_held, n_bwd = n_held - 1, n_bwd + 1
    # AdamW (one tensor at a time): sqrt(exp_avg_sq) and denom of one parameter while the previous
    # parameter's denom is still bound; the schedule's loss weights are gone, its reported loss not
    sizes = [0] + [b * _numel(s) for s in shapes.values()]
    scratch = max(2 * sizes[i] + sizes[i - 1] for i in range(1, len(sizes)))
    moments["optimizer"] = (param_bytes, batch_saved, scratch + batch - 4 * mb - batch_saved + ddp_buckets
                            + (loss_scalar if last else 0))

    totals = {k: params + states + sum(v) for k, v in moments.items()}
    peak_at = max(totals, key=totals.get)
    grads, act, temp = moments[peak_at]
    breakdown = dict(zip(CATEGORIES, (params, grads, states, act, temp)))
    return MemoryPrediction(peak_bytes=sum(breakdown.values()), breakdown=breakdown, activations_by_kind=kinds,
                            num_layers=layers, peak_at=peak_at, candidates=totals, held_per_microbatch=held,
                            held_at_peak=in_flight.get(peak_at, 0))
