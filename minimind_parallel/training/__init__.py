"""Training, one component per file (composed by the `train` task, and `step` by every task):

    step             a parallel model from dense weights, and the one training step: the
                     microbatch schedule, gradient finalisation, the loss scaler, clipping, the
                     finiteness check, the optimizer (what validate and benchmark run too)
    grad_clip        the global gradient norm over every parallel group, and clipping by it
    mixed_precision  fp32 parameters with bf16/fp16 compute, and the fp16 loss scaler
    lr_schedule      MiniMind's cosine schedule
    heldout          the held-out loss
    metrics          the numbers a person watches: metrics.jsonl, the loss curve, MFU
"""
from ..data_parallel import unwrap, wrap_data_parallel
from .step import StepStats, build_parallel_model, finalize_grads, make_optimizer, train_step

__all__ = ["StepStats", "build_parallel_model", "finalize_grads", "make_optimizer", "train_step", "unwrap",
           "wrap_data_parallel"]
