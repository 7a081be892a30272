"""MiniMind-3 under tensor / sequence / vocab parallelism (Megatron-style), sequence-first.

Parameter names are MiniMind's state-dict keys; each rank holds its shard of them
(`sharding.shard_state_dict`). Layouts, with T = TP size:

    ids [B, S] -> [S, B] -> embedding -> h [S, B, H]   (SP: [S/T, B, H] in norm/residual regions)
    block: h + o_proj(attn(qkv(norm(h)))) ; h + down(silu(gate) * up)(norm(h))
           q/k/v, gate/up: column-parallel [.., N/T];  o/down: row-parallel, partial -> sum
    final norm -> lm_head: replicated [S, B, V], or column-parallel [S, B, V/T] with --vocab_parallel

Under context parallelism (C ranks) every layout above holds this CP rank's S/C tokens instead of
S (its chunks of the `ContextLayout`, load-balanced by default): RoPE reads each token's global
position and attention crosses the CP group (`context_parallel_attention`, `--cp_comm_type`);
everything else is token-wise and runs unchanged on the local tokens.

`--recompute selective` swaps in the lean pieces of `recompute/` (RMSNorm saving its input and
rsqrt, GQA attention without repeat_kv copies, SwiGLU recompute); `full` also checkpoints every
block; `--loss_chunks K` computes the head and the loss over K token chunks.

Under pipeline parallelism (P stages) a rank builds only its stage: layers
[p*L/P, (p+1)*L/P), the embedding on stage 0, the final norm and lm_head on stage P-1. With V
virtual stages (interleaved 1F1B) it holds V chunks of L/(P V) layers, chunks p, p+P, .. of the
P V, and a forward runs one chunk: the embedding before the first chunk (stage 0's chunk 0), the
final norm and lm_head after the last (stage P-1's chunk V-1). Which
layer holds each parameter (its style: `styles.build_layer`), which stage builds what, and which
grads are partial over TP or shared between stages, is read from the parallel plan (`plan.py`).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .config import MiniMindConfig, ParallelConfig, Recompute
from .context_parallel import ContextLayout, context_parallel_attention
from .data.batches import IGNORE_INDEX
from .data_parallel import mark_expert_parameter
from .groups import ProcessGroups
from .loss_normalisation import expert_statistics, token_mean
from .model import CausalLMOutput, apply_rope, causal_attention, moe_aux_loss, repeat_kv, rope_tables
from .moe import MOEFeedForward, RouterStats, local_stats, summed_over
from .moe.dispatch import AllToAllDispatcher
from .moe.placement import local_experts
from .recompute import (causal_attention_gqa, checkpoint_block, chunked_head_loss, norm_with_recompute,
                        swiglu_linear)
from .plan import (LAYER, Style, grad_is_partial, grad_is_shared_over_stages, is_first_stage, is_last_stage,
                   plan_of, stage_chunks, stage_of)
from .styles import build_layer, moe_linear
from .tensor_parallel.deferred_wgrad import linear
from .tensor_parallel import (column_parallel, copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                              mark_partial_grad, scatter_to_sequence_parallel_region, vocab_parallel_cross_entropy)


class ParallelAttention(nn.Module):
    def __init__(self, c: MiniMindConfig, par: ParallelConfig, group, cp_group=None):
        super().__init__()
        t = par.tp
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads // t, c.num_key_value_heads // t, c.head_dim
        self.flash, self.lean = c.flash_attn, par.recompute.lean
        self.cp_group, self.cp_comm_type = cp_group, par.cp_comm_type
        self.q_proj = build_layer(LAYER + "self_attn.q_proj.weight", c, par, group)   # [heads/T * d, H]
        self.k_proj = build_layer(LAYER + "self_attn.k_proj.weight", c, par, group)   # [kv_heads/T * d, H]
        self.v_proj = build_layer(LAYER + "self_attn.v_proj.weight", c, par, group)
        self.o_proj = build_layer(LAYER + "self_attn.o_proj.weight", c, par, group)   # [H, heads/T * d]
        # each rank normalises only its own heads
        self.q_norm = build_layer(LAYER + "self_attn.q_norm.weight", c, par, group)
        self.k_norm = build_layer(LAYER + "self_attn.k_norm.weight", c, par, group)

    def forward(self, x, cos, sin, layout: ContextLayout | None = None):
        # x: [S/T, B, H] under SP, else [S, B, H]; under CP S is this rank's S/C tokens (`layout`)
        q, k, v = column_parallel([self.q_proj, self.k_proj, self.v_proj], x)  # [S, B, heads/T * d]
        s, b = q.shape[:2]
        q = q.view(s, b, self.n_heads, self.head_dim)
        k = k.view(s, b, self.n_kv, self.head_dim)
        v = v.view(s, b, self.n_kv, self.head_dim)
        q = apply_rope(self.q_norm(q), cos[:, None], sin[:, None])
        k = apply_rope(self.k_norm(k), cos[:, None], sin[:, None])
        if self.cp_group is not None:                               # [S/C, B, h, d] -> [S/C, B, h, d]
            out = context_parallel_attention(q, k, v, group=self.cp_group, layout=layout,
                                             comm_type=self.cp_comm_type)
            return self.o_proj(out.reshape(s, b, -1))
        q = q.permute(1, 2, 0, 3)                                   # [B, h, S, d]
        if self.lean:                                               # kv heads read in place: [B, k, S, d]
            out = causal_attention_gqa(q, k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), flash=self.flash)
        else:
            rep = self.n_heads // self.n_kv
            k = repeat_kv(k.transpose(0, 1), rep).transpose(1, 2)   # [B, h, S, d]
            v = repeat_kv(v.transpose(0, 1), rep).transpose(1, 2)
            out = causal_attention(q, k, v, flash=self.flash)       # [B, h, S, d]
        out = out.permute(2, 0, 1, 3).reshape(s, b, -1)             # [S, B, h*d]
        return self.o_proj(out)                                     # [S/T, B, H] (SP) or [S, B, H]


class ParallelMLP(nn.Module):
    def __init__(self, c: MiniMindConfig, par: ParallelConfig, group):
        super().__init__()
        self.lean = par.recompute.lean
        self.gate_proj = build_layer(LAYER + "mlp.gate_proj.weight", c, par, group)   # [I/T, H]
        self.down_proj = build_layer(LAYER + "mlp.down_proj.weight", c, par, group)   # [H, I/T]
        self.up_proj = build_layer(LAYER + "mlp.up_proj.weight", c, par, group)       # [I/T, H]

    def forward(self, x):
        gate, up = column_parallel([self.gate_proj, self.up_proj], x)   # [S, B, I/T]
        if self.lean:                                               # keeps gate and up only
            return self.down_proj.leave_region(swiglu_linear(gate, up, self.down_proj.weight))
        return self.down_proj(F.silu(gate) * up)


def parallel_moe(c: MiniMindConfig, par: ParallelConfig, group, groups: ProcessGroups | None = None) -> MOEFeedForward:
    """The MoE layer under TP: router and experts whole on every TP rank (the plan's ROUTER and
    EXPERT styles). Without SP every TP rank routes the same [S, B, H] tokens (no TP collective);
    under SP each routes its own [S/T, B, H] shard, and the aux loss's statistics are summed over
    TP so it is the whole batch's.

    With the rank's `groups`: expert parallelism (Megatron-LM's layout). The layer holds EP rank
    r's experts under their global indices (`moe.placement`), and the all-to-all dispatcher sends
    each routed token from its sequence shard to its expert's rank and back (`moe.dispatch`); the
    aux loss's statistics are summed over the ranks whose tokens it counts
    (`loss_normalisation.expert_statistics`: the global batch, or each replica's)."""
    linear = moe_linear(c, par, group)
    if groups is None:
        reduce = summed_over(group) if par.sequence_parallel else local_stats
        return MOEFeedForward(c, linear=linear, reduce_stats=reduce)
    return MOEFeedForward(c, expert_ids=local_experts(c.num_experts, par.ep, groups.ep_rank),
                          dispatcher=AllToAllDispatcher(groups.ep, c.num_experts), linear=linear,
                          reduce_stats=batch_statistics(groups))


def batch_statistics(groups: ProcessGroups):
    """A MoE layer's `reduce_stats`: its routing statistics summed over the token-holding ranks."""
    def reduce(stats: RouterStats) -> RouterStats:
        return RouterStats.unstack(expert_statistics(stats.stacked(), groups))
    return reduce


class ParallelBlock(nn.Module):
    def __init__(self, c: MiniMindConfig, par: ParallelConfig, group, cp_group=None, groups=None):
        super().__init__()
        self.self_attn = ParallelAttention(c, par, group, cp_group)
        self.input_layernorm = build_layer(LAYER + "input_layernorm.weight", c, par, group)
        self.post_attention_layernorm = build_layer(LAYER + "post_attention_layernorm.weight", c, par, group)
        self.mlp = parallel_moe(c, par, group, groups) if c.use_moe else ParallelMLP(c, par, group)
        self.norm_recompute = par.recompute == Recompute.SELECTIVE   # under `full` the checkpoint's hooks rule

    def forward(self, h, cos, sin, layout: ContextLayout | None = None):
        if not self.norm_recompute:
            h = h + self.self_attn(self.input_layernorm(h), cos, sin, layout)
            return h + self.mlp(self.post_attention_layernorm(h))
        x, recompute = norm_with_recompute(self.input_layernorm, h)   # the linears' copies of x re-made
        with recompute:
            a = self.self_attn(x, cos, sin, layout)
        h = h + a
        x, recompute = norm_with_recompute(self.post_attention_layernorm, h)
        with recompute:
            m = self.mlp(x)
        return h + m


class ParallelMiniMindModel(nn.Module):
    """The layers of `chunks` (global indices, one range per model chunk) of the decoder, the embedding when `embedding` (the
    first pipeline stage) and the final norm when `final_norm` (the last). Under CP (`cp_group`)
    the rank holds the tokens of CP rank `cp_rank`."""

    def __init__(self, c: MiniMindConfig, par: ParallelConfig, group, *, chunks: list[range], embedding: bool,
                 final_norm: bool, cp_group=None, cp_rank: int = 0, groups: ProcessGroups | None = None):
        super().__init__()
        self.group, self.sp, self.vp = group, par.sequence_parallel, par.vocab_parallel
        self.seq_shards = par.sequence_shards
        self.checkpoint = par.recompute == Recompute.FULL
        self.par, self.cp_rank = par, cp_rank
        self.embed_tokens = build_layer("model.embed_tokens.weight", c, par, group) if embedding else None
        # A dict keyed by the global index keeps MiniMind's names (`model.layers.{i}`) on every stage.
        self.layers = nn.ModuleDict({str(i): ParallelBlock(c, par, group, cp_group, groups)
                                     for chunk in chunks for i in chunk})
        self.chunks = [[str(i) for i in chunk] for chunk in chunks]   # this stage's model chunks, local order
        self.norm = build_layer("model.norm.weight", c, par, group) if final_norm else None
        cos, sin = rope_tables(c.head_dim, c.max_position_embeddings, c.rope_theta, scaling=c.rope_scaling)
        self.register_buffer("freqs_cos", cos, persistent=False)
        self.register_buffer("freqs_sin", sin, persistent=False)

    def forward(self, input_ids=None, hidden_states=None, chunk: int = 0):
        """Model chunk `chunk` of this stage (its only one without virtual stages). The first chunk
        of the first stage: input_ids [B, S]; the others: hidden_states [S/T, B, H] (SP) or [S, B, H]."""
        last_chunk = chunk == len(self.chunks) - 1
        if self.embed_tokens is not None and chunk == 0:
            h = self.embed_tokens(input_ids.t())                     # [B, S] -> [S, B] -> [S, B, H]; VP+SP: [S/T, B, H]
            if self.sp and not self.vp:
                h = scatter_to_sequence_parallel_region(h, self.group)  # [S, B, H] -> [S/T, B, H]
        else:
            h = hidden_states
        cos, sin, layout = self._rope(h.shape[0] * self.seq_shards)
        for name in self.chunks[chunk]:
            layer = self.layers[name]
            h = checkpoint_block(layer, h, cos, sin, layout) if self.checkpoint else layer(h, cos, sin, layout)
        return self.norm(h) if self.norm is not None and last_chunk else h   # [S/T, B, H] (SP) or [S, B, H]


    def _rope(self, local: int):
        """RoPE tables [local, d] of this rank's tokens (`local` = S, or S/C under CP) and the CP layout."""
        if self.par.cp == 1:
            return self.freqs_cos[:local], self.freqs_sin[:local], None
        layout = ContextLayout.of(self.par, local * self.par.cp)
        positions = layout.positions(self.cp_rank, device=self.freqs_cos.device)   # global, local order
        return self.freqs_cos[positions], self.freqs_sin[positions], layout


class ParallelMiniMindForCausalLM(nn.Module):
    """The TP/SP/VP model, or one pipeline stage of it (`groups.pp_rank` of `par.pp` stages).

    forward(input_ids [B, S], targets [B, S]) -> CausalLMOutput with logits [B, S, V] (or this
    rank's vocab slice [B, S, V/T] with --vocab_parallel). Under PP only the last stage returns
    that; the others return the hidden states [S/T, B, H] (SP) or [S, B, H] for the next stage,
    and every stage but the first takes `hidden_states` from the previous one instead of ids.

    Tied embeddings: within one stage the two names share one Parameter. Across stages the first
    stage's embedding and the last stage's lm_head are two copies with the same initial values;
    their grads are summed over the embedding group (`training.finalize_grads`) so they stay equal.
    """

    def __init__(self, config: MiniMindConfig, par: ParallelConfig, groups: ProcessGroups):
        super().__init__()
        self.config, self.par, self.group = config, par, groups.tp
        stage, pp = groups.pp_rank, par.pp
        self.first, self.last = is_first_stage(stage), is_last_stage(stage, pp)
        chunks = stage_chunks(config.num_hidden_layers, pp, stage, par.virtual_stages)

        def holds(key: str) -> bool:
            return stage_of(key, config.num_hidden_layers, pp, par.virtual_stages) == stage

        self.model = ParallelMiniMindModel(config, par, groups.tp, chunks=chunks,
                                           embedding=holds("model.embed_tokens.weight"),
                                           final_norm=holds("model.norm.weight"), cp_group=groups.cp,
                                           cp_rank=groups.cp_rank, groups=groups)
        self.lm_head = build_layer("lm_head.weight", config, par, groups.tp) if holds("lm_head.weight") else None
        self.weight_grad_store = None   # a zero-bubble schedule's, for the replicated head (deferred_wgrad)
        if config.tie_word_embeddings and self.model.embed_tokens is not None and self.lm_head is not None:
            self.model.embed_tokens.weight = self.lm_head.weight
        self._mark_grads()

    def _mark_grads(self) -> None:
        """Mark, as the plan says, the grads to sum over TP (norms on sequence shards, q_norm/k_norm
        on this rank's heads) and the tied copy to sum with the other stage's."""
        for name, param in self.named_parameters():
            if grad_is_partial(name, self.par):
                mark_partial_grad(param)
            if grad_is_shared_over_stages(name, self.config, self.par):
                mark_shared_embedding(param)
            if plan_of(name).style is Style.EXPERT:   # reduced over EDP, not DP x CP
                mark_expert_parameter(param)

    def stage_aux_loss(self, chunk: int = 0):
        """The MoE layers' aux loss of model chunk `chunk` of this stage, of its last forward (None:
        a dense model). Each chunk's forward sets its own layers' only: with virtual stages a
        chunk's aux loss is its layers' of that microbatch."""
        return moe_aux_loss([self.model.layers[name] for name in self.model.chunks[chunk]])

    def forward(self, input_ids=None, targets=None, hidden_states=None, chunk: int = 0):
        """targets: the next token of every position (`data.batches`), -100 where none; the loss
        runs over all S positions. Under CP ids and targets are this rank's [B, S/C] tokens
        (`data.batches.cp_tokens`), the logits too, and the loss is the mean over its targets
        (the schedule weights it by its share of the targets of every CP rank)."""
        h = self.model(input_ids, hidden_states, chunk)
        if not self.last or chunk < self.par.virtual_stages - 1:
            return h                                                 # to the next (virtual) stage
        aux = self.stage_aux_loss(chunk)                             # this chunk's MoE layers'
        if targets is not None and self.par.loss_chunks > 1:         # the logits never exist whole
            return CausalLMOutput(logits=None, loss=self._chunked_loss(h, targets.t()), aux_loss=aux)
        if self.par.vocab_parallel:
            logits = self.lm_head(h)                                 # enters the TP region: [S, B, V/T]
        else:
            if self.par.sequence_parallel:                           # replicated head: bwd keeps own slice
                h = gather_from_sequence_parallel_region(h, self.group, grad_is_partial=False)
            logits = linear(h, self.lm_head.weight, None, self.weight_grad_store)   # [S, B, V]
        loss = None
        if targets is not None:
            y = targets.t()                                          # [B, S] -> [S, B], as the logits
            if self.par.vocab_parallel:
                loss = vocab_parallel_cross_entropy(logits, y, self.group)
            elif self.par.cp > 1:   # a CP rank's tokens may all be padding: 0 targets give 0, not NaN
                total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE_INDEX,
                                        reduction="sum")
                loss = token_mean(total, y)
            else:
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE_INDEX)
        return CausalLMOutput(logits=logits.transpose(0, 1), loss=loss, aux_loss=aux)


    def _chunked_loss(self, h, y):
        """--loss_chunks K: the head's input enters the head's region once ([S/T, B, H] -> [S, B, H]
        under SP), then lm_head and the loss run chunk by chunk (`recompute.chunked_head_loss`).
        y: targets [S, B], as the hidden states."""
        group = self.group if self.par.vocab_parallel else None
        if self.par.sequence_parallel:   # VP: partial input grads, reduce-scattered; replicated: own slice
            h = gather_from_sequence_parallel_region(h, self.group, grad_is_partial=self.par.vocab_parallel)
        elif self.par.vocab_parallel:
            h = copy_to_tensor_parallel_region(h, self.group)        # bwd: all-reduce the partial input grads
        return chunked_head_loss(h, self.lm_head.weight, y, chunks=self.par.loss_chunks, group=group)


def mark_shared_embedding(param: nn.Parameter) -> nn.Parameter:
    """This copy of a tied embedding lives on the first or the last pipeline stage: its grad is
    summed with the other copy's over the embedding group."""
    param.shared_embedding = True
    return param
