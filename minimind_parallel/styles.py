"""The layer each style of the parallel plan builds.

As in torchtitan's tensor-parallel plan, where a module path maps to a ParallelStyle
(ColwiseParallel, RowwiseParallel, SequenceParallel) that decides how the module runs on the
mesh, a parameter's `Style` in `plan.PLAN` decides which module holds it here: the parallel
model asks `build_layer` for the module of each parameter and names no layer class itself.

    COLUMN           ColumnParallelLinear [out/T, in]: the async linear under --async_communication;
                     linears reading one input share its SP all-gather under --shared_sp_gather
    ROW              RowParallelLinear [out, in/T]
    VOCAB_EMBEDDING  VocabParallelEmbedding [V/T, H] with --vocab_parallel, else nn.Embedding [V, H]
    VOCAB_HEAD       ColumnParallelLinear [V/T, H] with --vocab_parallel, else nn.Linear [V, H]
    NORM             MiniMind's RMSNorm, or the lean one under --recompute selective|full
    ROUTER, EXPERT   nn.Linear of the dense shape: an MoE layer's gate and its experts' SwiGLU
                     weights, whole on every TP rank (`moe.MOEFeedForward` builds them through
                     `moe_linear`)

A new kind of parameter is a new row of the plan, with a new style and its builder here.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from .config import MiniMindConfig, ParallelConfig
from .plan import LAYER, Style, plan_of
from .recompute import make_rms_norm
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

# (dense shape, model config, layout, TP group) -> the module holding the parameter
Builder = Callable[[tuple[int, ...], MiniMindConfig, ParallelConfig, object], nn.Module]


def _column(shape, c, par, group):
    out_features, in_features = shape
    return ColumnParallelLinear(in_features, out_features, group=group, sequence_parallel=par.sequence_parallel,
                                async_communication=par.async_communication, shared_input=par.shared_sp_gather)


def _row(shape, c, par, group):
    out_features, in_features = shape
    return RowParallelLinear(in_features, out_features, group=group, sequence_parallel=par.sequence_parallel)


def _vocab_embedding(shape, c, par, group):
    vocab, hidden = shape
    if par.vocab_parallel:
        return VocabParallelEmbedding(vocab, hidden, group=group, sequence_parallel=par.sequence_parallel)
    return nn.Embedding(vocab, hidden)


def _vocab_head(shape, c, par, group):
    vocab, hidden = shape
    if par.vocab_parallel:
        return ColumnParallelLinear(hidden, vocab, group=group, sequence_parallel=par.sequence_parallel,
                                    async_communication=par.async_communication)
    return nn.Linear(hidden, vocab, bias=False)


def _whole_linear(shape, c, par, group):
    out_features, in_features = shape
    return nn.Linear(in_features, out_features, bias=False)


def _norm(shape, c, par, group):
    (dim,) = shape
    return make_rms_norm(dim, c.rms_norm_eps, lean=par.recompute.lean)


LAYERS: dict[Style, Builder] = {
    Style.COLUMN: _column,
    Style.ROW: _row,
    Style.VOCAB_EMBEDDING: _vocab_embedding,
    Style.VOCAB_HEAD: _vocab_head,
    Style.NORM: _norm,
    Style.ROUTER: _whole_linear,
    Style.EXPERT: _whole_linear,
}


def build_layer(key: str, c: MiniMindConfig, par: ParallelConfig, group) -> nn.Module:
    """The module holding parameter `key` (a state-dict key; `plan.LAYER` for any layer) on one
    rank of the TP group `group`, as its plan row's style says, with `.weight` at its local shape
    (`plan.local_shape`); the weights are filled by sharding a dense state dict (`sharding`)."""
    entry = plan_of(key)
    return LAYERS[entry.style](entry.shape(c), c, par, group)


def moe_linear(c: MiniMindConfig, par: ParallelConfig, group):
    """The `linear` builder an MoE layer (`moe.MOEFeedForward`) takes: its key below the layer
    ("gate.weight", "experts.%.up_proj.weight") -> the plan's layer for it."""
    def build(key: str, shape) -> nn.Module:
        return build_layer(LAYER + "mlp." + key, c, par, group)
    return build
