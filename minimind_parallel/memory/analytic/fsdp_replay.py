"""--zero 3 (FSDP2) replayed: the moments of schedule_replay.py, with what FSDP2 holds at each
(torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py; sizes: fsdp_sizes.py).

    root        the root group (embedding, final norm, head) is gathered at the first forward
                and kept to the end of the backward (the root does not reshard after forward;
                after a backward resharded it, the next forward gathers it again)
    a block     gathered at its forward and freed after it (the all-gather output stays until the
                next group's copy-out: the top block's at the forward's end); its copy-out into
                the parameters' storages happens while the previous group's all-gather output
                still lives (`pre_forward`), its last residual add while its own does
                (`block_forward_end`; --recompute selective: inside the lean SwiGLU,
                `swiglu_forward`); gathered again at its backward,
                while FSDP2 prefetches the block below (its all-gather output waits, a
                temporary, for that block's own pre-backward); freed at its post-backward
    its grads   unsharded (temporaries, not a registered parameter's .grad) until the block's
                post-backward copies them into the reduce-scatter input; its sharded grads (a
                view of the reduce-scatter output) are .grad from then on (accumulated into on
                later microbatches); FSDP2 keeps the reduce-scatter input alive until the next
                group's post-backward (one in flight)
"""
from __future__ import annotations

from ...config import MiniMindConfig, ParallelConfig, Recompute
from ...pipeline_parallel.order import Action, Step
from .backward_moments import backward_moments
from .fsdp_experts import expert_forward_end, expert_forward_shift, expert_group_shift, with_expert_group_moments
from .fsdp_moments import fsdp_block_moments
from .fsdp_sizes import FsdpSizes, fsdp_sizes, held_shards
from .schedule_replay import _moe_per_microbatch, _not_made_inside_the_loss, batch_saved, forward_moment, optimizer_step, targets_saved
from .stage_sizes import StageSizes, top_block_acts


def _backward_state(s: StageSizes, z: FsdpSizes, name: str, block: int) -> tuple[int, int, int, int]:
    """What FSDP2 holds at a backward moment (in `block`, the top one unless named otherwise)
    beyond the dense model's activations and temporaries: (blocks reduce-scattered so far, the
    dense grad bytes those blocks account for in the moment, gathered bytes saved (activations),
    gathered or buffered bytes unsaved (temporaries))."""
    root_saved, root_unsaved = z.root - z.root_unsaved, z.root_unsaved
    top = s.layers - 1
    # a block's gathered parameters, saved by its forward; under --recompute full only its
    # recomputation in backward reads them (nothing saves them in forward): temporaries
    saved, unsaved = (0, z.block) if s.par.recompute == Recompute.FULL else (z.block, 0)
    if name in ("embedding_backward", "tied_grad_sum"):   # every block reduced, block 0's input kept
        return s.layers, s.layers * s.block_params, root_saved, root_unsaved + z.block
    if name.startswith(("head_", "chunked_loss", "final_norm")):   # the root's pre-backward prefetched the top block
        return 0, 0, root_saved, root_unsaved + z.block
    above = top - block
    kept = z.block if block < top else 0          # the reduce-scatter input of the block above
    if name.startswith("pre_backward"):   # the block's gather copied out, its all-gather output still alive
        return above, above * s.block_params, root_saved + saved, root_unsaved + unsaved + z.block + kept
    prefetched = z.block if block > 0 else 0      # the all-gather of the block below, waiting
    return above, above * s.block_params, root_saved + saved, root_unsaved + unsaved + prefetched + kept


def _backward(s: StageSizes) -> dict:
    """The dense model's backward moments with FSDP2's own (fsdp_moments.py) after the top block's
    and the first block's (the embedding's and the tied grads' sum last)."""
    dense, own = backward_moments(s), fsdp_block_moments(s)
    tail = {k: dense.pop(k) for k in ("embedding_backward", "tied_grad_sum") if k in dense}
    return {**dense, **own, **tail}


def _block_moments(s: StageSizes, inner: dict) -> dict:
    """The backward's moments, named and placed in a block: the top block's, then (where they
    differ) the second one's and the second from the bottom's (between them a moment gains a
    block's sharded grads and loses its activations: the peak is at one end), then the first's.
    -> name: (block, (dense new grads, activations, temporaries))."""
    top, out, first = s.layers - 1, {}, "(first block)"
    for name, moment in inner.items():
        if not name.endswith(first):
            out[name] = (top, moment)
            continue
        base = inner[name[:-len(first)]]
        for k in sorted({top - 1, 1} & set(range(1, top)), reverse=True):
            deeper = top - k
            out[f"{name[:-len(first)]}(block {k})"] = (k, (base[0] + deeper * s.block_params,
                                                          base[1] - deeper * s.block, base[2]))
        out[name] = (0, moment)
    return out


