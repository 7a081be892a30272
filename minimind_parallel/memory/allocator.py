"""What `torch.cuda.max_memory_allocated()` reports, predicted on a CPU.

The tracker counts tensor storages to the byte; the CUDA allocator reports more. Two terms, each
from PyTorch's source (c10/cuda/CUDACachingAllocator.cpp, aten/src/ATen/cuda/CublasHandlePool.cpp):

**Block rounding** (`CachingAllocatorModel`). `allocated_bytes` counts the *block* a request
gets, not the request. A request of n bytes is rounded to a multiple of 512 (`round_size`,
`kMinBlockSize`); up to 1 MiB it is served from the small pool (`kSmallSize`), whose segments
are 2 MiB (`kSmallBuffer`); larger from the large pool, whose new segments are 20 MiB for
requests under 10 MiB (`kLargeBuffer`, `kMinLargeAlloc`) and the request rounded up to 2 MiB
beyond (`kRoundLarge`; `get_allocation_size`). A free cached block is reused best-fit (the
smallest that fits, then the lowest address: `BlockComparatorSize`, `get_free_block`) and split
only when the rest is worth keeping (`should_split`): in the small pool when >= 512 bytes remain,
in the large pool when > 1 MiB remains -- so a large request may hold up to 1 MiB more than it
asked for, the rounding the H200 measured (docs/memory.md, "On a GPU"). Freed blocks merge with
free neighbours of their segment (`try_merge_blocks`). With `expandable_segments:True` the large
pool splits like the small one (>= 512 bytes) and grows one segment per pool.

**cuBLAS workspaces** (`cublas_workspace_bytes`). `getCurrentCUDABlasHandle` gives every thread
its own handle and sets a workspace per (handle, stream), allocated through the caching
allocator and kept: `getChosenWorkspaceSize` = `CUBLAS_WORKSPACE_CONFIG` parsed as `:SIZE:COUNT`
pairs (KiB x count, summed; an unparsable value falls back to the default), else 32 MiB on
compute capability 9.0 and `4096 KiB x 2 + 16 KiB x 8` elsewhere. A training step runs GEMMs on
two threads -- the caller's (forward, optimizer) and autograd's device thread (backward) -- so
two workspaces: 64 MiB on an H100/H200, measured on the H200 by scripts/cuda_memory_gap.py (the
allocator's baseline before the step; docs/memory.md, "On a GPU"). cuBLASLt keeps its own workspaces
(`CUBLASLT_WORKSPACE_SIZE` KiB, default 1024, capped at the cuBLAS size) only for the GEMMs that
take that path (`lt_threads`; none showed in the H200 run: its excess was 64.00 MiB).

**FSDP2's storages** (--zero 3). FSDP2 all-gathers a group's shards into one flat buffer (an
ordinary allocation), then copies them out into each unsharded parameter's storage, which it
grows from 0 bytes with `UntypedStorage.resize_` (`alloc_storage`) and shrinks back to 0 after the
block's forward and backward (`free_storage`): on CUDA a malloc and a free of the caching
allocator each, which the recorder records (`AllocationRecorder._resized`).

Not modelled: streams other than the default one (NCCL's `recordStream` delays frees to the
communication stream's events), `max_split_size_mb`, `roundup_power2_divisions`, garbage
collection, and the history before the measured window (the replay starts from the tensors alive
at its start, each in its own fresh block).
"""
from __future__ import annotations

import bisect
import itertools
import os
import re
import weakref
from dataclasses import dataclass

import torch

from .estimate import estimate_step_memory
from .tracker import StorageTracker

MIN_BLOCK = 512                 # kMinBlockSize: every request rounds up to a multiple of this
SMALL_SIZE = 1 << 20            # kSmallSize: largest request of the small pool
SMALL_BUFFER = 2 << 20          # kSmallBuffer: a small-pool segment
LARGE_BUFFER = 20 << 20         # kLargeBuffer: the segment of a 1-10 MiB request
MIN_LARGE_ALLOC = 10 << 20      # kMinLargeAlloc: from here a segment is the request rounded to 2 MiB
ROUND_LARGE = 2 << 20           # kRoundLarge


