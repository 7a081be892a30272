"""An MoE layer's own backward at its largest moments (the top block's; `backward_moments` moves
them to the stage's first block), each (grads it adds, activations, temporaries).

Autograd runs the layer backward from its output (moe/feed_forward.py, moe/experts.py):

    weighting_backward    the aux loss's backward done (below), the weighted output freed; the
                          weighting's backward at its sum: the grads of the weighted output, of
                          the experts' output and their product [R, H] each, the weights' grad [R]
    start                 the layer's aux loss's backward done (its saved N and load freed, the
                          grad of its score sums [E] waiting for the router's backward);
                          index_add_'s and the weighting's backward done: the weighted and the
                          experts' output [R, H], the sorted weights [R] and the sort's order
                          freed (EP: the combine's backward too, its index [M] freed); the grad of
                          the experts' output [M, H] and of the routing weights [R] live
    combine_backward      EP: inside the combine's backward, before `start`: the reverse
                          all-to-all's grad [M, H], the zeroed [M, H] and index_add's output (the
                          experts' output grad) live, the regroup index not freed yet; above the
                          weighting's when a skewed routing sends this rank more rows (M > R)
    per local expert, the last one first (its nodes are the newest), m rows of the M received:
      down_backward       down_proj's weight grad [H, I_e] and input grad [m, I_e]
      swiglu_backward     the product freed, the grads of silu and up [m, I_e] (the last expert:
                          the experts' output grad [M, H] freed)
      up_backward         silu and up freed, up_proj's input grad [m, H], silu's backward out
      gate_backward       gate out freed, gate_proj's weight grad and input grad [m, H]
    each expert leaves its three weight grads and its input grad [m, H] (until the concat), and
    frees what it saved (4 b m I_e)
    router_backward       --recompute selective: the router's weight grad, at the
                          post-attention norm's output re-made for it (the experts' grads in)
    post_norm_backward    the router's and experts' grads in, the layer's saved tensors and the
                          router's input freed, the post-attention norm's fp32 temporaries
                          (selective: the lean norm's, as the dense model's)

The rows per expert: the balanced split (--estimate's: the loop splits the M rows evenly), or a
measured histogram's (StageSizes.expert_rows, per layer).
"""
from __future__ import annotations

from ...config import Recompute
from .stage_sizes import StageSizes, top_block_saved


def weighting_backward(s: StageSizes, *, first: bool) -> tuple[int, int, int]:
    """The first moment of the layer's backward after its aux loss's: the weighting's backward
    (`out * weights`), at the sum that reduces the weights' grad to [R, 1] -- the grad of the
    weighted output [R, H] (index_add_'s backward), of the experts' output and the product with
    it (two more [R, H]) and the sum [R] live beside the incoming grad [Nn, H]; the aux loss's N
    and load and the weighted output (index_add_'s backward done) freed. Holds the peak where the
    experts' tensors are small (few tokens, a narrow I_e)."""
    b, hid, r = s.b, s.hid, s.routed_rows
    aux_saved, aux_grad = s.aux_backward
    acts, redone = top_block_saved(s, aux_saved + b * r * hid)
    # --recompute full: without the weights' grad [R] (measured against --estimate at one rank and
    # tp2, float32 and bfloat16, 2 and 5 microbatches; not derived)
    weights_grad = 0 if s.par.recompute == Recompute.FULL else b * r
    temps = (b * s.nn * hid + 3 * b * r * hid + weights_grad + s.waiting + aux_grad
             - (s.f if first and aux_grad else 0))
    return s.head_grads, acts, temps + redone


def expert_moments(s: StageSizes, rows: tuple[int, ...], *, first: bool) -> dict[str, tuple[int, int, int]]:
    """The top block's experts' backward, `rows`: the rows of each local expert (M in all);
    `first`: the stage's first layer, whose aux loss's backward frees the grad of the stage's
    summed aux loss (f: the stacked layers' sum hands each a view of it)."""
    b, hid, inter, r = s.b, s.hid, s.expert_inter, s.routed_rows
    m_all = sum(rows)
    index = 8 * m_all if s.par.ep > 1 else 0          # the combine's regroup index, freed
    grads = s.head_grads
    aux_saved, aux_grad = s.aux_backward
    start = 2 * b * r * hid + b * r + 8 * r + index + aux_saved    # freed before the first expert
    temps = b * s.nn * hid + b * m_all * hid + b * r + s.waiting + aux_grad - (s.f if first and aux_grad else 0)
    w = b * hid * inter
    out = {}

    def moment(grads: int, freed: int, live: int) -> tuple[int, int, int]:
        acts, redone = top_block_saved(s, start + freed)       # --recompute full: the re-run's
        return grads, acts, temps + live + redone

    if index:   # EP: the combine's backward, its regroup undone into a zeroed [M, H] (the received grad alive)
        out["combine_backward"] = moment(grads, -index, 2 * b * m_all * hid)
    grads, freed = s.head_grads, 0
    for j in reversed(range(len(rows))):
        m, out_grad = rows[j], (b * m_all * hid if j == 0 else 0)
        mi, mh = b * m * inter, b * m * hid
        out[f"expert_down_backward(e{j})"] = moment(grads, freed, w + mi)
        out[f"expert_swiglu_backward(e{j})"] = moment(grads + w, freed + mi, 3 * mi - out_grad)
        out[f"expert_up_backward(e{j})"] = moment(grads + 2 * w, freed + 3 * mi, 2 * mi + mh - out_grad)
        out[f"expert_gate_backward(e{j})"] = moment(grads + 2 * w, freed + 4 * mi, mi + 2 * mh + w - out_grad)
        grads, freed, temps = grads + 3 * w, freed + 4 * mi, temps + mh
    # the gather's backward (flat[token_of]): every expert's weight grads in and its saved tensors
    # freed (their input [M, H] too), the experts' output grad gone; the input grads concatenated
    # [M, H], then scattered into a zeroed [N, H]: zeros and index_put's output
    acts, redone = top_block_saved(s, start + freed + b * m_all * hid)
    out["expert_gather_backward"] = (grads, acts, temps + b * s.nn * hid + redone)
    return out


