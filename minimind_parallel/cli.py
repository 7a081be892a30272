"""Command line: `python -m minimind_parallel <task> [launcher args] -- [task args]`.

The launcher parses the launcher args, looks the task up (minimind_parallel/tasks), parses the
task args with the task's parser and lets the task check everything: a bad input is one line,
exit 2, before any process starts. Then the task launches (usually one torchrun job of
`python -m minimind_parallel.worker` with the same arguments, see launcher.py).
"""
from __future__ import annotations

import argparse
import sys

from . import launcher, processes, tasks
from .config import ConfigError
from .options import Parser, check_launcher, split_argv


def launcher_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m minimind_parallel",
               description="Model-parallel MiniMind: <task> [launcher args] -- [task args]")
    p.add_argument("task", help=f"one of {', '.join(tasks.TASKS)}")
    p.add_argument("--tp_size", type=int, default=1)
    p.add_argument("--pp_size", type=int, default=1)
    p.add_argument("--cp", action="store_true", help="enable context parallelism")
    p.add_argument("--cp_size", type=int, default=1)
    p.add_argument("--dp_size", type=int, default=1, help="data-parallel replicas on top of tp x pp x cp")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node_rank", type=int, default=0)
    p.add_argument("--master_addr", default="127.0.0.1")
    p.add_argument("--master_port", type=int, default=None, help="multi-node: the rendezvous port (default 29500)")
    p.add_argument("--rdzv_timeout", type=float, default=300.0, metavar="SECONDS",
                   help="multi-node: give up when not every node has joined after this long (default 300)")
    p.add_argument("--collective_timeout", type=float, default=300.0, metavar="SECONDS",
                   help="a rank waiting this long in one collective (a peer stopped or gone) fails the job "
                        "(default 300)")
    p.add_argument("--skip_resource_check", action="store_true",
                   help="launch even when the ranks or their predicted memory do not fit the machine")
    p.add_argument("--kind", choices=tasks.kinds(), default=None,
                   help="what a task with kinds runs (also accepted among its task args): " +
                        "; ".join(f"{t.name}: {', '.join(t.kinds)}" for t in tasks.TASKS.values() if t.kinds))
    # A test hook: a rank that fails the way real ones do (KIND:RANK, see worker.inject_fault); not for users.
    p.add_argument("--inject_fault", default=None, help=argparse.SUPPRESS)
    return p


def parse(argv: list[str]):
    """-> (launcher namespace, task namespace); raises ConfigError on bad input."""
    head, tail = split_argv(argv)
    launch = launcher_parser().parse_args(head)
    task = tasks.get(launch.task)
    if launch.kind is not None and launch.kind not in task.kinds:
        takers = " / ".join(t.name for t in tasks.TASKS.values() if launch.kind in t.kinds)
        raise ConfigError(f"--kind is a {takers} option; got task {launch.task!r}")
    check_launcher(launch)
    return launch, task.parser().parse_args(tail)


def main(argv: list[str] | None = None) -> int:
    """-> the exit code: the task's, 2 for bad input (nothing started), 1 when the job could not
    start, 128 + the signal's number after SIGINT / SIGTERM (every process of the job ended)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with processes.signals_raise():
        try:
            launch, args = parse(argv)
            task = tasks.get(launch.task)
            task.check(launch, args)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except processes.Interrupted as e:
            print(f"{e}: nothing was started", file=sys.stderr)
            return e.exit_code
        try:
            return task.launch(launch, args, argv)
        except processes.Interrupted as e:
            print(f"{launch.task}: {e}; every process of the job was ended", file=sys.stderr)
            return e.exit_code
        except launcher.LaunchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
