"""Context-parallel attention equals the dense causal attention (scaled_dot_product_attention with
repeated kv heads): each CP rank's output and the grads of its q, k, v are the matching tokens of
the dense ones, for every comm type, load-balanced and contiguous, C = 2 and 4."""
import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from minimind_parallel.context_parallel import COMM_TYPES, ContextLayout, context_parallel_attention
from minimind_parallel.model import causal_attention, repeat_kv

S, B, HEADS, KV, D = 32, 2, 8, 4, 8
TOL = {torch.float64: 1e-12, torch.float32: 2e-6}   # relative-L2 of each output and grad


def dense_attention(q, k, v):
    """The reference: [S, B, h, d] in, [S, B, h, d] out, via the dense model's helpers."""
    rep = q.shape[2] // k.shape[2]
    qb, kb, vb = q.transpose(0, 1), repeat_kv(k.transpose(0, 1), rep), repeat_kv(v.transpose(0, 1), rep)
    out = causal_attention(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), flash=True)
    return out.permute(2, 0, 1, 3)


def inputs(dtype):
    g = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return make(S, B, HEADS, D), make(S, B, KV, D), make(S, B, KV, D), make(S, B, HEADS, D)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def compare_on_ranks(comm_type):
    rank, c = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(c)))
    errors = {}
    for dtype in (torch.float64, torch.float32):
        q, k, v, w = inputs(dtype)
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        (dense_attention(*full) * w).sum().backward()
        ref_out = dense_attention(q, k, v)
        for balance in (True, False):
            layout = ContextLayout(seq_len=S, cp=c, load_balance=balance)
            mine = [layout.split(x, rank, 0).requires_grad_() for x in (q, k, v)]
            out = context_parallel_attention(*mine, group=group, layout=layout, comm_type=comm_type)
            (out * layout.split(w, rank, 0)).sum().backward()
            key = f"{dtype} balance={balance}"
            errors[key + " out"] = rel(out, layout.split(ref_out, rank, 0))
            for name, local, dense in zip("qkv", mine, full):
                errors[key + f" d{name}"] = rel(local.grad, layout.split(dense.grad, rank, 0))
    return errors


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm_type", COMM_TYPES)
def test_context_parallel_attention_equals_dense_attention(comm_type, cp):
    for errors in run_ranks(compare_on_ranks, cp, comm_type):
        for item, err in errors.items():
            tol = TOL[torch.float64] if item.startswith("torch.float64") else TOL[torch.float32]
            assert err <= tol, (item, err)


def test_load_balanced_layout_gives_rank_i_chunks_i_and_2c_minus_1_minus_i():
    layout = ContextLayout(seq_len=16, cp=4)
    assert [layout.chunks(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert layout.positions(1).tolist() == [2, 3, 12, 13]
    x = torch.arange(16)
    assert torch.equal(layout.merge([layout.split(x, r, 0) for r in range(4)], 0), x)
    contiguous = ContextLayout(seq_len=16, cp=4, load_balance=False)
    assert contiguous.positions(3).tolist() == [12, 13, 14, 15]
