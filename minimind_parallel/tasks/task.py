"""What a task declares to the command line: its arguments, how they resolve into the run's job,
its pre-launch checks, what the launcher does once they pass, and what each rank does under torchrun."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from .. import launcher
from ..job import Job, LaunchOptions, TaskOptions
from ..options import model_config, parallel_config


def resolve_once(launch: LaunchOptions, args: argparse.Namespace, argv: tuple[str, ...]) -> Job:
    """The default resolution: the task's arguments frozen as given, the model they describe and
    the launcher's layout with their flags."""
    return Job(launch=launch, task=TaskOptions.of(args), model=model_config(args),
               parallel=parallel_config(launch, args), argv=argv)


def launch_once(job: Job) -> int:
    """The default launch: one torchrun job of the whole world, every rank running the task."""
    return launcher.run_job(job)


@dataclass(frozen=True, kw_only=True)
class Task:
    """One task of `python -m minimind_parallel <name> [launcher args] -- [task args]`.

    The launcher calls `parser` on the task args, `resolve(launch, args, argv)` -> the run's Job
    (job.py; once, on the launcher's side: a mode preset is applied here), `check(job)` (raises
    ConfigError: one line, exit 2, nothing started), then `launch(job)` -> exit code; every rank
    the launch starts reads the job and calls `run_rank(job, device)` -> exit code."""

    name: str
    parser: Callable[[], argparse.ArgumentParser]
    check: Callable[[Job], None]
    run_rank: Callable[..., int]
    resolve: Callable[[LaunchOptions, argparse.Namespace, tuple[str, ...]], Job] = resolve_once
    launch: Callable[[Job], int] = launch_once
    kinds: tuple[str, ...] = ()  # the values of the launcher's --kind this task takes (none: refused)
    # the process of `python -m evaluation.parallel` ends at once after it (cli.end_at_once: no teardown of
    # what it made, no exit handlers): a task that leaves nothing to close, whose objects are many
    ends_at_once: bool = False
