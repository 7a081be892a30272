"""Expert parallelism's groups and its token dispatch: the EP and EDP groups are Megatron-LM's
slices of the DP x CP ranks, and the all-to-all dispatcher (counts, tokens, back) gives what one
process computes with every expert, forward and backward."""
import torch
import torch.distributed as dist

from distributed import run_ranks

from minimind_parallel import ParallelConfig, ProcessGroups
from minimind_parallel.groups import expert_groups
from minimind_parallel.moe.dispatch import AllToAllDispatcher, chunk_permutation

H = 4


def test_expert_groups_are_contiguous_slices_and_strided_replicas():
    ep, edp = expert_groups([10, 11, 12, 13, 14, 15, 16, 17], 2)
    assert ep == [[10, 11], [12, 13], [14, 15], [16, 17]]
    assert edp == [[10, 12, 14, 16], [11, 13, 15, 17]]
    ep, edp = expert_groups([3, 7], 1)
    assert ep == [[3], [7]] and edp == [[3, 7]]


def test_chunk_permutation_reads_source_major_chunks_expert_major():
    sizes = torch.tensor([[1, 2], [0, 3]])        # source 0: 1 row of expert 0, 2 of expert 1; source 1: 0, 3
    assert chunk_permutation(sizes).tolist() == [0, 1, 2, 3, 4, 5]    # expert 0: row 0; expert 1: 1, 2, 3, 4, 5
    sizes = torch.tensor([[1, 1], [2, 1]])        # rows: s0e0 | s0e1 | s1e0 s1e0 | s1e1
    assert chunk_permutation(sizes).tolist() == [0, 2, 3, 1, 4]


def _group_ranks(group):
    return None if group is None else dist.get_process_group_ranks(group)


def _layouts():
    """Per layout of 4 ranks: this rank's (EP ranks, EDP ranks, ep_rank, rank within EP, edp is dp_cp)."""
    out = {}
    for name, par in {"dp2 cp2 ep2": ParallelConfig(dp=2, cp=2, ep=2), "dp2 tp2 ep2": ParallelConfig(dp=2, tp=2, ep=2),
                      "dp4 ep4": ParallelConfig(dp=4, ep=4), "dp2 tp2": ParallelConfig(dp=2, tp=2)}.items():
        g = ProcessGroups.build(par)
        out[name] = (_group_ranks(g.ep), _group_ranks(g.edp), g.ep_rank,
                     0 if g.ep is None else dist.get_rank(g.ep), g.edp is g.dp_cp)
    return out


def _expert_outputs(group, num_experts: int, seed: int):
    """One dispatch -> per local expert x @ W[e] -> combine, and backward, on this rank's tokens;
    and the same computed locally with every expert. -> max abs errors and the counts."""
    torch.manual_seed(seed)
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    weights = torch.randn(num_experts, H, H, dtype=torch.float64)              # the same on every rank
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    n = 3 + 2 * dist.get_rank()                                                 # uneven tokens per rank
    x = torch.randn(n, H, dtype=torch.float64, generator=g, requires_grad=True)
    experts = torch.randint(0, num_experts, (n,), generator=g)
    experts[experts == 1] = 0                                                   # expert 1 gets no token at all
    grad_out = torch.randn(n, H, dtype=torch.float64, generator=g)
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=num_experts)
    local = num_experts // ranks
    mine = weights[me * local:(me + 1) * local].clone().requires_grad_(True)   # [L, H, H]

    dispatcher = AllToAllDispatcher(group, num_experts)
    rows, local_counts = dispatcher.dispatch(x[order], counts)                 # [M, H], [L]
    outs = [chunk @ mine[e] for e, chunk in enumerate(rows.split(local_counts.tolist()))]
    y = torch.empty_like(x).index_copy(0, order, dispatcher.combine(torch.cat(outs)))
    y.backward(grad_out)

    full = weights.clone().requires_grad_(True)                                 # every expert, locally
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = torch.einsum("nh,nhk->nk", x_ref, full[experts])
    y_ref.backward(grad_out)
    dw = full.grad.clone()
    dist.all_reduce(dw, group=group)                                            # every rank's tokens
    all_counts = counts.clone()
    dist.all_reduce(all_counts, group=group)
    return {"y": (y - y_ref).abs().max().item(), "dx": (x.grad - x_ref.grad).abs().max().item(),
            "dw": (mine.grad - dw[me * local:(me + 1) * local]).abs().max().item(),
            "counts": local_counts.tolist() == all_counts[me * local:(me + 1) * local].tolist()}