def _copy_out_moments(s: StageSizes) -> dict:
    """A block's pre-backward, its all-gathered parameters copied out into their storages (before
    it prefetches the block below): the blocks above done (their grads in, their activations
    freed), this block's activations all alive, the incoming grad of its output [Nn, H]. At the
    top block, the one below it (the first with the reduce-scatter input of a block above kept)
    and the first (between them a moment gains a block's sharded grads and loses its
    activations). -> name: (block, (dense new grads, activations, temporaries))."""
    top, out = s.layers - 1, {}
    for k in sorted({top, max(top - 1, 0), 0}, reverse=True):
        above = top - k
        routed = sum(s.routed[k + 1:]) if s.routed and s.par.recompute != Recompute.FULL else 0
        out[f"pre_backward(block {k})"] = (k, (s.head_grads + above * s.block_params,
                                               top_block_acts(s) - above * s.block - routed,
                                               s.b * s.nn * s.hid + s.waiting))
    return out


def _forward_moments(s: StageSizes, z: FsdpSizes, *, fresh_root: bool, seen: bool, unmade_state: int = 0) -> dict:
    """The moments FSDP2 adds to a forward: each block's copy-out, the top block's last residual
    add and (--recompute selective, full) its lean SwiGLU. `fresh_root`: the root was gathered for
    this forward (the first, or one after a backward resharded it); `seen`: the blocks' parameters
    were saved by an earlier forward (the tracker files their storage under activations from then
    on; --recompute full saves none); `unmade_state`: what each MoE layer keeps all step, made by
    its first forward (not yet at a copy-out before it). -> name: (activations, temporaries)
    beyond what every moment of the forward holds."""
    # saved before the blocks: CP's RoPE tables of this rank's positions, VP's local ids and mask
    model = s.kinds["model.rope"] + (9 * s.n if s.first and s.par.vocab_parallel else 0)
    full = s.par.recompute == Recompute.FULL
    out = _pre_forward(s, z, model, fresh_root=fresh_root, saved_params=seen and not full)
    out = {name: (a, t - (s.layers - int(name.split()[-1][:-1])) * unmade_state) for name, (a, t) in out.items()}
    params = (0, z.block) if full else (z.block, 0)    # saved by the block's ops by its end
    acts, temps = _block_forward_end(s)
    out[f"block_forward_end(block {s.layers - 1})"] = (model + acts + params[0], temps + z.block + params[1])
    out.update(expert_forward_end(s, z, out[f"block_forward_end(block {s.layers - 1})"], first_forward=not seen))
    if s.par.recompute.lean and not s.expert_rows:
        acts, temps = _swiglu_forward(s, z, first_forward=not seen and not full)
        out[f"swiglu_forward(block {s.layers - 1})"] = (model + acts + params[0], temps + z.block + params[1])
    return out


def _pre_forward(s: StageSizes, z: FsdpSizes, model: int, *, fresh_root: bool, saved_params: bool) -> dict:
    """A block's pre-forward copy-out (FSDP2's `wait_for_unshard`: its all-gather output copied
    into the parameters' storages before the previous group's all-gather output is freed), at the
    stage's first block and its top one (between them a moment gains a block's activations):
    this microbatch's blocks below saved, the block's input [Nn, H], its all-gather output and
    parameters, and the previous group's all-gather output (the root's, when gathered for this
    forward, or the block below's; at block 0 of a later forward without a backward between
    them, the top block's of the forward before)."""
    out = {}
    for k in sorted({0, s.layers - 1}):
        previous = z.root if fresh_root and k == 0 else z.block
        acts = model + k * s.block + (sum(s.routed[:k]) if s.routed and s.par.recompute != Recompute.FULL else 0)
        params = (z.block, 0) if saved_params else (0, z.block)
        out[f"pre_forward(block {k})"] = (acts + params[0], s.b * s.nn * s.hid + z.block + params[1] + previous)
    return out


