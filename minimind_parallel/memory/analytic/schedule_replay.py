"""The schedule replayed: every moment of one stage's step, in the order its schedule runs.

A stage runs its forwards and backwards in the order of its schedule
(`pipeline_parallel.order.schedule_order`, the list the runtime executes). At each one, the
microbatches still held keep what their forward saved (per microbatch: the stage's blocks, plus
on later stages the received input, on earlier ones the sent output deallocated to one element,
on the last the final norm, head input and loss). The first backward finds no grads; every later
one accumulates into all of them; its moments are backward_moments.py's. At the end of a forward:
the last stage's loss (replicated head: its scaling; VP: inside the loss, with the fp32 copy of
the logits; --loss_chunks K: inside the chunked loss, `_chunked_loss_forward`), an earlier
stage's last residual add. Around them: the last stage's loss per finished forward and the
backward's seed (the runtime drops each received grad, sent input grad and finished loss as soon
as it is dead). Last, the optimizer step: all grads, and AdamW's sqrt and denom of the largest
parameter while the previous parameter's denom is still bound.

So 1F1B's first stage holds min(P, M) microbatches at its peak and GPipe's holds M.
"""
from __future__ import annotations

import functools

from ...config import Recompute
from ...pipeline_parallel.order import Action, Step
from .backward_moments import backward_moments
from .saved_kinds import target_copy
from .stage_sizes import StageSizes, chunk_rows
from .moe_forward_moments import combine_beyond_forward_end
from .zero_bubble_moments import received_pending


def _last_forward_end(s: StageSizes) -> tuple[int, int]:
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


def _chunked_loss_forward(s: StageSizes) -> tuple[int, int]:
    """--loss_chunks K: inside the loss's forward (`recompute.chunked_loss`), at a chunk's logits
    [r, V(/T)] made and cast to the work dtype (fp32: at its target masks, 19 r bytes), the
    previous chunk's work-dtype logits, target index, masks, target logit and row max still bound,
    the lse of the chunks so far, the running total (and the previous chunk's loss). The head's
    input (gathered under SP: the final norm's local output still bound), the target copy and the
    lse are not saved yet: (activations, temporaries)."""
    b, f, v, k = s.b, s.f, s.vocab, s.kinds
    rows = chunk_rows(s.n, s.par.loss_chunks)

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


def _earlier_forward_end(s: StageSizes) -> tuple[int, int]:
    """The end of an earlier stage's forward, at its last residual add: everything saved, plus
    down_proj's output, the sum, and in half precision the block's input and middle residual
    stream (their fp32 copies are what the norms save; a received input is counted as held). Under
    --recompute selective the block's frame still binds the attention's output and the
    post-attention norm's (neither saved: the lean norm saves its input, its output's copies are
    re-made in backward), [N(/T), H] each; the block's input and middle residual stream are then
    what the lean norms save (in the model dtype: activations), in half precision too."""
    selective = s.par.recompute == Recompute.SELECTIVE
    half = 0 if s.b == s.f or selective else 2 - (1 if not s.first and s.layers == 1 else 0)
    residual = 2 + half + (2 if selective else 0)
    return s.held - s.held_temps, residual * s.b * s.nn * s.hid


def batch_saved(s: StageSizes) -> int:
    """The tracker files a storage under activations from the first time autograd saves it: the
    ids once the embedding saves them (and the targets, when the replicated head's loss saves a
    view of them: one sequence)."""
    return (8 * s.n * s.mb if s.first and not s.par.vocab_parallel else 0) + targets_saved(s)


def targets_saved(s: StageSizes) -> int:
    """The last stage's share of batch_saved: the targets."""
    return 8 * s.n * s.mb if s.last and not s.par.vocab_parallel and s.bsz == 1 else 0


def forward_moment(s: StageSizes, n_held: int, grads: int, saved: int, extra: int) -> tuple[int, int, int]:
    """The end of a forward, `n_held` microbatches held before it. The runtime binds nothing of
    earlier microbatches (it drops each received grad, sent input grad and loss once dead:
    pipeline_parallel.schedules.run_order)."""
    b = s.b
    if not s.last:
        # this microbatch's output is not sent yet (no one-element stand-in for it)
        acts, temps = _earlier_forward_end(s)
        return grads, saved + (n_held + 1) * acts, extra + (n_held + 1) * s.held_temps - b + temps
    acts, temps = _chunked_loss_forward(s) if s.par.loss_chunks > 1 else _last_forward_end(s)
    moved = (n_held + 1) * s.held_temps
    return grads, saved + n_held * s.held + acts - moved, extra + temps + moved


def backward_seed(s: StageSizes) -> int:
    """The grad a backward starts from: the last stage's d loss / d loss; an earlier stage's MoE
    layers' aux loss enters backward beside its output with its own (float32, 0-dim)."""
    if s.last:
        return s.loss_scalar
    return s.f if s.aux_loss_experts else 0