def _all_checks():
    world = dist.new_group([0, 1, 2, 3])
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[dist.get_rank() // 2]
    return {"layouts": _layouts(), "ep4": _expert_outputs(world, 8, 0), "ep2": _expert_outputs(pair, 4, 1)}


def test_expert_groups_and_the_dispatch_on_four_ranks():
    results = run_ranks(_all_checks, 4)
    expected = {   # rank -> layout -> (EP ranks, EDP ranks, ep_rank, rank in EP, edp is dp_cp)
        "dp2 cp2 ep2": [([0, 1], [0, 2], 0, 0, False), ([0, 1], [1, 3], 1, 1, False),
                        ([2, 3], [0, 2], 0, 0, False), ([2, 3], [1, 3], 1, 1, False)],
        # grid (d, t): the DP x CP lists are [0, 2] (t = 0) and [1, 3]; ep 2 takes each whole
        "dp2 tp2 ep2": [([0, 2], None, 0, 0, False), ([1, 3], None, 0, 0, False),
                        ([0, 2], None, 1, 1, False), ([1, 3], None, 1, 1, False)],
        "dp4 ep4": [([0, 1, 2, 3], None, r, r, False) for r in range(4)],
        "dp2 tp2": [(None, [0, 2], 0, 0, True), (None, [1, 3], 0, 0, True),
                    (None, [0, 2], 0, 0, True), (None, [1, 3], 0, 0, True)],
    }
    for rank, result in enumerate(results):
        for name, want in expected.items():
            assert result["layouts"][name] == want[rank], (rank, name, result["layouts"][name])
        for case in ("ep4", "ep2"):
            r = result[case]
            assert r["counts"], (rank, case)
            assert max(r["y"], r["dx"], r["dw"]) < 1e-12, (rank, case, r)


def test_each_ep_rank_holds_a_contiguous_slice_of_the_experts_by_their_global_names():
    from minimind_parallel.moe.placement import expert_of, holds, local_experts
    assert [list(local_experts(8, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert expert_of("model.layers.3.mlp.experts.5.down_proj.weight") == 5
    assert expert_of("model.layers.3.mlp.gate.weight") is None
    assert holds("model.layers.0.mlp.experts.2.up_proj.weight", 4, 2, 1)
    assert not holds("model.layers.0.mlp.experts.2.up_proj.weight", 4, 2, 0)
    assert holds("model.layers.0.mlp.gate.weight", 4, 2, 0) and holds("model.norm.weight", 4, 2, 1)


def test_on_fake_tensors_the_dispatch_follows_the_balanced_policy_or_the_given_routing():
    """--estimate: the routing has no values; each rank sends and receives N*k/P rows per peer, or
    receives the rows a given routing sends its experts."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from minimind_parallel.memory.estimate import fake_process_group
    from minimind_parallel.moe.fake_routing import FakeRouting
    assert FakeRouting.balanced(10, 2, 2).rows == ((3, 3), (2, 2))
    given = FakeRouting.of_expert_rows([17, 3], 2)
    assert given.rows == ((9, 2), (8, 1)) and given.per_expert == [17, 3] and given.from_sources == [11, 9]
    with fake_process_group(0, 2), FakeTensorMode():
        group = dist.new_group([0, 1])
        for fake, received in ((None, 12), (given, 20)):
            dispatcher = AllToAllDispatcher(group, 4)
            tokens = torch.randn(12, H, requires_grad=True)
            rows, counts = dispatcher.dispatch(tokens, torch.zeros(4, dtype=torch.long), fake=fake)
            out = dispatcher.combine(rows * 2)
            out.sum().backward()
            assert rows.shape == (received, H) and counts.shape == (2,) and out.shape == (12, H)
            assert tokens.grad.shape == (12, H)


def test_sharding_a_moe_state_dict_over_ep_ranks_and_back_is_exact():
    from minimind_parallel import MiniMindConfig, MiniMindForCausalLM
    from minimind_parallel.sharding import gather_state_dict, shard_state_dict
    config = MiniMindConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=64, use_moe=True, num_experts=4, num_experts_per_tok=2)
    dense = MiniMindForCausalLM(config).state_dict()
    par = ParallelConfig(dp=2, tp=2, ep=2)
    shards = [shard_state_dict(dense, par, t, 0, r) for r in range(2) for t in range(2)]   # EP rank, then TP
    assert sorted(k for k in shards[2] if ".experts." in k) == sorted(
        k for k in dense if ".experts.2." in k or ".experts.3." in k)
    back = gather_state_dict(shards, par)
    assert back.keys() == dense.keys() and all(torch.equal(back[k], dense[k]) for k in dense)
