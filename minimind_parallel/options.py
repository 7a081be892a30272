"""What every task's command line shares: the argument parser that reports bad input as one
line, the model and layout arguments, the mode presets, building the configs from the parsed
arguments, the device, and the pre-launch checks every task makes (one home each)."""
from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import sys
from dataclasses import dataclass, field, replace

import torch

from .config import (DTYPES, INFERENCE_ROPE_SCALING, MOE_DEFAULTS, ZERO_LEVELS, ConfigError, CPCommType,
                     MiniMindConfig, MoEAuxLoss, ParallelConfig, Recompute, check_layout)
from .memory import predict_memory
from .pipeline_parallel.order import Schedule, check_schedule
from .zero.buckets import DEFAULT_BUCKET_MB

# What one CPU rank holds before any model: a Python process with torch and gloo (about 230 MiB
# resident: scripts/rank_process_rss.py), rounded up. A node starts a rank per this much available memory at most.
RANK_PROCESS_BYTES = 256 * 2**20

TP_FLAGS = ("sequence_parallel", "async_communication", "shared_sp_gather", "vocab_parallel")
# The MoE fields (add_moe_args) and their defaults, MiniMind's: what a dense mode of a sweep runs with.
MOE_FIELDS = {**MOE_DEFAULTS, "moe_intermediate_size": None}
# The launcher's size of each model-parallel dimension, and what a mode that uses it is called.
DIMENSIONS = (("tp", "tensor-parallel", "--tp_size"), ("pp", "pipeline-parallel", "--pp_size"),
              ("cp", "context-parallel", "--cp_size"))


@dataclass(frozen=True)
class Preset:
    """A mode of `benchmark --modes` and `validate --mode`: the model-parallel dimensions it uses
    and the flags it turns on (flags given explicitly are kept too).

    A dimension the mode uses takes the launcher's size, which must be above 1 (CP also needs
    --cp); one it does not use must be 1 at the launcher. `replicas` instead spends every rank of
    the launcher's world on data parallelism whatever its sizes (DDP: a sweep compares it with the
    model-parallel modes on the same ranks). A mode without tensor parallelism turns the TP flags
    (TP_FLAGS) off: flags given on the command line apply to the TP modes of a sweep. Likewise a
    dense mode (no --use_moe, neither given nor the mode's) sets the MoE fields (MOE_FIELDS) to
    MiniMind's defaults: `--num_experts_per_tok 2` applies to the MoE modes of a sweep.

    `ep`: the mode spreads the experts of the MoE model it turns on over the launcher's
    --ep_size (> 1) expert-parallel ranks, carved out of its DP x CP ranks; every other mode runs
    with --ep_size 1 (each rank holds every expert), so a sweep compares them on the same ranks."""

    name: str
    tp: bool = False
    pp: bool = False
    cp: bool = False
    ep: bool = False
    replicas: bool = False
    flags: dict[str, object] = field(default_factory=dict)

    def check(self, launch) -> None:
        """The launcher's sizes are this mode's: one ConfigError line naming both (and the modes that fit)."""
        wrong = self.mismatch(launch)
        if wrong is not None:
            fitting = ", ".join(p.name for p in PRESETS if not p.flags and p.mismatch(launch) is None)
            raise ConfigError(f"{wrong} (the modes of these sizes: {fitting})")

    def mismatch(self, launch) -> str | None:
        """What of the launcher's sizes is not this mode's (None: they are)."""
        if self.ep and launch.ep_size == 1:
            return f"mode {self.name} is expert-parallel and needs --ep_size > 1; got --ep_size 1"
        if self.replicas:
            return None
        if self.cp and not launch.cp:
            return f"mode {self.name} is context-parallel and needs --cp --cp_size C; got no --cp"
        for dim, adjective, option in DIMENSIONS:
            size = getattr(launch, f"{dim}_size")
            if getattr(self, dim) and size == 1:
                return f"mode {self.name} is {adjective} and needs {option} > 1; got {option} 1"
            if not getattr(self, dim) and size > 1:
                return f"mode {self.name} is not {adjective} and needs {option} 1; got {option} {size}"
        return None

    def apply(self, args) -> None:
        """Turn this mode's flags on in `args`, the TP flags off when it has no tensor parallelism,
        the MoE fields to their defaults when it is dense."""
        if not self.tp:
            for flag in TP_FLAGS:
                setattr(args, flag, False)
        if not (args.use_moe or self.flags.get("use_moe")):
            for flag, value in MOE_FIELDS.items():
                setattr(args, flag, value)
        for flag, value in self.flags.items():
            setattr(args, flag, value)

    def parallel(self, launch, args) -> ParallelConfig:
        """The layout of a run in this mode (`args` with its flags applied): the launcher's sizes, or
        with `replicas` every rank of the launcher's world a data-parallel replica."""
        par = parallel_config(launch, args)
        par = replace(par, ep=par.ep if self.ep else 1)
        return replace(par, tp=1, pp=1, cp=1, dp=par.world_size, virtual_stages=1) if self.replicas else par


