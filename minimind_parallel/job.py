"""One run as the launcher resolved it, the one thing every rank is handed.

The command line is parsed once, on the launcher's side (cli.py): the launcher's arguments
become `LaunchOptions`, the task's arguments are frozen once (`TaskOptions`, a mode preset's
flags already applied), and the model (`MiniMindConfig`) and layout (`ParallelConfig`) are built
from them once. Each node's launcher writes that `Job` as JSON in a temporary directory of its
own (launcher.run_job) and each rank reads it (worker.py): no rank parses a command line. The
idea is torchtitan's job config (torchtitan/config/job_config.py): typed sections, resolved
before training starts.

Enums are written by value and rebuilt by type when the job is read: the dataclasses' field
types, and for the task's options the types its parser gives them.
"""
from __future__ import annotations

import argparse
import enum
import json
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, is_dataclass

from .config import MiniMindConfig, ParallelConfig
from .files import atomic_path


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """The launcher's arguments (cli.launcher_parser), typed."""

    task: str
    tp_size: int
    pp_size: int
    cp: bool
    cp_size: int
    dp_size: int
    ep_size: int
    device: str | None
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    rdzv_timeout: float
    collective_timeout: float
    skip_resource_check: bool
    kind: str | None
    inject_fault: str | None   # a test hook (worker.inject_fault)

    @classmethod
    def of(cls, ns: argparse.Namespace) -> LaunchOptions:
        return cls(**vars(ns))


class TaskOptions:
    """A task's arguments, frozen once they are resolved: read as attributes (`opts.seq_len`),
    never set; `replace` gives a changed copy."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, object]):
        object.__setattr__(self, "_values", dict(values))

    @classmethod
    def of(cls, ns: argparse.Namespace) -> TaskOptions:
        return cls(vars(ns))

    def __getattr__(self, name: str):
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"the task's options are resolved once and frozen; use replace({name}=...)")

    def __eq__(self, other) -> bool:
        return isinstance(other, TaskOptions) and self._values == other._values

    __hash__ = None

    def __repr__(self) -> str:
        return f"TaskOptions({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"

    def replace(self, **changes) -> TaskOptions:
        return TaskOptions({**self._values, **changes})

    def as_dict(self) -> dict:
        return dict(self._values)

    def namespace(self) -> argparse.Namespace:
        """A mutable copy, for resolving a variant (a benchmark cell's preset) before freezing it again."""
        return argparse.Namespace(**self._values)


@dataclass(frozen=True, kw_only=True)
class Job:
    """What one run is: the launcher's options, the task's, the model and the layout, the command
    as typed (after the program's name) and `report`, the file the first rank of every node writes
    for its node's launcher (validate's verdict, a benchmark cell's result, train's outcome; None:
    no launcher reads one)."""

    launch: LaunchOptions
    task: TaskOptions
    model: MiniMindConfig | None     # None: the task builds no model from its arguments (export)
    parallel: ParallelConfig
    argv: tuple[str, ...] = ()
    report: str | None = None


# ---------------------------------------------------------------- JSON, for the ranks

def _by_value(value):
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, TaskOptions):
        return value.as_dict()
    raise TypeError(f"a job holds no {type(value).__name__}")


def job_json(job: Job) -> str:
    return json.dumps({"launch": asdict(job.launch), "task": job.task.as_dict(),
                       "model": None if job.model is None else asdict(job.model),
                       "parallel": asdict(job.parallel), "argv": list(job.argv), "report": job.report},
                      default=_by_value)


def write_job(job: Job, path: str) -> str:
    """Write `job` to `path` atomically; -> path."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(job_json(job))
    return path


def read_job(path: str, parser_of: Callable[[str], argparse.ArgumentParser]) -> Job:
    """The job `write_job` wrote; `parser_of(task)`: the task's parser, whose types rebuild its options' enums."""
    with open(path) as f:
        d = json.load(f)
    launch = _typed(LaunchOptions, d["launch"])
    task = TaskOptions(_task_values(d["task"], parser_of(launch.task)))
    return Job(launch=launch, task=task, model=None if d["model"] is None else _typed(MiniMindConfig, d["model"]),
               parallel=_typed(ParallelConfig, d["parallel"]), argv=tuple(d["argv"]), report=d["report"])


def _typed(cls, values: dict):
    """Dataclass `cls` from its JSON dict, each field rebuilt by its declared type."""
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _rebuild(hints[f.name], values[f.name]) for f in fields(cls) if f.name in values})


def _rebuild(hint, value):
    if value is None:
        return None
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if isinstance(hint, type) and is_dataclass(hint):
        return _typed(hint, value)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if arg is not type(None) and (isinstance(arg, type) and issubclass(arg, enum.Enum) or is_dataclass(arg)):
                return _rebuild(arg, value)
        return value
    if origin is tuple:
        return tuple(value)
    return value


def _task_values(values: dict, parser: argparse.ArgumentParser) -> dict:
    """The task's options with the enums its parser makes rebuilt (a list option: each item)."""
    out = dict(values)
    for action in parser._actions:
        kind = _enum_of(action.type)
        if kind is not None and action.dest in out and out[action.dest] is not None:
            v = out[action.dest]
            out[action.dest] = [kind(x) for x in v] if isinstance(v, list) else kind(v)
    return out


def _enum_of(kind) -> type[enum.Enum] | None:
    """The enum an argparse `type=` makes: the enum itself, or its classmethod (`Choice.parse`)."""
    owner = kind if isinstance(kind, type) else getattr(kind, "__self__", None)
    return owner if isinstance(owner, type) and issubclass(owner, enum.Enum) else None
