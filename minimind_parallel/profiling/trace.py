"""`profile_steps`: a few train steps under torch.profiler, one Chrome/Perfetto trace per rank.

Named ranges in the trace (open it in https://ui.perfetto.dev or chrome://tracing):
    step <k>                                  one train step (after a barrier)
    forward / backward / finalize_grads / optimizer      training.train_step
    block <i> forward / block <i> backward    hooks installed here, for the profiled steps only
    comm:<kind>, wait:<kind>                  every TP collective (tensor_parallel/comm.py)
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
from ..training import train_step_detailed
from .overlap import analyze_file, mean_over_ranks


def name_blocks(model: nn.Module) -> list:
    """Open a `block <i> forward` / `block <i> backward` range around each decoder block
    (`...layers.<i>`); returns the hook handles, to be removed after profiling."""
    handles = []
    for name, module in model.named_modules():
        m = re.search(r"layers\.(\d+)$", name)
        if m is None:
            continue
        for phase, pre, post in (("forward", module.register_forward_pre_hook, module.register_forward_hook),
                                 ("backward", module.register_full_backward_pre_hook,
                                  module.register_full_backward_hook)):
            label, open_ranges = f"block {m.group(1)} {phase}", []
            handles.append(pre(lambda *_, label=label, o=open_ranges: o.append(record_function(label).__enter__())))
            handles.append(post(lambda *_, o=open_ranges: o.pop().__exit__(None, None, None)))
    return handles


def profile_steps(model: nn.Module, optimizer, groups, ids, labels, *, steps: int = 3, warmup: int = 1,
                  num_microbatches: int = 1, schedule: str = "1f1b", out_dir: str, rank: int | None = None,
                  device="cpu", title: str = "") -> dict:
    """Run `warmup` plain steps, then `steps` profiled ones (each `num_microbatches` through
    `schedule`, as training.train_step); on every rank write `trace_rank<r>.json` and
    `report_rank<r>.json` to out_dir. Collective over the world: returns {"rank": this rank's
    report, "ranks": every rank's, "summary": their mean, "steps": this rank's StepResult of each
    profiled step}; rank 0 also writes report.json and timeline.png."""
    rank = (dist.get_rank() if dist.is_initialized() else 0) if rank is None else rank
    os.makedirs(out_dir, exist_ok=True)
    batches = dict(num_microbatches=num_microbatches, schedule=schedule)
    for _ in range(warmup):
        train_step_detailed(model, optimizer, groups, ids, labels, **batches)
    # The autograd profiler with kineto writes the same trace as torch.profiler.profile, without
    # the latter's first-use import of torch._inductor (~10 s per process on a small CPU).
    cuda = torch.device(device).type == "cuda"
    handles, steps_run = name_blocks(model), []
    try:
        with profile(use_kineto=True, use_device="cuda" if cuda else None) as prof:
            for k in range(steps):
                synchronize(device)  # ranks start each step together; outside the step window
                with record_function(f"step {k}"):
                    steps_run.append(train_step_detailed(model, optimizer, groups, ids, labels, **batches))
                    synchronize(device, barrier=False)
    finally:
        for h in handles:
            h.remove()
    trace_path = os.path.join(out_dir, f"trace_rank{rank}.json")
    prof.export_chrome_trace(trace_path)
    report = analyze_file(trace_path)
    with open(os.path.join(out_dir, f"report_rank{rank}.json"), "w") as f:
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
    from .timeline import plot_timelines
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(dict(title=title, summary=result["summary"], ranks=result["ranks"]), f, indent=1)
    plot_timelines({title or "profile": [r["timeline"] for r in result["ranks"]]},
                   os.path.join(out_dir, "timeline.png"))
