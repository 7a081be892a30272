"""The cells of a sweep: every (mode, swept value) pair, in run order, and what one cell runs
with (its task args with the mode's preset applied, its layout, its rows per replica), built once
per cell by `cell_run`."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from ...config import DTYPES, ConfigError, ParallelConfig
from ...options import MODES, apply_mode
from .command import BatchPolicy, Kind, batch_policy

SWEEPABLE = ("num_hidden_layers", "seq_len")


@dataclass(frozen=True)
class Cell:
    mode: str
    num_hidden_layers: int
    seq_len: int
    swept: str  # which of SWEEPABLE varies

    @property
    def value(self) -> int:
        return getattr(self, self.swept)

    @property
    def name(self) -> str:
        return f"{self.mode}:{self.value}"


@dataclass(frozen=True)
class CellRun:
    """One cell as it runs: its task args (one num_hidden_layers and seq_len, the mode's flags on),
    its layout and the sizes of one step the memory API takes (rows per DP replica per microbatch)."""
    cell: Cell
    args: argparse.Namespace
    par: ParallelConfig
    sizes: dict

    @property
    def rows(self) -> int:
        return self.sizes["micro_batch_size"]


def sweep_cells(args) -> list[Cell]:
    """The cells in run order: swept value outer, mode inner (so each mode follows the one it is compared with)."""
    swept = [name for name in SWEEPABLE if len(getattr(args, name)) > 1]
    if len(swept) > 1:
        raise ConfigError(f"sweep one dimension at a time; got num_hidden_layers={args.num_hidden_layers} "
                          f"and seq_len={args.seq_len}")
    swept = swept[0] if swept else "num_hidden_layers"
    fixed = {name: getattr(args, name)[0] for name in SWEEPABLE}
    return [Cell(mode=mode, swept=swept, **{**fixed, swept: value})
            for value in getattr(args, swept) for mode in args.modes]


def cell_args(args, cell: Cell) -> argparse.Namespace:
    """The task args of one cell: its sizes, its mode's preset flags (options.Preset.apply: a mode
    without tensor parallelism, ddp or pp, turns the TP flags off)."""
    a = argparse.Namespace(**vars(args))
    a.num_hidden_layers, a.seq_len = cell.num_hidden_layers, cell.seq_len
    apply_mode(a, cell.mode)
    return a


def cell_parallel(launch, a, mode: str) -> ParallelConfig:
    """The layout of a cell in `mode` (options.Preset.parallel): every mode uses the same ranks,
    world = dp x pp x cp x tp; ddp spends them all on data parallelism."""
    return MODES[mode].parallel(launch, a)


def rows_per_replica(kind: Kind, args, par: ParallelConfig, launch) -> int:
    """Rows of one microbatch on each DP replica of the cell's layout `par`."""
    if batch_policy(kind, args) == BatchPolicy.FIXED_PER_RANK:
        return args.micro_batch_size
    return args.micro_batch_size * launch.dp_size // par.dp


def cell_run(launch, args, kind: Kind, cell: Cell) -> CellRun:
    """What `cell` runs with (see CellRun); the checks, the launcher's row and the ranks all read this."""
    a = cell_args(args, cell)
    par = cell_parallel(launch, a, cell.mode)
    sizes = dict(seq_len=a.seq_len, micro_batch_size=rows_per_replica(kind, args, par, launch),
                 dtype=DTYPES[args.dtype], num_microbatches=args.num_microbatches, schedule=args.pp_schedule)
    return CellRun(cell, a, par, sizes)