def _moe_per_microbatch(s: StageSizes, finished: int, held: int) -> int:
    """MoE: what each microbatch adds beyond the first's (moe_sizes.moe_temporaries counts one):
    each finished forward's reported aux share (float32, 0-dim), and each microbatch held to its
    backward its objective (the last stage; under CP its scaled copy is in `held_temps`) or its
    aux loss's backward root (an earlier stage)."""
    if not s.top_k:
        return 0
    per_held = moe_held(s)
    return max(finished - 1, 0) * aux_share(s) + max(held - 1, 0) * per_held


def aux_share(s: StageSizes) -> int:
    """MoE: a finished forward's reported aux share, 0-dim: float32, or without an aux loss
    (router_aux_loss_coef 0) the constant 0 in the model dtype."""
    if not s.top_k:
        return 0
    return s.f if s.aux_loss_experts else s.b


def _not_made_inside_the_loss(s: StageSizes, finished: int) -> int:
    """MoE on the last stage, when the forward's moment is inside the loss (VP's softmax, the
    chunked loss's chunks): the layers' summed aux loss exists, this microbatch's reported aux
    share and its objective (LM loss + aux) not yet -- what `moe_temporaries` and
    `_moe_per_microbatch` count beyond it: the objective (none under CP, where its scaled copy
    is counted as held) and, before the first forward has finished, the one aux share."""
    if not (s.top_k and s.last and (s.par.vocab_parallel or s.par.loss_chunks > 1)):
        return 0
    return (0 if s.par.cp > 1 else s.f) + (s.f if finished == 0 else 0)


def moe_held(s: StageSizes) -> int:
    """MoE: what one held unit of these sizes keeps beyond the first microbatch's (its aux loss's
    backward root; on the last stage its objective, none under CP): `_moe_per_microbatch`'s per
    held microbatch, for the posted replay's units."""
    if not s.top_k:
        return 0
    if s.last:
        return 0 if s.par.cp > 1 else s.f
    return s.f if s.aux_loss_experts else 0   # without an aux loss no root (its loss a constant 0)


def moe_lingering(s: StageSizes) -> tuple[int, int]:
    """MoE on a later (virtual) stage: the received input of the chunk's last forward outlives that
    unit's backward until the chunk's next forward (or the step's end): each MoE layer keeps its
    last aux loss (`MOEFeedForward.aux_loss`, MiniMind's attribute), whose graph holds the input
    leaf (autograd's accumulator of its grad). -> (activations, temporaries), split as the
    received input is (`received_pending`); none on the first stage or without MoE layers."""
    if not s.top_k or s.first:
        return 0, 0
    return received_pending(s)


def moe_unmade(s: StageSizes) -> tuple[int, int]:
    """MoE: what the first microbatch's terms count that the end of a unit's forward does not hold
    yet -> (always, more while no forward has finished on the stage): an earlier (virtual) stage's
    aux share and backward root (made after its forward), the last stage's as
    `_not_made_inside_the_loss` says."""
    if not s.top_k:
        return 0, 0
    if not s.last:   # and before the stage's first forward has finished, the layers' summed aux loss
        # (without an aux loss the first microbatch's terms are its share alone, made after its forward)
        return (2 * s.f, s.f) if s.aux_loss_experts else (0, s.f)
    later = _not_made_inside_the_loss(s, 1)
    return later, _not_made_inside_the_loss(s, 0) - later


def _first_largest(inner: dict, grads_count: bool) -> dict:
    """The first of the largest of a backward's moments, by the total with its own grads or without."""
    name = max(inner, key=lambda k: (inner[k][0] if grads_count else 0) + inner[k][1] + inner[k][2])
    return {name: inner[name]}


