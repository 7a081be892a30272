"""The candidate space as data: one table of dimensions (`DIMENSIONS`), each with the values it
takes and when it exists at all (a TP flag only with tp > 1, a schedule only with pp > 1), and
the constraints every full assignment must pass: the planner's own (`RULES`: the rank grid, the
batch) and then `config.check_layout`, whose one-line message is the reason a layout is cut.

A new dimension is one row of `DIMENSIONS` (and a field of `Candidate`); its constraints come
with `check_layout` (e.g. --zero with ep > 1 under MoE, refused there).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Callable, Iterator

from ..memo import cached_property
from ..config import ConfigError, CPCommType, MiniMindConfig, ParallelConfig, Recompute, check_layout
from ..memory.analytic.fsdp_replay import check_fully_sharded
from ..memory.analytic.predict import MODELLED_SCHEDULES, MODELLED_ZERO_LEVELS
from ..memory.analytic.fsdp_composition import composition_refusal
from ..pipeline_parallel.order import Schedule, check_schedule


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What is trained and on how many ranks: the model, the sequence, the global batch (rows per
    optimizer step), the ranks and the nodes they are on, the parameters' dtype name."""

    model: MiniMindConfig
    seq_len: int
    global_batch_size: int
    world_size: int
    nnodes: int = 1
    dtype: str = "bfloat16"

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One layout: the rank grid dp x pp x cp x tp (TP fastest), its flags, and how the global
    batch is cut (num_microbatches of micro_batch_size rows on each DP replica); ep expert-parallel
    ranks carved out of the dp x cp ones (a MoE model), zero the sharded data parallelism's level."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    async_communication: bool = False
    shared_sp_gather: bool = False
    vocab_parallel: bool = False
    recompute: Recompute = Recompute.NONE
    loss_chunks: int = 1
    cp_comm_type: CPCommType = CPCommType.ALL_GATHER
    cp_load_balance: bool = True
    num_microbatches: int = 1
    pp_schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1
    micro_batch_size: int = 1

    GRID = ("tp", "pp", "cp", "dp", "ep", "zero")

    @cached_property
    def parallel(self) -> ParallelConfig:
        """Its ParallelConfig (made once: read it, do not change it)."""
        return ParallelConfig(tp=self.tp, pp=self.pp, cp=self.cp, dp=self.dp, ep=self.ep, zero=self.zero,
                              sequence_parallel=self.sequence_parallel,
                              async_communication=self.async_communication, shared_sp_gather=self.shared_sp_gather,
                              vocab_parallel=self.vocab_parallel, recompute=self.recompute,
                              loss_chunks=self.loss_chunks, cp_comm_type=self.cp_comm_type,
                              cp_load_balance=self.cp_load_balance, virtual_stages=self.virtual_stages)

    def __getstate__(self) -> dict:
        """Its fields, pickled without what it derives from them (`parallel`, made again when read): a
        forked planning process sends tens of thousands back (forked.py)."""
        return {k: v for k, v in self.__dict__.items() if k != "parallel"}

    @property
    def flags(self) -> dict:
        """Everything but the grid, as the command line names it."""
        return {name: getattr(self, name) for name in flag_names()}

    def describe(self) -> str:
        on = [name for name in ("sequence_parallel", "async_communication", "shared_sp_gather", "vocab_parallel",
                                "cp_load_balance") if getattr(self, name) and (name != "cp_load_balance" or self.cp > 1)]
        short = {"sequence_parallel": "sp", "async_communication": "async", "shared_sp_gather": "shared",
                 "vocab_parallel": "vp", "cp_load_balance": "lb"}
        grid = f"tp{self.tp} pp{self.pp} cp{self.cp} dp{self.dp}" + (f" ep{self.ep}" if self.ep > 1 else "")
        parts = [grid, *(f"zero{self.zero}",) * (self.zero > 0), *(short[n] for n in on)]
        if self.recompute != Recompute.NONE:
            parts.append(f"rc={self.recompute}")
        if self.loss_chunks > 1:
            parts.append(f"chunks={self.loss_chunks}")
        if self.cp > 1:
            parts.append(str(self.cp_comm_type))
        if self.pp > 1:
            parts.append(f"{self.pp_schedule} M={self.num_microbatches}")
        if self.virtual_stages > 1:
            parts.append(f"V={self.virtual_stages}")
        parts.append(f"b={self.micro_batch_size}")
        return " ".join(parts)


@functools.cache
def flag_names() -> tuple[str, ...]:
    """Candidate's fields but the grid, in order (read for every layout of a plan)."""
    return tuple(f.name for f in fields(Candidate) if f.name not in Candidate.GRID)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _rows_per_replica(w: Workload, c: dict) -> int:
    return w.global_batch_size // c["dp"]


