"""Moments of a block's backward that hold the peak only under --zero 3 (FSDP2), where a block's
weight grads stay unsharded temporaries until its post-backward: with fewer tokens per
microbatch than hidden_size its weight grads outweigh its activations, so the peak moves to the
end of the block's backward (the dense model's moments, backward_moments.py, stay as they are).

    qkv_backward   q_proj's input grad made (the attention's last linear backward, autograd
                   runs v, k, q): every weight grad of the block in but the input norm's, the sum
                   of k's and v's input grads [N, H] and q's [N, H], q's output grad
                   [N, h d] still bound, the residual grad [Nn, H]; the block's saved tensors
                   freed but the input norm's and the linears' shared input
    input_norm_backward  the block's last op (without --recompute): its input norm's backward,
                   every weight grad of the block in, the norm's fp32 temporaries live
"""
from __future__ import annotations

from ...config import Recompute
from .backward_moments import _in_first_block
from .stage_sizes import StageSizes, top_block_acts


def _scattered(s: StageSizes) -> int:
    """SP + async (`tensor_parallel.async_linear`): a column linear's backward re-gathers its input
    [N, H] and reduce-scatters its input grad [N, H] into [Nn, H] before it makes its weight grad,
    so at that weight grad the two linears' scattered input grads (its own and the earlier
    ones' sum) are alive beside the gathered input and its own unscattered one."""
    return 2 * s.b * s.nn * s.hid if s.par.async_communication else 0


def qkv_backward(s: StageSizes) -> tuple[int, int, int]:
    """(grads it adds, activations, temporaries) at q_proj's input grad (SP + async: its weight
    grad, made last) in the top block."""
    b, n, k = s.b, s.n, s.kinds
    kept = k["block.norm_fp32"] // 2 + k["block.column_input"] - s.gate_up_input
    return (s.head_grads + s.block_params - b * s.hid, top_block_acts(s) - s.block + kept,
            2 * b * n * s.hid + _scattered(s) + b * n * s.heads * s.head_dim + b * s.nn * s.hid + s.waiting)


def input_norm_backward(s: StageSizes) -> tuple[int, int, int]:
    """(grads it adds, activations, temporaries) inside the top block's input RMSNorm's backward
    (its last op, at the row means' grad): every weight grad of the block in, the input norm's
    too; q/k/v's shared input and the norm's fp32 input and rsqrt freed; q/k/v's input grads
    summed into the norm's incoming grad and q's output grad freed; the norm's fp32 temporaries
    [Nn, H] (four, and in half precision the incoming grad's fp32 copy) and the residual grad
    [Nn, H] live (measured with StorageTracker's timeline, fp32 and bf16; holds the peak at few
    tokens, without --recompute)."""
    b, f, nn_, hid, k = s.b, s.f, s.nn, s.hid, s.kinds
    kept = k["block.norm_fp32"] // 2 - f * nn_ * hid - f * nn_
    upcasts = 5 if b != f else 4
    return (s.head_grads + s.block_params, top_block_acts(s) - s.block + kept,
            upcasts * f * nn_ * hid + b * nn_ * hid + s.waiting)


def async_mlp_input_backward(s: StageSizes) -> tuple[int, int, int]:
    """SP + async: gate_proj's weight grad (its input grad made and scattered before it), the
    three MLP weight grads in, its re-gathered input and unscattered input grad [N, H], both
    scattered input grads [Nn, H], the grad of its output [N, I/T] still bound, the residual grad;
    the MLP's four [N, I/T] freed (the dense model's `mlp_input_backward` where the linears do not
    scatter)."""
    b = s.b
    return (s.head_grads + 3 * s.mlp_w_grad, top_block_acts(s) - 4 * s.mlp_out,
            s.mlp_out + 2 * b * s.n * s.hid + _scattered(s) + b * s.nn * s.hid + s.waiting)


def fsdp_block_moments(s: StageSizes) -> dict:
    """The moments above, in the top block and (with more than one block) the first one (where
    the model follows them: not under SP's gathers without the async linear, whose layouts with
    few tokens `fsdp_replay.check_fully_sharded` refuses)."""
    par = s.par
    top = {**({"mlp_input_backward": async_mlp_input_backward(s)}
              if par.async_communication and not s.expert_rows and not par.recompute.lean else {}),
           # SP's gathered linears (basic, shared) are not followed here: check_fully_sharded
           **({} if par.sequence_parallel and not par.async_communication else {"qkv_backward": qkv_backward(s)}),
           **({"input_norm_backward": input_norm_backward(s)} if par.recompute == Recompute.NONE
              and not (par.sequence_parallel and not par.async_communication) else {})}
    if s.layers == 1:
        return top
    return {**top, **{f"{name}(first block)": _in_first_block(s, moment, False) for name, moment in top.items()}}
