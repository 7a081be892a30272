"""`benchmark`: peak memory and step time over a sweep of (mode, swept value) cells.

The launcher checks every cell before anything starts, then runs each cell as its own torchrun
job (the cell's own job, `run_cell` on every rank; rank 0 writes the cell's result to a JSON
file), prints a row per
cell with the analytic prediction beside the measurement, and writes CSV/JSON after every cell
and a plot at the end. A cell that fails or runs out of memory is recorded and the sweep goes on.
With `--estimate` no process is launched: the memory API measures each cell under FakeTensorMode.

    python -m evaluation.parallel benchmark --kind memory --tp_size 2 -- --modes ddp tp \\
        --num_hidden_layers 8 16 --seq_len 2048 --dtype bfloat16 --sequence_parallel

    command.py   the task args, the sweep's job, the kind and the batch policy they resolve to
    cells.py     the cells of the sweep (`sweep_cells`), what one cell runs with (`cell_run`), its job
    checks.py    every constraint of every cell, before anything launches
    sweep.py     the launcher's loop over the cells, a row per cell
    estimate.py  `--estimate`: a cell's memory in this process, no ranks
    rank.py      what every rank of a cell's job runs
    profile.py   `--kind profile`: the per-cell traces and the cells side by side
    outputs.py   the table, CSV / JSON rows and the plot
"""
from __future__ import annotations

from ..task import Task
from .checks import check
from .command import Kind, parser, resolve
from .rank import run_cell
from .sweep import run_benchmark

TASK = Task(name="benchmark", parser=parser, resolve=resolve, check=check, launch=run_benchmark, run_rank=run_cell, kinds=Kind.values())
