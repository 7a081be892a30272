"""ZB-H1's B and W steps (Qi et al. 2023, "Zero Bubble Pipeline Parallelism";
tensor_parallel/deferred_wgrad.py), with TP, SP (basic, shared gather, async), VP, DP,
--zero 1, CP (ring, all_gather, a2a), --loss_chunks, --recompute selective|full
(`_lean_block`, `_full_block`, `_lean_moments`) and MiniMind's MoE model (`_moe_mlp`, `_moe_moments`).

B is the 1F1B backward (backward_moments.py) without the deferred linears' weight grads, and
each deferred linear keeps its output grad dY and saved input X from its backward until the
unit's W (`pending`): per block q, o, down's dY [N, H], k, v's [N, kv d], gate, up's [N, I]
(temporaries) and the inputs of q/k/v and of gate/up [N, H] each, o's [N, H], down's [N, I]
(activations, as saved; under basic SP each column linear its own gathered [N, H]); the
lm_head's on the last stage, dY [N, V(/T)] and X [N, H] (not under --loss_chunks K > 1: the
chunked loss's fused Function makes the head's weight grad in B). Under TP the sizes are this
rank's. Under CP a block's attention backward is one more moment of B (`_attention`).
W runs the unit's closures in the order B queued them (`closures`); each makes its weight's
grad [out, in] (a .grad on the first W, added and freed on later ones) and frees its dY, and X
once the last linear reading it is done.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...config import CPCommType, Recompute
from .backward_moments import _in_first_block
from .cp_attention_moments import _attention_grads_acts, _residual_grads
from .stage_sizes import StageSizes, top_block_acts


@dataclass(frozen=True)
class Closure:
    w: int      # its weight's grad
    dy: int     # its output grad, freed when it finishes
    x: int      # the input it frees when it finishes (0: a later closure reads it too)
    gather: int = 0   # the async linear: its saved shard gathered again [N, H] while its wgrad is made


def _block(s: StageSizes) -> list[Closure]:
    """One block's closures, in B's order: down, up, gate (X: the post-attention norm's output,
    freed with the second), o, v, k, q (X: the attention norm's output, freed with the third; autograd runs the
    later-made linear's backward first)."""
    b, n, h, i, par = s.b, s.n, s.hid, s.inter, s.par
    qd, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    # basic SP gathers the input once per column linear: each keeps its own [N, H]; the async
    # linear keeps the local shard [N/T, H] (shared), gathered again in W
    async_ = par.async_communication
    own = b * n * h if par.sequence_parallel and not par.shared_sp_gather and not async_ else 0
    col, g = (b * s.nn * h, b * n * h) if async_ else (b * n * h, 0)
    if par.recompute == Recompute.FULL:
        return _moe_mlp(s, _full_block(s, own, col, g))
    if par.recompute.lean:
        return _moe_mlp(s, _lean_block(s, own, g))
    return _moe_mlp(s, [Closure(b * h * i, b * n * h, b * n * i), Closure(b * i * h, b * n * i, own, g),
            Closure(b * i * h, b * n * i, col, g), Closure(b * h * qd, b * n * h, b * n * qd),
            Closure(b * kv * h, b * n * kv + _joint_kv_grad(s), own, g), Closure(b * kv * h, b * n * kv, own, g),
            Closure(b * qd * h, b * n * qd, col, g)])


def _moe_mlp(s: StageSizes, block: list[Closure]) -> list[Closure]:
    """The MoE model: the router and the experts are whole nn.Linear layers (styles.py), whose weight
    grads autograd makes in B; the block's closures are the attention's (o, v, k, q), the MLP's
    three kept as closures of nothing for the order."""
    return [Closure(0, 0, 0)] * 3 + block[3:] if s.top_k else block


def _full_block(s: StageSizes, own: int, col: int, g: int) -> list[Closure]:
    """--recompute full: the block's re-run in B saves under the checkpoint's hooks, so every
    input a closure keeps to W is a temporary (counted with its dY): gate/up's and q/k/v's shared
    norm output (basic SP: each its own gathered copy) and o's input; down_proj's grad is made in
    B (SwiGLU recompute)."""
    b, n, h, i = s.b, s.n, s.hid, s.inter
    qd, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return [Closure(0, 0, 0), Closure(b * i * h, b * n * i + own, 0, g), Closure(b * i * h, b * n * i + col, 0, g),
            Closure(b * h * qd, b * n * h + b * n * qd, 0), Closure(b * kv * h, b * n * kv + own + _joint_kv_grad(s), 0, g),
            Closure(b * kv * h, b * n * kv + own, 0, g), Closure(b * qd * h, b * n * qd + col, 0, g)]


def _lean_block(s: StageSizes, own: int, g: int) -> list[Closure]:
    """--recompute selective: down_proj's weight is inside SwiGLU recompute's fused Function, so
    its grad is made in B (a closure of nothing, kept for the order). Where a column linear's
    input is the norm's output itself (no SP: [N, H]; SP + async: the local shard [N/T, H]) each
    of q, k, v, gate and up re-makes it in B (`recompute.norm_recompute`), each unpack its own
    copy, a temporary the closure keeps to W; basic SP's gathered copies are saved as usual."""
    b, n, h, i, par = s.b, s.n, s.hid, s.inter, s.par
    qd, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    sp, async_ = par.sequence_parallel, par.async_communication
    each = b * s.nn * h if not sp or async_ else 0     # re-made per linear
    last = b * n * h if sp and par.shared_sp_gather else own
    return [Closure(0, 0, 0), Closure(b * i * h, b * n * i + each, own, g),
            Closure(b * i * h, b * n * i + each, last, g), Closure(b * h * qd, b * n * h, b * n * qd),
            Closure(b * kv * h, b * n * kv + each + _joint_kv_grad(s), own, g),
            Closure(b * kv * h, b * n * kv + each, own, g), Closure(b * qd * h, b * n * qd + each, last, g)]


def _joint_kv_grad(s: StageSizes) -> int:
    """CP with one kv head on this rank: v_proj's dY [N, kv d] is a view of the grad of K and V
    together, [N, 2 kv d] (all_gather: the reduce-scattered grad of their concatenation; ring in
    fp32: the dK/dV accumulator, `ring.RingAttention`), so it keeps k's half alive to its W too.
    With more kv heads (or a2a's head split) the view is not one and autograd copies dY out."""
    par = s.par
    if par.cp == 1 or s.kv_heads != 1:
        return 0
    joint = par.cp_comm_type == CPCommType.ALL_GATHER or (par.cp_comm_type == CPCommType.RING and s.b == s.f)
    return s.b * s.n * s.head_dim if joint else 0


def closures(s: StageSizes) -> list[Closure]:
    """One unit's W closures, in the order its B queued them: the head, then each block top-down;
    a later stage's received input goes with the last."""
    x_head, dy_head = head_pending(s)
    par = s.par
    regather = s.b * s.n * s.hid if par.vocab_parallel and par.sequence_parallel and par.async_communication else 0
    head = [Closure(s.head_w_grad, dy_head, x_head, regather)] if head_deferred(s) else []
    block = _block(s)
    acts, temps = received_pending(s)
    last = Closure(block[-1].w, block[-1].dy + temps, block[-1].x + acts, block[-1].gather)
    return head + block * (s.layers - 1) + block[:-1] + [last]


def head_pending(s: StageSizes) -> tuple[int, int]:
    """(X, dY) the last stage's lm_head keeps from B to W: its saved input [N, H] (VP + SP + async:
    the shard [N/T, H]), the logits' grad [N, V(/T)]."""
    return (s.kinds["model.head_input"], s.b * s.n * s.vocab) if head_deferred(s) else (0, 0)


def head_deferred(s: StageSizes) -> bool:
    """Whether the stage's lm_head defers its weight grad: the last stage's, but for --loss_chunks
    K > 1, whose fused Function (`recompute.chunked_loss`) makes the head's weight grad in B."""
    return s.last and s.par.loss_chunks == 1


def _head_grads(s: StageSizes) -> int:
    """The grads the head's backward leaves in B: the final norm's, and lm_head's unless deferred."""
    return s.head_grads - (s.head_w_grad if head_deferred(s) else 0)


def received_pending(s: StageSizes) -> tuple[int, int]:
    """(activations, temporaries): a later stage's received input [N, H], alive until the W (the
    first norm's saved input in fp32 and under the lean norm, which saves it as it is; in half
    precision the plain norm saves an fp32 copy)."""
    if s.first:
        return 0, 0
    one = s.b * s.nn * s.hid
    return (one, 0) if s.b == s.f or s.par.recompute.lean else (0, one)


def block_pending(s: StageSizes) -> tuple[int, int]:
    """(X, dY) one block keeps from its B to its W."""
    block = _block(s)
    return sum(c.x for c in block), sum(c.dy for c in block)


def pending(s: StageSizes) -> tuple[int, int]:
    """(X, dY) one unit keeps from its B to its W: activations, temporaries."""
    return sum(c.x for c in closures(s)), sum(c.dy for c in closures(s))


def deferred_grads(s: StageSizes) -> int:
    """The weight grads W makes (none before the stage's first W)."""
    return sum(c.w for c in closures(s))


def zb_backward_moments(s: StageSizes, inner: dict) -> dict:
    """B's moments, from the 1F1B backward's (`inner`, backward_moments): (grads it adds,
    activations, temporaries)."""
    b, f, nn_, h = s.b, s.f, s.nn, s.hid
    head_x, head_dy = head_pending(s)
    norm_grad = _head_grads(s)
    x_block, dy_block = block_pending(s)
    top = top_block_acts(s) + head_x
    # under SP down_proj's output grad is gathered [N, H], apart from the residual stream's grad
    down_dy = b * s.n * h if s.par.sequence_parallel else 0
    # without SP the top block's down_proj dY is an earlier stage's received grad, which the 1F1B
    # moments below the top block count as still bound by the schedule
    received = b * nn_ * h if not s.last and not s.par.sequence_parallel else 0
    if s.top_k:
        return _moe_moments(s, inner)
    if s.par.recompute.lean:
        return _lean_moments(s, inner)
    out = {}
    for name, (g, a, t) in inner.items():
        if name == "head_mm_backward":
            out[name] = (g, a, t - s.head_w_grad)
        elif name == "final_norm_backward":
            out[name] = (norm_grad, a + head_x, t + head_dy)
        elif name.startswith("down_backward"):
            out[name] = (norm_grad, top, t - s.mlp_w_grad + head_dy)
        elif name.startswith("mlp_backward"):
            out[name] = (norm_grad, top, 3 * s.mlp_out + b * nn_ * h + down_dy + head_dy)
        elif name.startswith("post_norm_backward"):
            out[name] = (norm_grad + b * h, top - 3 * s.mlp_out - (f * nn_ * h + f * nn_),
                         5 * f * nn_ * h + b * nn_ * h + 2 * s.mlp_out + down_dy + head_dy)
        elif name.startswith("attention_backward"):
            out[name] = _attention(s, inner["attention_backward"], first_block=name != "attention_backward")
        elif name == "embedding_backward":
            out[name] = (g - deferred_grads(s), a + s.layers * x_block + head_x,
                         t + s.layers * dy_block + head_dy - received)
        else:
            out[name] = (g, a, t)
        if name.endswith("(first block)"):
            g2, a2, t2 = out[name]
            deeper = s.layers - 1
            # (the attention's moments count the received grad already: cp_attention_moments._residual_grads)
            attention = name.startswith("attention_backward")
            bound = b * nn_ * h if not s.last and s.par.sequence_parallel and not attention else 0
            out[name] = (g2 + deeper * (s.block_params - sum(c.w for c in _block(s))),
                         a2 - deeper * (s.block - x_block), t2 + deeper * dy_block + bound)
    return out


def _moe_moments(s: StageSizes, inner: dict) -> dict:
    """B's moments of the MoE model, from its 1F1B backward's (`inner`): the router and the experts
    make their weight grads in B (`_moe_mlp`), so the top block's MoE moments are 1F1B's with the
    head's weight grad deferred (its X and dY kept); a moment in a lower block (and the
    embedding's) finds every block above W-pending: its attention's weight grads not made, their
    X and dY kept."""
    head_x, head_dy = head_pending(s)
    head_w = s.head_w_grad if head_deferred(s) else 0
    x_block, dy_block = block_pending(s)
    block_w = sum(c.w for c in _block(s))
    if s.par.cp == 1 and s.par.recompute != Recompute.FULL:   # (CP: 1F1B's attention moment, `_attention`)
        inner = _with_flash_attention(s, inner)
    out = {}
    for name, (g, a, t) in inner.items():
        top = name.replace("(first block)", "")
        if name == "attention_backward":
            out[name] = _attention(s, inner[top], first_block=False)
        elif top == "attention_backward":   # (the 1F1B moment's grads as in the stage's first block)
            g, a, t = _attention(s, inner[name], first_block=True)
            out[name] = (g + (s.layers - 1) * s.block_params, a, t)
        elif name == "head_mm_backward":
            out[name] = (g, a, t - s.head_w_grad)
        elif name == "head_backward":
            out[name] = (g, a, t)
        elif name == "embedding_backward":
            out[name] = (g - deferred_grads(s), a + s.layers * x_block + head_x, t + s.layers * dy_block + head_dy)
        else:
            out[name] = (g - head_w, a + head_x, t + head_dy)
        if name.endswith("(first block)"):
            g2, a2, t2 = out[name]
            deeper = s.layers - 1
            out[name] = (g2 - deeper * block_w, a2 + deeper * x_block, t2 + deeper * dy_block)
    return out


def _with_flash_attention(s: StageSizes, inner: dict) -> dict:
    """`inner` with each block's attention backward after its MoE layer's, at the flash
    attention's backward (its dq, dk, dv made [B, h, S, d] each, at the query heads: repeat_kv's
    copies), as 1F1B's moments are but for o_proj, whose weight grad is deferred (its input X and
    output grad dY kept, the attention output's grad [N, h d] live): the router's, the experts'
    and the post-attention norm's grads in, the MoE layer's saved tensors freed (of the column
    inputs the router's alone), the attention's own still bound. In the stage's first block
    (`_in_first_block`) the grad of the stage's summed aux loss is freed."""
    b, n = s.b, s.n
    qd = s.heads * s.head_dim
    o = _block(s)[3]
    grads, acts, redone = _attention_grads_acts(s)
    # (o's dY [N, H] is the residual stream's grad without SP)
    temps = (_residual_grads(s) + (o.dy if s.par.sequence_parallel else o.dy - b * n * s.hid) + b * n * qd
             + 3 * b * n * qd + s.waiting + redone)
    top = (grads - b * s.hid * qd, acts + o.x, temps)
    aux = s.f if s.aux_loss_experts else 0
    if s.layers == 1:
        return {**inner, "flash_attention_backward": (top[0], top[1], top[2] - aux)}
    g, a, t = _in_first_block(s, top, received_counted=True)
    return {**inner, "flash_attention_backward": top, "flash_attention_backward(first block)": (g, a, t - aux)}


def _lean_moments(s: StageSizes, inner: dict) -> dict:
    """B's moments under --recompute selective and full, from the lean 1F1B backward's (`inner`): the
    head's wgrad deferred (its X and dY kept); in the top block the SwiGLU Function makes
    down_proj's grad as in 1F1B, then gate/up defer theirs and keep X and dY; a lower block finds
    every block above W-pending, the received grad (an earlier stage's) bound by the schedule."""
    b, nn_, h = s.b, s.nn, s.hid
    head_x, head_dy = head_pending(s)
    head_w = s.head_w_grad if head_deferred(s) else 0
    block = _block(s)
    x_block, dy_block = block_pending(s)
    up, gate = block[1], block[2]
    deeper = s.layers - 1
    out = {}
    for name, (g, a, t) in inner.items():
        top = name.replace("(first block)", "")
        if top == "post_norm_backward":
            g, a, t = inner[top]
            g, a, t = g - 2 * s.mlp_w_grad, a + up.x + gate.x, t + up.dy + gate.dy
        elif top == "swiglu_backward":
            g, a, t = inner[top]
        if top == "attention_backward":
            out[name] = _attention(s, inner[top], first_block=name != top)
        elif name == "head_mm_backward":
            out[name] = (g, a, t - s.head_w_grad)
        elif name == "embedding_backward":
            out[name] = (g - deferred_grads(s), a + s.layers * x_block + head_x, t + s.layers * dy_block + head_dy)
        elif name in ("head_backward", "chunked_loss_backward"):
            out[name] = (g, a, t)
        else:
            out[name] = (g - head_w, a + head_x, t + head_dy)
        if name.endswith("(first block)"):
            g2, a2, t2 = out[name]
            # (the attention's moments count the received grad already: cp_attention_moments._residual_grads)
            bound = b * nn_ * h if not s.last and top != "attention_backward" else 0
            out[name] = (g2 + deeper * (s.block_params - sum(c.w for c in block)),
                         a2 - deeper * (s.block - x_block), t2 + deeper * dy_block + bound)
        # (selective: under full the re-run block's own moments stay the larger, tests/test_memory.py)
        if (top == "post_norm_backward" and name.endswith("(first block)") == (s.layers > 1)
                and s.par.recompute == Recompute.SELECTIVE):
            out[name.replace("post_norm", "input_norm")] = _lean_input_norm(s, out[name])
    return out


def _lean_input_norm(s: StageSizes, post_norm: tuple[int, int, int]) -> tuple[int, int, int]:
    """The stage's first block's input norm (lean) at its largest, the end of B: from the same
    block's post-attention norm moment (`post_norm`), the attention's grads made but o, v, k, q's
    (deferred: their X and dY kept, o's dY the residual stream's grad without SP), its saved
    tensors and the post-attention norm's freed but o_proj's input; the norm's own temporaries as
    the post-attention norm's."""
    g, a, t = post_norm
    k, par = s.kinds, s.par
    _, _, _, o, v, kk, q = _block(s)
    sp = par.sequence_parallel
    # the block's grads B makes but the input norm's (a temporary yet), down_proj's and under SP the
    # post-attention norm's (made by the earlier moment)
    made = s.block_params - sum(c.w for c in _block(s)) - s.b * s.hid - s.mlp_w_grad - (s.b * s.hid if sp else 0)
    freed = (k["block.qk_norm_fp32"] + k["block.attention_q"] + k["block.attention_kv"] + k["block.attention_out"]
             + k["block.norm_fp32"] // 2)
    # the one block of an earlier stage: its residual grad is no longer the received one, which the
    # schedule still binds (the first-block moments count it already)
    received = s.b * s.nn * s.hid if s.layers == 1 and not s.last else 0
    return (g + made, a - freed + o.x,
            t + v.dy + kk.dy + q.dy + (o.dy if sp else 0) + received)


def _attention(s: StageSizes, moment: tuple[int, int, int], *, first_block: bool) -> tuple[int, int, int]:
    """CP: B inside a block's attention backward, from the 1F1B moment (`moment`, of the top
    block): the MLP's and o_proj's weight grads deferred, their inputs X kept as activations and
    their output grads dY as temporaries (and the head's, on the last stage). Without SP, o_proj's
    dY is the residual stream's grad itself, and the top block's down_proj dY on an earlier stage
    the received grad, both counted in the moment already."""
    _, a, t = moment
    down, up, gate, o = _block(s)[:4]
    sp = s.par.sequence_parallel
    head_x, head_dy = head_pending(s)
    received = not sp and not s.last and not first_block
    # (o's dY [N, H] is the residual stream's grad without SP; --recompute full counts o's input with it)
    dy = up.dy + gate.dy + (0 if received else down.dy) + (o.dy if sp else o.dy - s.b * s.n * s.hid) + head_dy
    # SwiGLU recompute's, made in B; the MoE model's router and experts make all theirs in B
    down_grad = s.ffn_w_grads if s.top_k else s.mlp_w_grad if s.par.recompute.lean else 0
    return _head_grads(s) + s.b * s.hid + down_grad, a + head_x + down.x + up.x + gate.x + o.x, t + dy


def weight_moments(s: StageSizes, first: bool) -> list[tuple[int, int, int]]:
    """W's moments, each (grads made so far, X freed so far, temporaries net of the dY freed):
    at each closure's weight grad made. `first`: the stage's first W, whose grads stay."""
    made, x_freed, dy_freed, out = 0, 0, 0, []
    for c in closures(s):
        out.append((made if first else 0, x_freed, c.w + c.gather - dy_freed))
        made, x_freed, dy_freed = made + c.w, x_freed + c.x, dy_freed + c.dy
    return out
