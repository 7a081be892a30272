"""What a task declares to the command line: its arguments, its pre-launch checks, what the
launcher does once they pass, and what each rank does under torchrun."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from .. import launcher
from ..options import parallel_config


def launch_once(launch, args, argv: list[str]) -> int:
    """The default launch: one torchrun job of the whole world, every rank running the task."""
    par = parallel_config(launch, args)
    return launcher.run_torchrun(launch, par.world_size, argv, async_communication=args.async_communication)


@dataclass(frozen=True, kw_only=True)
class Task:
    """One task of `python -m minimind_parallel <name> [launcher args] -- [task args]`.

    The launcher calls `parser` on the task args, `check(launch, args)` (raises ConfigError: one
    line, exit 2, nothing started), then `launch(launch, args, argv)` -> exit code; every rank the
    launch starts calls `run_rank(launch, args, device)` -> exit code."""

    name: str
    parser: Callable[[], argparse.ArgumentParser]
    check: Callable[..., None]
    run_rank: Callable[..., int]
    launch: Callable[..., int] = launch_once
    kinds: tuple[str, ...] = ()  # the values of the launcher's --kind this task takes (none: refused)
