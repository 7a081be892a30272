"""`MemoryMeter`: peak memory of the measured iterations of a real run, on this rank.

    meter = MemoryMeter(device, model, optimizer)
    with meter:
        for _ in range(iters):
            train_step(model, optimizer, groups, ids, targets)
    report = meter.report()        # this rank's MemoryReport; the driver takes the worst rank

CPU: the live-storage tracker (exact bytes by category). CUDA: the allocator's own peak
(`torch.cuda.max_memory_allocated` after a reset) is the number; the same tracker runs beside it
for the breakdown, and whatever the allocator holds beyond the tracked tensors (512-byte
rounding, library workspaces) is counted as temporaries. Inside `with meter:` every collective
returns only once the backend has let go of its tensors (the tracker's `waits_for_release`,
`distributed.comm._Release`), so a tensor dies where the program drops it.
"""
from __future__ import annotations

import torch
from torch import nn

from .tracker import CATEGORIES, MemoryReport, StorageTracker


class MemoryMeter:
    tracker_type = StorageTracker   # a subclass may watch more (scripts/cuda_memory_gap.py)

    def __init__(self, device, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 also_alive: tuple[torch.Tensor, ...] = (), detail: bool = False, tracker_type=None,
                 answer=None):
        """also_alive: tensors alive through the window that no op touches (counted as
        temporaries); detail: see StorageTracker; tracker_type: a StorageTracker subclass that
        also watches something (memory/allocator.py records the allocation sequence); answer:
        the tracker's `answer` (StorageTracker). Each `with meter:` is a fresh measurement."""
        self.device = torch.device(device)
        self.model, self.optimizer = model, optimizer
        self.also_alive, self.detail, self.answer = also_alive, detail, answer
        if tracker_type is not None:
            self.tracker_type = tracker_type
        self.tracker = self.tracker_type(detail=detail)
        self._handles = []
        self._cuda_peak = None

    def _register_state(self) -> None:
        """Tell the tracker which storages are params, grads and optimizer states."""
        t = self.tracker
        for b in self.model.buffers():
            t.mark(b, "params")
        for p in self.model.parameters():
            t.mark(p, "params")
            t.mark(p.grad, "grads")
            # A gradient becomes a .grad when AccumulateGrad stores it: reclassify it then.
            self._handles.append(p.register_post_accumulate_grad_hook(lambda p: t.mark(p.grad, "grads")))
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:   # under --zero: the slices, and their grads
                for p in group["params"]:
                    t.mark(p.grad, "grads")
            self._mark_optimizer_states()
            # States created inside the window (no warm-up step) are classified after the step.
            self._handles.append(self.optimizer.register_step_post_hook(lambda *_: self._mark_optimizer_states()))

    def _mark_optimizer_states(self) -> None:
        for state in self.optimizer.state.values():
            for v in state.values():
                self.tracker.mark(v, "optimizer")

    def __enter__(self):
        self.tracker = self.tracker_type(detail=self.detail)
        self.tracker.answer = self.answer
        self._register_state()
        for t in self.also_alive:
            self.tracker.mark(t, "temporaries")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc):
        self.tracker.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._cuda_peak = torch.cuda.max_memory_allocated(self.device)
        return False

    def report(self) -> MemoryReport:
        r = self.tracker.report()
        if self._cuda_peak is None:
            return r
        # The allocator's peak is the number; the tracker's breakdown explains it, the rest
        # (allocator rounding, workspaces) goes to temporaries.
        tracked = {k: r.breakdown[k] for k in CATEGORIES if k != "temporaries"}
        tracked["temporaries"] = max(0, self._cuda_peak - sum(tracked.values()))
        return MemoryReport(peak_bytes=sum(tracked.values()), breakdown=tracked)
