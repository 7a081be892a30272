"""Column/row-parallel linears and the vocab-parallel embedding against their dense nn modules:
output, weight grad, bias grad and input grad, in every TP/SP/async combination."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import run_ranks
from minimind_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from minimind_parallel.distributed.comm import split_dim

S, B, H, N = 8, 2, 12, 16
TOL = dict(atol=1e-12, rtol=1e-12)


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    return x, torch.randn(S, B, N, generator=g, dtype=torch.float64)


def _column(sp, async_comm):
    group = dist.new_group(list(range(dist.get_world_size())))
    r, t = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    dense = nn.Linear(H, N, bias=True).double()
    x, dy = _inputs(1)
    layer = ColumnParallelLinear(H, N, group=group, bias=True, sequence_parallel=sp,
                                 async_communication=async_comm, dtype=torch.float64)
    with torch.no_grad():
        layer.weight.copy_(dense.weight.chunk(t, 0)[r])
        layer.bias.copy_(dense.bias.chunk(t, 0)[r])
    xr = x.clone().requires_grad_()
    ref = dense(xr)
    ref.backward(dy)
    xl = (x.chunk(t, 0)[r] if sp else x).clone().requires_grad_()       # SP input: this rank's sequence shard
    y = layer(xl)
    torch.testing.assert_close(y, ref.chunk(t, -1)[r].detach(), **TOL)  # this rank's output columns
    y.backward(dy.chunk(t, -1)[r])
    torch.testing.assert_close(layer.weight.grad, dense.weight.grad.chunk(t, 0)[r], **TOL)
    torch.testing.assert_close(layer.bias.grad, dense.bias.grad.chunk(t, 0)[r], **TOL)
    torch.testing.assert_close(xl.grad, xr.grad.chunk(t, 0)[r] if sp else xr.grad, **TOL)
    return True


def _row(sp):
    group = dist.new_group(list(range(dist.get_world_size())))
    r, t = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    dense = nn.Linear(N, H, bias=True).double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(S, B, N, generator=g, dtype=torch.float64)
    dy = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    layer = RowParallelLinear(N, H, group=group, bias=True, sequence_parallel=sp,
                              dtype=torch.float64)
    with torch.no_grad():
        layer.weight.copy_(dense.weight.chunk(t, 1)[r])
        layer.bias.copy_(dense.bias)
    xr = x.clone().requires_grad_()
    ref = dense(xr)
    ref.backward(dy)
    xl = x.chunk(t, -1)[r].clone().requires_grad_()                    # this rank's input columns
    y = layer(xl)
    torch.testing.assert_close(y, (ref.chunk(t, 0)[r] if sp else ref).detach(), **TOL)
    y.backward(dy.chunk(t, 0)[r] if sp else dy)
    if sp:  # the bias saw only this rank's sequence shard: its grad is partial until summed over TP
        dist.all_reduce(layer.bias.grad, group=group)
        assert layer.bias.tp_partial_grad
    torch.testing.assert_close(layer.weight.grad, dense.weight.grad.chunk(t, 1)[r], **TOL)
    torch.testing.assert_close(layer.bias.grad, dense.bias.grad, **TOL)
    torch.testing.assert_close(xl.grad, xr.grad.chunk(t, -1)[r], **TOL)
    return True


def _embedding(sp):
    group = dist.new_group(list(range(dist.get_world_size())))
    r, t = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    V = 8 * t
    dense = nn.Embedding(V, H).double()
    ids = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(3))
    dy = torch.randn(S, B, H, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    layer = VocabParallelEmbedding(V, H, group=group, sequence_parallel=sp, dtype=torch.float64)
    with torch.no_grad():
        layer.weight.copy_(dense.weight.chunk(t, 0)[r])
    ref = dense(ids)
    ref.backward(dy)
    y = layer(ids)
    torch.testing.assert_close(y, (ref.chunk(t, 0)[r] if sp else ref).detach(), **TOL)
    y.backward(dy.chunk(t, 0)[r] if sp else dy)
    torch.testing.assert_close(layer.weight.grad, dense.weight.grad.chunk(t, 0)[r], **TOL)
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp,async_comm", [(False, False), (True, False), (False, True), (True, True)])
def test_column_parallel_linear_matches_nn_linear(world, sp, async_comm):
    assert all(run_ranks(_column, world, sp, async_comm))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_row_parallel_linear_matches_nn_linear(world, sp):
    assert all(run_ranks(_row, world, sp))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_vocab_parallel_embedding_matches_nn_embedding(world, sp):
    assert all(run_ranks(_embedding, world, sp))


def _split_is_a_copy():
    group = dist.new_group([0, 1])
    x = torch.randn(8, 2, 3)
    y = split_dim(x, 0, group)
    return y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() and \
        y.untyped_storage().nbytes() == y.numel() * y.element_size()


def test_split_never_pins_the_full_tensor():
    assert all(run_ranks(_split_is_a_copy, 2))