SP_ASYNC = dict(sequence_parallel=True, async_communication=True)
PRESETS = (
    Preset("ddp", replicas=True),
    Preset("tp", tp=True),
    Preset("tp_sp", tp=True, flags=dict(sequence_parallel=True)),
    Preset("tp_sp_async", tp=True, flags=SP_ASYNC),
    Preset("tp_async", tp=True, flags=dict(async_communication=True)),
    Preset("tp_sp_async_shared", tp=True, flags={**SP_ASYNC, "shared_sp_gather": True}),
    Preset("tp_vp", tp=True, flags=dict(vocab_parallel=True)),
    Preset("tp_sp_async_vp", tp=True, flags={**SP_ASYNC, "vocab_parallel": True}),
    # what a block keeps for backward (`--recompute`, minimind_parallel/recompute/)
    Preset("tp_sp_async_lean", tp=True, flags={**SP_ASYNC, "recompute": Recompute.SELECTIVE}),
    Preset("tp_sp_async_full", tp=True, flags={**SP_ASYNC, "recompute": Recompute.FULL}),
    Preset("tp_sp_async_lean_chunked", tp=True, flags={**SP_ASYNC, "recompute": Recompute.SELECTIVE, "loss_chunks": 8}),
    # stages from --pp_size, schedule from --pp_schedule
    Preset("pp", pp=True),
    Preset("tp_pp", tp=True, pp=True),
    # context parallelism over --cp --cp_size C, the path from --cp_comm_type
    Preset("cp", cp=True),
    Preset("tp_cp", tp=True, cp=True),
    Preset("pp_cp", pp=True, cp=True),
    Preset("tp_cp_pp", tp=True, cp=True, pp=True),
    # sharded data parallelism (--zero, minimind_parallel/zero/): every rank a replica, or TP x DP
    Preset("zero1", replicas=True, flags=dict(zero=1)),
    Preset("zero2", replicas=True, flags=dict(zero=2)),
    Preset("zero3", replicas=True, flags=dict(zero=3)),
    Preset("tp_zero1", tp=True, flags=dict(zero=1)),
    Preset("tp_sp_async_zero1", tp=True, flags={**SP_ASYNC, "zero": 1}),
    Preset("tp_zero2", tp=True, flags=dict(zero=2)),
    Preset("tp_sp_async_zero3", tp=True, flags={**SP_ASYNC, "zero": 3}),
    # MiniMind's mixture-of-experts model (--use_moe): router and experts whole on every TP rank
    Preset("moe", flags=dict(use_moe=True)),
    Preset("tp_moe", tp=True, flags=dict(use_moe=True)),
    Preset("tp_sp_moe", tp=True, flags=dict(sequence_parallel=True, use_moe=True)),
    # MoE experts over --ep_size ranks of the DP x CP ones (the MoE model: --use_moe on)
    Preset("ep", ep=True, flags=dict(use_moe=True)),
    Preset("tp_ep", tp=True, ep=True, flags=dict(use_moe=True)),
    Preset("ep_pp", pp=True, ep=True, flags=dict(use_moe=True)),
)
MODES = {p.name: p for p in PRESETS}


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with every option's default (options without help text too), unless its help
    already says it, there is none (None) or the option is a flag that is off by default."""

    def _format_action(self, action):
        help_text = action.help or ""
        flag_off = action.nargs == 0 and action.default is False
        if (action.option_strings and action.help is not argparse.SUPPRESS and action.default is not None
                and action.default is not argparse.SUPPRESS and not flag_off and "default" not in help_text):
            action = copy.copy(action)
            action.help = f"{help_text} (default: %(default)s)" if help_text else "default: %(default)s"
        return super()._format_action(action)


class Parser(argparse.ArgumentParser):
    """argparse that reports bad input as one ConfigError line instead of usage + exit, and shows
    the defaults in its help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise ConfigError(f"{self.prog}: {message}")

    def option_strings(self) -> set[str]:
        """Every option this parser takes (`--name`, with its aliases)."""
        return {s for action in self._actions for s in action.option_strings}


