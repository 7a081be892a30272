"""The data module: targets are the next tokens (shifted once, before any split), every layout's
batch split keeps every target, and the batch makers give the global mean over DP ranks."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed import run_ranks
from minimind_parallel import MiniMindConfig, MiniMindForCausalLM
from minimind_parallel.data.batches import (IGNORE_INDEX, broadcast_batch, count_targets, dp_rows, random_batch,
                                            shift_labels, split_microbatches)

TINY = MiniMindConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=64, max_position_embeddings=64)


def test_targets_are_the_next_label_and_nothing_at_the_last_position():
    labels = torch.tensor([[5, 6, 7, 8], [9, -100, 10, -100]])
    assert shift_labels(labels).tolist() == [[6, 7, 8, -100], [-100, 10, -100, -100]]
    assert count_targets(shift_labels(labels)).item() == 4


def test_a_split_of_the_sequence_keeps_the_target_of_each_chunks_last_token():
    """Cross entropy summed over sequence chunks (as a context-parallel rank would compute it) is
    the model's loss over the whole sequence: no chunk loses its last token's target."""
    torch.manual_seed(0)
    model = MiniMindForCausalLM(TINY).double()
    ids, targets = random_batch(0, 2, 16, TINY.vocab_size)
    out = model(ids, targets=targets)
    chunks = zip(out.logits.chunk(4, dim=1), targets.chunk(4, dim=1))
    total = sum(F.cross_entropy(x.reshape(-1, x.shape[-1]), y.reshape(-1), reduction="sum") for x, y in chunks)
    assert sum(count_targets(y) for y in targets.chunk(4, dim=1)) == count_targets(targets) == 2 * (16 - 2)
    torch.testing.assert_close(total / count_targets(targets), out.loss, rtol=1e-12, atol=0)


def test_random_batches_give_every_row_the_same_targets_so_the_dp_mean_is_the_global_mean():
    torch.manual_seed(0)
    model = MiniMindForCausalLM(TINY).double()
    batch = random_batch(3, 4, 12, TINY.vocab_size)
    assert ((batch.targets != IGNORE_INDEX).sum(dim=1) == 12 - 2).all()
    assert (batch.targets[:, 0] == IGNORE_INDEX).all() and (batch.targets[:, -1] == IGNORE_INDEX).all()
    per_rank = [model(rows.input_ids, targets=rows.targets).loss for rows in (dp_rows(batch, r, 2) for r in range(2))]
    torch.testing.assert_close(sum(per_rank) / 2, model(batch.input_ids, targets=batch.targets).loss, rtol=1e-12, atol=0)


def test_dp_rows_and_microbatches_partition_the_batch():
    batch = random_batch(0, 8, 6, 64)
    mine = [dp_rows(batch, r, 2) for r in range(2)]
    for t in range(2):
        assert torch.equal(torch.cat([m[t] for m in mine]), batch[t])
    micro = split_microbatches(*mine[1], 2)
    assert [tuple(m.input_ids.shape) for m in micro] == [(2, 6), (2, 6)]
    assert torch.equal(torch.cat([m.targets for m in micro]), mine[1].targets)
    with pytest.raises(ValueError, match="not divisible by num_microbatches=3"):
        split_microbatches(*batch, 3)
    with pytest.raises(ValueError, match="not divisible by dp=3"):
        dp_rows(batch, 0, 3)


def _broadcast(seed_of_rank):
    return broadcast_batch(4, 8, 64, seed_of_rank[dist.get_rank()], "cpu")


def test_the_broadcast_batch_is_rank_0s_on_every_rank():
    a, b = run_ranks(_broadcast, 2, {0: 1, 1: 2})
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.targets, b.targets)
    assert torch.equal(a.targets, shift_labels(a.input_ids))
    g = torch.Generator().manual_seed(1)
    assert torch.equal(a.input_ids, torch.randint(0, 64, (4, 8), generator=g))
