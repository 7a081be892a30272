"""What `--recompute full` costs in communication: a checkpointed block re-runs its forward in
backward, collectives included, up to the last tensor it saves (PyTorch's non-reentrant
checkpoint stops early there). Counted from the real c10d calls on 2 gloo ranks, per block, with
the bytes each rank hands them, against `none` and `selective` -- the table of docs/memory.md
("Recompute and the chunked loss") and README.md as checks. A re-run that repeated more (the
block's exit reduce-scatter / all-reduce, a second pass) or fewer (a collective skipped, its
result taken stale) fails here."""
from collections import Counter

import pytest
import torch

from distributed import run_ranks
from minimind_parallel import MiniMindConfig, ParallelConfig, ProcessGroups
from minimind_parallel.model import rope_tables
from minimind_parallel.parallel_model import ParallelBlock
from minimind_parallel.profiling.collectives import CollectiveLog
from minimind_parallel.recompute import checkpoint_block

S, B, H, HEADS, KV = 8, 2, 32, 4, 2
CONFIG = dict(hidden_size=H, num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=KV, vocab_size=64)

# mode -> (flags, the collectives one block's re-run issues in backward under --recompute full)
RERUN = {
    # plain TP: o_proj's all-reduce (entering the TP region communicates only in backward)
    "tp": (dict(), {"all_reduce": 1}),
    "tp_async": (dict(async_communication=True), {"all_reduce": 1}),
    # SP: the q/k/v and gate/up all-gathers and o_proj's reduce-scatter; down_proj's is not re-run
    "sp": (dict(sequence_parallel=True), {"all_gather": 5, "reduce_scatter": 1}),
    "sp_async": (dict(sequence_parallel=True, async_communication=True), {"all_gather": 5, "reduce_scatter": 1}),
    # --shared_sp_gather: one gather per region
    "sp_shared": (dict(sequence_parallel=True, shared_sp_gather=True), {"all_gather": 2, "reduce_scatter": 1}),
    "sp_async_shared": (dict(sequence_parallel=True, async_communication=True, shared_sp_gather=True),
                        {"all_gather": 2, "reduce_scatter": 1}),
}

# Without recompute, per block (tests/test_sequence_parallel.py, the book's section 4.3.2 table)
BASE = {
    "tp": ({"all_reduce": 2}, {"all_reduce": 5}),
    "tp_async": ({"all_reduce": 2}, {"all_reduce": 5}),
    "sp": ({"all_gather": 5, "reduce_scatter": 2}, {"reduce_scatter": 5, "all_gather": 2}),
    "sp_async": ({"all_gather": 5, "reduce_scatter": 2}, {"all_gather": 5 + 2, "reduce_scatter": 5}),
    "sp_shared": ({"all_gather": 2, "reduce_scatter": 2}, {"reduce_scatter": 2, "all_gather": 2}),
    "sp_async_shared": ({"all_gather": 2, "reduce_scatter": 2}, {"all_gather": 2 + 2, "reduce_scatter": 2}),
}


def _block_calls(flags: dict) -> dict:
    """{recompute: (forward calls, backward calls)} of one block on this rank, [(kind, bytes)] in
    issue order; `full` runs the block under `checkpoint_block` as ParallelMiniMindModel does."""
    out = {}
    for recompute in ("none", "selective", "full"):
        par = ParallelConfig(tp=2, recompute=recompute, **flags)
        groups = ProcessGroups.build(par)
        torch.manual_seed(0)
        block = ParallelBlock(MiniMindConfig(**CONFIG), par, groups.tp)
        cos, sin = rope_tables(H // HEADS, S, 1e6)
        x = torch.randn(S // par.tp if par.sequence_parallel else S, B, H, requires_grad=True)
        with CollectiveLog() as fwd:
            y = checkpoint_block(block, x, cos, sin) if recompute == "full" else block(x, cos, sin)
        with CollectiveLog() as bwd:
            y.sum().backward()
        out[recompute] = (fwd.calls, bwd.calls)
    return out


@pytest.fixture(scope="module")
def calls():
    """Every mode's calls, measured in one 2-rank run; {mode: [rank 0's, rank 1's]}."""
    modes = list(RERUN)
    per_rank = run_ranks(_run_modes, 2, [RERUN[m][0] for m in modes])
    return {m: [per_rank[r][i] for r in range(2)] for i, m in enumerate(modes)}


def _run_modes(flag_list):
    return [_block_calls(flags) for flags in flag_list]


def _counts(calls) -> dict:
    return dict(Counter(kind for kind, _ in calls))


@pytest.mark.parametrize("mode", list(RERUN))
def test_selective_recompute_communicates_as_none(mode, calls):
    for rank_calls in calls[mode]:
        assert rank_calls["selective"] == rank_calls["none"]
        assert (_counts(rank_calls["none"][0]), _counts(rank_calls["none"][1])) == BASE[mode]


@pytest.mark.parametrize("mode", list(RERUN))
def test_full_recompute_reruns_the_forward_collectives_up_to_down_proj(mode, calls):
    rerun = RERUN[mode][1]
    n = sum(rerun.values())
    for rank_calls in calls[mode]:
        fwd, bwd = rank_calls["full"]
        ref_fwd, ref_bwd = rank_calls["selective"]
        assert fwd == ref_fwd                                      # the forward itself is unchanged
        extra = Counter(bwd) - Counter(ref_bwd)
        assert sum(Counter(bwd).values()) == sum(Counter(ref_bwd).values()) + n
        assert Counter(ref_bwd) - Counter(bwd) == Counter()         # every backward collective still runs
        assert _counts(extra.elements()) == rerun
        # the re-run is the forward's first n collectives, same kinds, same bytes, same order
        assert extra == Counter(fwd[:n])
        assert _counts(fwd[n:]) == ({"all_reduce": 1} if "reduce_scatter" not in rerun else {"reduce_scatter": 1})
