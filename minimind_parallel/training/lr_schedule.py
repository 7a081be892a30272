"""MiniMind's learning-rate schedule (trainer/trainer_utils.py, get_lr), with an optional linear warmup.

After warmup the rate follows a cosine from `lr` down to a floor of 0.1 * lr:

    lr * (0.1 + 0.45 * (1 + cos(pi * t / T)))      t = step - warmup_steps, T = total_steps - warmup_steps

With warmup_steps = 0 this is MiniMind's formula itself (t = step, T = total_steps). During warmup the
rate rises linearly from 0 at step 0 to `lr` at step warmup_steps, where the cosine begins.
Steps past total_steps stay at the floor.
"""
from __future__ import annotations

import math

from ..config import ConfigError


def cosine_lr(step: int, total_steps: int, lr: float, warmup_steps: int = 0) -> float:
    """The learning rate at `step` of a run of `total_steps` steps (MiniMind counts 1..total_steps)."""
    if not 0 <= warmup_steps < total_steps:
        raise ConfigError(f"learning-rate schedule needs 0 <= warmup_steps < total_steps; "
                          f"got warmup_steps={warmup_steps}, total_steps={total_steps}")
    if step < warmup_steps:
        return lr * step / warmup_steps
    t = min(step, total_steps) - warmup_steps
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t / (total_steps - warmup_steps))))
