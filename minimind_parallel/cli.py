"""Command line: `python -m minimind_parallel <task> [launcher args] -- [task args]`.

The launcher parses the launcher args, looks the task up (minimind_parallel/tasks), parses the
task args with the task's parser and lets the task check everything: a bad input is one line,
exit 2, before any process starts. The arguments are resolved once into the run's job (job.py:
typed launcher options, the task's options, the model and the layout); the task launches it
(usually one torchrun job of `python -m minimind_parallel.worker JOB.json`, see launcher.py).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

from . import launcher, processes, tasks
from .config import ConfigError
from .job import Job, LaunchOptions
from .options import Parser, check_launcher, program_name, split_argv


HELP = ("-h", "--help")


def launcher_parser(prog: str | None = None) -> Parser:
    prog = prog or program_name()
    p = Parser(prog=prog, usage="%(prog)s <task> [launcher args] -- [task args]",
               description=f"Model-parallel MiniMind. Tasks: {', '.join(tasks.TASKS)}; "
                           f"`{prog} <task> --help` lists the task's arguments too.")
    p._optionals.title = "launcher args"
    p.add_argument("task", help=f"one of {', '.join(tasks.TASKS)}")
    p.add_argument("--tp_size", type=int, default=1)
    p.add_argument("--pp_size", type=int, default=1)
    p.add_argument("--cp", action="store_true", help="enable context parallelism")
    p.add_argument("--cp_size", type=int, default=1)
    p.add_argument("--dp_size", type=int, default=1, help="data-parallel replicas on top of tp x pp x cp")
    p.add_argument("--ep_size", type=int, default=1,
                   help="expert-parallel ranks carved out of the dp x cp ranks (MoE: each holds num_experts / ep_size "
                        "experts)")
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


def task_parser(task, prog: str) -> Parser:
    """The task's own parser, named as the command line names it."""
    p = task.parser()
    p.prog, p.usage = f"{prog} {task.name}", "%(prog)s [launcher args] -- [task args]"
    p._optionals.title = f"task args of {task.name} (after --)"
    return p


def help_text(argv: list[str], prog: str | None = None) -> str | None:
    """`[<task>] --help` or `<task> ... -- --help`: the launcher's arguments and, with a task, the
    task's; None when no help is asked for."""
    head, tail = split_argv(argv)
    if not any(a in HELP for a in head + tail):
        return None
    prog = prog or program_name()
    launcher = launcher_parser(prog)
    named = [a for a in head if a in tasks.TASKS]
    if not named:
        return launcher.format_help()
    task = tasks.get(named[0])
    launcher.usage = f"%(prog)s {task.name} [launcher args] -- [task args]"
    own = task_parser(task, prog)
    own.usage = argparse.SUPPRESS  # one usage line, the launcher's
    return launcher.format_help() + "\n" + own.format_help()


def parse(argv: list[str], prog: str | None = None):
    """-> (launcher namespace, task namespace); raises ConfigError on bad input. Task arguments
    before `--` (or launcher arguments after it) get a hint where they go."""
    prog = prog or program_name()
    head, tail = split_argv(argv)
    launcher = launcher_parser(prog)
    launch, extra = launcher.parse_known_args(head)
    task = tasks.get(launch.task)
    parser = task_parser(task, prog)
    if extra:
        hint = (f" (task arguments go after --: {prog} {task.name} [launcher args] -- {' '.join(extra)})"
                if misplaced(extra, parser) else "")
        raise ConfigError(f"{prog}: unrecognized arguments: {' '.join(extra)}{hint}")
    if launch.kind is not None and launch.kind not in task.kinds:
        takers = " / ".join(t.name for t in tasks.TASKS.values() if launch.kind in t.kinds)
        raise ConfigError(f"--kind is a {takers} option; got task {launch.task!r}")
    check_launcher(launch)
    args, extra = parser.parse_known_args(tail)
    if extra:
        hint = (f" (launcher arguments go before --: {prog} {task.name} {' '.join(extra)} -- [task args])"
                if misplaced(extra, launcher) else "")
        raise ConfigError(f"{parser.prog}: unrecognized arguments: {' '.join(extra)}{hint}")
    return launch, args


def resolve(argv: list[str], prog: str | None = None) -> Job:
    """The command line parsed (`parse`) and resolved once by its task into the run's job; raises ConfigError."""
    launch, args = parse(argv, prog)
    return tasks.get(launch.task).resolve(LaunchOptions.of(launch), args, tuple(argv))


def misplaced(extra: list[str], other: Parser) -> bool:
    """Whether some of the unrecognized arguments are options of the other parser."""
    theirs = other.option_strings()
    return any(a.split("=", 1)[0] in theirs for a in extra if a.startswith("-"))


def process_main() -> int:
    """main() of a process that ends with it (`python -m evaluation.parallel`): then Python's cyclic
    collector is kept (gc.freeze) from walking every object still alive -- a plan's millions of
    remembered sizes, about 1.5 s -- only to find them freed at exit. The objects alive before it
    (the imports': modules, classes, functions; the entry modules import this with the collector
    off, so that no collection walks them meanwhile, about 0.2 s) are frozen first, and the
    collector is on for the task. After a task that `ends_at_once` (tasks/task.py) the process ends
    here (`end_at_once`)."""
    gc.freeze()
    gc.enable()
    ran: list = []
    code = main(ran=ran)
    gc.freeze()
    if ran and ran[0].ends_at_once:
        end_at_once(code)
    return code


def end_at_once(code: int) -> None:
    """The process ended with `code` now, its output flushed: without the interpreter's teardown,
    which frees every object still alive one by one (a plan's remembered sizes: about 0.3 s), nor
    the exit handlers (a task that ends so registers none of its own). Where the output cannot be
    flushed (a closed pipe) the ordinary exit goes on and reports it."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    os._exit(code)


def main(argv: list[str] | None = None, ran: list | None = None) -> int:
    """-> the exit code: the task's, 2 for bad input (nothing started), 1 when the job could not
    start, 128 + the signal's number after SIGINT / SIGTERM (every process of the job ended).
    `ran`: the task that was launched is appended to it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    text = help_text(argv)
    if text is not None:
        print(text, end="")
        return 0
    with processes.signals_raise():
        try:
            job = resolve(argv)
            task = tasks.get(job.launch.task)
            task.check(job)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except processes.Interrupted as e:
            print(f"{e}: nothing was started", file=sys.stderr)
            return e.exit_code
        if ran is not None:
            ran.append(task)
        try:
            return task.launch(job)
        except ConfigError as e:  # found only once the task reads what it was given (one line, as above)
            print(f"error: {e}", file=sys.stderr)
            return 2
        except processes.Interrupted as e:
            print(f"{task.name}: {e}; every process of the job was ended", file=sys.stderr)
            return e.exit_code
        except launcher.LaunchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
