import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks


def _sum_of_ranks():
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x)
    return x.item()


def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 broke")
    dist.barrier()  # rank 0 would wait here forever without the harness


def test_ranks_run_and_return():
    assert run_ranks(_sum_of_ranks, 3) == [3.0, 3.0, 3.0]


def test_a_failing_rank_is_reported_not_hung():
    with pytest.raises(AssertionError, match="rank 1 broke"):
        run_ranks(_raise_on_rank_1, 2, timeout=60)
