"""The sizes every moment of one pipeline stage's step is a sum of (`StageSizes`).

From the plan (this rank's parameters and layers, plan.stage_parameters / stage_layers) and
the saved-tensor kinds (saved_kinds.py): what one microbatch holds from its forward to its
backward, what is alive all step -- params and RoPE buffers, AdamW states, the batch (ids and
targets [M B, S] int64 and the fp32 loss weights [M]), DDP's flat gradient buckets (pp = 1,
dp > 1) -- and what the stage's top block holds when its backward begins. --recompute full: a
block holds its input (`StageSizes.block`); its backward re-makes the rest
(`StageSizes.recomputed`, temporaries to the tracker).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from ...config import MiniMindConfig, ParallelConfig, Recompute
from ...moe.experts import balanced_counts
from ...moe.placement import expert_of, local_experts
from ...memo import Frozen, cached_property
from ...plan import (SHAPE_FIELDS, Partial, build_stage_parameters, is_first_stage, is_last_stage, is_partial, plan_of,
                     stage_layers)
from .moe_sizes import basic_sp_router_input
from .saved_kinds import activations_by_kind


def numel(shape) -> int:
    return math.prod(shape)


@dataclass(frozen=True, kw_only=True)
class StageSizes:
    """The sizes every moment of one stage's step is a sum of (bytes, unless a count or a flag).
    Frozen, so each derived size is computed once (`cached_property`): the schedule's replay reads
    them at every moment."""

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
    tied_here: bool            # a weight tied within this stage (embedding and lm_head both here)
    shapes: dict               # this rank's parameters (plan.stage_parameters)
    counts: ParameterCounts    # their elements, in the sums the moments read
    kinds: dict                # activations_by_kind
    layers: int                # layers on this stage
    block_params: int          # the parameters of one block
    heads: int = 0             # h, kv: attention / kv heads on this rank; d: head_dim
    kv_heads: int = 0
    head_dim: int = 0
    chunk_len: int = 0         # CP: tokens of one sequence chunk (context_parallel.ContextLayout)
    cp_rank: int = 0           # CP: this rank's place in the CP group (which chunks it holds)
    # MoE under a routing other than the balanced one: what each layer of the stage (in order)
    # saves beyond "block.moe" (the rows its experts receive, moe_sizes.expert_rows); may be < 0
    routed: tuple[int, ...] = ()
    top_k: int = 0             # MoE: experts per token, and each expert's width I_e
    expert_inter: int = 0
    aux_loss_experts: int = 0  # MoE with router_aux_loss_coef > 0: E (the aux loss's statistics)
    # MoE: the rows each local expert receives in one microbatch, per layer of the stage (in order)
    expert_rows: tuple[tuple[int, ...], ...] = ()

    @cached_property
    def param_bytes(self) -> int:
        return self.b * self.counts.total

    @cached_property
    def block(self) -> int:
        """One block's activations of one microbatch, held to its backward (full: its input)."""
        if self.par.recompute == Recompute.FULL:
            return self.kinds["block.checkpoint_input"]
        return sum(v for k, v in self.kinds.items() if k.startswith("block."))

    @cached_property
    def gate_up_input(self) -> int:
        """The share of a block's column-parallel inputs ("block.column_input") that gate_proj and
        up_proj save: two of five under basic SP (one gather per linear), else half."""
        par = self.par
        basic_sp = par.sequence_parallel and not par.shared_sp_gather and not par.async_communication
        column = self.kinds["block.column_input"]
        return column * 2 // 5 if basic_sp else column // 2

    @cached_property
    def recomputed(self) -> int:
        """--recompute full: what a block's re-run forward saves again, alive in its backward
        (kept by the checkpoint's own saved-tensor hooks: temporaries to the tracker)."""
        if self.par.recompute != Recompute.FULL:
            return 0
        # the input norm's saved input is the block's input: the checkpoint's, already held
        return (sum(v for k, v in self.kinds.items() if k.startswith("block.") and k != "block.checkpoint_input")
                - self.kinds["block.checkpoint_input"] + (self.routed[-1] if self.routed else 0))

    @cached_property
    def blocks(self) -> int:
        """What the stage's blocks hold of one microbatch from its forward to its backward."""
        routed = sum(self.routed) if self.par.recompute != Recompute.FULL else 0
        return self.layers * self.block + routed

    @cached_property
    def batch(self) -> int:
        """Alive all step, on every stage: the ids and targets [M*B, S] (split into microbatches
        there) and the microbatches' loss weights (fp32 [M])."""
        return 16 * self.n * self.mb + 4 * self.mb

    @cached_property
    def loss_scalar(self) -> int:
        """The last stage keeps one loss per forward (the report)."""
        return 4 if (self.par.vocab_parallel or self.par.loss_chunks > 1) else self.b

    @cached_property
    def weight(self) -> int:
        """The loss weight cast to the loss dtype, saved by the scaling (nothing when fp32)."""
        return self.loss_scalar if self.loss_scalar != 4 else 0

    @cached_property
    def held_temps(self) -> int:
        """Not saved for backward, so temporaries to the tracker: the received input (the first
        norm saves its fp32 copy instead) and the sent output, deallocated to one element."""
        b = self.b
        # the lean norm saves the received input itself (an activation, in its kind)
        upcast_only = b != self.f and self.par.recompute == Recompute.NONE
        sent = self.cp_scaled_loss if self.last else b
        return (b * self.nn * self.hid if not self.first and upcast_only else 0) + sent

    @cached_property
    def cp_scaled_loss(self) -> int:
        """The last stage under CP: the loss scaled by cp for backward (the schedule's grad_scale),
        held until its backward; with MoE layers the objective (LM loss + aux, at least float32)."""
        if not (self.last and self.par.cp > 1):
            return 0
        return self.f if "block.moe" in self.kinds else self.loss_scalar

    @cached_property
    def held(self) -> int:
        """What one microbatch keeps from the end of its forward to its backward."""
        k = self.kinds
        held = self.blocks + self.held_temps + k["model.rope"]
        if self.first and self.par.vocab_parallel:
            held += 9 * self.n              # local ids and out-of-range mask (the ids are in `batch`)
        if self.last:
            held += k["model.final_norm"] + k["model.head_input"] + k["model.logits_loss"] + self.weight
        return held

    @cached_property
    def mlp_out(self) -> int:
        """One [N, I/T] tensor of the MLP."""
        return self.b * self.n * self.inter

    @cached_property
    def mlp_w_grad(self) -> int:
        """down_proj's weight grad [H, I/T]."""
        return self.b * self.hid * self.inter

    @cached_property
    def ffn_saved(self) -> int:
        """What the top block's feed-forward saves: the MLP's, or the MoE layer's ("block.moe", and
        what its routing adds)."""
        if "block.moe" not in self.kinds:
            return self.kinds["block.mlp"]
        return self.kinds["block.moe"] + (self.routed[-1] if self.routed else 0)

    @cached_property
    def routed_rows(self) -> int:
        """R = Nn k: the (token, expert) pairs this rank routes per MoE layer."""
        return self.nn * self.top_k

    @cached_property
    def partial_grads_flat(self) -> int:
        """The flat copy of the TP-partial grads `training.finalize_grads` sums (plan.grad_is_partial;
        none for a single tensor)."""
        partial = [(n, elements) for rule, n, elements in self.counts.partial if is_partial(rule, self.par)]
        tensors = sum(n for n, _ in partial)
        return self.b * sum(elements for _, elements in partial) if tensors > 1 else 0

    @cached_property
    def aux_backward(self) -> tuple[int, int]:
        """MoE with an aux loss: (what a layer's aux loss saved -- its N and load, f + f E --
        freed by its backward, the grad of its score sums it leaves for the router's backward:
        [E] cast to the model dtype, or in float32 the grad of the stacked statistics [2E + 1]
        it is a slice of, moe.RouterStats.stacked)."""
        e = self.aux_loss_experts
        if not e:
            return 0, 0
        return self.f + self.f * e, self.b * e if self.b != self.f else self.f * (2 * e + 1)

    @cached_property
    def router_input(self) -> int:
        """What the router's input adds to the block's column inputs: the post-attention norm's
        output (moe_sizes.moe_column_input); under basic SP the shard (none under --recompute selective),
        else gate/up's share."""
        par = self.par
        if par.sequence_parallel and not par.async_communication:
            return basic_sp_router_input(par, self.b * self.nn * self.hid)
        return self.gate_up_input

    @cached_property
    def ffn_w_grads(self) -> int:
        """One block's feed-forward weight grads (the MLP's three, or the router's and this rank's
        experts'): every block of the stage holds as many."""
        return self.b * self.counts.ffn // self.layers

    @cached_property
    def head_w_grad(self) -> int:
        return self.b * self.vocab * self.hid if self.last else 0

    @cached_property
    def head_grads(self) -> int:
        """The grads the head's backward leaves: the final norm's, and lm_head's unless tied here."""
        return self.b * self.hid + (0 if self.tied_here else self.head_w_grad) if self.last else 0

    @cached_property
    def waiting(self) -> int:
        """A tied weight's grad waits in autograd's buffer for the embedding's contribution."""
        return self.head_w_grad if self.tied_here else 0

    @cached_property
    def ddp_buckets(self) -> int:
        """DDP's flat gradient buckets (no DDP under a pipeline, nor under --zero): every parameter but
        the experts' (DDP ignores them, `data_parallel.wrap_data_parallel`)."""
        if self.par.dp * self.par.cp == 1 or self.par.pp > 1 or self.par.zero:
            return 0
        return self.b * self.counts.dense


