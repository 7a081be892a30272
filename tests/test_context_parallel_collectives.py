"""Collectives of one MiniMind block under context parallelism, counted from the real c10d calls
(point-to-point included) with the bytes each rank hands them, forward and backward, for every
comm type -- the table of README.md ("Context parallelism") as checks. Under TP + SP the TP
collectives are those of the SP table, unchanged: CP adds its own beside them."""
import pytest
import torch

from distributed import run_ranks
from minimind_parallel import MiniMindConfig, ParallelConfig, ProcessGroups
from minimind_parallel.context_parallel import COMM_TYPES, ContextLayout
from minimind_parallel.model import rope_tables
from minimind_parallel.parallel_model import ParallelBlock
from minimind_parallel.profiling.collectives import CollectiveLog

S, B, H, HEADS, KV = 32, 2, 64, 8, 4
D = H // HEADS
FLOAT = 4  # bytes of float32, the dtype of the block and of the ring's dK/dV accumulator


def cp_table(comm: str, c: int, t: int = 1) -> tuple[dict, dict]:
    """({kind: (calls, bytes)} forward, backward) of the CP attention of one block on one rank:
    S/C tokens, h = HEADS/T query and kv = KV/T kv heads of this TP rank."""
    tokens, h, kv = S // c, HEADS // t, KV // t
    kv_block = 2 * tokens * B * kv * D * FLOAT                  # this rank's K and V
    if comm == "all_gather":                                     # K/V gathered; dK/dV reduce-scattered home
        return {"all_gather": (1, kv_block)}, {"reduce_scatter": (1, c * kv_block)}
    if comm == "a2a":                                            # q, k, v to head shards; the output back
        qkv, out = tokens * B * (h + 2 * kv) * D * FLOAT, tokens * B * h * D * FLOAT
        return {"all_to_all": (2, qkv + out)}, {"all_to_all": (2, out + qkv)}
    # ring: C-1 K/V hops forward; backward the same C-1 again plus C hops of the dK/dV accumulator
    fwd = {"send": (c - 1, (c - 1) * kv_block), "recv": (c - 1, (c - 1) * kv_block)}
    hops = (2 * c - 1, (2 * c - 1) * kv_block)
    return fwd, {"send": hops, "recv": hops}


# tests/test_sequence_parallel.py's SP-recompute row: the TP collectives of a block under CP too
SP_RECOMPUTE = ({"all_gather": 5, "reduce_scatter": 2}, {"all_gather": 5 + 2, "reduce_scatter": 5})


def _logs(cases):
    """[(name, ParallelConfig)] -> {name: (forward calls, backward calls)} of one block on this rank."""
    out = {}
    for name, par in cases:
        groups = ProcessGroups.build(par)
        torch.manual_seed(0)
        config = MiniMindConfig(hidden_size=H, num_hidden_layers=1, num_attention_heads=HEADS,
                                num_key_value_heads=KV, vocab_size=64)
        block = ParallelBlock(config, par, groups.tp, groups.cp)
        layout = ContextLayout.of(par, S)
        positions = layout.positions(groups.cp_rank)
        cos, sin = (t[positions] for t in rope_tables(D, S, 1e6))
        x = torch.randn(S // par.cp // (par.tp if par.sequence_parallel else 1), B, H, requires_grad=True)
        with CollectiveLog() as fwd:
            y = block(x, cos, sin, layout)
        with CollectiveLog() as bwd:
            y.sum().backward()
        out[name] = (fwd.calls, bwd.calls)
    return out


def summed(calls) -> dict:
    out = {}
    for kind, n in calls:
        count, total = out.get(kind, (0, 0))
        out[kind] = (count + 1, total + n)
    return out


def counts(calls) -> dict:
    return {kind: n for kind, (n, _) in summed(calls).items()}


@pytest.mark.parametrize("c", [2, 4])
def test_cp_collectives_per_block_are_the_table_with_its_bytes(c):
    cases = [(comm, ParallelConfig(cp=c, cp_comm_type=comm)) for comm in COMM_TYPES]
    logs = run_ranks(_logs, c, cases)
    for rank, per_rank in enumerate(logs):
        for comm in COMM_TYPES:
            fwd, bwd = per_rank[comm]
            assert (summed(fwd), summed(bwd)) == cp_table(comm, c), (rank, comm)


def test_tp_collectives_are_unchanged_beside_cp_under_sp():
    par = dict(tp=2, cp=2, sequence_parallel=True, async_communication=True)
    cases = [(comm, ParallelConfig(**par, cp_comm_type=comm)) for comm in COMM_TYPES]
    logs = run_ranks(_logs, 4, cases)[0]
    for comm in COMM_TYPES:
        fwd, bwd = logs[comm]
        cp_fwd, cp_bwd = cp_table(comm, 2, t=2)
        for got, tp, cp in ((fwd, SP_RECOMPUTE[0], cp_fwd), (bwd, SP_RECOMPUTE[1], cp_bwd)):
            want = dict(tp)
            for kind, (n, _) in cp.items():
                want[kind] = want.get(kind, 0) + n
            assert counts(got) == want, comm
        # the CP collectives move the bytes of this TP rank's heads only
        if comm != "all_gather":
            kinds = set(cp_fwd)
            assert {k: v for k, v in summed(fwd).items() if k in kinds} == cp_fwd, comm
            assert {k: v for k, v in summed(bwd).items() if k in kinds} == cp_bwd, comm

