"""Named ranges for the profiler trace. `span(name)` is a `record_function` while a profiler
is recording and a no-op otherwise, so the library can name its phases at no cost.

Names the overlap report relies on (see overlap.py):
    comm:<kind>      one collective from issue to return (sync: includes the blocking wait)
    wait:<kind>      the main thread blocked on an async collective's handle
    async_linear.dgrad / async_linear.wgrad   the GEMMs the book overlaps with the collective
"""
from __future__ import annotations

import contextlib

import torch
from torch.autograd.profiler import record_function

_NULL = contextlib.nullcontext()


def span(name: str):
    return record_function(name) if torch.autograd._profiler_enabled() else _NULL