def program_name(argv0: str | None = None) -> str:
    """The program as it was typed: `python -m evaluation.parallel`, `python -m minimind_parallel`,
    or the script's name (`minimind-parallel`)."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    path = os.path.normpath(os.path.abspath(argv0)) if argv0 else ""
    for module in ("evaluation.parallel", "minimind_parallel"):
        parts = module.split(".")
        if path.endswith(os.path.join(*parts) + ".py") or path.endswith(os.path.join(*parts, "__main__.py")):
            return f"python -m {module}"
    return os.path.basename(argv0) if argv0 and not argv0.startswith("-") else "minimind-parallel"


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """`[launcher args] -- [task args]` -> (launcher args, task args)."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Task args every task shares: the model, the batch, the dtype and the TP features."""
    p.add_argument("--hidden_size", type=int, default=768)
    p.add_argument("--num_attention_heads", type=int, default=8)
    p.add_argument("--num_key_value_heads", type=int, default=4)
    p.add_argument("--vocab_size", type=int, default=6400)
    p.add_argument("--intermediate_size", type=int, default=None)
    p.add_argument("--tie_word_embeddings", action=argparse.BooleanOptionalAction, default=False,
                   help="lm_head shares the embedding's matrix (MiniMind's default; train, export and generate "
                        "default to it, benchmark and validate to two matrices as the book's runs)")
    add_moe_args(p)
    p.add_argument("--micro_batch_size", type=int, default=2)
    p.add_argument("--num_microbatches", type=int, default=1)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--sequence_parallel", action="store_true")
    p.add_argument("--async_communication", action="store_true")
    p.add_argument("--shared_sp_gather", action="store_true")
    p.add_argument("--vocab_parallel", action="store_true")
    p.add_argument("--pp_schedule", type=Schedule.parse, choices=Schedule.values(), default=Schedule.ONE_F_ONE_B,
                   help="pipeline schedule over --num_microbatches (with one stage: gradient accumulation); "
                        "interleaved: Megatron-LM's interleaved 1F1B over --virtual_stages chunks per stage; "
                        "zb: ZB-H1, the weight grads deferred into the bubble")
    p.add_argument("--virtual_stages", type=int, default=1,
                   help="model chunks per pipeline stage (--pp_schedule interleaved): stage p holds chunks p, p+P, ..")
    p.add_argument("--recompute", type=Recompute.parse, choices=Recompute.values(), default=Recompute.NONE,
                   help="selective: lean norms, GQA without copies, SwiGLU recompute; full: also checkpoint "
                        "every block (keep its input only)")
    p.add_argument("--loss_chunks", type=int, default=1,
                   help="lm_head and cross entropy over this many token chunks (the logits never whole)")
    p.add_argument("--cp_comm_type", type=CPCommType.parse, choices=CPCommType.values(),
                   default=CPCommType.ALL_GATHER,
                   help="context-parallel attention: gather K/V, all-to-all heads (Ulysses) or ring (p2p)")
    p.add_argument("--cp_load_balance", action=argparse.BooleanOptionalAction, default=True,
                   help="2C chunks, CP rank i holding chunks i and 2C-1-i (--no-cp_load_balance: C contiguous)")
    p.add_argument("--zero", type=int, choices=ZERO_LEVELS, default=0,
                   help="shard over the DP x CP ranks: 1 the AdamW states (a distributed optimizer), 2 the grads too")
    p.add_argument("--bucket_size_mb", type=float, default=DEFAULT_BUCKET_MB,
                   help="--zero: MiB of grads per reduce-scatter bucket")
    p.add_argument("--moe_aux_loss", type=MoEAuxLoss.parse, choices=MoEAuxLoss.values(), default=MoEAuxLoss.GLOBAL,
                   help="MoE load balancing over the global batch's tokens (the dense model's) or each data-parallel "
                        "replica's own (MiniMind's trainer: each DDP rank's batch)")
    p.add_argument("--flash_attn", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=1234)


