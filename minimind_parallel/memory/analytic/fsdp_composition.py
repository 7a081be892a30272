"""The --zero 3 compositions `predict_memory` does not replay, refused in one line before any replay.

fsdp_replay.py follows one FSDP2 group per block (and the root's): its all-gather before the
block's forward and backward, the copy-out, the free, the reduce-scatter. Under expert parallelism
(ep_size > 1, zero/fully_shard.py) each MoE layer's experts are a second FSDP2 group of the block,
over the EDP mesh, or whole outside FSDP2 on one EDP rank: fsdp_experts.py replays that timeline
(their gather between the dispatch and the experts, the block's pre-backward prefetch of them, their
copy-out at the grad of their output, their reduce-scatter before the dispatch's backward). Under
gpipe and 1f1b fsdp_pipeline.py keeps each block's experts a group of their own, gathered inside
the MoE layer of the stage's first forward and kept to the schedule's end (whole, outside FSDP2,
on one EDP rank), under interleaved fsdp_posted.py each chunk's blocks' and experts' from the
chunk's first forward, under zb fsdp_posted.py's walk with zb's first forward as 1F1B's (the
experts' groups gathered there; the experts make their grads in B, so no W step touches them); not
the whole experts (one EDP rank) under --recompute full (116 KB under at tp4 x pp4 x dp2 x ep2 with
SP, 1f1b, bf16: refused).

Under pipeline parallelism every schedule is replayed: gpipe and 1f1b by fsdp_pipeline.py, the
posted ones (interleaved, zb) by fsdp_posted.py (the MoE model and few tokens as
fsdp_replay.check_fully_sharded says).
"""
from __future__ import annotations

from ...config import ParallelConfig, Recompute
from ...pipeline_parallel.order import Schedule


def composition_refusal(par: ParallelConfig, schedule: Schedule, num_microbatches: int) -> str | None:
    """Why the --zero 3 layout `par` (under `schedule`, `num_microbatches`) is not modelled; None where it is."""
    if par.pp == 1:
        return None
    if par.ep > 1 and par.ep == par.dp * par.cp and par.recompute == Recompute.FULL:
        return (f"--zero 3 with the experts whole (ep_size = dp_size x cp_size) under pipeline parallelism is "
                f"modelled without --recompute full (its re-run's experts' backward not replayed); got pp_size={par.pp}, "
                f"ep_size={par.ep}, dp_size x cp_size={par.dp * par.cp}, recompute={par.recompute}")
    return None


def check_composition(par: ParallelConfig, schedule: Schedule, num_microbatches: int) -> None:
    """Refuse (one line) the --zero 3 layouts whose FSDP2 groups neither replay follows."""
    reason = composition_refusal(par, schedule, num_microbatches)
    if reason is not None:
        raise NotImplementedError(f"predict_memory: {reason}")
