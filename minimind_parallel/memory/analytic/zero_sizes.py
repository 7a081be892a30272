"""Sharded data parallelism's facet of the memory model (--zero 1 and 2, `zero.DistributedOptimizer`):
what the flat buffers of the stage's parameters hold, from the same layout the optimizer builds
(`zero.plan_buffer` over `plan.stage_parameters`).

    params      the flat parameter buffer: every parameter and the padding of each bucket to a
                multiple of the DP x CP size W
    grads       --zero 1: the flat grad buffer, the same bytes, alive all step (the parameters'
                .grad are views of it from the start: no grad appears or grows during backward).
                --zero 2: this rank's slices only (1/W of the buffer), alive all step; a grad
                backward is making is a temporary until its hook copies it into the staging
                buffers (`zero.staging`: a pool of `IN_FLIGHT` + 1 of the largest bucket, and under
                interleaved and zb a buffer of its own for each bucket that may fill across
                actions; all made at the start, temporaries all step) and frees it
    optimizer   AdamW's exp_avg and exp_avg_sq of this rank's slices (1/W of the buffer) and one
                step counter per slice (a float32 scalar on the CPU)
    the step    AdamW updates one slice at a time: its scratch is the slices' (`optimizer_scratch`);
                the reduce-scatter and the all-gather work in place in the buffers
"""
from __future__ import annotations

import functools

from ...config import MiniMindConfig, ParallelConfig
from ...memo import Frozen
from ...moe.placement import expert_of, local_experts
from ...pipeline_parallel.order import Schedule
from ...plan import SHAPE_FIELDS, grad_is_shared_over_stages, stage_chunks, stage_parameters
from ...zero.buckets import BufferLayout, bucket_numel, plan_buffer
from ...zero.staging import StagingPlan, staging_plan
from .stage_sizes import numel


def zero_layouts(c: MiniMindConfig, par: ParallelConfig, stage: int, dtype, bucket_size_mb: float,
                 model: Frozen | None = None) -> tuple[BufferLayout, ...]:
    """The stage's buffer layouts under --zero, in the optimizer's order (() without it): one over
    DP x CP; under expert parallelism the dense parameters' and this rank's experts' (over the EDP
    group, dp x cp / ep ranks), as `zero.reduction_group` groups them. Remembered on the model, the
    layout fields it reads (`LAYOUT_FIELDS`), the stage and the bucket size: the planner asks it for
    every stage of every --zero layout (`model`: Frozen(c), if made already)."""
    if not par.zero:
        return ()
    shape = tuple(getattr(par, name) for name in LAYOUT_FIELDS)
    return _remembered_layouts(model or Frozen(c), shape, stage, _bucket_numel(bucket_size_mb, dtype))


@functools.lru_cache(maxsize=64)
def _bucket_numel(bucket_size_mb: float, dtype) -> int:
    return bucket_numel(bucket_size_mb, dtype)


# the ParallelConfig fields a stage's buffers depend on: its parameters' (plan.SHAPE_FIELDS) and the
# sharding's (tests/test_planning.py checks the others do not matter)
LAYOUT_FIELDS = (*SHAPE_FIELDS, "dp", "cp", "ep", "zero")


@functools.lru_cache(maxsize=4096)
def _remembered_layouts(model: Frozen, shape: tuple, stage: int, bucket: int | None) -> tuple[BufferLayout, ...]:
    return build_zero_layouts(model.config, ParallelConfig(**dict(zip(LAYOUT_FIELDS, shape))), stage, bucket)


