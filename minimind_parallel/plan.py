"""The parallel plan: every parameter of MiniMind-3, how tensor parallelism cuts it, when its
gradient is partial over TP, which pipeline stage owns it and its dense shape -- one table.

As in torchtitan's layer plan (a dict from module path to ColwiseParallel / RowwiseParallel /
SequenceParallel), the layout is data: the model's construction (`parallel_model`: the layer each
style builds, `styles.build_layer`; which stage builds the embedding, final norm and lm_head;
which grads are marked partial or shared), the sharding of a state dict (`sharding`), the dense
slices of validation and the memory model's parameters (`memory.analytic`) all read `PLAN`
through the functions below. Adding a layer or a parallelism edits this table (and, for a new
style, adds its layer to `styles.py`); tests/test_plan.py fails when the table and the model
disagree.

    style        COLUMN: dim 0 (output features) split over TP;  ROW: dim 1 (input features);
                 VOCAB_EMBEDDING, VOCAB_HEAD: dim 0 (vocabulary rows) of the embedding / the
                 lm_head with --vocab_parallel, else replicated;
                 NORM: a norm's weight, every TP rank holds all of it;
                 ROUTER: an MoE layer's gate [E, H]; EXPERT: one expert's SwiGLU weight -- both
                 whole on every TP rank (expert-tensor-parallel size 1, as Megatron-LM's
                 --expert-tensor-parallel-size 1): without SP every TP rank routes the same
                 tokens through the same experts, under SP each its own sequence shard
    model        which models have the row: ANY, DENSE (the SwiGLU MLP) or MOE (use_moe: the
                 router and the experts, "%" in the pattern being the expert index)
    partial      when the gradient on one TP rank is a part of the full one, summed over TP by
                 `training.finalize_grads`: NEVER; UNDER_SP (a norm that runs on sequence
                 shards, and the router and experts, which then route only the shard's tokens);
                 WHEN_TP (q_norm/k_norm: each rank normalises only its own heads)
    owner        LAYER: the stage of its layer (contiguous L/P layers per stage; with V virtual
                 stages, chunks of L/(P V) layers, chunk c on stage c mod P); FIRST / LAST stage
    tied         the embedding / lm_head pair that --tie_word_embeddings makes one weight: one
                 Parameter within a stage, two copies summed over the embedding group across stages
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from enum import Enum
from typing import Callable

from .config import MiniMindConfig, ParallelConfig
from .memo import Frozen


class Style(Enum):
    COLUMN = "column"
    ROW = "row"
    VOCAB_EMBEDDING = "vocab embedding"
    VOCAB_HEAD = "vocab head"
    NORM = "norm"
    ROUTER = "router"
    EXPERT = "expert"


class Models(Enum):
    ANY = "any model"
    DENSE = "dense models"
    MOE = "mixture-of-experts models"


class Partial(Enum):
    NEVER = "never"
    UNDER_SP = "under sequence parallelism"
    WHEN_TP = "whenever tp > 1"


class Owner(Enum):
    LAYER = "the layer's stage"
    FIRST = "first stage"
    LAST = "last stage"


@dataclass(frozen=True, kw_only=True)
class ParamPlan:
    pattern: str                                   # state-dict key; "*" is the global layer index
    style: Style
    shape: Callable[[MiniMindConfig], tuple[int, ...]]   # the dense shape
    partial: Partial = Partial.NEVER
    owner: Owner = Owner.LAYER
    tied: bool = False
    models: Models = Models.ANY

    def applies(self, c: MiniMindConfig) -> bool:
        """Whether a model of config `c` has this parameter."""
        return self.models is Models.ANY or (self.models is Models.MOE) == c.use_moe


def _q(c):  # [heads * d, H]
    return (c.num_attention_heads * c.head_dim, c.hidden_size)


def _kv(c):  # [kv_heads * d, H]
    return (c.num_key_value_heads * c.head_dim, c.hidden_size)


def _up(c):  # [I, H]
    return (c.intermediate_size, c.hidden_size)


def _router(c):  # [E, H]
    return (c.num_experts, c.hidden_size)


def _expert_up(c):  # [I_moe, H]
    return (c.moe_intermediate_size, c.hidden_size)


def _vocab(c):  # [V, H]
    return (c.vocab_size, c.hidden_size)


def _hidden(c):
    return (c.hidden_size,)


def _head(c):
    return (c.head_dim,)


LAYER = "model.layers.*."   # the key prefix of a parameter of any layer
EXPERT = LAYER + "mlp.experts.%."   # the key prefix of a parameter of any expert of any layer
# In the model's parameter order (the optimizer's): first stage, each layer, last stage.
PLAN: tuple[ParamPlan, ...] = (
    ParamPlan(pattern="model.embed_tokens.weight", style=Style.VOCAB_EMBEDDING, shape=_vocab, owner=Owner.FIRST,
              tied=True),
    ParamPlan(pattern=LAYER + "self_attn.q_proj.weight", style=Style.COLUMN, shape=_q),
    ParamPlan(pattern=LAYER + "self_attn.k_proj.weight", style=Style.COLUMN, shape=_kv),
    ParamPlan(pattern=LAYER + "self_attn.v_proj.weight", style=Style.COLUMN, shape=_kv),
    ParamPlan(pattern=LAYER + "self_attn.o_proj.weight", style=Style.ROW, shape=lambda c: _q(c)[::-1]),
    ParamPlan(pattern=LAYER + "self_attn.q_norm.weight", style=Style.NORM, shape=_head, partial=Partial.WHEN_TP),
    ParamPlan(pattern=LAYER + "self_attn.k_norm.weight", style=Style.NORM, shape=_head, partial=Partial.WHEN_TP),
    ParamPlan(pattern=LAYER + "input_layernorm.weight", style=Style.NORM, shape=_hidden, partial=Partial.UNDER_SP),
    ParamPlan(pattern=LAYER + "post_attention_layernorm.weight", style=Style.NORM, shape=_hidden,
              partial=Partial.UNDER_SP),
    ParamPlan(pattern=LAYER + "mlp.gate_proj.weight", style=Style.COLUMN, shape=_up, models=Models.DENSE),
    ParamPlan(pattern=LAYER + "mlp.down_proj.weight", style=Style.ROW, shape=lambda c: _up(c)[::-1],
              models=Models.DENSE),
    ParamPlan(pattern=LAYER + "mlp.up_proj.weight", style=Style.COLUMN, shape=_up, models=Models.DENSE),
    ParamPlan(pattern=LAYER + "mlp.gate.weight", style=Style.ROUTER, shape=_router, partial=Partial.UNDER_SP,
              models=Models.MOE),
    ParamPlan(pattern=EXPERT + "gate_proj.weight", style=Style.EXPERT, shape=_expert_up, partial=Partial.UNDER_SP,
              models=Models.MOE),
    ParamPlan(pattern=EXPERT + "down_proj.weight", style=Style.EXPERT, shape=lambda c: _expert_up(c)[::-1],
              partial=Partial.UNDER_SP, models=Models.MOE),
    ParamPlan(pattern=EXPERT + "up_proj.weight", style=Style.EXPERT, shape=_expert_up, partial=Partial.UNDER_SP,
              models=Models.MOE),
    ParamPlan(pattern="model.norm.weight", style=Style.NORM, shape=_hidden, partial=Partial.UNDER_SP,
              owner=Owner.LAST),
    ParamPlan(pattern="lm_head.weight", style=Style.VOCAB_HEAD, shape=_vocab, owner=Owner.LAST, tied=True),
)

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


@functools.lru_cache(maxsize=4096)
def plan_of(key: str) -> ParamPlan:
    """The table entry of the state-dict key `key` (KeyError for a name the plan does not know).
    A pure function of the key and the table, remembered: the memory model asks it for every
    parameter of every layout the planner weighs."""
    pattern = _EXPERT.sub(".mlp.experts.%.", _LAYER.sub(LAYER, key, count=1), count=1)
    for entry in PLAN:
        if entry.pattern == pattern:
            return entry
    raise KeyError(f"{key!r} has no entry in the parallel plan (minimind_parallel/plan.py)")


def tp_split_dim(key: str, par: ParallelConfig) -> int | None:
    """The dim of `key` that TP splits, or None if every TP rank holds all of it."""
    style = plan_of(key).style
    if style in (Style.VOCAB_EMBEDDING, Style.VOCAB_HEAD):
        return 0 if par.vocab_parallel else None
    return {Style.COLUMN: 0, Style.ROW: 1}.get(style)


def grad_is_partial(key: str, par: ParallelConfig) -> bool:
    """Whether one TP rank's gradient of `key` is a part of the full one (summed over TP)."""
    return is_partial(plan_of(key).partial, par)


