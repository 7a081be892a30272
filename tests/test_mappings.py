"""Each region switch against its closed form, forward and backward, on every rank."""
import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from minimind_parallel.tensor_parallel import mappings


def _check_mappings():
    group = dist.new_group(list(range(dist.get_world_size())))
    r, t = dist.get_rank(), dist.get_world_size()

    def base(shape):  # the same full tensor on every rank
        return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape) + 1

    def per_rank(x):  # a different tensor on every rank
        return x * (r + 1)

    tot = sum(range(1, t + 1))
    full = base((2 * t, 3, 4))                                         # [S, B, H]
    # f: identity forward, all-reduce backward
    x = full.clone().requires_grad_()
    y = mappings.copy_to_tensor_parallel_region(x, group)
    assert torch.equal(y, full)
    y.backward(per_rank(torch.ones_like(y)))
    assert torch.equal(x.grad, torch.full_like(full, tot))
    # g: all-reduce forward, identity backward
    x = per_rank(full).requires_grad_()
    y = mappings.reduce_from_tensor_parallel_region(x, group)
    assert torch.equal(y, full * tot)
    g = per_rank(full)
    y.backward(g)
    assert torch.equal(x.grad, g)
    # scatter/gather along the last dim (hidden split 4t ways)
    wide = base((2, 3, 4 * t))
    x = wide.clone().requires_grad_()
    y = mappings.scatter_to_tensor_parallel_region(x, group)
    assert torch.equal(y, wide[..., 4 * r:4 * (r + 1)])
    y.backward(torch.ones_like(y) * (r + 1))
    expect = torch.cat([torch.full((2, 3, 4), float(k + 1), dtype=torch.float64) for k in range(t)], dim=-1)
    assert torch.equal(x.grad, expect)
    x = wide[..., 4 * r:4 * (r + 1)].clone().requires_grad_()
    y = mappings.gather_from_tensor_parallel_region(x, group)
    assert torch.equal(y, wide)
    y.backward(wide * 10)
    assert torch.equal(x.grad, (wide * 10)[..., 4 * r:4 * (r + 1)])
    # sequence scatter: split dim 0 forward (a fresh tensor), all-gather backward
    x = full.clone().requires_grad_()
    y = mappings.scatter_to_sequence_parallel_region(x, group)
    assert torch.equal(y, full[2 * r:2 * (r + 1)])
    assert y.untyped_storage().nbytes() == y.numel() * y.element_size(), "scatter pinned the full tensor"
    y.backward(torch.full_like(y, float(r + 1)))
    assert torch.equal(x.grad, torch.cat([torch.full((2, 3, 4), float(k + 1), dtype=torch.float64)
                                          for k in range(t)]))
    # sequence gather: all-gather forward; backward reduce-scatter (partial grads) or split
    for partial in (True, False):
        x = full[2 * r:2 * (r + 1)].clone().requires_grad_()
        y = mappings.gather_from_sequence_parallel_region(x, group, grad_is_partial=partial)
        assert torch.equal(y, full)
        y.backward(per_rank(full))
        want = (full * tot if partial else per_rank(full))[2 * r:2 * (r + 1)]
        assert torch.equal(x.grad, want)
    # reduce-scatter forward, all-gather backward
    x = per_rank(full).requires_grad_()
    y = mappings.reduce_scatter_to_sequence_parallel_region(x, group)
    assert torch.equal(y, (full * tot)[2 * r:2 * (r + 1)])
    y.backward(full[2 * r:2 * (r + 1)] * 7)
    assert torch.equal(x.grad, full * 7)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_mappings_closed_form(world):
    assert all(run_ranks(_check_mappings, world))
