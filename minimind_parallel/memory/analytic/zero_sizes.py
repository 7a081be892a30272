"""Sharded data parallelism's facet of the memory model (--zero 1 and 2, `zero.DistributedOptimizer`):
what the flat buffers of the stage's parameters hold, from the same layout the optimizer builds
(`zero.plan_buffer` over `plan.stage_parameters`).

    params      the flat parameter buffer: every parameter and the padding of each bucket to a
                multiple of the DP x CP size W
    grads       --zero 1: the flat grad buffer, the same bytes, alive all step (the parameters'
                .grad are views of it from the start: no grad appears or grows during backward).
                --zero 2: this rank's slices only (1/W of the buffer), alive all step; a grad
                backward is making is a temporary until its hook copies it into the staging
                buffers (`IN_FLIGHT` + 1 of the largest bucket, temporaries all step) and frees it
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
from ...plan import SHAPE_FIELDS, grad_is_shared_over_stages, stage_parameters
from ...zero.buckets import BufferLayout, bucket_numel, plan_buffer
from ...zero.distributed_optimizer import IN_FLIGHT
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


def staging_bytes(layouts: tuple[BufferLayout, ...], b: int) -> int:
    """--zero 2: the staging buffers (`zero.distributed_optimizer.staging_buffers`), alive all step."""
    return sum(b * max(bucket.padded_numel for bucket in layout.buckets) * min(IN_FLIGHT + 1, len(layout.buckets))
               for layout in layouts)


def posted_zero2_refusal(c: MiniMindConfig, par: ParallelConfig, dtype, bucket_size_mb: float) -> str | None:
    """Why --zero 2 under a posted order (interleaved's chunks, zb's W steps) is not modelled on a
    layout (one line), or None. Such an order completes a bucket before the grads of its other
    chunk (or its W step) come, which then fill it again (`FlatBuffer._take_grad`): several buckets
    fill at once. Where a buffer has at most `IN_FLIGHT` + 1 buckets each has a staging buffer of
    its own, so the buffers stay the ones allocated at the start and `zero2_moments` holds; with
    more, a bucket opened while every staging buffer fills makes one more (`FlatBuffer._open`),
    kept to the step's end, at a moment of the order not replayed."""
    most = max(len(layout.buckets) for stage in range(par.pp)
               for layout in zero_layouts(c, par, stage, dtype, bucket_size_mb))
    if most <= IN_FLIGHT + 1:
        return None
    return (f"--zero 2 under a posted schedule (interleaved, zb) is modelled where every grad buffer has at most "
            f"{IN_FLIGHT + 1} buckets (a staging buffer each); got {most} (--bucket_size_mb {bucket_size_mb:g})")


def zero2_moments(moments: dict, layouts: tuple[BufferLayout, ...], b: int) -> dict:
    """The replayed moments (grads, activations, temporaries) under --zero 2: the grads are the
    slices at every moment (each parameter's grad is copied into its bucket's staging buffer by
    its post-accumulate-grad hook and freed there, so the grads a moment of the schedule has
    accumulated are gone; those still being made, temporaries, are not), and the staging buffers
    are temporaries all step."""
    slices, staging = sum(b * layout.shard_numel for layout in layouts), staging_bytes(layouts, b)
    return {k: (slices, a, t + staging) for k, (_, a, t) in moments.items()}
