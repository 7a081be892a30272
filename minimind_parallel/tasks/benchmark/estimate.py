"""`--estimate`: a cell's memory measured in the launcher's process, no rank launched and no
kernel run (memory.estimate_step_memory: the live-storage tracker on fake tensors and a fake
process group), every pipeline stage in turn; with --device cuda also the caching allocator's
predicted peak."""
from __future__ import annotations

from ... import memory
from ...job import Job
from ...memory.allocator import CudaSetup, predict_cuda_peak
from ...memory.analytic.moe_sizes import RoutingPolicy, routing_text
from ...options import model_config
from . import outputs
from .cells import CellRun


def estimate_device(launch, args) -> str:
    if launch.device == "cuda":
        return f"cuda (estimate, allocator of compute capability {args.cuda_capability})"
    return "cpu (estimate)"


def estimate_cell(job: Job, run: CellRun, row: dict, memo: dict | None = None) -> None:
    """Fill `row` with the cell's estimated peak (every stage: the worst CP rank of each, the last ones
    under the contiguous split, and with a --routing histogram the worst EP rank; the worst stage is
    the cell's peak), or record why it failed. `memo`: the fake dispatch's memo, shared by the
    sweep's cells (memory/fake_memo.py)."""
    config, par, routing = model_config(run.args), run.par, job.task.routing
    memo = {} if memo is None else memo
    try:
        cp_ranks = range(1 if par.cp_load_balance else par.cp)
        # a histogram routes each EP rank differently: every one's (the policies are symmetric)
        ep_ranks = range(par.ep) if config.use_moe and routing not in tuple(RoutingPolicy) else range(1)
        reports = [max((memory.estimate_step_memory(config, par, iters=1, stage=p, cp_rank=r, routing=routing,
                                                    ep_rank=e, memo=memo, **run.sizes)
                        for r in cp_ranks for e in ep_ranks), key=lambda r: r.peak_bytes) for p in range(par.pp)]
        worst = max(reports, key=lambda r: r.peak_bytes)
        outputs.fill_memory(row, worst.peak_bytes, worst.breakdown)
        row["peak_mib_per_stage"] = " ".join(f"{r.peak_bytes / outputs.MIB:.2f}" for r in reports)
        if job.launch.device == "cuda":
            fill_cuda_allocator(row, job.task, config, par, run.sizes)
        if config.use_moe:   # fake tensors have no routing: the dispatch and experts follow --routing's
            row["tokens_per_expert"] = f"{routing_text(routing)}, the estimate's policy (--routing)"
    except Exception as e:
        outputs.fail(row, e)


def fill_cuda_allocator(row: dict, args, config, par, sizes: dict) -> None:
    """--estimate --device cuda: the predicted torch.cuda.max_memory_allocated of the worst stage
    (memory/allocator.py: the step's allocations through the caching allocator's rules, plus the
    cuBLAS workspaces), under this process's CUBLAS_WORKSPACE_CONFIG / PYTORCH_CUDA_ALLOC_CONF."""
    setup = CudaSetup.from_env(capability=parse_capability(args.cuda_capability))
    preds = [predict_cuda_peak(config, par, setup=setup, stage=p, **sizes) for p in range(par.pp)]
    worst = max(preds, key=lambda q: q.max_memory_allocated)
    row["cuda_allocated_mib"] = worst.max_memory_allocated / outputs.MIB
    row["cuda_workspace_mib"] = worst.workspace_bytes / outputs.MIB
    row["cuda_rounding_mib"] = worst.rounding_bytes / outputs.MIB


def parse_capability(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)
