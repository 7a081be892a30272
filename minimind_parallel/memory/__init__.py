"""Memory: what is alive at the peak of a training step, measured and predicted (SPEC 6).

    MemoryMeter           real run: live-storage tracker on CPU, allocator peak on CUDA
    estimate_step_memory  the same tracker on fake tensors and a fake process group (--estimate)
    predict_memory        the analytic model: bytes by category and by saved-tensor kind
"""
from .estimate import estimate_step_memory
from .meter import MemoryMeter
from .tracker import CATEGORIES, MemoryReport, StorageTracker

__all__ = ["CATEGORIES", "MemoryMeter", "MemoryReport", "StorageTracker", "estimate_step_memory"]
