"""The cells of a sweep: every (mode, swept value) pair, in run order, what one cell runs with
(its task args with the mode's preset applied, its layout, its rows per replica), built once per
cell by `cell_run` on the launcher's side, and the cell's own job (`cell_job`) its ranks are
handed, from which they rebuild the same run (`job_run`) without resolving anything again."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ...config import DTYPES, ConfigError, ParallelConfig
from ...job import Job, TaskOptions
from ...options import MODES, apply_mode, model_config
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
    args: TaskOptions
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


def cell_args(args: TaskOptions, cell: Cell) -> TaskOptions:
    """The task args of one cell: its mode alone, its sizes, its mode's preset flags
    (options.Preset.apply: a mode without tensor parallelism, ddp or pp, turns the TP flags off)."""
    a = args.namespace()
    a.modes, a.num_hidden_layers, a.seq_len = [cell.mode], cell.num_hidden_layers, cell.seq_len
    apply_mode(a, cell.mode)
    return TaskOptions.of(a)


def cell_parallel(launch, a, mode: str) -> ParallelConfig:
    """The layout of a cell in `mode` (options.Preset.parallel): every mode uses the same ranks,
    world = dp x pp x cp x tp; ddp spends them all on data parallelism."""
    return MODES[mode].parallel(launch, a)


def rows_per_replica(kind: Kind, args, par: ParallelConfig, launch) -> int:
    """Rows of one microbatch on each DP replica of the cell's layout `par`."""
    if batch_policy(kind, args) == BatchPolicy.FIXED_PER_RANK:
        return args.micro_batch_size
    return args.micro_batch_size * launch.dp_size // par.dp


def step_sizes(job: Job, a: TaskOptions, par: ParallelConfig) -> dict:
    """The sizes of one step of a cell (task args `a`, layout `par`) that the memory API takes."""
    return dict(seq_len=a.seq_len, micro_batch_size=rows_per_replica(a.kind, a, par, job.launch),
                dtype=DTYPES[a.dtype], num_microbatches=a.num_microbatches, schedule=a.pp_schedule,
                bucket_size_mb=a.bucket_size_mb)


def cell_run(job: Job, cell: Cell) -> CellRun:
    """What `cell` of the sweep's `job` runs with (see CellRun); the checks, the launcher's row and
    the cell's job all read this."""
    a = cell_args(job.task, cell)
    par = cell_parallel(job.launch, a, cell.mode)
    return CellRun(cell, a, par, step_sizes(job, a, par))


def cell_job(job: Job, run: CellRun, *, report: str, profile_dir: str | None) -> Job:
    """The job of one cell's ranks: its task args (with the cell, and where a profile goes), its model,
    its layout, and `report`, where the first rank of every node writes the result."""
    task = run.args.replace(cell=asdict(run.cell), profile_dir=profile_dir)
    return replace(job, task=task, model=model_config(run.args), parallel=run.par, report=report)


def job_run(job: Job) -> CellRun:
    """On a rank: the run `cell_job` handed it (nothing resolved again)."""
    return CellRun(Cell(**job.task.cell), job.task, job.parallel, step_sizes(job, job.task, job.parallel))
