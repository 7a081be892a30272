"""--zero 3 under expert parallelism (ep_size > 1): what the experts' own FSDP2 group adds to the
replay of fsdp_replay.py (zero/fully_shard.py's `shard_experts`; sizes: fsdp_sizes.py's
`experts`, `experts_shard`, `experts_dense`). A block's group is then its other parameters, and
FSDP2 orders the groups by their post-forwards: a block's experts, then the block, then the next
block's experts (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, `_backward_prefetch`:
each group's pre-backward prefetches the group before it in that order).

Over more than one EDP rank (ep < D x C), per MoE layer, E its experts' gathered bytes:

    forward     gathered between the dispatch and the experts, freed after them; their all-gather
                output kept, as every forward all-gather output, to the next group's copy-out
                (the next block's, or the forward's end: in place of the block's own)
    prefetch    the block's pre-backward prefetches its experts, not the block below: the
                experts' all-gather output waits over the weighting's and the combine's backward
    copy-out    the experts' pre-backward (the grad of their output in): their all-gather output
                copied into the unsharded experts, both alive (`expert_pre_backward`); then it
                prefetches the block below
    experts     their backward with the unsharded experts saved, their grads unsharded temporaries
    reduce      their post-backward (the input grads concatenated, before the scatter back to the
                tokens): the experts resharded, the block above's reduce-scatter input let go, their
                own reduce-scatter input [E] made from the unsharded grads (`expert_reduce`)
    after       the rest of the block's backward: their sharded grads (.grad), their reduce-scatter
                input kept to the block's post-backward
    rerun       --recompute full: the MoE layer's re-run in the block's backward gathers them (its
                copy-out, no copy-out at their pre-backward then); at their forward's end
                (`expert_rerun_forward_end`) their all-gather output and the unsharded experts
                both alive beside the re-run's tensors so far

With one EDP rank (ep = D x C) the experts stay whole outside FSDP2: whole parameters and AdamW
states, and their grads registered .grad as autograd makes them (accumulated into in place on
later microbatches), reduced as under DDP by `finalize_grads` after the step's backwards.
"""
from __future__ import annotations

from ...config import Recompute
from .fsdp_sizes import FsdpSizes
from .stage_sizes import StageSizes

_PHASES = (("weighting_backward", "prefetch"), ("expert_pre_backward", "copy-out"), ("expert_rerun_forward_end", "rerun"),
           ("expert_reduce", "reduce"),
           ("expert_down_backward", "experts"), ("expert_swiglu_backward", "experts"),
           ("expert_up_backward", "experts"), ("expert_gate_backward", "experts"),
           ("expert_gather_backward", "after"), ("router_backward", "after"), ("post_norm_backward", "after"),
           ("qkv_backward", "after"),
           ("input_norm_backward", "after"),
           ("attention_backward", "after"), ("embedding_backward", "all"), ("tied_grad_sum", "all"),
           ("pre_backward", "before"))


def _phase(name: str) -> str:
    """Where a backward moment of fsdp_replay falls against its block's experts (head: the root's)."""
    return next((phase for prefix, phase in _PHASES if name.startswith(prefix)), "head")


def with_expert_group_moments(s: StageSizes, z: FsdpSizes, inner: dict) -> dict:
    """fsdp_replay's backward moments (name: (block, (dense new grads, activations, temporaries)))
    with, over more than one EDP rank, the experts' copy-out before each block's first expert
    backward (its state: that moment's without the down_proj grads it makes) and their
    post-backward before each gather backward (that moment's without the scatter's [Nn, H])."""
    if not z.experts:
        return inner
    # --recompute full: the re-run's experts' forward end before each weighting backward, no copy-out after it
    full, out = s.par.recompute == Recompute.FULL, {}
    for name, (block, (grads, acts, temps)) in inner.items():
        if full and name.startswith("weighting_backward"):
            out["expert_rerun_forward_end" + name[len("weighting_backward"):]] = (
                block, (grads, acts, temps + _rerun_forward_end_shift(s, name.endswith("(first block)"))))
        if name.startswith("expert_gather_backward"):
            out["expert_reduce" + name[len("expert_gather_backward"):]] = (
                block, (grads, acts, temps - s.b * s.nn * s.hid))
        first = f"expert_down_backward(e{len(s.expert_rows[-1]) - 1})"   # the last local expert's, made first
        if name.startswith(first) and not full:   # --recompute full: the re-run gathered them (above)
            rows = s.expert_rows[0 if name.endswith("(first block)") else -1][-1]
            out["expert_pre_backward" + name[len(first):]] = (
                block, (grads, acts, temps - s.b * s.hid * s.expert_inter - s.b * rows * s.expert_inter))
        out[name] = (block, (grads, acts, temps))
    return out