@dataclass(frozen=True)
class Dimension:
    """A dimension of the space: its name (a `Candidate` field), its values given the workload and the
    dimensions before it, and when it exists (else it keeps the field's default)."""

    name: str
    values: Callable[[Workload, dict], list]
    applies: Callable[[dict], bool] = lambda c: True


def _balanced_fits(w: Workload, c: dict) -> bool:
    """The load-balanced split (2C chunks, under SP each over T) divides the sequence."""
    shards = c["tp"] if c.get("sequence_parallel") else 1
    return w.seq_len % (2 * c["cp"] * shards) == 0


def _expert_parallel_sizes(w: Workload, c: dict) -> list[int]:
    """The divisors of dp x cp that divide num_experts (a dense model: 1)."""
    if not w.model.use_moe:
        return [1]
    return [e for e in divisors(c["dp"] * c["cp"]) if w.model.num_experts % e == 0]


# The benchmark's expert-parallel modes (options.PRESETS: ep, tp_ep, ep_pp) as (tp > 1, pp > 1, cp > 1):
# a layout's estimate_command is the benchmark cell of its mode, so an ep > 1 layout needs one of them.
EXPERT_PARALLEL_MODES = {(False, False, False), (True, False, False), (False, True, False)}


def _expert_parallel_mode(w: Workload, c: dict) -> str | None:
    if c.get("ep", 1) == 1 or (c["tp"] > 1, c["pp"] > 1, c["cp"] > 1) in EXPERT_PARALLEL_MODES:
        return None
    return (f"the benchmark's expert-parallel modes (ep, tp_ep, ep_pp) have no context parallelism nor TP with PP, "
            f"so the layout's estimate_command has no cell; got ep_size={c['ep']}, tp_size={c['tp']}, "
            f"pp_size={c['pp']}, cp_size={c['cp']}")



