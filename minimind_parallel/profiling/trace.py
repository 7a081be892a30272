"""`profile_steps`: a few train steps under torch.profiler, one Chrome/Perfetto trace per rank.

Named ranges in the trace (open it in https://ui.perfetto.dev or chrome://tracing):
    step <k>                                  one train step (after a barrier)
    forward / backward / weight               the pipeline schedule (pipeline_parallel/schedules.py; weight: zb's W)
    finalize_grads / optimizer                training.train_step
    block <i> forward / block <i> backward    hooks installed here, for the profiled steps only
    comm:<kind>, wait:<kind>                  every collective (distributed/comm.py)
    async_linear.dgrad / async_linear.wgrad   the GEMMs of LinearWithAsyncCommunication.backward
    gloo:<op> on pt_gloo_runloop threads      when a gloo collective really runs (recorded by torch)
"""
from __future__ import annotations

import json
import os
import re

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import profile, record_function

from ..device_sync import synchronize
from ..files import atomic_path
from ..pipeline_parallel import Schedule
from ..training import train_step
from .overlap import analyze_file, mean_over_ranks
from .timeline import plot_timelines


def name_blocks(model: nn.Module) -> list:
    """Open a `block <i> forward` / `block <i> backward` range around each decoder block
    (`...layers.<i>`); returns the hook handles, to be removed after profiling."""
    handles = []
    for name, module in model.named_modules():
        m = re.search(r"layers\.(\d+)$", name)
        if m is not None:
            handles += name_block(module, m.group(1))
    return handles


def name_block(block: nn.Module, index: str) -> list:
    """Forward: a range from the block's pre-hook to its hook. Backward: from autograd reaching
    the block's output node to the grad of its input being complete, hooked on the graph itself;
    a module full-backward hook would turn the block's output into a view (and a pipeline
    stage could then no longer free its output once sent)."""
    opened = []

    def enter(module, inputs):
        opened.append(record_function(f"block {index} forward").__enter__())

    def leave(module, inputs, out):
        opened.pop().__exit__(None, None, None)
        x = inputs[0]
        if torch.is_grad_enabled() and x.requires_grad and out.grad_fn is not None:
            name_backward(f"block {index} backward", x, out)

    return [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]


def name_backward(label: str, x: torch.Tensor, out: torch.Tensor) -> None:
    """A `label` range from autograd reaching `out`'s node to `x`'s grad being complete."""
    opened = []

    def enter(grad_outputs):
        opened.append(record_function(label).__enter__())

    def leave(grad):
        if opened:
            opened.pop().__exit__(None, None, None)

    out.grad_fn.register_prehook(enter)
    x.register_hook(leave)


def profile_steps(model: nn.Module, optimizer, groups, ids, targets, *, steps: int = 3, warmup: int = 1,
                  num_microbatches: int = 1, schedule: Schedule = Schedule.ONE_F_ONE_B, out_dir: str,
                  rank: int | None = None, device="cpu", title: str = "") -> dict:
    """Run `warmup` plain steps, then `steps` profiled ones (each `num_microbatches` through
    `schedule`, as training.train_step); on every rank write `trace_rank<r>.json` and
    `report_rank<r>.json` to out_dir. Collective over the world: returns {"rank": this rank's
    report, "ranks": every rank's, "summary": their mean, "steps": this rank's StepResult of each
    profiled step}; rank 0 also writes report.json and timeline.png."""
    rank = (dist.get_rank() if dist.is_initialized() else 0) if rank is None else rank
    os.makedirs(out_dir, exist_ok=True)
    batches = dict(num_microbatches=num_microbatches, schedule=schedule)
    for _ in range(warmup):
        train_step(model, optimizer, groups, ids, targets, **batches)
    # The autograd profiler with kineto writes the same trace as torch.profiler.profile, without
    # the latter's first-use import of torch._inductor (~10 s per process on a small CPU).
    cuda = torch.device(device).type == "cuda"
    handles, steps_run = name_blocks(model), []
    try:
        with profile(use_kineto=True, use_device="cuda" if cuda else None) as prof:
            for k in range(steps):
                synchronize(device)  # ranks start each step together; outside the step window
                with record_function(f"step {k}"):
                    steps_run.append(train_step(model, optimizer, groups, ids, targets, **batches).schedule)
                    synchronize(device, barrier=False)
    finally:
        for h in handles:
            h.remove()
    trace_path = os.path.join(out_dir, f"trace_rank{rank}.json")
    with atomic_path(trace_path) as tmp:
        prof.export_chrome_trace(tmp)
    report = analyze_file(trace_path)
    with atomic_path(os.path.join(out_dir, f"report_rank{rank}.json")) as tmp, open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    reports = [None] * dist.get_world_size() if dist.is_initialized() else [report]
    if dist.is_initialized():
        dist.all_gather_object(reports, report)
    result = dict(rank=report, ranks=reports, summary=mean_over_ranks(reports), steps=steps_run)
    if rank == 0:
        write_outputs(result, out_dir, title)
    return result


def write_outputs(result: dict, out_dir: str, title: str = "") -> None:
    """report.json (the mean over ranks, and every rank's report) and timeline.png."""
    with atomic_path(os.path.join(out_dir, "report.json")) as tmp, open(tmp, "w") as f:
        json.dump(dict(title=title, summary=result["summary"], ranks=result["ranks"]), f, indent=1)
    plot_timelines({title or "profile": [r["timeline"] for r in result["ranks"]]},
                   os.path.join(out_dir, "timeline.png"))
