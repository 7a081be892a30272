"""Moments of a block's backward that hold the peak only under --zero 3 (FSDP2), where a block's
weight grads stay unsharded temporaries until its post-backward: with fewer tokens per
microbatch than hidden_size its weight grads outweigh its activations, so the peak moves to the
end of the block's backward (the dense model's moments, backward_moments.py, stay as they are).

    qkv_backward   q_proj's input grad made (the attention's last linear backward, autograd
                   runs v, k, q): every weight grad of the block in but the input norm's, the sum
                   of k's and v's input grads [N, H] and q's [N, H], q's output grad
                   [N, h d] still bound, the residual grad [Nn, H]; the block's saved tensors
                   freed but the input norm's and the linears' shared input (basic SP, each
                   linear's own gather: `gathered_qkv_backward`)
    input_norm_backward  the block's last op (without --recompute): its input norm's backward,
                   every weight grad of the block in, the norm's fp32 temporaries live (under
                   --recompute full the re-run block's: `rerun_input_norm_backward`, and
                   input_norm_backward_weight before it)
    mlp_input_backward  --recompute selective / full: the lean SwiGLU's gate_proj input grad, the
                   three MLP weight grads in (`lean_mlp_input_backward`)
"""
from __future__ import annotations

from ...config import Recompute
from .backward_moments import _in_first_block
from .stage_sizes import StageSizes, top_block_acts, top_block_saved


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


def gathered_qkv_backward(s: StageSizes) -> tuple[int, int, int]:
    """Basic SP (each column linear gathers its own input, `tensor_parallel.column_linear`):
    `qkv_backward` where k's and v's backward have freed their gathered inputs [N, H] (q's still
    saved) and reduce-scattered their input grads, whose sum is [Nn, H], not [N, H]."""
    grads, acts, temps = qkv_backward(s)
    row, shard = s.b * s.n * s.hid, s.b * s.nn * s.hid
    return grads, acts - 2 * row, temps - row + shard


def rerun_input_norm_backward(s: StageSizes) -> dict:
    """--recompute full: the re-run block's input RMSNorm's backward after q/k/v's (`qkv_backward`:
    q's output grad and the two input grads freed, their sum the norm's incoming grad), the
    norm's re-made tensors still alive under the checkpoint's hooks:
    input_norm_backward_weight  its weight grad's sum [H] (fp32) made, two fp32 temporaries
                   [Nn, H] (grad w, grad x normed) and in half precision the incoming grad's fp32 copy
    input_norm_backward  at the row means' grad: three fp32 [Nn, H], the weight grad in the
                   model's dtype (in half precision its fp32 sum freed) and the row means [Nn] (f)
    -> name: (grads it adds, activations, temporaries)."""
    b, f, n, nn_, hid = s.b, s.f, s.n, s.nn, s.hid
    grads, acts, temps = qkv_backward(s)
    # the re-run's saved tensors are temporaries to the tracker (stage_sizes.top_block_saved)
    acts, temps = top_block_acts(s), temps + acts - top_block_acts(s)
    after = temps - b * n * s.heads * s.head_dim - 2 * b * n * hid
    upcast = f * nn_ * hid if b != f else 0
    return {"input_norm_backward_weight": (grads, acts, after + 2 * f * nn_ * hid + upcast + f * hid),
            "input_norm_backward": (grads + b * hid, acts, after + 3 * f * nn_ * hid + f * nn_)}


def lean_mlp_input_backward(s: StageSizes) -> tuple[int, int, int]:
    """--recompute selective / full (the lean SwiGLU, `recompute.swiglu`): gate_proj's input grad
    made, the three MLP weight grads in; the lean op's saved gate and up and its product's grad
    freed, up's input grad not yet added [N, H] beside gate's [N, H], gate's output grad
    [N, I/T] still bound, the residual grad [Nn, H] (the dense model's `mlp_input_backward`
    where the MLP is not lean)."""
    b = s.b
    acts, redone = top_block_saved(s, 2 * s.mlp_out)
    return (s.head_grads + 3 * s.mlp_w_grad, acts,
            s.mlp_out + 2 * b * s.n * s.hid + b * s.nn * s.hid + s.waiting + redone)


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
    the model follows them: not the re-run norm's under basic SP, nor the lean SwiGLU's under SP,
    whose layouts with few tokens `fsdp_replay.check_fully_sharded` refuses)."""
    par = s.par
    basic_sp = par.sequence_parallel and not par.async_communication
    top = {**({"mlp_input_backward": async_mlp_input_backward(s)}
              if par.async_communication and not s.expert_rows and not par.recompute.lean else {}),
           **({"mlp_input_backward": lean_mlp_input_backward(s)}
              if par.recompute.lean and not s.expert_rows and not par.sequence_parallel else {}),
           "qkv_backward": gathered_qkv_backward(s) if basic_sp and not par.shared_sp_gather else qkv_backward(s),
           **({"input_norm_backward": input_norm_backward(s)} if par.recompute == Recompute.NONE else {}),
           **(rerun_input_norm_backward(s) if par.recompute == Recompute.FULL and not basic_sp else {})}
    if s.layers == 1:
        return top
    return {**top, **{f"{name}(first block)": _in_first_block(s, moment, False) for name, moment in top.items()}}