@dataclass(frozen=True)
class ParameterCounts:
    """Elements of a stage's parameters: all, the feed-forward's (".mlp."), all but the experts', the
    stage's first block's, each one's."""

    total: int
    ffn: int
    dense: int
    top_block: int
    each: tuple[int, ...]    # every parameter's, in the model's order
    partial: tuple = ()      # (plan.Partial rule, tensors, elements) of each rule (plan.grad_is_partial)

    @classmethod
    def of(cls, shapes: dict, top: str) -> "ParameterCounts":
        sizes = {k: numel(s) for k, s in shapes.items()}
        rules = {rule: [0, 0] for rule in Partial}
        for k, n in sizes.items():
            rule = rules[plan_of(k).partial]
            rule[0], rule[1] = rule[0] + 1, rule[1] + n
        return cls(total=sum(sizes.values()), ffn=sum(n for k, n in sizes.items() if ".mlp." in k),
                   dense=sum(n for k, n in sizes.items() if expert_of(k) is None),
                   top_block=sum(n for k, n in sizes.items() if k.startswith(top)), each=tuple(sizes.values()),
                   partial=tuple((rule, n, elements) for rule, (n, elements) in rules.items()))


def stage_parameter_counts(c: MiniMindConfig, par: ParallelConfig, stage: int, experts: range,
                           model: Frozen | None = None) -> tuple[dict, ParameterCounts]:
    """This rank's parameters of stage `stage` (plan.stage_parameters, holding `experts`) and their
    counts, remembered on what they depend on (plan.SHAPE_FIELDS): the planner asks for the same few
    stages for thousands of layouts. The dict is shared: read it, do not change it. `model`: Frozen(c),
    if made already."""
    return _remembered_counts(model or Frozen(c), tuple(getattr(par, name) for name in SHAPE_FIELDS), stage, experts)


