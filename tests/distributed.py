"""Run a function on N gloo ranks (processes, one torch thread each) and collect results.

A rank that raises ends the run at once: the others are killed and its traceback is re-raised
here, so a failing test never hangs in a collective.

Ranks are forked from a fork server started clean (torch preloaded), not from the test process:
once a test has run autograd in the test process, a CUDA build of torch has autograd threads
there, and a rank forked from it could not run backward ("Unable to handle autograd's threading
in combination with fork-based multiprocessing"). So `fn` and `args` must pickle: `fn` a
module-level function of a test module. The server has imported torch, the package and every test
module of the session once (`_start_fork_server`), so a rank starts in milliseconds instead of
importing its test file and all that file imports.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver as forkserver
import os
import pickle
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist


def _child(rank, world, store_path, out_dir, fn, args):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
        result = fn(*args)
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        dist.destroy_process_group()
    except BaseException:
        # Written whole then renamed: a rank killed mid-write (after another rank failed) leaves no
        # empty .err behind to hide the real error.
        with open(os.path.join(out_dir, f"{rank}.err.tmp"), "w") as f:
            f.write(traceback.format_exc())
        os.replace(os.path.join(out_dir, f"{rank}.err.tmp"), os.path.join(out_dir, f"{rank}.err"))
        os._exit(1)
    os._exit(0)


_CTX = mp.get_context("forkserver")
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "minimind_parallel", "distributed"]
_TESTS = os.path.dirname(os.path.abspath(__file__))


def _test_modules() -> list[str]:
    """The modules of this directory the test process has imported (the collected test files
    among them), for the fork server to import once: a rank then unpickles `fn` without importing
    its module and all that module imports (the harness, transformers: seconds per rank, per
    launch, on a loaded machine)."""
    return sorted(name for name, module in list(sys.modules.items()) if name != "__main__"
                  and os.path.dirname(os.path.abspath(getattr(module, "__file__", None) or "/")) == _TESTS)


def _start_fork_server() -> None:
    """The fork server, started once (on the first launch, after pytest has imported every test
    file) with this directory on its path: its preload imports the modules by name, from the path
    it started with (its cwd, not this process's sys.path: CPython 3.11's forkserver ignores the
    sys_path it is handed)."""
    _CTX.set_forkserver_preload(_PRELOAD + _test_modules())
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_TESTS, before]))
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def run_ranks(fn, world: int, *args, timeout: float = 300.0) -> list:
    """fn(*args) on `world` ranks; returns [result of rank 0, rank 1, ...]."""
    ctx = _CTX
    _start_fork_server()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, args=(r, world, store, tmp, fn, args)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in procs):
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        # The first error written is the cause; later ones may only report a lost peer.
        paths = sorted((os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".err")), key=os.path.getmtime)
        errors = [open(path).read() for path in paths]
        if errors:
            raise AssertionError("a rank failed:\n" + errors[0])
        if any(p.exitcode != 0 for p in procs):
            raise AssertionError(f"ranks timed out or died: exit codes {[p.exitcode for p in procs]}")
        out = []
        for r in range(world):
            with open(os.path.join(tmp, f"{r}.pkl"), "rb") as f:
                out.append(pickle.load(f))
        return out
