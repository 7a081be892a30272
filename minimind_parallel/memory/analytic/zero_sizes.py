"""Sharded data parallelism's facet of the memory model (--zero 1, `zero.DistributedOptimizer`):
what the flat buffers of the stage's parameters hold, from the same layout the optimizer builds
(`zero.plan_buffer` over `plan.stage_parameters`, the model's order).

    params      the flat parameter buffer: every parameter and the padding of each bucket to a
                multiple of the DP x CP size W
    grads       the flat grad buffer, the same bytes, alive all step (the parameters' .grad are
                views of it from the start: no grad appears or grows during backward)
    optimizer   AdamW's exp_avg and exp_avg_sq of this rank's slices (1/W of the buffer) and one
                step counter per slice (a float32 scalar on the CPU)
    the step    AdamW updates one slice at a time: its scratch is the slices' (`optimizer_scratch`);
                the reduce-scatter and the all-gather work in place in the buffers
"""
from __future__ import annotations

import functools

from ...config import MiniMindConfig, ParallelConfig
from ...memo import Frozen
from ...plan import SHAPE_FIELDS, grad_is_shared_over_stages, stage_parameters
from ...zero.buckets import BufferLayout, bucket_numel, plan_buffer
from .stage_sizes import numel


def zero_layout(c: MiniMindConfig, par: ParallelConfig, stage: int, dtype, bucket_size_mb: float
                ) -> BufferLayout | None:
    """The stage's buffer layout under --zero (None without it). Remembered on the model, the layout
    fields it reads (`LAYOUT_FIELDS`), the stage and the bucket size: the planner asks it for every
    stage of every --zero layout."""
    if not par.zero:
        return None
    shape = tuple(getattr(par, name) for name in LAYOUT_FIELDS)
    return _remembered_layout(Frozen(c), shape, stage, bucket_numel(bucket_size_mb, dtype))


# the ParallelConfig fields a stage's buffer depends on: its parameters' (plan.SHAPE_FIELDS) and the
# sharding's (tests/test_planning.py checks the others do not matter)
LAYOUT_FIELDS = (*SHAPE_FIELDS, "dp", "cp", "ep", "zero")


@functools.lru_cache(maxsize=4096)
def _remembered_layout(model: Frozen, shape: tuple, stage: int, bucket: int | None) -> BufferLayout:
    return build_zero_layout(model.config, ParallelConfig(**dict(zip(LAYOUT_FIELDS, shape))), stage, bucket)


def build_zero_layout(c: MiniMindConfig, par: ParallelConfig, stage: int, bucket: int | None) -> BufferLayout:
    """`zero_layout` computed from the plan (not remembered), with buckets of `bucket` elements."""
    shapes = stage_parameters(c, par, stage)
    alone = par.pp > 1   # the tied copies are a bucket of their own only where the embedding group exists
    return plan_buffer([(name, numel(shape), alone and grad_is_shared_over_stages(name, c, par))
                        for name, shape in shapes.items()], par.dp * par.cp, bucket)


def optimizer_state_bytes(layout: BufferLayout, b: int, device: str) -> int:
    """exp_avg and exp_avg_sq of every slice, and its step counter on the CPU."""
    return 2 * b * layout.shard_numel + (4 * len(layout.buckets) if device == "cpu" else 0)


def slice_sizes(layout: BufferLayout, b: int) -> list[int]:
    """Bytes of each slice, in the order AdamW steps them."""
    return [b * bucket.shard_numel for bucket in layout.buckets]
