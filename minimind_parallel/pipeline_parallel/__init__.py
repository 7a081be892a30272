"""Pipeline parallelism: point-to-point exchange between stages (p2p) and the schedules."""
from .schedules import SCHEDULES, StepResult, bubble_fraction, deallocate_output_tensor, forward_backward