BOOLS = lambda w, c: [False, True]  # noqa: E731
DIMENSIONS = (
    Dimension("tp", lambda w, c: divisors(w.world_size)),
    Dimension("pp", lambda w, c: divisors(w.world_size // c["tp"])),
    Dimension("cp", lambda w, c: divisors(w.world_size // (c["tp"] * c["pp"]))),
    Dimension("dp", lambda w, c: [w.world_size // (c["tp"] * c["pp"] * c["cp"])]),
    # the levels predict_memory models (MODELLED_ZERO_LEVELS), where a DP x CP group shards
    Dimension("zero", lambda w, c: list(MODELLED_ZERO_LEVELS), lambda c: c["dp"] * c["cp"] > 1),
    # a MoE model's experts over ep of the dp x cp ranks, each holding num_experts / ep of them
    Dimension("ep", lambda w, c: _expert_parallel_sizes(w, c)),
    Dimension("sequence_parallel", BOOLS, lambda c: c["tp"] > 1),
    Dimension("async_communication", BOOLS, lambda c: c["tp"] > 1),
    Dimension("shared_sp_gather", BOOLS, lambda c: c.get("sequence_parallel", False)),
    Dimension("vocab_parallel", BOOLS, lambda c: c["tp"] > 1),
    Dimension("recompute", lambda w, c: list(Recompute)),
    Dimension("loss_chunks", lambda w, c: [1, 8]),
    Dimension("cp_comm_type", lambda w, c: list(CPCommType), lambda c: c["cp"] > 1),
    Dimension("cp_load_balance", lambda w, c: [True] if _balanced_fits(w, c) else [True, False],
              lambda c: c["cp"] > 1),
    # one stage: no microbatches (the benchmark's cells, and so estimate_command, take num_microbatches > 1
    # only with pp > 1); a pipeline: every count >= pp that splits the replica's rows evenly
    Dimension("num_microbatches", lambda w, c: [m for m in divisors(max(1, _rows_per_replica(w, c))) if m >= c["pp"]],
              lambda c: c["pp"] > 1),
    # the schedules whose memory the analytic model replays (MODELLED_SCHEDULES; zb where its variant is modelled)
    Dimension("pp_schedule", lambda w, c: list(MODELLED_SCHEDULES), lambda c: c["pp"] > 1),
    # model chunks per stage (interleaved 1F1B): every V >= 2 that splits each stage's layers evenly
    Dimension("virtual_stages", lambda w, c: [v for v in divisors(w.model.num_hidden_layers // c["pp"]) if v > 1],
              lambda c: c.get("pp_schedule") == Schedule.INTERLEAVED),
)


@dataclass(frozen=True)
class Rule:
    """A constraint of the planner's own on a rank grid (beyond check_layout): its check -> None or the
    one-line reason."""

    name: str
    check: Callable[[Workload, dict], str | None]


RULES = (
    Rule("batch over dp", lambda w, c: None if w.global_batch_size % c["dp"] == 0 else
         f"global_batch_size must be divisible by dp; got global_batch_size={w.global_batch_size}, dp={c['dp']}"),
    Rule("a microbatch per stage", lambda w, c: None if c["pp"] == 1 or w.global_batch_size // c["dp"] >= c["pp"] else
         f"a pipeline needs at least one row per stage from each DP replica (global_batch_size / dp >= pp); "
         f"got global_batch_size={w.global_batch_size}, dp={c['dp']}, pp={c['pp']}"),
    Rule("an expert-parallel benchmark mode", _expert_parallel_mode),
)
# Values left out of the space because another value of the same dimension beats them in time and
# memory (printed with the plan, so nothing is left out silently).
DOMINATED = (
    "num_microbatches < pp (a stage idles, and each microbatch holds more rows)",
    "--no-cp_load_balance where the load-balanced split divides seq_len (the contiguous split gives the "
    "last CP rank more attention blocks: more time and memory)",
)


@dataclass(frozen=True)
class Cut:
    candidate: Candidate
    reason: str

    @property
    def constraint(self) -> str:
        """The constraint without its values (what cuts are grouped by)."""
        return self.reason.split("; got")[0]


def _assignments(w: Workload, dims=DIMENSIONS, partial: dict | None = None) -> Iterator[dict]:
    partial = partial or {}
    if not dims:
        yield dict(partial)
        return
    dim, rest = dims[0], dims[1:]
    if not dim.applies(partial):
        yield from _assignments(w, rest, partial)
        return
    for value in dim.values(w, partial):
        partial[dim.name] = value
        yield from _assignments(w, rest, partial)
    partial.pop(dim.name, None)


def _grid_reason(w: Workload, grid: dict) -> str | None:
    """Why every layout of this rank grid is cut, if one reason cuts them all: the batch rule, or
    check_layout on the grid with no flag on and the contiguous CP split (the weakest constraints:
    a flag only adds some, the load-balanced split needs 2C chunks where the contiguous needs C)."""
    reason = next((r for r in (rule.check(w, grid) for rule in RULES) if r), None)
    if reason is not None:
        return reason
    plain = Candidate(**grid, cp_load_balance=False)
    try:
        check_layout(w.model, plain.parallel, seq_len=w.seq_len)
    except ConfigError as e:
        return str(e)
    return None


def check_candidate(w: Workload, cand: "Candidate") -> None:
    """Raise ConfigError (one line) where a full assignment cannot run or be predicted: check_layout,
    the schedule's constraints (check_schedule), and the --zero 3 layouts its FSDP2 replay refuses
    (memory/analytic/fsdp_composition.py, fsdp_replay.check_fully_sharded)."""
    check_layout(w.model, cand.parallel, seq_len=w.seq_len)
    refusal = composition_refusal(cand.parallel, cand.pp_schedule, cand.num_microbatches) if cand.zero == 3 else None
    if refusal is not None:
        raise ConfigError(f"the memory model refuses it: {refusal}")
    if cand.zero == 3:   # FSDP2: what its replay follows (the MoE model, too few tokens refused there)
        try:
            check_fully_sharded(w.model, cand.parallel, w.seq_len // cand.cp * cand.micro_batch_size)
        except NotImplementedError as e:
            raise ConfigError(str(e)) from None
    if cand.pp == 1:
        return
    check_schedule(cand.pp_schedule, cand.parallel, cand.num_microbatches)


def enumerate_layouts(w: Workload) -> tuple[list[Candidate], list[Cut]]:
    """Every assignment of DIMENSIONS -> (the layouts that pass every rule and check_layout, the cut
    ones with the reason). A rank grid that no flags can rescue is cut once, as a whole."""
    valid, cuts = [], []
    grid_dims = tuple(d for d in DIMENSIONS if d.name in Candidate.GRID)
    rest = tuple(d for d in DIMENSIONS if d.name not in Candidate.GRID)
    for grid in _assignments(w, grid_dims):
        reason = _grid_reason(w, grid)
        if reason is not None:
            cuts.append(Cut(Candidate(**grid, cp_load_balance=False), reason))
        else:
            _expand(w, grid, rest, valid, cuts)
    return valid, cuts


def _expand(w: Workload, grid: dict, dims: tuple, valid: list, cuts: list) -> None:
    """Every assignment of the flags `dims` on a rank grid that passed `_grid_reason`."""
    rows = w.global_batch_size // grid["dp"]
    for a in _assignments(w, dims, dict(grid)):
        cand = Candidate(**a, micro_batch_size=rows // a.get("num_microbatches", 1))
        try:
            check_candidate(w, cand)
        except ConfigError as e:
            cuts.append(Cut(cand, str(e)))
            continue
        valid.append(cand)
