"""The --zero 3 compositions `predict_memory` does not replay, refused in one line before any replay.

fsdp_replay.py follows one FSDP2 group per block (and the root's): its all-gather before the
block's forward and backward, the copy-out, the free, the reduce-scatter. Under expert parallelism
(ep_size > 1, zero/fully_shard.py) each MoE layer's experts are a second FSDP2 group of the block,
over the EDP mesh, or whole outside FSDP2 on one EDP rank: fsdp_experts.py replays that timeline
(their gather between the dispatch and the experts, the block's pre-backward prefetch of them, their
copy-out at the grad of their output, their reduce-scatter before the dispatch's backward), not
under pipeline parallelism (refused).

Under pipeline parallelism fsdp_pipeline.py replays gpipe and 1f1b with two microbatches or more;
refused: the posted schedules (interleaved, zb: their replays, posted_replay.py, are not composed
with the gathered stage), --recompute full (a block's gathered parameters are saved only while its
backward re-runs its forward, not from the first forward on), and one microbatch (the last stage's
forward end and the reduces after a first-and-last backward hold bytes the replay does not follow).
"""
from __future__ import annotations

from ...config import ParallelConfig, Recompute
from ...pipeline_parallel.order import Schedule


def composition_refusal(par: ParallelConfig, schedule: Schedule, num_microbatches: int) -> str | None:
    """Why the --zero 3 layout `par` (under `schedule`, `num_microbatches`) is not modelled; None where it is."""
    if par.pp == 1:
        return None
    if par.ep > 1:
        return (f"--zero 3 with --ep_size > 1 is modelled without pipeline parallelism (the experts' FSDP2 groups "
                f"over a stage gathered through the schedule are not replayed); got pp_size={par.pp}, ep_size={par.ep}")
    if Schedule(schedule) not in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
        return (f"--zero 3 with --pp_size > 1 is modelled under gpipe and 1f1b (a stage gathered over the schedule); "
                f"got pp_schedule={schedule}")
    if par.recompute == Recompute.FULL:
        return ("--zero 3 with --pp_size > 1 is not modelled under --recompute full (a block's gathered parameters "
                "saved only while its backward re-runs its forward)")
    if num_microbatches < 2:
        return (f"--zero 3 with --pp_size > 1 is modelled at two microbatches or more (one backward, the first and "
                f"the last, is not replayed); got num_microbatches={num_microbatches}")
    return None


def check_composition(par: ParallelConfig, schedule: Schedule, num_microbatches: int) -> None:
    """Refuse (one line) the --zero 3 layouts whose FSDP2 groups neither replay follows."""
    reason = composition_refusal(par, schedule, num_microbatches)
    if reason is not None:
        raise NotImplementedError(f"predict_memory: {reason}")
