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

torch itself holds groups past the call in ways no collection reaches. `torch._dynamo` (which
an optimizer's first use imports), imported after the default group exists, keeps that group
alive from its C++ side; the worker imports it before it creates the group. DTensor's sharding
propagation caches (one in Python, one on its C++ fast path) keep the spec of every op they have
seen, each spec its device mesh, and a mesh its process group: under --zero 3 FSDP2's DTensor
parameters leave the DP x CP mesh's group (and the experts' EDP one) there, so the caches are
cleared first (`_drop_dtensor_caches`).
"""
from __future__ import annotations

import gc
import sys

import torch.distributed as dist


def destroy_process_groups() -> None:
    """Destroy every process group of this rank (nothing if none is initialised): first what may
    still hold one let go (DTensor's caches, the unreachable objects), then the groups destroyed."""
    if not dist.is_initialized():
        return
    _drop_dtensor_caches()
    gc.collect()
    dist.destroy_process_group()


def _drop_dtensor_caches() -> None:
    """DTensor's sharding propagation caches emptied where DTensor is loaded (their device meshes,
    and so the meshes' groups, freed with them); nothing where it never was."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import debug   # loaded already: the caches' own clearing
    debug._clear_python_sharding_prop_cache()
    debug._clear_fast_path_sharding_prop_cache()