@functools.lru_cache(maxsize=4096)
def _remembered_counts(model: Frozen, shape: tuple, stage: int, experts: range) -> tuple[dict, ParameterCounts]:
    c, par = model.config, ParallelConfig(**dict(zip(SHAPE_FIELDS, shape)))
    return build_stage_parameter_counts(c, par, stage, experts)


def build_stage_parameter_counts(c: MiniMindConfig, par: ParallelConfig, stage: int, experts: range,
                                 model: Frozen | None = None) -> tuple[dict, ParameterCounts]:
    """`stage_parameter_counts` computed from the plan (not remembered; `model` unused: its signature)."""
    shapes = build_stage_parameters(c, par, stage, experts)
    top = f"model.layers.{stage_layers(c.num_hidden_layers, par.pp, stage)[0]}."
    return shapes, ParameterCounts.of(shapes, top)


def stage_sizes(c: MiniMindConfig, par: ParallelConfig, stage: int, *, seq_len: int, micro_batch_size: int,
                num_microbatches: int, dtype, cp_rank: int = 0, routed: tuple[int, ...] = (),
                expert_rows: tuple[tuple[int, ...], ...] = (), model: Frozen | None = None) -> StageSizes:
    """The sizes of pipeline stage `stage` (the whole model when pp = 1) on CP rank `cp_rank`;
    `routed`, `expert_rows`: each layer's MoE bytes beyond the balanced routing's and its local
    experts' rows (StageSizes; default: the balanced routing's). `model`: Frozen(c), if made already."""
    b = dtype.itemsize
    t, n = par.tp, seq_len // par.cp * micro_batch_size
    first, last = is_first_stage(stage), is_last_stage(stage, par.pp)
    # this rank's experts under expert parallelism (every EP rank holds as many)
    experts = local_experts(c.num_experts, par.ep, 0) if c.use_moe else range(c.num_experts)
    shapes, counts = stage_parameter_counts(c, par, stage, experts, model)
    layers_at = stage_layers(c.num_hidden_layers, par.pp, stage)
    tokens = n // par.sequence_shards
    if c.use_moe and not expert_rows:   # balanced: N k rows per rank, split evenly over its experts
        expert_rows = (tuple(balanced_counts(tokens * c.num_experts_per_tok, c.num_experts // par.ep)),) * len(layers_at)
    return StageSizes(par=par, b=b, f=max(b, 4), n=n, nn=n // par.sequence_shards,
                      hid=c.hidden_size, inter=c.intermediate_size // t,
                      vocab=c.vocab_size // t if par.vocab_parallel else c.vocab_size, bsz=micro_batch_size,
                      mb=num_microbatches, first=first, last=last,
                      tied_here=c.tie_word_embeddings and first and last, shapes=shapes, counts=counts,
                      kinds=activations_by_kind(c, par, seq_len=seq_len, micro_batch_size=micro_batch_size, dtype=dtype),
                      layers=len(layers_at),
                      block_params=b * counts.top_block,
                      heads=c.num_attention_heads // t, kv_heads=c.num_key_value_heads // t, head_dim=c.head_dim,
                      chunk_len=seq_len // (2 * par.cp if par.cp_load_balance else par.cp), cp_rank=cp_rank,
                      routed=routed, top_k=c.num_experts_per_tok if c.use_moe else 0,
                      expert_inter=c.moe_intermediate_size if c.use_moe else 0, expert_rows=expert_rows,
                      aux_loss_experts=c.num_experts if c.use_moe and c.router_aux_loss_coef > 0 else 0)


def chunk_sizes(c: MiniMindConfig, par: ParallelConfig, stage: int, each: tuple[dict, ...] = (),
                **kw) -> list[StageSizes]:
    """The sizes of each model chunk of pipeline stage `stage` (one without virtual stages): chunk
    v is virtual stage v P + stage, sized as that stage of a P V-stage pipeline (its layers, the
    embedding on the first, the head on the last; the plan's `stage_chunks`). `each[v]`: chunk v's
    own `routed` and `expert_rows` (MoE under a measured routing; none: the balanced one's)."""
    chunked = replace(par, pp=par.pp * par.virtual_stages, virtual_stages=1)
    return [stage_sizes(c, chunked, v * par.pp + stage, **kw, **(each[v] if each else {}))
            for v in range(par.virtual_stages)]


def chunk_rows(n: int, chunks: int) -> list[int]:
    """Rows of each chunk of `torch.tensor_split(n rows, chunks)`: the first n % chunks one longer."""
    return [n // chunks + (1 if i < n % chunks else 0) for i in range(chunks)]


def top_block_acts(s: StageSizes) -> int:
    """The activations alive when the stage's last block begins its backward: on the last stage
    the loss, the head's input and the final norm's are freed by then."""
    if not s.last:
        return s.held
    k, f, nn_, hid = s.kinds, s.f, s.nn, s.hid
    head = s.held - s.weight - k["model.logits_loss"] - k["model.head_input"]
    if s.par.recompute.lean:
        return head - k["model.final_norm"]
    return head - (f * nn_ * hid + f * nn_) - f * nn_ * hid


def top_block_saved(s: StageSizes, freed: int) -> tuple[int, int]:
    """In the top block's backward, `freed` bytes of its saved tensors released: (activations,
    re-made tensors). --recompute full: the block's re-run saved them, under the checkpoint's
    own hooks, so they are temporaries to the tracker; otherwise activations."""
    if s.par.recompute == Recompute.FULL:
        return top_block_acts(s), s.recomputed - freed
    return top_block_acts(s) - freed, 0
