"""Which layout fits a set of devices and which is fastest: every valid layout of the project's
dimensions, its per-rank peak from the analytic memory model and its step time from a stated,
calibrated time model, ranked by predicted tokens/s (docs/planning.md).

    space.py        the candidate space as data: one table of dimensions, every layout of it and
                    why each one cut was cut (check_layout's constraint, or the planner's own)
    hardware.py     the rates the time model reads (`Hardware`), built-in GPU profiles with their
                    sources, the calibration file
    time_model.py   `step_time`: GEMM / attention FLOPs, elementwise bytes, each collective's bytes
                    over its group's link, the overlaps, the pipeline bubble
    ranking.py      `plan`: each candidate's memory (analytic; on CUDA the allocator level) and
                    time, the fitting ones ranked, the others with why
    allocator_rounding.py  the CUDA allocator's block rounding at the peak, estimated from the
                    analytic model's saved tensors
    calibrate.py    `calibrate`: this machine's rates, measured at the workload's shapes
    op_count.py     `OpCount`: a step's dispatched ops by what the time model costs (GEMM FLOPs,
                    memory-bound bytes, attention, views, collectives); calibrate's and the tests'
    agreement.py    predicted against measured: MAPE, Spearman's rank correlation
    forked.py       `forked_map`: the layouts' predictions in forked processes, the results in order
"""
from .hardware import GPU_PROFILES, Hardware, Link
from .ranking import Plan, PlanEntry, plan
from .space import Candidate, Workload, enumerate_layouts
from .time_model import StepTime, step_time

__all__ = ["Candidate", "GPU_PROFILES", "Hardware", "Link", "Plan", "PlanEntry", "StepTime", "Workload",
           "enumerate_layouts", "plan", "step_time"]
