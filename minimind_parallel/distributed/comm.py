"""The raw collectives of every process group (TP, DP, EP, the embedding group, pipeline p2p).
Every collective in the library goes through this module: the autograd mappings, the async
linear, gradient finalisation and the pipeline's p2p call it; layers never call
`torch.distributed` themselves. `group=None` means a one-rank group: nothing to communicate.

Each collective runs inside `collective(kind)`, the one explicit marker of "a collective is
running", from its issue to its return and again around `wait()`:
    - a profiler sees a `comm:<kind>` range (`wait:<kind>` is opened by the caller that waits);
    - an observer among the active dispatch modes (the memory tracker) is told through its
      `collective_region()` context manager, so it can tell a backend's own buffers (e.g. gloo's
      reduce-scatter works on a copy made out of our sight) from ours. A new collective is
      counted correctly by wrapping it in `collective(...)`; the tracker needs no change.
While an observer counts when tensors die (the memory tracker: its `waits_for_release`), each
returns (or its handle's wait() returns) only once the backend has let go of the tensors
(`_issue`, `_Release`), so a tensor dies where the program drops it; otherwise (train, generate)
nothing waits for that.

Sequence collectives act on dim 0 because activations are sequence-first [S, B, H].
"""
from __future__ import annotations

import contextlib
import time
import warnings

import torch
import torch.distributed as dist

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from .ranges import span

RELEASE_WAIT_S = 2.0  # the longest wait for a backend to drop a finished collective's tensors

# torch >= 2.13 names the single-tensor collectives *_single; older releases *_into_tensor / *_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _observers() -> list:
    """The active dispatch modes that observe collectives (have `collective_region()`)."""
    return [m for m in _get_current_dispatch_mode_stack() if hasattr(m, "collective_region")]


def _release_awaited() -> bool:
    """Whether an active observer asks for each collective's release (`waits_for_release`: the
    memory tracker while it measures). Outside a measurement nothing counts the moment a tensor
    dies, so nothing waits for it."""
    return any(getattr(mode, "waits_for_release", False) for mode in _observers())


@contextlib.contextmanager
def _observed():
    """Every active dispatch mode that observes collectives (has `collective_region()`) is
    inside one until this returns."""
    with contextlib.ExitStack() as stack:
        for mode in _observers():
            stack.enter_context(mode.collective_region())
        yield


@contextlib.contextmanager
def collective(kind: str):
    """Mark a running collective: its observers, and a `comm:<kind>` profiler range."""
    with _observed(), span(f"comm:{kind}"):
        yield


class _Done:
    """Handle of a collective that had nothing to do (one-rank group)."""

    def wait(self):
        return True

    def done(self) -> bool:
        return True


class _Release:
    """Waits, after a collective, until the backend has let go of our tensors -- only while an
    observer asks for it (`_release_awaited`: a memory meter measuring); otherwise it waits for
    nothing and reads no reference count.

    gloo runs a collective on a worker thread that marks it done -- wait() returns -- and only then
    drops its reference to the work, and with it the work's references to our tensors. A tensor
    the caller frees right after the collective could so outlive its last use by a moment, at
    random (after up to about one gloo call in five on two loaded cores, as counted by
    scripts/gloo_release_lag.py), and a memory meter would see it held. So each tensor's references are counted before the
    collective is issued -- to the tensor itself (the work may hold it) and to its storage (the
    work may hold views of it) -- and once the work is done and ours dropped, we wait until both
    are back, at most RELEASE_WAIT_S, then warn. CPU tensors only: NCCL's lifetimes are the CUDA
    caching allocator's (stream-ordered). The counts are PyTorch's private `Tensor._use_count` and
    `torch._C._storage_Use_Count`; a release without them waits for nothing, and
    tests/test_distributed_comm.py fails."""

    def __init__(self, tensors):
        counted = hasattr(torch.Tensor, "_use_count") and hasattr(torch._C, "_storage_Use_Count")
        awaited = counted and _release_awaited()
        self._tensors = [t for t in tensors if t.device.type == "cpu"] if awaited else []
        self._before = self._counts()

    def _counts(self) -> list[tuple[int, int]]:
        return [(t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)) for t in self._tensors]

    def wait(self) -> None:
        """Called once our references to the work are gone: wait for the backend's to go."""
        if not self._tensors:
            return
        deadline = time.monotonic() + RELEASE_WAIT_S
        while any(now[0] > then[0] or now[1] > then[1] for now, then in zip(self._counts(), self._before)):
            if time.monotonic() > deadline:
                warnings.warn(f"a finished collective's tensors are still referenced after {RELEASE_WAIT_S} s")
                break
            time.sleep(0)
        self._tensors = []  # nor do we keep them


