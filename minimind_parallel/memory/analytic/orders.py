"""The schedule orders and their send release points, remembered: the planner replays the same
few orders (pipeline_parallel.order.schedule_order) for thousands of layouts."""
from __future__ import annotations

import functools

from ...pipeline_parallel.order import Schedule, posted, schedule_order
from ...pipeline_parallel.releases import release_points


@functools.lru_cache(maxsize=1024)
def stage_order(pp: int, stage: int, num_microbatches: int, schedule: Schedule, virtual_stages: int) -> tuple:
    """The stage's schedule order (order.schedule_order), remembered."""
    return tuple(schedule_order(pp, stage, num_microbatches, schedule, virtual_stages))


@functools.lru_cache(maxsize=1024)
def stage_posted(pp: int, stage: int, num_microbatches: int, schedule: Schedule, virtual_stages: int) -> bool:
    """Whether the stage's order is posted (order.posted: model chunks or W steps), remembered: a
    gpipe or 1f1b order is read whole to say no."""
    return posted(stage_order(pp, stage, num_microbatches, schedule, virtual_stages))


@functools.lru_cache(maxsize=256)
def stage_releases(pp: int, num_microbatches: int, schedule: Schedule, virtual_stages: int) -> tuple:
    """Every stage's release points of its posted sends (pipeline_parallel.releases), remembered: they
    depend on the orders alone, which the planner's layouts share."""
    orders = [stage_order(pp, p, num_microbatches, schedule, virtual_stages) for p in range(pp)]
    return tuple(release_points(orders, pp, virtual_stages))