def add_moe_args(p: argparse.ArgumentParser) -> None:
    """MiniMind's mixture-of-experts fields (model/model_minimind.py), its defaults; used only with --use_moe."""
    p.add_argument("--use_moe", action="store_true",
                   help="MiniMind's MoE feed-forward in every layer (router, top-k of --num_experts SwiGLU experts)")
    p.add_argument("--num_experts", type=int, default=4)
    p.add_argument("--num_experts_per_tok", type=int, default=1)
    p.add_argument("--moe_intermediate_size", type=int, default=None, help="each expert's width (default: "
                   "the dense intermediate size)")
    p.add_argument("--norm_topk_prob", action=argparse.BooleanOptionalAction, default=True,
                   help="renormalise the top-k weights of each token to sum to 1")
    p.add_argument("--router_aux_loss_coef", type=float, default=5e-4,
                   help="the load-balancing loss's weight (added to the LM loss in training)")


def apply_mode(args, mode: str | None) -> None:
    """Set the flags of preset `mode` in `args`, a mutable namespace being resolved (Preset.apply;
    None: nothing). Presets are applied once, on the launcher's side: the ranks get the result."""
    if mode is None:
        return
    check_modes([mode])
    MODES[mode].apply(args)


def mode_parallel(launch, args, mode: str | None) -> ParallelConfig:
    """The layout of a run in preset `mode` (`args` with its flags applied; None: the launcher's sizes)."""
    return parallel_config(launch, args) if mode is None else MODES[mode].parallel(launch, args)


def launcher_layout(launch) -> ParallelConfig:
    """The launcher's sizes alone, for a task without the model arguments (export)."""
    return ParallelConfig(tp=launch.tp_size, pp=launch.pp_size, cp=launch.cp_size, dp=launch.dp_size, ep=launch.ep_size)


def add_rope_scaling_arg(p: argparse.ArgumentParser) -> None:
    """--inference_rope_scaling (MiniMind's flag): YaRN for sequences past the trained positions."""
    p.add_argument("--inference_rope_scaling", action="store_true",
                   help="YaRN as MiniMind's --inference_rope_scaling: factor 16 over 2048 original positions, "
                        "beta_fast 32, beta_slow 1, attention factor 1 (for sequences beyond the trained length)")


def rope_scaling(args) -> dict | None:
    """The model's rope_scaling for --inference_rope_scaling (tasks without the flag: none)."""
    return dict(INFERENCE_ROPE_SCALING) if getattr(args, "inference_rope_scaling", False) else None


def model_config(args, num_hidden_layers: int | None = None) -> MiniMindConfig:
    return MiniMindConfig(hidden_size=args.hidden_size, num_hidden_layers=num_hidden_layers or args.num_hidden_layers,
                          num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
                          vocab_size=args.vocab_size, intermediate_size=args.intermediate_size,
                          tie_word_embeddings=args.tie_word_embeddings, flash_attn=args.flash_attn,
                          rope_scaling=rope_scaling(args),
                          use_moe=args.use_moe, num_experts=args.num_experts,
                          num_experts_per_tok=args.num_experts_per_tok,
                          moe_intermediate_size=args.moe_intermediate_size, norm_topk_prob=args.norm_topk_prob,
                          router_aux_loss_coef=args.router_aux_loss_coef)


