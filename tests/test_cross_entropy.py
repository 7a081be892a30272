"""Vocab-parallel cross entropy against F.cross_entropy: loss and logit grads, ignored labels,
extreme logits (stability), and the input left untouched."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed import run_ranks
from minimind_parallel.tensor_parallel import vocab_parallel_cross_entropy


def _check(dtype):
    group = dist.new_group(list(range(dist.get_world_size())))
    r, t = dist.get_rank(), dist.get_world_size()
    V, N = 10 * t, 24
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(N, V, generator=g, dtype=torch.float64) * 4
    logits[0, 3] = 1e4                                    # would overflow exp() without the max shift
    target = torch.randint(0, V, (N,), generator=g)
    target[[1, 5, 7]] = -100
    ref_in = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_in, target, ignore_index=-100)
    ref.backward()
    shard = logits.chunk(t, -1)[r].to(dtype).clone().requires_grad_()
    before = shard.detach().clone()
    loss = vocab_parallel_cross_entropy(shard, target, group)
    loss.backward()
    assert torch.equal(shard.detach(), before), "the input logits were modified"
    tol = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss.double(), ref.detach(), **tol)
    torch.testing.assert_close(shard.grad.double(), ref_in.grad.chunk(t, -1)[r], **tol)
    assert torch.all(shard.grad[[1, 5, 7]] == 0)
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_vocab_parallel_cross_entropy(world, dtype):
    assert all(run_ranks(_check, world, dtype))
