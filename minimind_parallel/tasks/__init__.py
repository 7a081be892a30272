"""The tasks of the command line, by name. A task is one file (or a package, as benchmark/) that
declares a `TASK` (tasks/task.py: its parser, its pre-launch checks, its launch, what each rank
runs); registering one is a line here. The launcher and the worker know tasks only through `get`."""
from __future__ import annotations

from ..config import ConfigError
from . import benchmark, export, generate, plan, sft, train, validate
from .task import Task

TASKS: dict[str, Task] = {t.name: t for t in (validate.TASK, benchmark.TASK, train.TASK, sft.TASK, export.TASK,
                                         generate.TASK, plan.TASK)}


def get(name: str) -> Task:
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; expected one of: {', '.join(TASKS)}")
    return TASKS[name]


def kinds() -> tuple[str, ...]:
    """Every value the launcher's --kind may take, over all tasks."""
    return tuple(dict.fromkeys(k for t in TASKS.values() for k in t.kinds))
