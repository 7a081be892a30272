"""Full recompute: activation checkpointing per block (Chen et al. 2016; Megatron-LM's
`--recompute-granularity full`, Korthikanti et al. 2022 section 5).

A checkpointed block keeps only its input -- the residual stream entering it, [S/T, B, H] under
SP, [S, B, H] otherwise -- and re-runs its forward when backward reaches it. PyTorch's
non-reentrant `torch.utils.checkpoint` does the bookkeeping: inside the block every tensor
autograd would save is replaced by a handle; backward re-runs the block and fills the handles,
stopping as soon as the last one is filled (early stop), so the block's last ops -- down_proj's
exit collective and the residual add, which save nothing -- are not re-run.

Collectives: the re-run repeats the block's forward collectives up to down_proj's input. Per
block under SP that is the all-gathers of q/k/v and gate/up (5, or 2 with --shared_sp_gather)
and o_proj's reduce-scatter; under plain TP o_proj's all-reduce (the copies into the TP region
communicate only in backward). No dropout runs in MiniMind-3, so no RNG state is kept.

Inside the block the selective pieces (lean norms, GQA without copies, SwiGLU recompute) run
too: they set what one block holds while its backward runs.
"""
from __future__ import annotations

from torch.utils.checkpoint import checkpoint


def checkpoint_block(block, h, *args):
    """block(h, *args) keeping only h (and views of buffers in args) for backward."""
    return checkpoint(block, h, *args, use_reentrant=False, preserve_rng_state=False)
