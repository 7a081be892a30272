"""One microbatch's backward at its largest moments, each (grads it adds, its activations,
temporaries); `backward_moments` lists them in the order they happen:

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

--loss_chunks K: the head's moments become the chunked loss's backward (`_chunked_loss_backward`);
--recompute: the lean MLP's and norm's (`_swiglu_backward`, `_lean_post_norm_backward`). Under
context parallelism a block's attention backward is one more (cp_attention_moments.py).
"""
from __future__ import annotations

from ...config import CPCommType, Recompute
from .cp_attention_moments import chunked_attention_backward, ring_attention_backward
from .moe_backward_moments import moe_block_moments
from .saved_kinds import target_copy
from .stage_sizes import StageSizes, chunk_rows, top_block_acts, top_block_saved


def _head_backward(s: StageSizes) -> tuple[int, int, int]:
    """The loss gradients of the logits [N, V(/T)]."""
    b, f, n, v = s.b, s.f, s.n, s.vocab
    if s.par.vocab_parallel:   # the fp32 softmax clone and its cast to the model dtype; the count released
        return 0, s.held - 8 - s.weight, f * n * v + (b * n * v if b != f else 0) + 4
    # grads of log-softmax and logits [N, V]; target copy and weight (CP: the target count) released
    count = 8 if s.par.cp > 1 else 0
    return 0, s.held - target_copy(s.bsz, n) - b - s.weight - count, 2 * b * n * v


def _chunked_loss_backward(s: StageSizes) -> tuple[int, int, int]:
    """--loss_chunks K (`recompute.chunked_loss`): the head input's grad [N, H] and the weight's
    [V(/T), H] allocated, a chunk's recomputed logits [r, V(/T)] and their work-dtype softmax
    while the previous chunk's logits grad (model dtype) and its target index and masks (int64,
    two bools per row) are still bound; the target count released, the loss's grad (f) in."""
    b, f, v = s.b, s.f, s.vocab
    rows = chunk_rows(s.n, s.par.loss_chunks)
    prev_g = b if b != f else f                  # g = softmax.to(model dtype): the softmax itself in fp32

    def chunk(r: int) -> int:
        return b * r * v + (f * r * v if b != f else 0)

    # fp32: the logits are the softmax, so the largest moment is the target masks' making (19 r
    # bytes: `chunked_loss._targets`, the previous chunk's still bound)
    masks = 19 if b == f else 0
    worst = max([chunk(rows[0]) + masks * rows[0]]
                + [chunk(r) + masks * r + prev_g * p * v + 10 * p for p, r in zip(rows, rows[1:])])
    return 0, s.held - 8 - s.weight, b * s.n * s.hid + b * v * s.hid + worst + f


def _head_mm_backward(s: StageSizes) -> tuple[int, int, int]:
    """lm_head's backward: the grad of the logits [S, B, V(/T)], then the grads of its weight (a
    .grad once accumulated) and of its input (VP + SP + async: the input re-gathered from the
    saved shard, the input grad's reduce-scatter issued before the weight grad)."""
    b, n, hid, par = s.b, s.n, s.hid, s.par
    regather = b * n * hid + b * s.nn * hid if (par.vocab_parallel and par.sequence_parallel
                                                and par.async_communication) else 0
    return 0, s.held - s.weight - s.kinds["model.logits_loss"], b * n * s.vocab + s.head_w_grad + b * n * hid + regather


def _final_norm_backward(s: StageSizes) -> tuple[int, int, int]:
    """The final RMSNorm's fp32 temporaries (5 f Nn H)."""
    f, nn_, hid = s.f, s.nn, s.hid
    if s.par.recompute.lean:
        # lean (one Function): its input and rsqrt still saved; the incoming grad bound through
        # its backward; 3 f Nn H, the row means and its weight grad (not yet a .grad)
        grad_in = s.b * nn_ * hid
        return (s.head_grads - s.b * hid, top_block_acts(s) + s.kinds["model.final_norm"],
                grad_in + 3 * f * nn_ * hid + f * nn_ + s.b * hid + s.waiting)
    return s.head_grads, top_block_acts(s) + f * nn_ * hid, 5 * f * nn_ * hid + s.waiting


def _down_backward(s: StageSizes) -> tuple[int, int, int]:
    """The last block's down_proj: the grad of its output (gathered to the full sequence under
    SP), the grads of its input and weight (the latter a .grad only after both mms)."""
    b, hid = s.b, s.hid
    gathered = b * s.n * hid if s.par.sequence_parallel else 0
    return s.head_grads, top_block_acts(s), gathered + b * s.nn * hid + s.mlp_out + s.mlp_w_grad + s.waiting


