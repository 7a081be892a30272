"""A rank's end: every process group destroyed, and its backend's threads joined, while the
interpreter is still whole.

`dist.destroy_process_group` drops torch's own references to the groups (and shuts each down); a
gloo group is destroyed -- its worker threads joined -- only when its last reference goes. A
reference that outlives the call, such as one held in a cycle of the task's objects that the
collector has not reached yet, leaves the group and its threads alive into the interpreter's
finalization, which destroys it at last. (Objects should not hold a group in a cycle at all: a
cycle through a tensor's hooks, which torch keeps on its C++ side, is one the collector cannot
even see -- zero/distributed_optimizer.py's hooks hold their buffer weakly.) A gloo worker thread that still has a
finished collective to drop (it lets go of its work after `wait()` returns, see comm._Release) and
with it the last reference to a tensor of Python's, needs the GIL for that; a finalizing
interpreter ends a thread that asks for the GIL (pthread_exit), and that unwinding through a
noexcept C++ destructor aborts the process: "terminate called without an active exception",
SIGABRT, after the rank's work is done. So the task's garbage is collected before the groups are
destroyed, and the groups go, with their threads, inside `destroy_process_group`.

torch itself holds one group past the call in a way no collection reaches: `torch._dynamo` (which
an optimizer's first use imports), imported after the default group exists, keeps that group
alive from its C++ side. The worker imports it before it creates the group. (FSDP2 at --zero 3
still keeps one group past the call: its device mesh's.)
"""
from __future__ import annotations

import gc

import torch.distributed as dist


def destroy_process_groups() -> None:
    """Destroy every process group of this rank (nothing if none is initialised): first the
    unreachable objects that may still hold one collected, then the groups destroyed."""
    if not dist.is_initialized():
        return
    gc.collect()
    dist.destroy_process_group()
