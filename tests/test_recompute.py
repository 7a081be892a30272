"""The lean autograd pieces of `--recompute selective` and `--loss_chunks` compute MiniMind's
numbers (model.py) to round-off, and keep for backward only what they claim to keep."""
import pytest
import torch
import torch.nn.functional as F

from minimind_parallel import ConfigError, MiniMindConfig, ParallelConfig, check_layout
from minimind_parallel.memory import StorageTracker
from minimind_parallel.model import RMSNorm, causal_attention, next_token_cross_entropy, repeat_kv
from minimind_parallel.recompute import (LeanRMSNorm, causal_attention_gqa, chunked_head_loss, norm_with_recompute,
                                        swiglu_linear)

DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def saved_bytes(fn, *leaves) -> int:
    """Bytes autograd keeps for backward of fn(*leaves), the leaves themselves (parameters) not counted."""
    with StorageTracker() as t:
        for leaf in leaves:
            t.mark(leaf, "params")
        out = fn(*leaves)
        kept = t.live["activations"]
    del out
    return kept


def _norm_pair(dtype, dim=64):
    ref, lean = RMSNorm(dim).to(dtype), LeanRMSNorm(dim).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(dim))
        lean.weight.copy_(ref.weight)
    return ref, lean


@pytest.mark.parametrize("dtype", DTYPES)
def test_lean_rms_norm_is_minimind_rms_norm_to_the_last_ulps(dtype):
    """Forward and weight grad bit for bit (the same ops); the input grad within 4 ulps of each
    row's largest grad in float32/float64 (measured: 1.5), within 1 ulp in bfloat16 (0.3)."""
    torch.manual_seed(0)
    bound = 1.0 if dtype == torch.bfloat16 else 4.0
    for _ in range(10):
        ref, lean = _norm_pair(dtype)
        x = (3 * torch.randn(32, 4, 64)).to(dtype)
        g = torch.randn(32, 4, 64).to(dtype)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ref(xa), lean(xb)
        assert torch.equal(ya, yb)
        ya.backward(g)
        yb.backward(g)
        assert torch.equal(lean.weight.grad, ref.weight.grad)
        scale = xa.grad.double().abs().amax(-1, keepdim=True) * torch.finfo(dtype).eps
        assert ((xb.grad.double() - xa.grad.double()).abs() / scale).max() <= bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_rms_norm_keeps_the_input_and_one_fp32_rsqrt_per_row(dtype):
    ref, lean = _norm_pair(dtype)
    x = torch.randn(32, 4, 64).to(dtype).requires_grad_()
    b, rows = x.element_size(), 32 * 4
    assert saved_bytes(lambda w, x: lean(x * 1), lean.weight, x) == b * rows * 64 + 4 * rows
    # MiniMind's keeps x.float() and x * rsqrt in fp32 (in fp32 x.float() is x itself) and rsqrt
    assert saved_bytes(lambda w, x: ref(x * 1), ref.weight, x) == 2 * 4 * rows * 64 + 4 * rows


def _gqa_inputs(dtype, b=2, h=8, k=2, s=16, d=8):
    torch.manual_seed(1)
    return [torch.randn(b, n, s, d).to(dtype).requires_grad_() for n in (h, k, k)]


def _norm_then_linears(norm, w1, w2, h, *, recompute: bool):
    """Two linears reading norm(h) (as q/k/v or gate/up do), the norm output re-made in backward
    when `recompute`; one of them through a [N, H] view of it (what F.linear saves for 3-D input)."""
    if not recompute:
        x = norm(h)
        return (F.linear(x, w1) * F.linear(x.reshape(-1, x.shape[-1]), w2).view_as(F.linear(x, w1))).sum()
    x, remake = norm_with_recompute(norm, h)
    with remake:
        return (F.linear(x, w1) * F.linear(x.reshape(-1, x.shape[-1]), w2).view_as(F.linear(x, w1))).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_output_recompute_is_bit_identical_and_keeps_no_norm_output(dtype):
    """Grads bit for bit the same with and without the re-made norm output; what is kept for
    backward shrinks by exactly the norm output (one [S, B, H] storage; the rest is unchanged)."""
    torch.manual_seed(0)
    s_, b_, hid = 8, 2, 32
    _, norm = _norm_pair(dtype, hid)
    w1, w2 = (torch.randn(16, hid, dtype=dtype, requires_grad=True) for _ in range(2))
    h = torch.randn(s_, b_, hid, dtype=dtype, requires_grad=True)
    grads = []
    for recompute in (False, True):
        _norm_then_linears(norm, w1, w2, h, recompute=recompute).backward()
        grads.append([t.grad.clone() for t in (h, w1, w2, norm.weight)])
        for t in (h, w1, w2, norm.weight):
            t.grad = None
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    kept = [saved_bytes(lambda h_, *_, r=r: _norm_then_linears(norm, w1, w2, h_, recompute=r), h, w1, w2,
                        norm.weight) for r in (False, True)]
    assert kept[0] - kept[1] == h.numel() * h.element_size()


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_attention_equals_repeat_kv_attention(dtype, flash):
    q, k, v = _gqa_inputs(dtype)
    rep = q.shape[1] // k.shape[1]

    def dense(q, k, v):   # MiniMind: repeat k, v to every query head, then attention
        return causal_attention(q, repeat_kv(k.transpose(1, 2), rep).transpose(1, 2),
                                repeat_kv(v.transpose(1, 2), rep).transpose(1, 2), flash=flash)

    g = torch.randn(q.shape).to(dtype)
    ref = torch.autograd.grad(dense(q, k, v), (q, k, v), g)
    out = causal_attention_gqa(q, k, v, flash=flash)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, dense(q, k, v), **tol)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g), ref):
        torch.testing.assert_close(a, r, **tol)