class _Started:
    """Collectives started with async_op=True; wait() waits for each inside the collective marker
    (a backend may copy its own buffer into the output there), then for the backend to release
    the tensors (`_Release`)."""

    def __init__(self, works: list, release: _Release):
        self._works, self._release = works, release

    def done(self) -> bool:
        """Whether every work has finished (without waiting)."""
        return all(w.is_completed() for w in self._works)

    def wait(self):
        with _observed():
            for i in range(len(self._works)):   # no loop variable left holding the last work
                self._works[i].wait()
            self._works = []   # ours were the last references, unless the backend still has one
            self._release.wait()
        return True


def _issue(tensors, async_op: bool, collective_fn, *args, **kwargs):
    """Run `collective_fn(*args, async_op=..., **kwargs)` on `tensors`. Blocking: return once it is
    done and the backend has let go of them (a blocking call is left blocking: NCCL runs it on
    the current stream). async_op: return its handle, whose wait() does both."""
    release = _Release(tensors)
    work = collective_fn(*args, async_op=async_op, **kwargs)
    if async_op:
        return _Started([work], release)
    release.wait()
    return None


def group_size(group) -> int:
    """Ranks in `group` (1 for None, the one-rank group)."""
    return 1 if group is None else dist.get_world_size(group)


def rank_in(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group, *, async_op: bool = False, op=dist.ReduceOp.SUM):
    """In place on `x` (callers pass a tensor they own, e.g. a fresh GEMM output)."""
    if group is None:
        return (x, _Done()) if async_op else x
    with collective("all_reduce"):
        work = _issue([x], async_op, dist.all_reduce, x, op=op, group=group)
    return (x, work) if async_op else x


def all_gather_dim0(x: torch.Tensor, group, *, async_op: bool = False):
    """[S/T, ...] -> [S, ...], rank order along dim 0."""
    t = group_size(group)
    if t == 1:
        return (x, _Done()) if async_op else x
    x = x.contiguous()
    out = torch.empty((x.shape[0] * t, *x.shape[1:]), dtype=x.dtype, device=x.device)
    with collective("all_gather"):
        work = _issue([out, x], async_op, _all_gather_single, out, x, group=group)
    return (out, work) if async_op else out


