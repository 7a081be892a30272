"""A live-storage tracker: exact bytes of every tensor storage alive, by category, and the peak.

A TorchDispatchMode sees every aten op (forward, backward, optimizer, collectives); each storage
an op reads or writes is tracked once (deduplicated by storage, so views cost nothing) and
forgotten when it is freed (a weakref callback). It works the same on real and fake tensors,
which is what makes `--estimate` the same measurement as a real CPU run.

Categories (each storage has exactly one; the first that applies wins):
    params       parameters and module buffers (model state)
    grads        storages that are some parameter's .grad
    optimizer    optimizer states
    activations  storages saved for backward (seen by a saved-tensors pack hook)
    temporaries  everything else: outputs, gradients of activations, collective buffers, DDP's
                 gradient buckets, the optimizer's scratch tensors

A storage first seen as the input of an op, never as an output, existed before the window (the
batch, DDP's buckets); it was alive all along, so it is counted from the start, the peak included.
Except inside a collective: every collective of the library runs inside the explicit marker
`distributed.comm.collective`, which enters this tracker's `collective_region()`. There such a
storage is the backend's own buffer (gloo's reduce-scatter works on a copy it makes out of our
sight), the kind NCCL keeps outside the CUDA allocator too; it is not counted.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..distributed.loaded_types import is_dtensor

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")
_RANK = {c: i for i, c in enumerate(CATEGORIES)}  # lower rank wins a reclassification


@dataclass
class MemoryReport:
    """Peak bytes of live tensors and what they were at that moment."""

    peak_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)  # CATEGORIES -> bytes, sums to peak_bytes

    def mib(self) -> float:
        return self.peak_bytes / 2**20

    @staticmethod
    def worst(reports: list["MemoryReport"]) -> "MemoryReport":
        """The worst rank's report (e.g. of dist.all_gather_object over the ranks)."""
        return max(reports, key=lambda r: r.peak_bytes)