def parallel_config(launch, args, *, tp: int | None = None, dp: int | None = None) -> ParallelConfig:
    return ParallelConfig(tp=launch.tp_size if tp is None else tp, pp=launch.pp_size, cp=launch.cp_size,
                          dp=launch.dp_size if dp is None else dp, ep=launch.ep_size,
                          sequence_parallel=args.sequence_parallel, async_communication=args.async_communication,
                          shared_sp_gather=args.shared_sp_gather, vocab_parallel=args.vocab_parallel,
                          cp_comm_type=args.cp_comm_type, cp_load_balance=args.cp_load_balance,
                          recompute=args.recompute, loss_chunks=args.loss_chunks, zero=args.zero,
                          virtual_stages=getattr(args, "virtual_stages", 1), moe_aux_loss=args.moe_aux_loss)


def collective_timeout(launch) -> datetime.timedelta:
    """--collective_timeout: the longest one collective of the job's process groups waits."""
    return datetime.timedelta(seconds=launch.collective_timeout)


def resolve_device(launch) -> str:
    """--device, or cuda when available, else cpu."""
    if launch.device is not None:
        return launch.device
    return "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------- pre-launch checks (one home each)

def check_common(job, runs: list, *, steps: str | None, kernels: bool = True,
                 sizes: tuple[str, ...] = ("micro_batch_size", "num_microbatches")) -> None:
    """The checks every task makes before launching `job` (job.py), in this order: `sizes` >= 1,
    float16 with AdamW steps (`steps`, see check_float16_steps), each of `runs` [(task options,
    ParallelConfig)] (check_layout), the ranks over the nodes and the device (`kernels`: it runs any)."""
    args = job.task
    check_at_least(args, 1, sizes)
    check_number(args, "learning_rate", minimum=0.0)
    check_number(args, "bucket_size_mb", minimum=0.0, exclusive=True, unit=" MiB")
    check_float16_steps(args.dtype, steps)
    for run_args, par in runs:
        check_run(run_args, par)
    check_world(job.launch, job.parallel.world_size, args.dtype, kernels=kernels)


def check_launcher(launch) -> None:
    """The launcher's own arguments."""
    if launch.nnodes < 1:
        raise ConfigError(f"nnodes must be >= 1; got nnodes={launch.nnodes}")
    if not 0 <= launch.node_rank < launch.nnodes:
        raise ConfigError(f"node_rank must be in [0, nnodes); got node_rank={launch.node_rank}, nnodes={launch.nnodes}")
    if launch.master_port is not None and not 1 <= launch.master_port <= 65535:
        raise ConfigError(f"master_port must be a TCP port in 1-65535; got master_port={launch.master_port}")
    for name in ("rdzv_timeout", "collective_timeout"):
        check_number(launch, name, minimum=0.0, exclusive=True, unit=" seconds")
    if launch.cp_size > 1 and not launch.cp:
        raise ConfigError(f"--cp_size {launch.cp_size} needs --cp")


def check_modes(modes: list[str], launch=None) -> None:
    """Known presets, each (given the launcher's args) of the launcher's sizes (Preset.check)."""
    for mode in modes:
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r}; expected one of: {', '.join(MODES)}")
        if launch is not None:
            MODES[mode].check(launch)


