"""Sharded data parallelism (ZeRO, Rajbhandari et al. 2020) over the ranks that hold the same
parameters, as Megatron-LM's distributed optimizer does it:

    reduction_group        the one place that says over which group a parameter is sharded
                           (DP x CP for dense parameters)
    buckets                the layout of a contiguous buffer per (group, dtype): buckets of whole
                           parameters, each padded to a multiple of the group's size, and the
                           slice of every bucket that each rank owns
    distributed_optimizer  --zero 1 (AdamW states of this rank's slices only; grads
                           reduce-scattered into the slices after backward, parameters
                           all-gathered after the step) and --zero 2 (grads kept only as slices,
                           reduce-scattered bucket by bucket from backward hooks)
    staging                --zero 2's staging buffers, made up front: a pool, and under the
                           posted pipeline orders one per bucket that fills across actions
    fully_shard            --zero 3 with PyTorch's FSDP2 over the DP x CP mesh (the experts over
                           their EDP mesh under expert parallelism)
"""
from .buckets import DEFAULT_BUCKET_MB, Bucket, BufferLayout, Piece, bucket_numel, plan_buffer
from .distributed_optimizer import DistributedOptimizer
from .reduction_group import reduction_group

__all__ = ["DEFAULT_BUCKET_MB", "Bucket", "BufferLayout", "DistributedOptimizer", "Piece", "bucket_numel",
           "plan_buffer", "reduction_group"]