def test_gqa_attention_keeps_kv_heads_not_repeated_copies():
    """CPU flash attention with enable_gqa saves k and v at their own heads: q, k, v, out, lse."""
    q, k, v = _gqa_inputs(torch.float32)
    rep = q.shape[1] // k.shape[1]
    b, h, s, d = q.shape
    lse = 4 * b * h * s
    lean = saved_bytes(lambda q, k, v: causal_attention_gqa(q, k, v, flash=True), q, k, v)
    assert lean == 4 * b * h * s * d + lse      # the output (q, k, v are leaves here)
    copies = saved_bytes(lambda q, k, v: causal_attention(
        q, repeat_kv(k.transpose(1, 2), rep).transpose(1, 2), repeat_kv(v.transpose(1, 2), rep).transpose(1, 2),
        flash=True), q, k, v)
    assert copies - lean == 2 * 4 * b * h * s * d   # the two repeated [B, h, S, d] copies


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_recompute_equals_down_of_silu_gate_times_up(dtype):
    torch.manual_seed(2)
    gate, up = (torch.randn(16, 2, 48).to(dtype).requires_grad_() for _ in range(2))
    w = (0.1 * torch.randn(32, 48)).to(dtype).requires_grad_()
    g = torch.randn(16, 2, 32).to(dtype)
    ref_out = F.linear(F.silu(gate) * up, w)
    ref = torch.autograd.grad(ref_out, (gate, up, w), g)
    out = swiglu_linear(gate, up, w)
    assert torch.equal(out, ref_out)
    for a, r in zip(torch.autograd.grad(out, (gate, up, w), g), ref):   # the same ops: the same bits
        assert torch.equal(a, r)


def test_swiglu_recompute_keeps_gate_and_up_only():
    gate, up = (torch.randn(16, 2, 48).requires_grad_() for _ in range(2))
    w = torch.randn(32, 48).requires_grad_()
    assert saved_bytes(lambda gate, up, w: swiglu_linear(gate.clone(), up.clone(), w), gate, up, w) == 2 * 4 * 16 * 2 * 48
    dense = saved_bytes(lambda gate, up, w: F.linear(F.silu(gate.clone()) * up.clone(), w), gate, up, w)
    assert dense == 4 * 4 * 16 * 2 * 48     # gate, silu(gate), up, their product


@pytest.mark.parametrize("chunks", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_head_loss_equals_the_dense_loss(dtype, chunks):
    """lm_head + cross entropy over K chunks against F.cross_entropy of the whole logits, ignored
    targets included: loss and both grads."""
    torch.manual_seed(3)
    h = torch.randn(2, 16, 32).to(dtype).requires_grad_()       # [B, S, H]
    w = (0.1 * torch.randn(128, 32)).to(dtype).requires_grad_()
    targets = torch.randint(0, 128, (2, 16))
    targets[:, -1] = -100
    ref = next_token_cross_entropy(F.linear(h, w), targets)
    ref_grads = torch.autograd.grad(ref, (h, w))
    loss = chunked_head_loss(h, w, targets, chunks=chunks)
    grads = torch.autograd.grad(loss, (h, w))
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(loss.to(dtype), ref, **tol)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, **tol)


def test_chunked_head_loss_keeps_no_logits():
    """Saved: the log-sum-exp per row (fp32) and the targets; the [N, V] logits never outlive a chunk."""
    n, hid, vocab, chunks = 64, 16, 512, 8
    h = torch.randn(n, hid).requires_grad_()
    w = torch.randn(vocab, hid).requires_grad_()
    y = torch.randint(0, vocab, (n,))
    with StorageTracker() as t:
        for leaf in (h, w, y):
            t.mark(leaf, "params")
        loss = chunked_head_loss(h, w, y, chunks=chunks)
        kept = t.live["activations"]
        torch.autograd.grad(loss, (h, w))
    assert kept == 4 * n + 8                    # lse [N] and the target count of the mean
    # beside the inputs and their grads, a few chunks' [N/K, V] fp32 logits (measured: two and a
    # few [N/K] vectors), never the whole [N, V]
    grads_and_inputs = 2 * (h.nbytes + w.nbytes) + y.nbytes
    assert t.peak_bytes - grads_and_inputs <= 3 * 4 * (n // chunks) * vocab


@pytest.mark.parametrize("par,message", [
    (ParallelConfig(recompute="some"), "recompute must be one of none, selective, full; got 'some'"),
    (ParallelConfig(loss_chunks=0), "loss_chunks must be >= 1; got loss_chunks=0"),
    (ParallelConfig(loss_chunks=40), "loss_chunks must be <= seq_len"),
])
def test_bad_recompute_input_is_one_line(par, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as err:
        check_layout(MiniMindConfig(), par, seq_len=32)
    assert "\n" not in str(err.value)
