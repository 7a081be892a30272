"""Activation memory: what a training step keeps for backward, and what it recomputes instead.

`--recompute none | selective | full` (`ParallelConfig.recompute`) and `--loss_chunks K`:

    selective   lean RMSNorm (the input in the model dtype and the fp32 rsqrt per token, not the
                fp32 copies), GQA attention reading the kv heads without repeat_kv copies, and
                SwiGLU recompute (gate and up saved; silu(gate) * up recomputed for down_proj's
                weight gradient), and the norm outputs the column-parallel linears save re-made
                from the norms' inputs in backward (`norm_recompute.py`)
    full        selective inside, and activation checkpointing per block: only the block's input
                ([S/T, B, H] under SP) is kept; backward re-runs the block's forward, collectives
                included (`checkpoint.py`)
    loss_chunks the head and cross entropy over K token chunks; backward recomputes each chunk
                (`chunked_loss.py`)

Every piece computes the dense model's numbers (MiniMind's RMSNorm, attention, MLP and loss in
`model.py`) to round-off; tests/test_recompute.py holds them to it.
"""
from .attention import causal_attention_gqa
from .checkpoint import checkpoint_block
from .chunked_loss import chunked_head_loss
from .norm_recompute import norm_with_recompute, recompute_norm_output
from .rms_norm import LeanRMSNorm, lean_rms_norm, make_rms_norm
from .swiglu import swiglu_linear

__all__ = ["LeanRMSNorm", "causal_attention_gqa", "checkpoint_block", "chunked_head_loss",
           "lean_rms_norm", "make_rms_norm", "norm_with_recompute",
           "recompute_norm_output", "swiglu_linear"]
