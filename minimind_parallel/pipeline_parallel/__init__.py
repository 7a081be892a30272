"""Pipeline parallelism: point-to-point exchange between stages (p2p), a schedule as the order of
a stage's actions (order) and the executor that runs it (schedules)."""
from .order import SCHEDULES, Action, Schedule, Step, schedule_order
from .schedules import StepResult, bubble_fraction, deallocate_output_tensor, forward_backward