def _rerun_forward_end_shift(s: StageSizes, first_block: bool) -> int:
    """--recompute full: the temporaries by which the re-run of a block's MoE layer in its backward,
    at its experts' forward end (their outputs [m, H] concatenated into [M, H]), differs from the
    layer's weighting backward that follows: the experts' all-gather output is alive beside the
    unsharded experts (their copy-out ran inside the re-run: no copy-out at their pre-backward
    then; the phase's shift, `rerun`), the re-run has not yet saved the combine's, weighting's and aux
    loss's tensors (the combine's index [M], the sort's order [R], the sorted weights [R], the
    combined output [R, H]; the weighted output [R, H] the weighting backward has let go already),
    the outputs and their concatenation [M, H] each, the routing weights [N, k] and the counts [E]
    and [E_local] live, none of the weighting backward's three [R, H] nor the aux loss's grad [E]
    (a float scalar of the aux loss alive, f bytes). Measured with the
    tracker's timeline (bf16 and fp32, CP ring and a2a, tp 1 and 2), not derived."""
    b, hid, r = s.b, s.hid, s.routed_rows
    rows = s.expert_rows[0 if first_block else -1]
    aux_grad = s.aux_backward[1]
    return (-4 * b * r * hid + 2 * b * sum(rows) * hid + 8 * len(rows) + 8 * len(rows) * s.par.ep
            - aux_grad + (s.f if aux_grad else 0))


def expert_group_shift(s: StageSizes, z: FsdpSizes, name: str, block: int, new_grads: int, *,
                       first_backward: bool) -> tuple[int, int, int]:
    """(grads, activations, temporaries) the experts' groups add to fsdp_replay's backward moment
    `name` in `block` (none at ep_size 1), whose dense model's new grads are `new_grads`; on the
    step's first backward (`first_backward`) the blocks above hold their experts' grads already."""
    if s.par.ep == 1 or not s.expert_rows:
        return 0, 0, 0
    phase, top = _phase(name), s.layers - 1
    above = s.layers if phase == "all" else 0 if phase == "head" else top - block
    done = phase in ("reduce", "after")
    if not z.experts:   # one EDP rank: whole experts, their grads .grad as made
        mine = (new_grads - s.head_grads - above * s.block_params if phase == "experts"
                else z.experts_dense if done else 0)
        return (above * z.experts_dense + mine if first_backward else 0), 0, -mine
    grads = above * z.experts_shard + (z.experts_shard if phase == "after" else 0) if first_backward else 0
    below = z.block if block > 0 else 0     # the block below's all-gather, prefetched by fsdp_replay
    kept = z.block if block < top else 0    # the block above's reduce-scatter input, kept by fsdp_replay
    # rerun: --recompute full, the re-run's copy-out (its all-gather output and the unsharded experts, which
    # only the re-run saves: temporaries)
    shift = {"prefetch": (0, z.experts - below), "copy-out": (z.experts, z.experts - below),
             "rerun": (0, 2 * z.experts - below),
             "experts": (z.experts, 0), "reduce": (0, z.experts - kept),
             "after": (0, z.experts - kept - z.experts_dense)}.get(phase, (0, 0))
    return grads, shift[0], shift[1]


def expert_forward_shift(s: StageSizes, z: FsdpSizes, name: str, *, fresh_root: bool) -> int:
    """The temporaries the experts' groups add to fsdp_replay's forward moment `name`: over more
    than one EDP rank the all-gather output kept to the next copy-out is the experts' (the block
    below's, or the top block's at the forward's end), not the block's."""
    if not z.experts or name == "pre_forward(block 0)" and fresh_root:
        return 0
    return z.experts - z.block


def expert_forward_end(s: StageSizes, z: FsdpSizes, block_end: tuple[int, int], *, first_forward: bool) -> dict:
    """Over more than one EDP rank, the top block's experts' copy-out in forward (`expert_pre_forward`,
    below) and their forward at its end (their outputs
    [m, H] concatenated into [M, H], before their post-forward reshards them): the unsharded
    experts saved, and of the MoE layer not yet saved what its combine, weighting and aux loss
    save (the combine's index [M], the sort's order [R], the sorted weights [R], the combined and
    the weighted output [R, H], the aux loss's N and load); the outputs and their concatenation,
    the order [R] and the dispatch's regroup index [M] (not saved yet), the routing weights
    [N, k] and the local counts [E_local] live, not yet the weighting's output and the residual
    sum [Nn, H] nor the aux loss (after the step's first forward the layer's aux loss and counts
    [E] of the forward before are, beside this one's counts). From `block_end`, the block's last
    residual add (activations, temporaries)."""
    if not z.experts:
        return {}
    b, r, m = s.b, s.routed_rows, sum(s.expert_rows[-1])
    experts = len(s.expert_rows[-1]) * s.par.ep   # E: the counts [E] int64
    saved_after = 8 * m + 8 * r + b * r + 2 * b * r * s.hid + s.aux_backward[0]
    live = 2 * b * m * s.hid + 8 * r + 8 * m + b * r + 8 * len(s.expert_rows[-1])
    acts, temps = block_end
    acts, temps = acts - saved_after + z.experts, temps - 2 * b * s.nn * s.hid + live + (
        -s.f if first_forward else 8 * experts)
    # their copy-out: none of their forward's tensors yet, the tokens [M, H] not saved yet, the
    # unsharded experts (not saved before the first forward's) beside the block's all-gather output
    saved_by_experts = 4 * b * m * s.expert_inter + b * m * s.hid
    unsaved = z.experts if first_forward else 0
    return {f"expert_pre_forward(block {s.layers - 1})": (acts - saved_by_experts - unsaved,
                                                          temps - b * m * s.hid + z.block + unsaved),
            f"expert_forward_end(block {s.layers - 1})": (acts, temps)}