def _describe(func, out) -> str:
    shapes = [f"{tuple(t.shape)}:{str(t.dtype)[6:]}" for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return f"{func.__name__} -> {' '.join(shapes)}"


# The op that only answers a question about a tensor: the autograd engine asks every tensor's device
# (prim.device, dispatched to the mode for fake tensors), more often than all other ops together.
_DEVICE_QUERY = torch.ops.prim.device.default


def _tensors(tree):
    """The tensors among an op's arguments or outputs: a tensor, or nested tuples / lists / dicts
    of them (what aten ops take and return; `tree_flatten`'s leaves, without its generality). A
    DTensor (--zero 3: FSDP2's sharded parameters, their grads and AdamW states) is its local
    tensor, the storage this rank holds."""
    if isinstance(tree, torch.Tensor):
        yield tree.to_local() if is_dtensor(tree) else tree
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


def _device_type(t: torch.Tensor) -> str:
    """t.device.type; a FakeTensor's without dispatching the question (`prim.device`) again."""
    return t.fake_device.type if type(t) is FakeTensor else t.device.type


class StorageTracker(TorchDispatchMode):
    """`with StorageTracker() as t: ...` then `t.report()`. Register known storages with `mark`."""

    # An optional answer(func, args, kwargs) -> (outputs, input tensors, output tensors) or None:
    # an op's result without dispatching it further, from a mode below that knows it
    # (memory/fake_memo.py under --estimate); None dispatches the op as usual.
    answer = None

    # While this tracker is active, every collective of `distributed.comm` returns only once the
    # backend has let go of its tensors (`comm._Release`), so a tensor dies where the program drops
    # it; outside a measurement nothing waits for that.
    waits_for_release = True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """TorchDispatchMode's switch: nothing under this mode is compiled, so its
        __torch_dispatch__ is not wrapped in torch._disable_dynamo (a frame-callback swap per op)."""
        return False

    def __init__(self, *, detail: bool = False):
        """detail=True also keeps, for the peak, every live storage with the op that made it
        (`peak_items`) and the op at the peak (`peak_op`): slow, for finding out what is there."""
        super().__init__()
        self.detail, self.peak_items, self.peak_op, self._op = detail, [], None, None
        self._entries: dict[int, list] = {}  # id(storage) -> [nbytes, category, weakref, origin]
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.peak_bytes = 0
        self.peak_breakdown = dict(self.live)
        self._hooks = None
        self._lock = threading.RLock()  # backward and collectives may run ops on other threads
        self._collectives = 0           # collectives running now (see collective_region)

    # -- bookkeeping ---------------------------------------------------------------------------
    @property
    def live_bytes(self) -> int:
        return sum(self.live.values())

    def mark(self, t: torch.Tensor | None, category: str) -> None:
        """Track t's storage as `category` (or move it there, if that category ranks higher)."""
        if t is None or not isinstance(t, torch.Tensor):
            return
        if is_dtensor(t):   # the shard this rank holds
            t = t.to_local()
        with self._lock:
            self._mark(t, category)

    def _mark(self, t: torch.Tensor, category: str) -> None:
        st = t.untyped_storage()
        entry = self._entries.get(id(st))
        if entry is None:
            self._add(st, category)
        elif _RANK[category] < _RANK[entry[1]]:
            self.live[entry[1]] -= entry[0]
            self.live[category] += entry[0]
            entry[1] = category
            if self.live_bytes == self.peak_bytes:  # still at the peak: refine its breakdown
                self._snapshot()

    def _add(self, st: torch.UntypedStorage, category: str) -> None:
        key, nbytes = id(st), st.nbytes()
        live, entries = self.live, self._entries

        def freed(_ref, key=key, lock=self._lock):
            with lock:
                entry = entries.pop(key, None)
                if entry is not None:
                    live[entry[1]] -= entry[0]

        entries[key] = [nbytes, category, weakref.ref(st, freed), self._op if self.detail else None]
        live[category] += nbytes

    def _see(self, t: torch.Tensor, *, is_input: bool, foreign: set) -> None:
        st = t.untyped_storage()
        key = id(st)
        entry = self._entries.get(key)
        if entry is None:
            if key in foreign:
                return
            if is_input and self._collectives:
                foreign.add(key)  # the backend's own copy inside a collective (gloo)
                return
            self._add(st, "temporaries")
            if is_input:  # an op's input we never saw made: alive since before the window
                self._backdate(st.nbytes())
        elif entry[0] != st.nbytes():  # resized in place
            self.live[entry[1]] += st.nbytes() - entry[0]
            entry[0] = st.nbytes()

    def _backdate(self, nbytes: int) -> None:
        """A storage that existed before the window (the batch, DDP's gradient buckets) but is
        first seen now was alive at every earlier moment, the peak included."""
        self.peak_bytes += nbytes
        self.peak_breakdown["temporaries"] += nbytes
        if self.detail:
            self.peak_items.append(("temporaries", nbytes, f"(before the window) {self._op}"))

    def _update_peak(self) -> None:
        if self.live_bytes > self.peak_bytes:
            self._snapshot()

    def _snapshot(self) -> None:
        self.peak_bytes, self.peak_breakdown = self.live_bytes, dict(self.live)
        if self.detail:
            self.peak_op = self._op
            self.peak_items = sorted(((e[1], e[0], e[3]) for e in self._entries.values()), reverse=True)

    reset_peak = _snapshot

    def report(self) -> MemoryReport:
        return MemoryReport(peak_bytes=self.peak_bytes, breakdown=dict(self.peak_breakdown))

    # -- the mode ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY:   # a question about a tensor (its device): no storage made or touched
            if type(args[0]) is FakeTensor:   # the fake device, as FakeTensorMode would answer
                return args[0].fake_device
            return func(*args, **(kwargs or {}))
        answered = self.answer(func, args, kwargs) if self.answer is not None else None
        if answered is None:
            out = func(*args, **(kwargs or {}))
            inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        else:
            out, inputs, outputs = answered
        foreign = set()
        with self._lock:
            if self.detail:
                self._op = _describe(func, out)
            for is_input, tensors in ((True, inputs), (False, outputs)):
                for t in tensors:
                    if _device_type(t) != "meta":
                        self._see(t, is_input=is_input, foreign=foreign)
            self._update_peak()
        return out

    @contextlib.contextmanager
    def collective_region(self):
        """Entered by `distributed.comm.collective` while a collective (or its wait) runs."""
        with self._lock:
            self._collectives += 1
        try:
            yield
        finally:
            with self._lock:
                self._collectives -= 1

    def _pack(self, t: torch.Tensor):
        self.mark(t, "activations")  # saved for backward
        return t

    def _resized(self, st: torch.UntypedStorage) -> None:
        """A storage resized outside any op: FSDP2 (--zero 3) frees a block's all-gathered
        parameters by resizing their storage to 0 bytes and allocates them again the same way (a
        storage of the warm-up step, first seen so, starts to count now, not before the window)."""
        with self._lock:
            entry = self._entries.get(id(st))
            if entry is None:   # made before the window, empty until now (not alive all along)
                self._add(st, "temporaries")
                self._update_peak()
            elif entry[0] != st.nbytes():
                self.live[entry[1]] += st.nbytes() - entry[0]
                entry[0] = st.nbytes()
                self._update_peak()

    @contextlib.contextmanager
    def _watching_resizes(self):
        """`UntypedStorage.resize_` reported to `_resized` while the window is open (it is no aten
        op: the mode does not see it)."""
        resize = torch.UntypedStorage.resize_

        def watched(st, nbytes):
            out = resize(st, nbytes)
            self._resized(st)
            return out

        torch.UntypedStorage.resize_ = watched
        try:
            yield
        finally:
            torch.UntypedStorage.resize_ = resize

    def __enter__(self):
        self._hooks = contextlib.ExitStack()
        self._hooks.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
        self._hooks.enter_context(self._watching_resizes())
        self.reset_peak()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._hooks.__exit__(*exc)
        return out
