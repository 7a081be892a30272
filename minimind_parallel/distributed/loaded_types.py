"""Type checks against PyTorch's DTensor and FSDP2 module classes without importing them.

`torch.distributed.tensor` and `torch.distributed.fsdp` take half a second to import (sympy,
the DTensor op table); a process that never shards (the planner, a TP run) need not pay it. No
instance of a class can exist before the module defining it has run, so a check reads the class
from `sys.modules` and answers False while the module is not loaded.
"""
from __future__ import annotations

import sys


def _loaded(module: str, name: str):
    """`module`.`name` when `module` is imported (and has defined it), else None."""
    return getattr(sys.modules.get(module), name, None)


def is_dtensor(t) -> bool:
    """isinstance(t, torch.distributed.tensor.DTensor), without importing it."""
    cls = _loaded("torch.distributed.tensor", "DTensor")
    return cls is not None and isinstance(t, cls)


def is_fsdp_module(m) -> bool:
    """isinstance(m, torch.distributed.fsdp.FSDPModule) (FSDP2's fully_shard), without importing it."""
    cls = _loaded("torch.distributed.fsdp", "FSDPModule")
    return cls is not None and isinstance(m, cls)