def _mlp_backward(s: StageSizes) -> tuple[int, int, int]:
    """At silu*up's backward: down's grad is in, the saved product freed, three [N, I/T] live."""
    return (s.head_grads + s.mlp_w_grad, top_block_acts(s) - s.mlp_out,
            3 * s.mlp_out + s.b * s.nn * s.hid + s.waiting)


def _mlp_input_backward(s: StageSizes) -> tuple[int, int, int]:
    """gate_proj's input grad made (the MLP's last mm): the three weight grads in, up's input grad
    [N, H] (the full sequence under SP) still apart from it, the grad of gate's output [N, I/T]
    still bound; the MLP's four [N, I/T] freed (under basic SP up's own gathered input too), the
    residual grad live. (A few tokens per microbatch: the weight grads outweigh the norm's fp32
    temporaries.)"""
    b, par = s.b, s.par
    basic_sp = par.sequence_parallel and not par.shared_sp_gather and not par.async_communication
    up_input = s.gate_up_input // 2 if basic_sp else 0
    return (s.head_grads + 3 * s.mlp_w_grad, top_block_acts(s) - 4 * s.mlp_out - up_input,
            s.mlp_out + 2 * b * s.n * s.hid + b * s.nn * s.hid + s.waiting)


def _post_norm_backward(s: StageSizes) -> tuple[int, int, int]:
    """The post-attention RMSNorm's backward (the peak where I/T is small against H): the MLP's
    grads in, its activations and its share of the column inputs freed, the norm's fp32
    temporaries and the residual grad live."""
    b, f, nn_, hid = s.b, s.f, s.nn, s.hid
    return (s.head_grads + 3 * s.mlp_w_grad + b * hid,
            top_block_acts(s) - 4 * s.mlp_out - s.gate_up_input - (f * nn_ * hid + f * nn_),
            5 * f * nn_ * hid + b * nn_ * hid + s.waiting)


def _lean_post_norm_rest(s: StageSizes, saved: tuple[int, int]) -> tuple[int, int]:
    acts, redone = saved
    f, b, nn_, hid = s.f, s.b, s.nn, s.hid
    return acts, 3 * f * nn_ * hid + f * nn_ + b * hid + 2 * b * nn_ * hid + s.waiting + redone


def _swiglu_backward(s: StageSizes) -> tuple[int, int, int]:
    """Lean MLP (`recompute.swiglu_linear`): inside its backward, down's output grad (gathered
    under SP) and the residual grad in, down's weight grad made, three [N, I/T] live (the grad of
    the product, reused in place, dup and dgate); gate and up still saved."""
    b, hid = s.b, s.hid
    gathered = b * s.n * hid if s.par.sequence_parallel else 0
    acts, redone = top_block_saved(s, 0)
    return s.head_grads, acts, gathered + b * s.nn * hid + 3 * s.mlp_out + s.mlp_w_grad + s.waiting + redone


def _lean_post_norm_backward(s: StageSizes) -> tuple[int, int, int]:
    """Lean post-attention RMSNorm (`recompute.lean_rms_norm`) at its largest: the recomputed
    normed input, g w and their product (3 f Nn H), the row means (f Nn) and its weight grad
    (b H), the grads of its output and of the residual stream ([Nn, H] each); the MLP's grads
    in, its activations and its share of the column inputs freed, the norm's own input and rsqrt
    still saved."""
    par, b, hid = s.par, s.b, s.hid
    # under SP one more [H] grad is in by then: measured with StorageTracker(detail=True) (docs/memory.md),
    # not derived; no layout of tests/test_memory.py has this moment at its peak under SP, so no test pins it
    return (s.head_grads + 3 * s.mlp_w_grad + (b * hid if par.sequence_parallel else 0),
            *_lean_post_norm_rest(s, top_block_saved(s, 2 * s.mlp_out + s.gate_up_input)))


def _in_first_block(s: StageSizes, moment: tuple[int, int, int], received_counted: bool) -> tuple[int, int, int]:
    """A moment of the top block, in the stage's first block: every block above has added its
    grads and freed its activations. The top block holds the peak unless a block's parameters
    outweigh one microbatch's activations of it (a few tokens per microbatch, or --recompute
    full). On an earlier stage the top block's residual grad is the received grad itself; lower
    down it is another tensor, the received one still bound by the schedule (unless the moment
    counts both already: `received_counted`)."""
    grads, acts, temps = moment
    deeper = s.layers - 1
    received = s.b * s.nn * s.hid if not s.last and not received_counted else 0
    routed_acts, routed_temps = _routed_shift(s, ffn_freed=received_counted)
    return grads + deeper * s.block_params, acts - deeper * s.block + routed_acts, temps + received + routed_temps


