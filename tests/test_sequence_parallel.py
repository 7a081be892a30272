"""The MiniMind Parallelism Book's chapter 4 as checks: collectives per block counted from the
real calls (the book's section 4.3.2 table, and --shared_sp_gather), and what autograd keeps
alive between forward and backward."""
from collections import Counter

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

from distributed import run_ranks
from minimind_parallel import MiniMindConfig, ParallelConfig, ProcessGroups
from minimind_parallel.model import rope_tables
from minimind_parallel.parallel_model import ParallelBlock
from minimind_parallel.tensor_parallel import column_parallel

S, B, H = 8, 2, 32
CONFIG = dict(hidden_size=H, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
KIND = {"allreduce_": "all_reduce", "_allgather_base_": "all_gather", "_reduce_scatter_base_": "reduce_scatter"}


def _counts(mode: CommDebugMode) -> dict:
    out = Counter()
    for op, n in mode.get_comm_counts().items():
        out[KIND.get(op._qualified_op_name.split("::")[-1].split(".")[-1], str(op))] += n
    return dict(out)


def _block(par):
    groups = ProcessGroups.build(par)
    torch.manual_seed(0)
    block = ParallelBlock(MiniMindConfig(**CONFIG), par, groups.tp)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    cos, sin = rope_tables(H // 4, S, 1e6)
    return block, cos, sin


def _block_collectives(par):
    block, cos, sin = _block(par)
    x = torch.randn(S // par.tp if par.sequence_parallel else S, B, H, requires_grad=True)
    with CommDebugMode() as fwd:
        y = block(x, cos, sin)
    with CommDebugMode() as bwd:
        y.sum().backward()
    return _counts(fwd), _counts(bwd)


# (mode flags) -> (forward collectives, backward collectives) per MiniMind block (5 column, 2 row linears)
EXPECTED = {
    "tp": (dict(), {"all_reduce": 2}, {"all_reduce": 5}),
    "tp_async": (dict(async_communication=True), {"all_reduce": 2}, {"all_reduce": 5}),
    # MiniMind Parallelism Book, section 4.3.2, basic SP:
    # column backward = 5 reduce-scatters, row backward = 2 all-gathers
    "basic_sp": (dict(sequence_parallel=True), {"all_gather": 5, "reduce_scatter": 2},
                 {"reduce_scatter": 5, "all_gather": 2}),
    # MiniMind Parallelism Book, section 4.3.2, SP recompute:
    # column backward = 5 re-gathers + 5 dgrad reduce-scatters; row = 2 all-gathers
    "sp_recompute": (dict(sequence_parallel=True, async_communication=True), {"all_gather": 5, "reduce_scatter": 2},
                     {"all_gather": 5 + 2, "reduce_scatter": 5}),
    # --shared_sp_gather: one gather per region (q/k/v, gate/up): 5 -> 2
    "basic_sp_shared": (dict(sequence_parallel=True, shared_sp_gather=True), {"all_gather": 2, "reduce_scatter": 2},
                        {"reduce_scatter": 2, "all_gather": 2}),
    "sp_recompute_shared": (dict(sequence_parallel=True, async_communication=True, shared_sp_gather=True),
                            {"all_gather": 2, "reduce_scatter": 2}, {"all_gather": 2 + 2, "reduce_scatter": 2}),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_collectives_per_block_match_the_seed_table(name):
    flags, fwd, bwd = EXPECTED[name]
    got_fwd, got_bwd = run_ranks(_block_collectives, 2, ParallelConfig(tp=2, **flags))[0]
    assert (got_fwd, got_bwd) == (fwd, bwd)


def _saved_inputs(par, which):
    """Run only the column-parallel linears of one region on a local input and record what
    autograd saves: [(elements, storage pointer)] of every saved non-parameter tensor (F.linear
    may save a 2-D view of a 3-D input, so elements, not shapes)."""
    block, _, _ = _block(par)
    attn, mlp = block.self_attn, block.mlp
    x = torch.randn(S // par.tp if par.sequence_parallel else S, B, H, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved = []

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved.append((t.numel(), ptr))
        return t

    projs = [attn.q_proj, attn.k_proj, attn.v_proj] if which == "attention" else [mlp.gate_proj, mlp.up_proj]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = column_parallel(projs, x) if par.shared_sp_gather else [p(x) for p in projs]
    sum(o.sum() for o in outs).backward()
    return saved, x.untyped_storage().data_ptr()


@pytest.mark.parametrize("which,n", [("attention", 3), ("mlp", 2)])
def test_recompute_saves_one_local_shard_not_full_inputs(which, n):
    par = ParallelConfig(tp=2, sequence_parallel=True, async_communication=True)
    saved, x_ptr = run_ranks(_saved_inputs, 2, par, which)[0]
    assert len(saved) == n                                   # one saved input per linear ...
    assert {numel for numel, _ in saved} == {S // 2 * B * H}  # ... each the [S/T, B, H] local shard ...
    assert {ptr for _, ptr in saved} == {x_ptr}              # ... and all the same storage


@pytest.mark.parametrize("which,n", [("attention", 3), ("mlp", 2)])
def test_basic_sp_saves_one_full_sequence_input_per_linear(which, n):
    par = ParallelConfig(tp=2, sequence_parallel=True)
    saved, _ = run_ranks(_saved_inputs, 2, par, which)[0]
    assert [numel for numel, _ in saved] == [S * B * H] * n
    assert len({ptr for _, ptr in saved}) == n               # the book's 5F: independent gathered copies


@pytest.mark.parametrize("which", ["attention", "mlp"])
def test_shared_gather_keeps_one_full_input_per_region(which):
    par = ParallelConfig(tp=2, sequence_parallel=True, shared_sp_gather=True)
    saved, _ = run_ranks(_saved_inputs, 2, par, which)[0]
    assert {numel for numel, _ in saved} == {S * B * H}
    assert len({ptr for _, ptr in saved}) == 1               # 5F -> 2F per block


def _block_saved_sizes(par):
    block, cos, sin = _block(par)
    x = torch.randn(S // par.tp, B, H, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    sizes = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x, cos, sin)
    y.sum().backward()
    return sizes


def test_no_full_sequence_hidden_state_survives_forward_under_recompute():
    # No other tensor of the block has S*B*H elements at these sizes (q: S*B*H/2, MLP: S*B*64).
    recompute = run_ranks(_block_saved_sizes, 2, ParallelConfig(tp=2, sequence_parallel=True,
                                                                async_communication=True))[0]
    basic = run_ranks(_block_saved_sizes, 2, ParallelConfig(tp=2, sequence_parallel=True))[0]
    assert S * B * H not in recompute
    assert basic.count(S * B * H) == 5