def moe_post_norm_backward(s: StageSizes, *, first: bool) -> tuple[int, int, int]:
    """The post-attention RMSNorm's backward after the MoE layer's: its grads in (the router's and
    this rank's experts'), its saved tensors and the router's input freed, the norm's fp32
    temporaries and the residual grad live."""
    b, f, nn_, hid = s.b, s.f, s.nn, s.hid
    if s.par.recompute == Recompute.SELECTIVE:
        return _lean_post_norm_backward(s, first=first)
    # (ffn_saved, the layer's "block.moe", holds the aux loss's N and load already)
    acts, redone = top_block_saved(s, s.ffn_saved + s.router_input + (f * nn_ * hid + f * nn_))
    weight_grad, rerun = b * hid, _rerun_post_norm(s)
    return (s.head_grads + s.ffn_w_grads + (0 if rerun else weight_grad), acts,
            5 * f * nn_ * hid + b * nn_ * hid + s.waiting - (f if first and s.aux_loss_experts else 0) + redone + rerun)


def _lean_post_norm_backward(s: StageSizes, *, first: bool) -> tuple[int, int, int]:
    """--recompute selective: the lean post-attention norm (`recompute.lean_rms_norm`, its input and
    rsqrt saved) in its backward, as the dense model's (backward_moments._lean_post_norm_backward):
    the recomputed normed input, g w and their product (3 f Nn H), the row means (f Nn), its
    weight grad (b H, not a grad yet), its output's grad and the residual grad ([Nn, H] each); the
    router's and experts' grads in, the layer's saved tensors freed, the norm's own still saved."""
    b, f, nn_, hid = s.b, s.f, s.nn, s.hid
    acts, _ = top_block_saved(s, s.ffn_saved + s.router_input)
    return (s.head_grads + s.ffn_w_grads, acts,
            3 * f * nn_ * hid + f * nn_ + b * hid + 2 * b * nn_ * hid + s.waiting
            - (f if first and s.aux_loss_experts else 0))


def router_backward(s: StageSizes, *, first: bool) -> tuple[int, int, int]:
    """--recompute selective: the router's weight grad needs the post-attention norm's output,
    re-made from the norm's input (`recompute/norm_recompute.py`): at g w * (x rsqrt), the fp32
    copy of the input (half precision only), x rsqrt and the product (f Nn H each) and the rsqrt
    (f Nn) live beside the router logits' grad [Nm, E], the experts' input grad scattered to [Nn, H]
    and the residual grad; the experts' grads in, the router's not yet. Above the norm's own
    backward in half precision (Nm E > H (E + 1))."""
    b, f, nn_, hid = s.b, s.f, s.nn, s.hid
    grads, acts, temps = _lean_post_norm_backward(s, first=first)
    router_w_grad = s.ffn_w_grads - 3 * b * hid * s.expert_inter * len(s.expert_rows[-1])   # [E, H]
    experts = router_w_grad // (b * hid)
    return (grads - router_w_grad, acts, temps - b * hid - (f * nn_ * hid if b == f else 0) + b * nn_ * experts)


def _rerun_post_norm(s: StageSizes) -> int:
    """--recompute full: what the post-attention norm's backward holds beyond the moment above
    when its block was re-run (0 otherwise): its weight grad [H] not yet accumulated (a
    temporary, not a grad), its row means and rsqrt [Nn] (f each) still alive, and in half
    precision one [Nn, H] fewer. Measured against --estimate (StorageTracker's timeline at the
    norm's mean backward: bf16 and fp32, one and two microbatches, an earlier pipeline stage, SP
    with and without the async linear), not derived."""
    if s.par.recompute != Recompute.FULL:
        return 0
    b, f, nn_, hid = s.b, s.f, s.nn, s.hid
    return b * hid + 2 * f * nn_ - (b * nn_ * hid if b != f else 0)


def moe_block_moments(s: StageSizes, rows: tuple[int, ...], *, first: bool) -> dict[str, tuple[int, int, int]]:
    """Every moment of the top block's MoE backward listed above (`first`: see expert_moments)."""
    return {"weighting_backward": weighting_backward(s, first=first), **expert_moments(s, rows, first=first),
            **({"router_backward": router_backward(s, first=first)} if s.par.recompute == Recompute.SELECTIVE else {}),
            "post_norm_backward": moe_post_norm_backward(s, first=first)}