def check_at_least(args, minimum: int, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(args, name) < minimum:
            raise ConfigError(f"{name} must be >= {minimum}; got {name}={getattr(args, name)}")


def check_number(ns, name: str, *, minimum: float, exclusive: bool = False, unit: str = "") -> None:
    """`ns.<name>` (None: not given) is a finite number >= `minimum` (> with `exclusive`)."""
    value = getattr(ns, name)
    if value is None:
        return
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number; got {name}={value:g}")
    if value < minimum or (exclusive and value == minimum):
        raise ConfigError(f"{name} must be {'>' if exclusive else '>='} {minimum:g}{unit}; got {name}={value:g}")


def check_float16_steps(dtype: str, steps: str | None) -> None:
    """`steps`: the option that makes the run take AdamW steps and how to avoid them (None: no steps)."""
    if dtype == "float16" and steps is not None:
        raise ConfigError(f"float16 parameters cannot take AdamW steps (eps=1e-8 underflows to 0 in float16); "
                          f"got --dtype float16{steps}")


def check_run(args, par: ParallelConfig) -> None:
    """One run's model and layout (`args` with a single num_hidden_layers and seq_len), and its
    pipeline schedule over its microbatches."""
    check_layout(model_config(args), par, seq_len=args.seq_len)
    if hasattr(args, "pp_schedule"):
        check_schedule(args.pp_schedule, par, args.num_microbatches)


def check_world(launch, world_size: int, dtype: str, *, kernels: bool = True) -> None:
    """The ranks fit the nodes and (`kernels`: the run launches ranks) the device has what they need."""
    if world_size % launch.nnodes:
        raise ConfigError(f"world size must be divisible by nnodes; got world_size={world_size}, "
                          f"nnodes={launch.nnodes}")
    if kernels:
        check_device(resolve_device(launch), dtype, world_size // launch.nnodes)


def check_device(device: str, dtype: str, world_per_node: int) -> None:
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda needs a CUDA device; torch.cuda.is_available() is False")
        if world_per_node > torch.cuda.device_count():
            raise ConfigError(f"one GPU per rank: got {world_per_node} ranks per node, "
                              f"{torch.cuda.device_count()} GPUs")
        if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
            raise ConfigError("dtype bfloat16 is not supported on this GPU; use float16 or float32")


# ---------------------------------------------------------------- what the machine can hold

def check_resources(launch, runs: list, *, rows: list[int] | None = None) -> None:
    """The node can start its ranks and hold the memory the analytic model predicts for them
    (docs/memory.md), unless --skip_resource_check. `runs`: [(args, ParallelConfig)] as for
    check_common; `rows`: each run's sequences per microbatch (default its micro_batch_size).
    CPU: ranks per node x (RANK_PROCESS_BYTES + the worst rank's predicted peak) <= MemAvailable.
    CUDA (one GPU per rank): the worst rank's predicted peak <= the GPU's memory."""
    if launch.skip_resource_check or not runs:
        return
    device = resolve_device(launch)
    per_node = runs[0][1].world_size // launch.nnodes
    rows = rows or [a.micro_batch_size for a, _ in runs]
    peaks = [predicted_peak(a, par, device, r) for (a, par), r in zip(runs, rows)]
    peak = max((p for p in peaks if p is not None), default=0)
    override = "; pass --skip_resource_check to launch anyway"
    if device == "cuda":
        gpu = min(torch.cuda.get_device_properties(i).total_memory for i in range(per_node))
        if peak > gpu:
            raise ConfigError(f"predicted memory exceeds the GPU: the worst rank's predicted peak "
                              f"{peak / 2**30:.2f} GiB (analytic model) > {gpu / 2**30:.2f} GiB of GPU memory{override}")
        return
    available = mem_available()
    if available is None:
        return
    start = per_node * RANK_PROCESS_BYTES
    if start > available:
        raise ConfigError(f"the machine cannot start {per_node} ranks: each CPU rank is a process of about "
                          f"{RANK_PROCESS_BYTES >> 20} MiB before the model, {per_node} ranks need "
                          f"{start / 2**30:.1f} GiB and {available / 2**30:.1f} GiB are available (MemAvailable)"
                          f"{override}")
    if start + per_node * peak > available:
        raise ConfigError(f"predicted memory exceeds the machine: {per_node} ranks x ({RANK_PROCESS_BYTES >> 20} MiB "
                          f"per process + the worst rank's predicted peak {peak / 2**20:.0f} MiB, analytic model) = "
                          f"{(start + per_node * peak) / 2**30:.2f} GiB > {available / 2**30:.2f} GiB available "
                          f"(MemAvailable){override}")


def predicted_peak(args, par: ParallelConfig, device: str, rows: int) -> int | None:
    """The analytic model's peak bytes of a training step on the worst rank (None: not modelled)."""
    try:
        return predict_memory(model_config(args), par, seq_len=args.seq_len, micro_batch_size=rows,
                              dtype=DTYPES[args.dtype], device=device,
                              num_microbatches=args.num_microbatches, schedule=args.pp_schedule).peak_bytes
    except NotImplementedError:  # a path the analytic model does not cover
        return None


def mem_available() -> int | None:
    """Bytes the kernel can give new processes without swapping (/proc/meminfo; None elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
