"""Configuration: the model (MiniMind-3) and the parallel layout, and every size constraint.

All checks live in `check_layout`, one message per constraint, so the launcher can refuse
bad input with one clear line before any process starts.
"""
from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass

import torch

# A dtype by the name the command line gives it (--dtype); every name -> dtype lookup reads this.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class Choice(str, enum.Enum):
    """A value of a command-line choice (--recompute, --cp_comm_type, --pp_schedule, ...): a str,
    so it equals, hashes, formats and writes to JSON / CSV as its text ("full"), and code compares
    members, never text. argparse takes it as `type=X.parse, choices=X.values()`."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    __hash__ = str.__hash__   # a member and its text are one dict key

    @classmethod
    def parse(cls, text):
        """The member named `text`, or `text` unchanged when none is (argparse's `choices`, or the
        config's check, then refuses it in one line)."""
        try:
            return cls(text)
        except ValueError:
            return text

    @classmethod
    @functools.cache   # check_layout asks it for every layout the planner weighs
    def values(cls) -> tuple[str, ...]:
        """Every member's text, in order (argparse's `choices`, error messages)."""
        return tuple(m.value for m in cls)


class CPCommType(Choice):
    """How attention crosses the CP group (`--cp_comm_type`, see context_parallel/attention.py)."""

    ALL_GATHER = "all_gather"   # gather K/V
    A2A = "a2a"                 # all-to-all of heads (Ulysses)
    RING = "ring"               # K/V blocks passed round the ring (p2p)


class Recompute(Choice):
    """What a block keeps for backward (`--recompute`, see minimind_parallel/recompute/)."""

    NONE = "none"
    SELECTIVE = "selective"     # lean norms, GQA without copies, SwiGLU recompute
    FULL = "full"               # the selective pieces, and a checkpoint of every block

    @property
    def lean(self) -> bool:
        """The selective pieces run in `selective` and inside `full`."""
        return self != Recompute.NONE


# MiniMind's `--inference_rope_scaling` (model/model_minimind.py, MiniMindConfig): YaRN (Peng et al. 2023)
# stretching the positions a model learned in 2048 sixteen-fold, the attention factor left at 1.
INFERENCE_ROPE_SCALING = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048,
                          "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0}

# --zero: 0 plain data parallelism; 1 optimizer states sharded; 2 and the grads (zero/); 3 the
# parameters too (FSDP2's fully_shard, zero/fully_shard.py).
ZERO_LEVELS = (0, 1, 2, 3)
class MoEAuxLoss(Choice):
    """Over which tokens a MoE layer's load-balancing loss counts the loads and mean scores
    (`--moe_aux_loss`, see loss_normalisation.expert_statistics)."""

    GLOBAL = "global"   # every token of the global batch: the dense model's aux loss on the whole batch
    LOCAL = "local"     # each data-parallel replica's own tokens: MiniMind's trainer on each DDP rank


class ConfigError(ValueError):
    """A size or flag constraint that a configuration breaks (one line, names the values)."""


@dataclass(kw_only=True)
class MiniMindConfig:
    """MiniMind-3, dense or mixture-of-experts (`use_moe`). Field names and defaults follow
    jingyaogong/minimind (model/model_minimind.py, `MiniMindConfig`)."""

    hidden_size: int = 768
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    vocab_size: int = 6400
    head_dim: int | None = None  # default hidden_size // num_attention_heads
    intermediate_size: int | None = None  # default ceil(hidden*pi/64)*64
    max_position_embeddings: int = 32768
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    dropout: float = 0.0
    tie_word_embeddings: bool = True
    flash_attn: bool = True
    hidden_act: str = "silu"
    rope_scaling: dict | None = None   # YaRN's parameters (INFERENCE_ROPE_SCALING) or None: plain RoPE
    # mixture of experts (MiniMind's MOEFeedForward in every layer; unused unless use_moe)
    use_moe: bool = False
    num_experts: int = 4
    num_experts_per_tok: int = 1
    moe_intermediate_size: int | None = None   # default intermediate_size
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 5e-4

    def __post_init__(self):
        if self.head_dim is None and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.intermediate_size is None:
            self.intermediate_size = math.ceil(self.hidden_size * math.pi / 64) * 64
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act must be 'silu' (MiniMind-3); got {self.hidden_act!r}")


@dataclass(kw_only=True)
class ParallelConfig:
    """The rank grid dp x pp x cp x tp (TP fastest) and the tensor-parallel features. Expert
    parallelism (`ep`) adds no ranks: its groups are carved out of the DP x CP ranks (groups.py)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1                     # expert-parallel ranks among the DP x CP ones (each holds num_experts / ep experts)
    sequence_parallel: bool = False
    async_communication: bool = False
    shared_sp_gather: bool = False
    vocab_parallel: bool = False
    recompute: Recompute = Recompute.NONE   # none | selective (lean norms, GQA, SwiGLU) | full (+ per-block checkpoint)
    loss_chunks: int = 1            # lm_head + cross entropy over this many token chunks
    cp_comm_type: CPCommType = CPCommType.ALL_GATHER   # how attention crosses the CP group: all_gather | a2a | ring
    cp_load_balance: bool = True       # 2C chunks, rank i holding i and 2C-1-i (else C contiguous)
    zero: int = 0                      # sharded data parallelism over DP x CP: 1 optimizer states, 2 + grads
    virtual_stages: int = 1            # model chunks per pipeline rank (interleaved 1F1B): rank p holds p, p+P, ..
    moe_aux_loss: MoEAuxLoss = MoEAuxLoss.GLOBAL   # the MoE aux loss over the global batch | each replica's tokens

    def __post_init__(self):
        # text (a test, a JSON config) becomes the member; an unknown name stays for check_layout to refuse
        self.recompute = Recompute.parse(self.recompute)
        self.cp_comm_type = CPCommType.parse(self.cp_comm_type)
        self.moe_aux_loss = MoEAuxLoss.parse(self.moe_aux_loss)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def sequence_shards(self) -> int:
        """How many pieces the sequence of a CP rank is cut into between the TP blocks: T under
        sequence parallelism ([S/T, B, H]), else 1 ([S, B, H])."""
        return self.tp if self.sequence_parallel else 1


def check_layout(model: MiniMindConfig, par: ParallelConfig, *, seq_len: int | None = None) -> None:
    """Raise ConfigError naming the first broken constraint and its values."""
    for name in ("tp", "pp", "cp", "dp", "ep"):
        if getattr(par, name) < 1:
            raise ConfigError(f"{name} size must be >= 1; got {name}={getattr(par, name)}")
    if par.moe_aux_loss not in MoEAuxLoss.values():
        raise ConfigError(f"moe_aux_loss must be one of {', '.join(MoEAuxLoss.values())}; got {par.moe_aux_loss!r}")
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        if getattr(model, name) < 1:
            raise ConfigError(f"{name} must be >= 1; got {name}={getattr(model, name)}")
    if model.hidden_size % model.num_attention_heads:
        raise ConfigError(f"hidden_size must be divisible by num_attention_heads; "
                          f"got hidden_size={model.hidden_size}, num_attention_heads={model.num_attention_heads}")
    if model.head_dim % 2:
        raise ConfigError(f"head_dim must be even (rotary embeddings rotate pairs of channels); got head_dim="
                          f"{model.head_dim} (hidden_size={model.hidden_size} / num_attention_heads="
                          f"{model.num_attention_heads})")
    if model.intermediate_size < 1:
        raise ConfigError(f"intermediate_size must be >= 1; got intermediate_size={model.intermediate_size}")
    if model.num_attention_heads % model.num_key_value_heads:
        raise ConfigError(f"num_attention_heads must be divisible by num_key_value_heads (GQA); "
                          f"got num_attention_heads={model.num_attention_heads}, "
                          f"num_key_value_heads={model.num_key_value_heads}")
    t = par.tp
    if model.num_attention_heads % t:
        raise ConfigError(f"num_attention_heads must be divisible by tp_size; "
                          f"got num_attention_heads={model.num_attention_heads}, tp_size={t}")
    if model.num_key_value_heads % t:
        raise ConfigError(f"num_key_value_heads must be divisible by tp_size; "
                          f"got num_key_value_heads={model.num_key_value_heads}, tp_size={t}")
    if model.hidden_size % t:
        raise ConfigError(f"hidden_size must be divisible by tp_size; got hidden_size={model.hidden_size}, tp_size={t}")
    if model.intermediate_size % t:
        raise ConfigError(f"intermediate_size must be divisible by tp_size; "
                          f"got intermediate_size={model.intermediate_size}, tp_size={t}")
    if par.vocab_parallel and model.vocab_size % t:
        raise ConfigError(f"vocab_size must be divisible by tp_size with --vocab_parallel; "
                          f"got vocab_size={model.vocab_size}, tp_size={t}")
    if par.vocab_parallel and t == 1:
        raise ConfigError("--vocab_parallel needs tensor parallelism; got tp_size=1")
    if par.sequence_parallel and t == 1:
        raise ConfigError("--sequence_parallel needs tensor parallelism; got tp_size=1")
    if par.async_communication and t == 1:
        raise ConfigError("--async_communication needs tensor parallelism; got tp_size=1")
    if par.shared_sp_gather and not par.sequence_parallel:
        raise ConfigError("--shared_sp_gather shares the sequence-parallel all-gather and needs --sequence_parallel")
    check_moe(model)
    check_expert_parallel(model, par)
    check_context_parallel(model, par)
    check_recompute(par)
    check_zero(par)
    check_pipeline_chunks(model, par)
    if seq_len is not None:
        if seq_len < 2:
            raise ConfigError(f"seq_len must be >= 2 (the loss is shifted by one); got seq_len={seq_len}")
        if seq_len > model.max_position_embeddings:
            raise ConfigError(f"seq_len must be <= max_position_embeddings; "
                              f"got seq_len={seq_len}, max_position_embeddings={model.max_position_embeddings}")
        if par.sequence_parallel and seq_len % t:
            raise ConfigError(f"seq_len must be divisible by tp_size with --sequence_parallel; "
                              f"got seq_len={seq_len}, tp_size={t}")
        if par.loss_chunks > seq_len:
            raise ConfigError(f"loss_chunks must be <= seq_len (a chunk of at least one position per sequence); "
                              f"got loss_chunks={par.loss_chunks}, seq_len={seq_len}")
        check_context_split(par, seq_len)


def check_pipeline_chunks(model: MiniMindConfig, par: ParallelConfig) -> None:
    """The layers cut into pp_size x virtual_stages equal chunks (one per stage without virtual stages)."""
    v = par.virtual_stages
    if v < 1:
        raise ConfigError(f"virtual_stages must be >= 1; got virtual_stages={v}")
    if v > 1 and par.pp == 1:
        raise ConfigError(f"virtual_stages > 1 needs pipeline parallelism; got virtual_stages={v}, pp_size=1")
    if v == 1 and model.num_hidden_layers % par.pp:
        raise ConfigError(f"num_hidden_layers must be divisible by pp_size; "
                          f"got num_hidden_layers={model.num_hidden_layers}, pp_size={par.pp}")
    if model.num_hidden_layers % (par.pp * v):
        raise ConfigError(f"num_hidden_layers must be divisible by pp_size x virtual_stages (one chunk of layers "
                          f"per virtual stage); got num_hidden_layers={model.num_hidden_layers}, pp_size={par.pp}, "
                          f"virtual_stages={v}")
def check_expert_parallel(model: MiniMindConfig, par: ParallelConfig) -> None:
    """The expert-parallel ranks are carved out of the DP x CP ranks (Megatron-LM's layout): ep
    divides dp x cp; a MoE model's experts split evenly over them."""
    if par.ep > 1 and not model.use_moe:
        raise ConfigError(f"--ep_size {par.ep} spreads the experts of a mixture-of-experts model and needs --use_moe")
    if model.use_moe and model.num_experts >= 1 and model.num_experts % par.ep:
        raise ConfigError(f"num_experts must be divisible by ep_size (each expert-parallel rank holds num_experts / "
                          f"ep_size experts); got num_experts={model.num_experts}, ep_size={par.ep}")
    replicas = par.dp * par.cp
    if par.ep > replicas:
        raise ConfigError(f"ep_size must be <= dp_size x cp_size (the expert-parallel ranks are carved out of the "
                          f"data- and context-parallel ones); got ep_size={par.ep}, dp_size={par.dp}, cp_size={par.cp}")
    if replicas % par.ep:
        raise ConfigError(f"ep_size must divide dp_size x cp_size (the expert-parallel ranks are carved out of the "
                          f"data- and context-parallel ones); got ep_size={par.ep}, dp_size={par.dp}, cp_size={par.cp}")


# the mixture-of-experts fields and their values when the model is dense (MiniMind's defaults)
MOE_DEFAULTS = {"num_experts": 4, "num_experts_per_tok": 1, "norm_topk_prob": True, "router_aux_loss_coef": 5e-4}


def check_moe(model: MiniMindConfig) -> None:
    """The MoE fields: given only with use_moe; k of E experts per token; sizes >= 1."""
    if not model.use_moe:
        changed = [f"{k}={getattr(model, k)}" for k, v in MOE_DEFAULTS.items() if getattr(model, k) != v]
        if model.moe_intermediate_size != model.intermediate_size:
            changed.append(f"moe_intermediate_size={model.moe_intermediate_size}")
        if changed:
            raise ConfigError(f"mixture-of-experts fields need use_moe (--use_moe); got {', '.join(changed)} "
                              f"with use_moe=False")
        return
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if getattr(model, name) < 1:
            raise ConfigError(f"{name} must be >= 1; got {name}={getattr(model, name)}")
    if model.num_experts_per_tok > model.num_experts:
        raise ConfigError(f"num_experts_per_tok must be <= num_experts (top-k of the experts); "
                          f"got num_experts_per_tok={model.num_experts_per_tok}, num_experts={model.num_experts}")
    if model.router_aux_loss_coef < 0:
        raise ConfigError(f"router_aux_loss_coef must be >= 0; got router_aux_loss_coef={model.router_aux_loss_coef}")


def check_recompute(par: ParallelConfig) -> None:
    """--recompute names a mode; --loss_chunks is a count."""
    if par.recompute not in Recompute.values():
        raise ConfigError(f"recompute must be one of {', '.join(Recompute.values())}; got {par.recompute!r}")
    if par.loss_chunks < 1:
        raise ConfigError(f"loss_chunks must be >= 1; got loss_chunks={par.loss_chunks}")


def check_zero(par: ParallelConfig) -> None:
    """--zero names a level the library shards at, over a DP x CP group of more than one rank."""
    if par.zero not in ZERO_LEVELS:
        raise ConfigError(f"zero must be one of {', '.join(map(str, ZERO_LEVELS))}; got zero={par.zero}")
    if par.zero and par.dp * par.cp == 1:
        raise ConfigError(f"--zero {par.zero} shards over the data-parallel x context-parallel ranks and needs "
                          f"dp_size x cp_size > 1; got dp_size={par.dp}, cp_size={par.cp}")


def check_context_parallel(model: MiniMindConfig, par: ParallelConfig) -> None:
    """The comm type, and a2a's heads: every TP rank's query and kv heads split over the CP group."""
    if par.cp_comm_type not in CPCommType.values():
        raise ConfigError(f"cp_comm_type must be one of {', '.join(CPCommType.values())}; got {par.cp_comm_type!r}")
    if par.cp > 1 and par.cp_comm_type == CPCommType.A2A:
        heads, kv = model.num_attention_heads // par.tp, model.num_key_value_heads // par.tp
        if heads % par.cp or kv % par.cp:
            raise ConfigError(f"--cp_comm_type a2a needs the query and kv heads of each TP rank divisible by "
                              f"cp_size; got {heads} query and {kv} kv heads per TP rank "
                              f"(num_attention_heads={model.num_attention_heads}, "
                              f"num_key_value_heads={model.num_key_value_heads}, tp_size={par.tp}), "
                              f"cp_size={par.cp}")


def check_context_split(par: ParallelConfig, seq_len: int) -> None:
    """The sequence cut into 2C chunks (C without load balance), each CP rank's tokens over TP under SP."""
    if par.cp == 1:
        return
    chunks = 2 * par.cp if par.cp_load_balance else par.cp
    shards = par.sequence_shards
    if seq_len % (chunks * shards):
        what = f"{chunks} chunks (2 x cp_size)" if par.cp_load_balance else f"{chunks} chunks (cp_size, no load balance)"
        sp = f" x tp_size={par.tp} under --sequence_parallel" if shards > 1 else ""
        raise ConfigError(f"seq_len must be divisible by {chunks * shards}: {what}{sp}; "
                          f"got seq_len={seq_len}, cp_size={par.cp}")