def reduce_scatter_dim0(x: torch.Tensor, group, *, async_op: bool = False):
    """[S, ...] -> [S/T, ...]: sum over ranks, keep this rank's chunk of dim 0."""
    t = group_size(group)
    if t == 1:
        return (x, _Done()) if async_op else x
    x = x.contiguous()
    out = torch.empty((x.shape[0] // t, *x.shape[1:]), dtype=x.dtype, device=x.device)
    with collective("reduce_scatter"):
        work = _issue([out, x], async_op, _reduce_scatter_single, out, x, group=group)
    return (out, work) if async_op else out


def reduce_scatter_flat(flat: torch.Tensor, group, *, async_op: bool = False):
    """[W * n] -> its rank's n elements summed over the group, written in place into that rank's
    slice of `flat` (returned, a view), as Megatron-LM's distributed optimizer reduces a bucket."""
    t = group_size(group)
    shard = flat.view(t, -1)[rank_in(group)]
    if t == 1:
        return (shard, _Done()) if async_op else shard
    with collective("reduce_scatter"):
        work = _issue([flat], async_op, _reduce_scatter_single, shard, flat, group=group)
    return (shard, work) if async_op else shard


def all_gather_flat(flat: torch.Tensor, group, *, async_op: bool = False):
    """Every rank's slice of `flat` [W * n] (its n elements at rank * n) gathered into `flat`, in place."""
    t = group_size(group)
    if t == 1:
        return _Done() if async_op else None
    shard = flat.view(t, -1)[rank_in(group)]
    with collective("all_gather"):
        return _issue([flat], async_op, _all_gather_single, flat, shard, group=group)


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """Every rank's `x` [n] gathered into `out` [W * n] (rank order), blocking: FSDP2's all-gather
    (zero/fully_shard.py hands it this one, so the collective is marked like the library's own)."""
    with collective("all_gather"):
        _issue([out, x], False, _all_gather_single, out, x, group=group)


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    """`x` [W * n] reduced over the ranks by `op`, this rank's n elements written into `out`,
    blocking: FSDP2's reduce-scatter of the grads (zero/fully_shard.py)."""
    with collective("reduce_scatter"):
        _issue([out, x], False, _reduce_scatter_single, out, x, op=op, group=group)


def all_gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """[..., N/T] -> [..., N], rank order along the last dim."""
    t = group_size(group)
    if t == 1:
        return x
    stacked = all_gather_dim0(x.unsqueeze(0), group)           # [T, ..., N/T]
    return torch.cat(stacked.unbind(0), dim=-1).contiguous()  # [..., N]


def split_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's chunk of `dim`, as a fresh tensor: a view would pin the whole input alive."""
    t = group_size(group)
    if t == 1:
        return x
    return x.chunk(t, dim=dim)[rank_in(group)].clone(memory_format=torch.contiguous_format)


def all_to_all_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """[C*n, ...] -> [C*n, ...]: part c of dim 0 goes to rank c; part c of the result came from
    rank c (C = ranks in `group`)."""
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    out = torch.empty_like(x)
    with collective("all_to_all"):
        _issue([out, x], False, dist.all_to_all_single, out, x, group=group)
    return out


def all_to_all_uneven(x: torch.Tensor, group, *, out_splits: list[int], in_splits: list[int],
                      kind: str = "all_to_all") -> torch.Tensor:
    """[sum(in_splits), ...] -> [sum(out_splits), ...]: the in_splits[c] rows of part c go to rank c;
    part c of the result (out_splits[c] rows) came from rank c. `kind` names the profiler range."""
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with collective(kind):
        _issue([out, x], False, dist.all_to_all_single, out, x, output_split_sizes=out_splits,
               input_split_sizes=in_splits, group=group)
    return out


def send_recv(group, *, sends=(), recvs=(), tag: int = 0, async_op: bool = False, kind: str = "send_recv"):
    """One batch of point-to-point transfers within `group`: sends [(tensor, global peer rank)],
    recvs [(preallocated tensor, global peer rank)], all posted together, then every work
    waited on (posting both directions at once is what keeps exchanges deadlock-free).
    async_op: return a handle instead of waiting (its wait() waits for the whole batch).
    `tag` keeps two batches in flight between the same peers apart; `kind` names the profiler
    range (`comm:<kind>`; the caller that waits on an async batch opens `wait:<kind>`)."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer, group, tag) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group, tag) for t, peer in recvs]
    if not ops:
        return _Done() if async_op else None
    with collective(kind):
        release = _Release([op.tensor for op in ops])
        works = _Started(dist.batch_isend_irecv(ops), release)
        del ops                      # the works keep the sent buffers: once done, they go at once
        if not async_op:             # a blocking exchange: its wait is part of its range
            works.wait()
            return None
    return works