def _routed_shift(s: StageSizes, *, ffn_freed: bool) -> tuple[int, int]:
    """(activations, temporaries) by which a moment in the first block differs from the top
    block's under a routing other than the balanced one (`StageSizes.routed`, per layer): the
    blocks above keep no MoE tensors any more, the first block its own (none once its MoE layer's
    backward is done: `ffn_freed`); --recompute full: the first block's re-run in place of the top's."""
    r = s.routed
    if not r:
        return 0, 0
    if s.par.recompute == Recompute.FULL:
        return 0, (0 if ffn_freed else r[0] - r[-1])
    return -(sum(r[:-1]) if ffn_freed else sum(r[1:])), 0


def _embedding_backward(s: StageSizes) -> tuple[int, int, int]:
    """The embedding's dense weight grad [V(/T), H] (a .grad once accumulated), the grad of its
    output [N, H] (gathered from the sequence shards under SP) and the received grad."""
    b, hid = s.b, s.hid
    emb_w_grad = b * s.vocab * hid
    # VP: the local ids (int64) still saved; the out-of-range mask went with the masked_fill's backward
    acts = (8 * s.n if s.par.vocab_parallel else 0) + s.held_temps   # (the first stage's: the sent output)
    return (s.param_bytes - emb_w_grad, acts,
            emb_w_grad + b * s.n * hid + s.waiting + (0 if s.last else b * s.nn * hid))


def _tied_grad_sum(s: StageSizes) -> tuple[int, int, int]:
    """A weight tied within the stage adds the waiting head grad to the embedding's: three [V, H]
    (the VP masks freed)."""
    emb_w_grad = s.b * s.vocab * s.hid
    return s.param_bytes - emb_w_grad, s.cp_scaled_loss, 3 * emb_w_grad


def backward_moments(s: StageSizes) -> dict[str, tuple[int, int, int]]:
    """One microbatch's backward at its largest moments, in the order they happen."""
    inner = {}
    if s.last and s.par.loss_chunks > 1:
        inner.update(chunked_loss_backward=_chunked_loss_backward(s), final_norm_backward=_final_norm_backward(s))
    elif s.last:
        inner.update(head_backward=_head_backward(s), head_mm_backward=_head_mm_backward(s),
                     final_norm_backward=_final_norm_backward(s))
    if s.expert_rows:
        top = moe_block_moments(s, s.expert_rows[-1], first=s.layers == 1)
    elif s.par.recompute.lean:
        top = {"swiglu_backward": _swiglu_backward(s), "post_norm_backward": _lean_post_norm_backward(s)}
    else:
        top = {"down_backward": _down_backward(s), "mlp_backward": _mlp_backward(s),
               **({} if s.par.async_communication else {"mlp_input_backward": _mlp_input_backward(s)}),
               "post_norm_backward": _post_norm_backward(s)}
    if s.par.cp > 1:
        top["attention_backward"] = (ring_attention_backward(s) if s.par.cp_comm_type == CPCommType.RING
                                    else chunked_attention_backward(s))
    inner.update(top)
    if s.layers > 1:
        # MoE: the first layer's own routing (its rows per expert) and its aux loss's last grad
        first = ({**moe_block_moments(s, s.expert_rows[0], first=True),
                  **({"attention_backward": top["attention_backward"]} if "attention_backward" in top else {})}
                 if s.expert_rows else top)
        inner.update({f"{name}(first block)": _in_first_block(s, moment, name == "attention_backward")
                      for name, moment in first.items()})
    if s.first:
        inner["embedding_backward"] = _embedding_backward(s)
    if s.first and s.tied_here:
        inner["tied_grad_sum"] = _tied_grad_sum(s)
    return _after_the_aux_losses(s, inner)


def _after_the_aux_losses(s: StageSizes, inner: dict) -> dict:
    """The moments after the stage's first MoE layer's aux loss has run its backward (that
    layer's attention, the embedding's, the tied grads' sum): the grad of the stage's summed aux
    loss (f, which the stacked layers' sum hands each layer a view of) is freed. (The first
    layer's own MoE moments count it already: moe_backward_moments.)"""
    if not s.aux_loss_experts:
        return inner
    attention = "attention_backward" if s.layers == 1 else "attention_backward(first block)"
    after = (attention, "embedding_backward", "tied_grad_sum")
    return {name: (g, a, t - s.f) if name in after else (g, a, t) for name, (g, a, t) in inner.items()}
