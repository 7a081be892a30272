"""Precision of a training run: the parameters' dtype, the compute dtype, and float16's loss scaler.

    mixed  (MiniMind's trainer: torch.autocast around the forward, GradScaler for float16)
           parameters, grads and AdamW states in float32; matmuls of the forward (and their
           backward) in --dtype bfloat16 / float16 under torch.autocast; float16 losses are
           multiplied by a dynamic loss scale before backward, grads unscaled before clipping,
           and a step whose grads overflowed is skipped with the scale halved.
    pure   every tensor in --dtype (the benchmark's mode; the memory model covers this one).

With --dtype float32 or float64 the two are the same run.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..config import Choice

HALF = (torch.bfloat16, torch.float16)


class PrecisionMode(Choice):
    """`--precision`: which tensors take --dtype (above)."""

    MIXED = "mixed"
    PURE = "pure"


@dataclass(frozen=True, kw_only=True)
class Precision:
    param_dtype: torch.dtype     # parameters, grads, optimizer states
    compute_dtype: torch.dtype   # the forward's matmuls (autocast) when it differs from param_dtype
    device_type: str             # "cpu" or "cuda": autocast's device

    @classmethod
    def of(cls, mode: PrecisionMode, dtype: torch.dtype, device) -> "Precision":
        mode = PrecisionMode.parse(mode)
        if not isinstance(mode, PrecisionMode):
            raise ValueError(f"precision must be one of {', '.join(PrecisionMode.values())}; got {mode!r}")
        param = torch.float32 if mode == PrecisionMode.MIXED and dtype in HALF else dtype
        return cls(param_dtype=param, compute_dtype=dtype, device_type=torch.device(device).type)

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != self.param_dtype

    @property
    def needs_loss_scaling(self) -> bool:
        """float16 compute: small grads underflow without a loss scale (bfloat16 has float32's range)."""
        return self.mixed and self.compute_dtype == torch.float16

    def forward_context(self):
        """Entered around every forward (pipeline_parallel.forward_backward's `forward_context`)."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)


class LossScaler:
    """A dynamic loss scale (as torch.amp.GradScaler), decided the same way on every rank: the
    overflow test is the global grad norm's (grad_clip.global_grad_norm), which every rank shares,
    so no rank steps while another skips."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale = init_scale
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        """Divide the step's grads (`grad_clip.grads_of`: the parameters', or the --zero slices) by the scale."""
        for g in grads:
            g.div_(self.scale)

    def update(self, finite: bool) -> bool:
        """After a step's grads were checked: -> whether to take the optimizer step."""
        if not finite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