def replay_schedule(s: StageSizes, order: list[Action], grads_count: bool | None = None,
                    backward: dict | None = None, each: list[StageSizes] | None = None) -> tuple[dict, dict]:
    """Every moment of the stage's `order` (its schedule's actions) -> (grads, activations,
    temporaries), and how many microbatches each finds in flight. With `grads_count` (the
    planner's: whether the peak's total counts these grads, not under --zero's constant buffer),
    of each backward only its first largest moment: its moments share everything else, so the
    step's first largest is among those. `backward`: backward_moments(s), if made already.
    `each`: microbatch i's own sizes (MoE: a routing per microbatch; what it saves and its
    experts' moments differ), the others held counted at theirs."""
    moments, in_flight, n_held, n_fwd, n_bwd = {}, {}, 0, 0, 0
    inner, batch = backward if backward is not None else backward_moments(s), batch_saved(s)
    # (the first backward's grads are its own; later ones find every grad made)
    first, later = (inner, inner) if grads_count is None else (_first_largest(inner, grads_count),
                                                                 _first_largest(inner, False))
    held: list[int] = []       # the microbatches held (`each`: what they hold beyond microbatch i's)
    linger = (0, 0)            # MoE: the last forward's received input, once it is backwarded
    last_forward = None
    own: dict = {}             # `each`: microbatch i's backward moments
    for action in order:
        i = action.microbatch
        mine = each[i] if each is not None else s
        shift = sum(each[j].held - mine.held for j in held if j != i) if each is not None else 0
        grads = s.param_bytes if n_bwd else 0      # after the first backward every grad exists
        # the fp32 loss weights are filed as activations once a loss scaling saves them
        saved = batch + (4 * s.mb if s.last and s.weight == 0 and n_fwd else 0)
        # the last stage's losses so far (and a backward's seed, d loss / d loss)
        extra = s.batch - saved + s.ddp_buckets + (n_fwd * s.loss_scalar if s.last else 0)
        if action.step is Step.FORWARD:   # its layers' new aux losses free the last one's
            linger = (0, 0)
        saved += shift + linger[0]
        extra += linger[1]
        extra += backward_seed(s) if action.step is Step.BACKWARD else 0
        if action.step is Step.FORWARD:
            # an earlier stage: this microbatch's aux share and backward root are made after its forward
            unmade, unmade_first = moe_unmade(s)
            extra += _moe_per_microbatch(s, n_fwd, n_held + 1) - unmade - (unmade_first if n_fwd == 0 else 0)
            moments[f"forward_end[{i}]"] = forward_moment(mine, n_held, grads, saved, extra)
            in_flight[f"forward_end[{i}]"] = n_held + 1
            combine = combine_beyond_forward_end(mine, first=n_fwd == 0)   # MoE: inside the top layer's combine
            if combine is not None:
                g, a, t = moments[f"forward_end[{i}]"]
                moments[f"moe_combine[{i}]"] = (g, a + combine[0], t + combine[1])
                in_flight[f"moe_combine[{i}]"] = n_held + 1
            n_held, n_fwd = n_held + 1, n_fwd + 1
            held.append(i)
            last_forward = i
            continue
        extra += _moe_per_microbatch(s, n_fwd, n_held)
        moved = n_held * s.held_temps
        if mine is not s and i not in own:
            own[i] = backward_moments(mine)
        for name, (new_grads, a, temp) in (own[i] if mine is not s else later if grads else first).items():
            moments[f"{name}[{i}]"] = (grads or new_grads, saved + (n_held - 1) * mine.held + a - moved,
                                       extra + temp + moved)
            in_flight[f"{name}[{i}]"] = n_held
        n_held, n_bwd = n_held - 1, n_bwd + 1
        held.remove(i)
        if i == last_forward:
            linger = moe_lingering(mine)
    return moments, in_flight


def optimizer_step(s: StageSizes, stepped: list[int] | None = None, grads: int | None = None) -> tuple[int, int, int]:
    """AdamW (one tensor at a time): sqrt(exp_avg_sq) and denom of one parameter while the
    previous parameter's denom is still bound; the schedule's loss weights are gone, its reported
    loss not. `stepped`: the bytes of the tensors AdamW steps, in order (default: the parameters;
    --zero: the slices, zero_sizes.py), `grads` the grads alive (default: the parameters')."""
    scratch = _step_scratch(tuple(stepped) if stepped is not None else s.counts.each, 1 if stepped is not None else s.b)
    saved = batch_saved(s)
    return (s.param_bytes if grads is None else grads, saved, scratch + s.batch - 4 * s.mb - saved + s.ddp_buckets
            + (s.loss_scalar if s.last else 0))


@functools.lru_cache(maxsize=4096)
def _step_scratch(counts: tuple[int, ...], b: int) -> int:
    """AdamW's largest scratch over tensors of `counts` x `b` bytes, in order: 2 of one and the
    previous one's denom (remembered: the planner's layouts step the same few lists)."""
    sizes = [0] + [b * n for n in counts]
    return max(2 * sizes[i] + sizes[i - 1] for i in range(1, len(sizes)))


def partial_grad_sum(s: StageSizes) -> tuple[int, int, int]:
    """After the last backward, `training.finalize_grads` sums the TP-partial grads (plan.py's
    partial rule: under SP the norms and the MoE layers' router and experts) over TP in one flat
    copy (`_all_reduce_grads`; none for a single tensor, summed in place): all grads alive, and
    what the optimizer step finds (the schedule's loss weights gone, its reported loss not)."""
    saved = batch_saved(s)
    return (s.param_bytes, saved, s.partial_grads_flat + s.batch - 4 * s.mb - saved + s.ddp_buckets
            + (s.loss_scalar if s.last else 0))
