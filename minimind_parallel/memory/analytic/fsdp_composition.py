"""The --zero 3 compositions `predict_memory` does not replay, refused in one line before any replay.

fsdp_replay.py follows one FSDP2 group per block (and the root's): its all-gather before the
block's forward and backward, the copy-out, the free, the reduce-scatter. Under expert parallelism
(ep_size > 1, zero/fully_shard.py) each MoE layer's experts are a second FSDP2 group of the block,
over the EDP mesh: gathered inside the MoE layer between the token dispatch and the combine, freed
after the experts' forward, gathered again in backward by the block's pre-backward prefetch (FSDP2
prefetches in the reverse of the forward's order: the block's dense group, then its experts, so
both gathers are alive over the block's attention backward), and reduce-scattered over EDP before
the dispatch's backward all-to-all. That timeline is not replayed (nor, at ep_size 1, the MoE model
under --zero 3: fsdp_replay.check_fully_sharded).

Under pipeline parallelism (pp_size > 1) a stage keeps every parameter gathered from its first
forward to the end of the schedule (reshard_after_forward False), its grads accumulate unsharded
over the microbatches, and every group reduce-scatters once after the last backward
(zero/fully_shard.reduced_after_the_schedule): a timeline of its own, interleaved with the
schedule's held microbatches, that neither fsdp_replay (one microbatch's per-block gathers) nor
the schedule replays (whole unsharded parameters) follow.
"""
from __future__ import annotations

from ...config import ParallelConfig


def check_composition(par: ParallelConfig) -> None:
    """Refuse (one line) the --zero 3 layouts whose FSDP2 groups fsdp_replay does not follow."""
    if par.ep > 1:
        raise NotImplementedError(f"predict_memory: --zero 3 with --ep_size > 1 is not modelled (the experts' "
                                  f"FSDP2 group over the expert-data-parallel mesh, gathered between the dispatch "
                                  f"and the combine and prefetched by the block's backward, is not replayed); "
                                  f"got ep_size={par.ep}")
    if par.pp > 1:
        raise NotImplementedError(f"predict_memory: --zero 3 with --pp_size > 1 is not modelled (each stage's "
                                  f"parameters gathered over the whole schedule and its grads reduce-scattered once "
                                  f"after the last backward are not replayed); got pp_size={par.pp}")