def is_partial(partial: Partial, par: ParallelConfig) -> bool:
    """Whether a gradient of the plan's `partial` rule is partial under `par`."""
    if partial is Partial.UNDER_SP:
        return par.sequence_parallel
    return partial is Partial.WHEN_TP and par.tp > 1


def grad_is_shared_over_stages(key: str, c: MiniMindConfig, par: ParallelConfig) -> bool:
    """Whether `key` is one of two copies of a tied weight on the first and last pipeline stage
    (their grads are summed over the embedding group)."""
    return plan_of(key).tied and c.tie_word_embeddings and par.pp > 1


def is_first_stage(stage: int) -> bool:
    return stage == 0


def is_last_stage(stage: int, pp: int) -> bool:
    return stage == pp - 1


def chunk_layers(num_layers: int, pp: int, virtual_stages: int, chunk: int) -> range:
    """The contiguous global layer indices of model chunk `chunk` of pp x virtual_stages (the
    virtual stage `chunk`; num_layers % (pp * virtual_stages) == 0, see check_layout)."""
    per_chunk = num_layers // (pp * virtual_stages)
    return range(chunk * per_chunk, (chunk + 1) * per_chunk)


def stage_chunks(num_layers: int, pp: int, stage: int, virtual_stages: int = 1) -> list[range]:
    """The layers of each model chunk stage `stage` holds, its local chunk order: chunks stage,
    stage + P, stage + 2P, .. (Megatron-LM's interleaved assignment; one chunk without virtual stages)."""
    return [chunk_layers(num_layers, pp, virtual_stages, v * pp + stage) for v in range(virtual_stages)]