def round_size(nbytes: int) -> int:
    """The block size of a request (round_size without roundup_power2_divisions)."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """What a new segment for a rounded request of `size` reserves (get_allocation_size)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("addr", "size", "small", "allocated", "prev", "next")

    def __init__(self, addr: int, size: int, small: bool):
        self.addr, self.size, self.small, self.allocated = addr, size, small, False
        self.prev = self.next = None

    def key(self):
        return (self.size, self.addr)


class CachingAllocatorModel:
    """PyTorch's CUDA caching allocator on one device and one stream, as far as
    `memory_allocated` / `max_memory_allocated` see it. `malloc(n)` -> a handle; `free(handle)`."""

    def __init__(self, *, expandable_segments: bool = False):
        self.expandable = expandable_segments
        self.allocated = self.peak = self.reserved = 0
        self._free = {True: [], False: []}          # pool (small?) -> sorted [(size, addr, block)]
        self._next_addr = 0
        self._tail = {True: None, False: None}      # expandable: the last block of each pool's segment

    def reset_peak(self) -> None:
        self.peak = self.allocated

    def malloc(self, nbytes: int) -> _Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(size, small) or self._new_segment(size, small)
        if self._should_split(block, size):
            rest = _Block(block.addr + size, block.size - size, small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            elif self.expandable:
                self._tail[small] = rest
            block.next, block.size = rest, size
            self._insert(rest)
        block.allocated = True
        self.allocated += block.size
        self.peak = max(self.peak, self.allocated)
        return block

    def free(self, block: _Block) -> None:
        block.allocated = False
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):      # try_merge_blocks
            if neighbour is not None and not neighbour.allocated:
                self._remove(neighbour)
                if neighbour is block.prev:
                    block.addr, block.prev = neighbour.addr, neighbour.prev
                    if neighbour.prev is not None:
                        neighbour.prev.next = block
                else:
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
                    elif self.expandable:
                        self._tail[block.small] = block
                block.size += neighbour.size
        self._insert(block)

    # -- pools -----------------------------------------------------------------------------------
    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.expandable:
            return remaining >= MIN_BLOCK
        return remaining > SMALL_SIZE

    def _best_fit(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        return pool.pop(i)[2]

    def _new_segment(self, size: int, small: bool) -> _Block:
        tail = self._tail[small]
        if self.expandable and tail is not None and not tail.allocated:
            # the segment grows by mapping pages after its free tail: the tail becomes the block
            self._remove(tail)
            grow = -(-(size - tail.size) // ROUND_LARGE) * ROUND_LARGE
            tail.size += grow
            self.reserved += grow
            return tail
        seg = -(-size // ROUND_LARGE) * ROUND_LARGE if self.expandable else segment_size(size)
        block = _Block(self._next_addr, seg, small)
        self._next_addr += seg
        self.reserved += seg
        if self.expandable:
            block.prev = tail
            if tail is not None:
                tail.next = block
            self._tail[small] = block
        return block

    def _insert(self, block: _Block) -> None:
        bisect.insort(self._free[block.small], (block.size, block.addr, block))

    def _remove(self, block: _Block) -> None:
        pool = self._free[block.small]
        i = bisect.bisect_left(pool, (block.size, block.addr))
        assert pool[i][2] is block
        pool.pop(i)


# ---------------------------------------------------------------------------------- workspaces

def cublas_workspace_bytes(capability: tuple[int, int], config: str | None = None) -> int:
    """One cuBLAS workspace (getChosenWorkspaceSize): CUBLAS_WORKSPACE_CONFIG's `:SIZE:COUNT`
    pairs (KiB x count, summed), else 32 MiB on compute capability 9.0, else `:4096:2:16:8`."""
    default = 4096 * 8 * 1024 if tuple(capability) == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8
    if config is None:
        return default
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if not pairs:
        return default
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def cublaslt_workspace_bytes(cublas_bytes: int, size_kib: str | None = None) -> int:
    """One cuBLASLt workspace (getCUDABlasLtWorkspaceSize): CUBLASLT_WORKSPACE_SIZE KiB (default
    1024), capped at the cuBLAS workspace."""
    try:
        kib = int(size_kib) if size_kib is not None else 1024
    except ValueError:
        kib = 1024
    return min(kib * 1024, cublas_bytes)


@dataclass(kw_only=True, frozen=True)
class CudaSetup:
    """What sets the allocator's numbers beyond the tensors: the GPU generation, the environment
    variables PyTorch reads, and how many threads run GEMMs (each gets its own workspaces)."""

    capability: tuple[int, int] = (9, 0)            # H100 / H200
    cublas_workspace_config: str | None = None      # CUBLAS_WORKSPACE_CONFIG
    cublaslt_workspace_size: str | None = None      # CUBLASLT_WORKSPACE_SIZE (KiB)
    expandable_segments: bool = False               # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    gemm_threads: int = 2                           # the caller's and autograd's device thread
    lt_threads: int = 0                             # threads whose GEMMs take the cuBLASLt path

    @staticmethod
    def from_env(capability: tuple[int, int] = (9, 0), env=None) -> "CudaSetup":
        """The setup the environment variables PyTorch reads would give on a GPU of `capability`."""
        env = os.environ if env is None else env
        alloc_conf = env.get("PYTORCH_CUDA_ALLOC_CONF", "") or env.get("PYTORCH_ALLOC_CONF", "")
        return CudaSetup(capability=tuple(capability), cublas_workspace_config=env.get("CUBLAS_WORKSPACE_CONFIG"),
                         cublaslt_workspace_size=env.get("CUBLASLT_WORKSPACE_SIZE"),
                         expandable_segments="expandable_segments:true" in alloc_conf.replace(" ", "").lower())

    def workspaces(self) -> list[int]:
        cublas = cublas_workspace_bytes(self.capability, self.cublas_workspace_config)
        lt = cublaslt_workspace_bytes(cublas, self.cublaslt_workspace_size)
        return [n for n in [cublas] * self.gemm_threads + [lt] * self.lt_threads if n > 0]


# ------------------------------------------------------------------------ the recorded sequence

class AllocationRecorder(StorageTracker):
    """The storage tracker (its report unchanged), also recording every storage's allocation and
    free in order. `before`: the storages alive when the window opened (marked state, and what
    the tracker backdates); `events`: ("alloc", id, nbytes) / ("free", id) / ("step",) inside it.
    AdamW's `step` counters are left out: on CUDA they stay on the host."""

    def __init__(self, *, detail: bool = False):
        super().__init__(detail=detail)
        self.before: list[tuple[int, int]] = []
        self.events: list[tuple] = []
        self._ids = itertools.count()
        self._serial: dict[int, int] = {}               # id(storage) -> serial, while alive
        self._refs: dict[int, weakref.ref] = {}
        self._open = self._host = False
        self.host_bytes = 0                             # AdamW step counters: on the host on CUDA

    def mark(self, t, category: str) -> None:
        self._host = category == "optimizer" and isinstance(t, torch.Tensor) and t.dim() == 0
        try:
            super().mark(t, category)
        finally:
            self._host = False

    def _add(self, st, category: str) -> None:
        super()._add(st, category)
        if self._host:
            self.host_bytes += st.nbytes()
            return
        if st.nbytes() == 0:
            return
        serial = next(self._ids)
        self._serial[id(st)] = serial
        self._refs[serial] = weakref.ref(st, lambda _r, s=serial, k=id(st): self._freed(s, k))
        if self._open:
            self.events.append(("alloc", serial, st.nbytes()))
        else:
            self.before.append((serial, st.nbytes()))

    def _freed(self, serial: int, key: int) -> None:
        with self._lock:
            self._refs.pop(serial, None)
            if self._serial.get(key) == serial:
                del self._serial[key]
            self.events.append(("free", serial))

    def _backdate(self, nbytes: int) -> None:
        super()._backdate(nbytes)
        last = self.events[-1] if self.events else None
        if last is not None and last[0] == "alloc" and last[2] == nbytes:  # the storage `_see` just added
            self.events.pop()
            self.before.append((last[1], nbytes))

    def _see(self, t, *, is_input: bool, foreign: set) -> None:
        st = t.untyped_storage()
        entry = self._entries.get(id(st))
        old = entry[0] if entry is not None else None
        super()._see(t, is_input=is_input, foreign=foreign)
        if old is not None and old != st.nbytes() and id(st) in self._serial:
            # resized in place: CUDA allocates the new size, copies, frees the old block
            new = next(self._ids)
            self.events += [("alloc", new, st.nbytes()), ("free", self._serial[id(st)])]
            self._serial[id(st)] = new

    def _resized(self, st) -> None:
        """FSDP2's `resize_` outside any op: on CUDA resizing a storage to 0 bytes frees its block
        (`free_storage`), to n bytes from 0 allocates one (`alloc_storage`): a free and an alloc."""
        with self._lock:
            key = id(st)
            entry = self._entries.get(key)
            size = entry[0] if entry is not None else None
            super()._resized(st)
            if size is None or size == st.nbytes():   # new: _add recorded it (when not empty)
                return
            old = self._serial.pop(key, None)
            if old is not None:
                self.events.append(("free", old))
            if st.nbytes() > 0:
                serial = next(self._ids)
                self._serial[key] = serial
                self._refs[serial] = weakref.ref(st, lambda _r, s=serial, k=key: self._freed(s, k))
                self.events.append(("alloc", serial, st.nbytes()))

    def end_step(self) -> None:
        with self._lock:
            self.events.append(("step",))

    def __enter__(self):
        out = super().__enter__()
        self._open = True
        return out


# ------------------------------------------------------------------------------------- replay

@dataclass(kw_only=True, frozen=True)
class AllocatorPrediction:
    """Predicted `max_memory_allocated` of the measured steps, and its parts."""

    max_memory_allocated: int   # the allocator's peak: blocks of the tensors + workspaces
    tensors_peak: int           # the tracker's peak (live tensor bytes)
    workspace_bytes: int        # cuBLAS (and cuBLASLt) workspaces, alive all step
    reserved: int               # segments the allocator holds at the end (`memory_reserved`)

    @property
    def rounding_bytes(self) -> int:
        """What the blocks hold beyond the tensors at the allocator's peak, workspaces aside."""
        return self.max_memory_allocated - self.workspace_bytes - self.tensors_peak


def replay(recorder: AllocationRecorder, setup: CudaSetup = CudaSetup(), *, skip_steps: int = 1) -> tuple[int, int]:
    """The recorder's sequence through the allocator model: the storages alive before the window
    and the workspaces first, then the window. The peak is taken over the steps after the first
    `skip_steps` (the allocator's warm-up: its first step finds no cached blocks, as a real run's
    warm-up step does). -> (max_memory_allocated, memory_reserved at the end)."""
    model = CachingAllocatorModel(expandable_segments=setup.expandable_segments)
    blocks = {serial: model.malloc(n) for serial, n in recorder.before}
    for n in setup.workspaces():
        model.malloc(n)
    steps = sum(1 for e in recorder.events if e[0] == "step")
    skip = min(skip_steps, max(steps - 1, 0))
    done = 0
    if skip == 0:
        model.reset_peak()
    for event in recorder.events:
        if event[0] == "alloc":
            blocks[event[1]] = model.malloc(event[2])
        elif event[0] == "free":
            block = blocks.pop(event[1], None)
            if block is not None:
                model.free(block)
        else:
            done += 1
            if done == skip:
                model.reset_peak()
    return model.peak, model.reserved


def predict_cuda_peak(model_config, par, *, setup: CudaSetup = CudaSetup(), stage: int = 0, iters: int = 2,
                      **sizes) -> AllocatorPrediction:
    """`max_memory_allocated` of a step of `model_config` under `par` on one GPU of generation
    `setup.capability`: `estimate_step_memory`'s steps (fake tensors; `sizes`: seq_len,
    micro_batch_size, dtype, num_microbatches, schedule) recorded and replayed through the
    allocator model, the first step as the allocator's warm-up."""
    if iters < 2:
        raise ValueError(f"the replay needs a warm-up step and a measured one; got iters={iters}")
    seen: list[AllocationRecorder] = []

    def on_step(tracker: AllocationRecorder) -> None:
        tracker.end_step()
        if not seen:
            seen.append(tracker)

    report = estimate_step_memory(model_config, par, iters=iters, stage=stage, tracker_type=AllocationRecorder,
                                  on_step=on_step, **sizes)
    peak, reserved = replay(seen[0], setup)
    return AllocatorPrediction(max_memory_allocated=peak, tensors_peak=report.peak_bytes - seen[0].host_bytes,
                               workspace_bytes=sum(setup.workspaces()), reserved=reserved)