def _block_forward_end(s: StageSizes) -> tuple[int, int]:
    """The top block's last residual add (its parameters and all-gather output alive: the
    caller's): this microbatch's blocks saved; down_proj's output and the sum, and in half
    precision the block's input and middle residual stream (the norms save their fp32 copies; the
    MoE model's lean norms under --recompute selective save them);
    under SP before it, down_proj's output [N, H] reduce-scattered into [Nn, H] (basic SP: the
    post-attention norm's output shard, which the MLP's gathers do not save, still bound). The MoE
    layer works on the tokens of the rank's shard (under SP too): its output [Nn, H] and the sum."""
    par, row = s.par, s.b * s.nn * s.hid
    pair = 0 if s.b == s.f else 2 * row
    if s.expert_rows:   # the MoE layer's output and the sum [Nn, H] (selective: the attention's too, and the norm's,
        # and no pair: the lean norms save their half-precision inputs, the block's saved tensors)
        if par.recompute == Recompute.SELECTIVE:
            return s.blocks, 4 * row
        return s.blocks, pair + 2 * row
    if not par.sequence_parallel:
        return s.blocks, pair + 2 * row
    normed = row if not par.async_communication else 0
    return s.blocks, pair + s.b * s.n * s.hid + row + normed


def _swiglu_forward(s: StageSizes, z: FsdpSizes, *, first_forward: bool) -> tuple[int, int]:
    """Inside the top block's lean SwiGLU forward (`recompute.swiglu`), silu(gate) * up made: gate
    and up (not saved yet: its own ctx), silu(gate) and the product [N, I/T], the attention's
    output and the post-attention norm's output [Nn, H] still bound (the lean norm saves its
    input); in the first forward down_proj's gathered weight (dim 0 padded to W rows) not yet
    saved. (--recompute full: under the block's checkpoint nothing of it is saved.)"""
    w = s.par.dp * s.par.cp
    down = -(-s.hid // w) * w * s.inter * s.b if first_forward else 0
    gate_up = 0 if s.par.recompute == Recompute.FULL else s.kinds["block.mlp"]
    return s.blocks - gate_up - down, 2 * s.b * s.nn * s.hid + 4 * s.mlp_out + down


def replay_fully_sharded(s: StageSizes, z: FsdpSizes, order: list[Action], moe_step: int = 0,
                         moe_layer_state: int = 0) -> tuple[dict, dict]:
    """Every moment of the stage's `order` -> (grads, activations, temporaries) under FSDP2, and
    how many microbatches each finds in flight. `moe_step`, `moe_layer_state`: the MoE tensors
    alive until the step's end and each layer's alive all step, which the caller adds to every
    moment (moe_sizes.moe_temporaries)."""
    moments, in_flight, n_held, n_fwd, n_bwd = {}, {}, 0, 0, 0
    last_was_backward = False
    inner = with_expert_group_moments(s, z, {**_copy_out_moments(s), **_block_moments(s, _backward(s))})
    batch = batch_saved(s)
    every = z.params   # every group's sharded grads, after the first backward
    for action in order:
        i = action.microbatch
        saved = batch + (4 * s.mb if s.last and s.weight == 0 and n_fwd else 0)
        extra = s.batch - saved + (n_fwd * s.loss_scalar if s.last else 0)
        extra += s.loss_scalar if action.step is Step.BACKWARD and s.last else 0
        if action.step is Step.FORWARD:
            fresh = not moments or n_bwd > 0 and last_was_backward
            # before the first loss neither the head's weights nor the targets are saved
            root = (z.root - z.root_unsaved, z.root_unsaved) if n_fwd else (0, z.root)
            unsaved = 0 if n_fwd else targets_saved(s)
            # MoE: of the step's aux and objective tensors (moe_sizes.moe_temporaries) this microbatch's
            # summed aux loss and objective not made yet (nor, in the first forward, its aux share)
            before_loss = moe_step - (s.f if n_fwd and moe_step else 0)
            for name, (a, t) in _forward_moments(s, z, fresh_root=fresh, seen=n_fwd > 0,
                                                 unmade_state=0 if n_fwd else moe_layer_state).items():
                moments[f"{name}[{i}]"] = (every if n_bwd else 0,
                                           saved - unsaved + n_held * s.held - n_held * s.held_temps + root[0] + a,
                                           extra + unsaved + n_held * s.held_temps + root[1] + t - before_loss
                                           + _moe_per_microbatch(s, n_fwd, n_held)
                                           + expert_forward_shift(s, z, name, fresh_root=fresh))
                in_flight[f"{name}[{i}]"] = n_held
            last_was_backward = False
            inside = _not_made_inside_the_loss(s, n_fwd)
            _, a, t = forward_moment(s, n_held, 0, saved, extra + _moe_per_microbatch(s, n_fwd, n_held + 1) - inside)
            # the top block's all-gather output, kept by FSDP2 until its next all-gather
            moments[f"forward_end[{i}]"] = (every if n_bwd else 0, a + z.root - z.root_unsaved,
                                            t + z.root_unsaved + z.block
                                            + expert_forward_shift(s, z, "forward_end", fresh_root=fresh))
            in_flight[f"forward_end[{i}]"] = n_held + 1
            n_held, n_fwd = n_held + 1, n_fwd + 1
            continue
        moved = n_held * s.held_temps
        extra += _moe_per_microbatch(s, n_fwd, n_held)
        for name, (block, (new_grads, a, temp)) in inner.items():
            reduced, reduced_dense, acts, temps = _backward_state(s, z, name, block)
            grads = every if n_bwd else reduced * z.block_shard
            dg, da, dt = expert_group_shift(s, z, name, block, new_grads, first_backward=not n_bwd)
            moments[f"{name}[{i}]"] = (grads + dg, saved + (n_held - 1) * s.held + a - moved + acts + da,
                                       extra + temp + moved + temps + new_grads - reduced_dense + dt)
            in_flight[f"{name}[{i}]"] = n_held
        n_held, n_bwd = n_held - 1, n_bwd + 1
        last_was_backward = True
    return moments, in_flight


def fully_sharded_moments(s: StageSizes, order: list[Action], device: str,
                          moe_step: int = 0, moe_layer_state: int = 0) -> tuple[dict, dict, int, int]:
    """The step's moments under FSDP2, the optimizer step's last (AdamW over this rank's shards),
    how many microbatches each finds in flight, this rank's parameter shards and AdamW's states
    (two per shard, and a float32 step counter per parameter on the CPU)."""
    z = fsdp_sizes(s)
    moments, in_flight = replay_fully_sharded(s, z, order, moe_step, moe_layer_state)
    held = held_shards(s, z)
    moments["optimizer"] = optimizer_step(s, list(held), grads=z.params)
    # an empty local shard's padded storage: alive all step, no parameter's (a temporary)
    empty = z.params - sum(held)
    moments = {k: (g, a, t + empty) for k, (g, a, t) in moments.items()}
    states = 2 * sum(held) + (4 * len(z.shards) if device == "cpu" else 0)
    return moments, in_flight, sum(held), states


def check_fully_sharded(c: MiniMindConfig, par: ParallelConfig, tokens: int) -> None:
    """The --zero 3 layouts the model follows exactly, at any number of `tokens` per microbatch on
    a rank (the MoE model at ep 1 too, under SP, --recompute and CP), fsdp_moments.py listing the
    moments that hold the peak where a block's weights outweigh its activations: without
    --recompute and under --recompute full, with or without SP (basic SP: its gathered q/k/v
    backward and input norm's; full: the re-run block's input norm backward and the lean SwiGLU's
    MLP input). The others refused in one line, their thresholds measured
    (memory_model_sweep.py with them lifted), not derived: --recompute selective below 2
    hidden_size tokens (the q/k/v backward under SP + async, 8 KB under at a quarter of
    hidden_size with CP, 51 KB at a half; the post-norm's, 28 KB; CP attention's, 1.4 to 11 KB;
    4.6 KB at a sixteenth with the MoE model) and basic SP under --recompute below hidden_size
    (full: CP attention's backward in the first block, 5.4 KB under at an eighth with the shared
    gather; neither the re-run norm's nor q/k/v's moments are written for SP's own gathers under
    the checkpoint), and with the MoE model below hidden_size under basic SP (its q/k/v backward,
    1 KB under at a quarter with the shared gather) and under --recompute full (the first block's
    re-run input norm backward, 4 B over at an eighth under ring CP). (EP: the experts' own groups,
    fsdp_experts.py, under SP, --recompute and CP too; under PP, fsdp_pipeline.py, the same hold.)"""
    basic_sp = par.sequence_parallel and not par.async_communication
    # few tokens not followed: basic SP under --recompute or with the MoE model, the MoE model under full
    unfollowed = basic_sp and (par.recompute != Recompute.NONE or c.use_moe) or c.use_moe and par.recompute == Recompute.FULL
    if unfollowed and tokens < c.hidden_size:
        raise NotImplementedError(f"predict_memory: --zero 3 (FSDP2) with sequence_parallel={par.sequence_parallel} "
                                  f"(async_communication={par.async_communication}), --recompute {par.recompute} and "
                                  f"use_moe={c.use_moe} is modelled at hidden_size tokens per microbatch on a rank or "
                                  f"more (fewer: the dense model, and basic SP without --recompute); got seq_len / "
                                  f"cp_size * micro_batch_size = {tokens} < {c.hidden_size}")
    if par.recompute == Recompute.SELECTIVE and tokens < 2 * c.hidden_size:
        raise NotImplementedError(f"predict_memory: --zero 3 (FSDP2) under --recompute selective is modelled at "
                                  f"2 x hidden_size tokens per microbatch on a rank or more; "
                                  f"got seq_len / cp_size * micro_batch_size = {tokens} < {2 * c.hidden_size}")