def stage_layers(num_layers: int, pp: int, stage: int, virtual_stages: int = 1) -> list[int]:
    """The global layer indices of stage `stage`, ascending: L/P contiguous ones without virtual
    stages, else its chunks' (`stage_chunks`)."""
    return [i for chunk in stage_chunks(num_layers, pp, stage, virtual_stages) for i in chunk]


def stage_of(key: str, num_layers: int, pp: int, virtual_stages: int = 1) -> int:
    """The pipeline stage holding `key`: the stage of its layer's chunk (chunk c on stage c mod P).
    The embedding is on the first stage (the first chunk); a tied lm_head is the last stage's copy
    (the last chunk, P x V - 1, is on stage P - 1)."""
    owner = plan_of(key).owner
    if owner is Owner.LAYER:
        return int(_LAYER.match(key).group(1)) // (num_layers // (pp * virtual_stages)) % pp
    return 0 if owner is Owner.FIRST else pp - 1


def local_shape(key: str, c: MiniMindConfig, par: ParallelConfig) -> tuple[int, ...]:
    """The shape of one TP rank's shard of `key`."""
    shape, dim = list(plan_of(key).shape(c)), tp_split_dim(key, par)
    if dim is not None:
        shape[dim] //= par.tp
    return tuple(shape)


def stage_parameters(c: MiniMindConfig, par: ParallelConfig, stage: int = 0,
                     experts: range | None = None) -> dict[str, tuple[int, ...]]:
    """The parameters of one rank of pipeline stage `stage` with their local shapes, in the model's
    order (the optimizer's); a weight tied within the stage is listed once, under its first name.
    `experts`: the MoE experts this rank holds (default all).

    Remembered on the model and the layout fields it reads (`SHAPE_FIELDS`; each call gets its own
    dict): the memory model asks it for every stage of every layout the planner weighs."""
    experts = range(c.num_experts) if experts is None else experts
    shape = tuple(getattr(par, name) for name in SHAPE_FIELDS)
    return dict(_remembered_stage_parameters(Frozen(c), shape, stage, experts))


# the ParallelConfig fields that stage parameters depend on (tests/test_planning.py checks the others do not matter)
SHAPE_FIELDS = ("tp", "pp", "vocab_parallel", "virtual_stages")


@functools.lru_cache(maxsize=4096)
def _remembered_stage_parameters(model: Frozen, shape: tuple, stage: int, experts: range) -> tuple:
    par = ParallelConfig(**dict(zip(SHAPE_FIELDS, shape)))
    return tuple(build_stage_parameters(model.config, par, stage, experts).items())


def build_stage_parameters(c: MiniMindConfig, par: ParallelConfig, stage: int = 0,
                           experts: range | None = None) -> dict[str, tuple[int, ...]]:
    """`stage_parameters` computed from the table (not remembered)."""
    first, last = is_first_stage(stage), is_last_stage(stage, par.pp)
    experts = range(c.num_experts) if experts is None else experts
    rows = [e for e in PLAN if e.applies(c)]
    entries = [(e.pattern, e) for e in rows if e.owner is Owner.FIRST and first]
    for i in stage_layers(c.num_hidden_layers, par.pp, stage, par.virtual_stages):
        layer = [(e.pattern.replace("*", str(i)), e) for e in rows if e.owner is Owner.LAYER]
        entries += [(n, e) for n, e in layer if "%" not in n]
        entries += [(n.replace("%", str(x)), e) for x in experts for n, e in layer if "%" in n]   # expert by expert
    entries += [(e.pattern, e) for e in rows if e.owner is Owner.LAST and last]
    if c.tie_word_embeddings:
        tied = [n for n, e in entries if e.tied]
        entries = [(n, e) for n, e in entries if n not in tied[1:]]
    shapes = {e.pattern: local_shape(e.pattern, c, par) for e in rows}   # every layer's entry shares its shape
    return {n: shapes[e.pattern] for n, e in entries}
