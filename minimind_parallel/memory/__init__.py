"""Memory: what is alive at the peak of a training step, measured and predicted (docs/memory.md).

    MemoryMeter           real run: live-storage tracker on CPU, allocator peak on CUDA
    estimate_step_memory  the same tracker on fake tensors and a fake process group (--estimate), any stage
    predict_memory        the analytic model: bytes by category and by saved-tensor kind, every pipeline stage
"""
from .analytic import MemoryPrediction, activations_by_kind, predict_memory
from .estimate import estimate_step_memory
from .meter import MemoryMeter
from .tracker import CATEGORIES, MemoryReport, StorageTracker

__all__ = ["CATEGORIES", "MemoryMeter", "MemoryPrediction", "MemoryReport", "StorageTracker", "activations_by_kind",
           "estimate_step_memory", "predict_memory"]