def build_zero_layouts(c: MiniMindConfig, par: ParallelConfig, stage: int, bucket: int | None
                       ) -> tuple[BufferLayout, ...]:
    """`zero_layouts` computed from the plan (not remembered), with buckets of `bucket` elements."""
    shapes = stage_parameters(c, par, stage, experts=local_experts(c.num_experts, par.ep, 0) if c.use_moe else None)
    alone = par.pp > 1   # the tied copies are a bucket of their own only where the embedding group exists

    def layout(names: list[str], world: int) -> BufferLayout:
        return plan_buffer([(n, numel(shapes[n]), alone and grad_is_shared_over_stages(n, c, par)) for n in names],
                           world, bucket)

    if par.ep == 1:
        return (layout(list(shapes), par.dp * par.cp),)
    dense = [n for n in shapes if expert_of(n) is None]
    return (layout(dense, par.dp * par.cp), layout([n for n in shapes if expert_of(n) is not None],
                                                   par.dp * par.cp // par.ep))


def optimizer_state_bytes(layouts: tuple[BufferLayout, ...], b: int, device: str) -> int:
    """exp_avg and exp_avg_sq of every slice, and its step counter on the CPU."""
    return sum(2 * b * layout.shard_numel + (4 * len(layout.buckets) if device == "cpu" else 0) for layout in layouts)


def slice_sizes(layouts: tuple[BufferLayout, ...], b: int) -> list[int]:
    """Bytes of each slice, in the order AdamW steps them."""
    return [b * bucket.shard_numel for layout in layouts for bucket in layout.buckets]


def staging_plans(c: MiniMindConfig, par: ParallelConfig, stage: int, layouts: tuple[BufferLayout, ...],
                  schedule) -> tuple[StagingPlan, ...]:
    """--zero 2: each buffer's staging (`zero.staging.staging_plan`, as `zero.FlatBuffer` makes it): zb's
    W steps (`schedule`), the stage's model chunks (interleaved's)."""
    chunks = stage_chunks(c.num_hidden_layers, par.pp, stage, par.virtual_stages)
    layer_chunks = {i: k for k, layers in enumerate(chunks) for i in layers}
    weight_steps = par.pp > 1 and Schedule(schedule) is Schedule.ZERO_BUBBLE
    return tuple(staging_plan(layout, weight_steps=weight_steps, layer_chunks=layer_chunks, chunks=len(chunks))
                 for layout in layouts)


def remembered_staging_plans(c: MiniMindConfig, par: ParallelConfig, stage: int, dtype, bucket_size_mb: float,
                             schedule, model: Frozen | None = None) -> tuple[StagingPlan, ...]:
    """staging_plans of the stage's `zero_layouts`, remembered on what both read: the layouts' key (the
    model, `LAYOUT_FIELDS`, the stage, the bucket) and whether the order has W steps (the chunks are
    the model's layers over pp and virtual_stages, both layout fields). The planner asks it for every
    stage of every --zero 2 layout; an interleaved stage's walks every bucket's names."""
    shape = tuple(getattr(par, name) for name in LAYOUT_FIELDS)
    weight_steps = par.pp > 1 and Schedule(schedule) is Schedule.ZERO_BUBBLE
    return _remembered_staging(model or Frozen(c), shape, stage, _bucket_numel(bucket_size_mb, dtype), weight_steps)


@functools.lru_cache(maxsize=4096)
def _remembered_staging(model: Frozen, shape: tuple, stage: int, bucket: int | None,
                        weight_steps: bool) -> tuple[StagingPlan, ...]:
    par = ParallelConfig(**dict(zip(LAYOUT_FIELDS, shape)))
    layouts = _remembered_layouts(model, shape, stage, bucket)
    return staging_plans(model.config, par, stage, layouts,
                         Schedule.ZERO_BUBBLE if weight_steps else Schedule.ONE_F_ONE_B)


def staging_bytes(layouts: tuple[BufferLayout, ...], plans: tuple[StagingPlan, ...], b: int) -> int:
    """--zero 2: the staging buffers (`zero.distributed_optimizer.staging_buffers`), made at the
    start and alive all step."""
    return sum(b * plan.numel(layout) for layout, plan in zip(layouts, plans))


def zero2_moments(moments: dict, layouts: tuple[BufferLayout, ...], plans: tuple[StagingPlan, ...], b: int) -> dict:
    """The replayed moments (grads, activations, temporaries) under --zero 2: the grads are the
    slices at every moment (each parameter's grad is copied into its bucket's staging buffer by
    its post-accumulate-grad hook and freed there, so the grads a moment of the schedule has
    accumulated are gone; those still being made, temporaries, are not), and the staging buffers
    are temporaries all step."""
    slices, staging = sum(b * layout.shard_numel for layout in layouts), staging_bytes(layouts, plans, b)
    return {k: (slices, a, t + staging) for k, (_, a, t) in moments.items()}
