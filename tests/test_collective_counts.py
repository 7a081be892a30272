"""The time model's collectives are the step's: for each layout, every collective a real training step
issues (counted by the harness's meter, profiling.collectives.CollectiveLog, on the last stage's rank)
is one the CPU time model costs, with its bytes, and none is missing (planning.time_model.
collectives_of_step); and the collective clock's share of a collective after every rank arrived
(planning.collective_clock) and the calibration's per-call cost on hand-made calls."""
from collections import Counter
from dataclasses import replace

import pytest
import torch

from distributed import run_ranks
from minimind_parallel.config import CPCommType, MiniMindConfig, ParallelConfig, Recompute
from minimind_parallel.planning import Candidate, Link, Workload
from minimind_parallel.planning.collective_clock import Call, after_all_arrived
from minimind_parallel.planning.time_model import Collective, Op, collectives_of_step

CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
SEQ, ROWS = 16, 2
# the plan's layouts at world 2: TP's flags (the head's and the loss's collectives, full recompute's
# re-run), CP's three exchanges, ZeRO's buckets, DDP, a pipeline
LAYOUTS = [
    Candidate(tp=2),
    Candidate(tp=2, vocab_parallel=True, loss_chunks=4),
    Candidate(tp=2, sequence_parallel=True),
    Candidate(tp=2, sequence_parallel=True, vocab_parallel=True, loss_chunks=2, recompute=Recompute.FULL),
    Candidate(tp=2, sequence_parallel=True, shared_sp_gather=True, async_communication=True),
    Candidate(tp=2, vocab_parallel=True, async_communication=True, recompute=Recompute.FULL),
    Candidate(cp=2, cp_comm_type=CPCommType.A2A, recompute=Recompute.FULL),
    Candidate(cp=2, cp_comm_type=CPCommType.RING, zero=2),
    Candidate(cp=2, cp_comm_type=CPCommType.ALL_GATHER, zero=1, loss_chunks=4),
    Candidate(dp=2),
    Candidate(pp=2, num_microbatches=2),
]


def _real_steps(layouts):
    """Per layout: the third training step's collectives on this rank (CollectiveLog) and its
    parameter elements; then what the calibration's in-step link measures on this rank."""
    from minimind_parallel.context_parallel import ContextLayout
    from minimind_parallel.data.batches import broadcast_batch, cp_tokens, dp_rows
    from minimind_parallel.groups import ProcessGroups
    from minimind_parallel.model import MiniMindForCausalLM
    from minimind_parallel.profiling.collectives import CollectiveLog
    from minimind_parallel.training import build_parallel_model, make_optimizer, train_step, wrap_data_parallel
    config, out = MiniMindConfig(**CONFIG), []
    for k in layouts:
        par: ParallelConfig = k.parallel
        groups = ProcessGroups.build(par)
        torch.manual_seed(0)
        model = build_parallel_model(config, par, groups, MiniMindForCausalLM(config).state_dict())
        model = wrap_data_parallel(model, groups)
        optimizer = make_optimizer(model, 1e-4, groups)
        m = k.num_microbatches
        batch = dp_rows(broadcast_batch(ROWS * m * par.dp, SEQ, config.vocab_size, 1, "cpu"), groups.dp_rank, par.dp)
        ids, targets = cp_tokens(batch, ContextLayout.of(par, SEQ), groups.cp_rank)
        for _ in range(2):       # DDP rebuilds its buckets in the second step (a broadcast of their order)
            train_step(model, optimizer, groups, ids, targets, num_microbatches=m)
        with CollectiveLog() as log:
            train_step(model, optimizer, groups, ids, targets, num_microbatches=m)
        out.append((log.calls, sum(p.numel() for p in model.parameters())))
    from minimind_parallel.planning.calibrate import Shapes, in_step_all_reduces
    from minimind_parallel.planning.step_costs import FIT_LAYOUTS, timed_steps
    fit = MiniMindConfig(**{**CONFIG, "num_hidden_layers": 1})
    return out, in_step_all_reduces(Shapes(model=config, seq=SEQ)), timed_steps(fit, SEQ, FIT_LAYOUTS, torch.float32)


def _as_logged(k: Candidate, x: Collective) -> list[tuple[str, int]]:
    """A costed collective as the meter logs it: an all-gather by the shard this rank sends; a ring
    pass is a send and a receive, a pipeline boundary's transfer one of them (both as p2p)."""
    n = int(round(x.nbytes))
    if x.kind == Op.P2P:
        return [("p2p", n)] * (2 if k.cp > 1 else 1)
    kind = {Op.ALL_REDUCE: "all_reduce", Op.REDUCE_SCATTER: "reduce_scatter", Op.ALL_TO_ALL: "all_to_all"}
    return [("all_gather", n // x.ranks)] if x.kind == Op.ALL_GATHER else [(kind[x.kind], n)]


def test_the_time_models_collectives_are_the_real_steps_with_their_bytes():
    """And the calibration's in-step link times every all-reduce of its TP steps: the model's count
    of them, with their bytes, on both ranks; and its fitted steps (step_costs.timed_steps) run."""
    from minimind_parallel.planning.calibrate import IN_STEP_LAYERS, IN_STEP_ROWS, IN_STEP_STEPS
    ranks = run_ranks(_real_steps, 2, LAYOUTS, timeout=600)
    tp_step = Candidate(tp=2, vocab_parallel=True, micro_batch_size=IN_STEP_ROWS)
    w = Workload(model=MiniMindConfig(**{**CONFIG, "num_hidden_layers": IN_STEP_LAYERS}), seq_len=SEQ,
                 global_batch_size=IN_STEP_ROWS, world_size=2, dtype="float32")
    each = Counter(int(x.nbytes) for x in collectives_of_step(tp_step, w, stage_params=0) if x.kind == Op.ALL_REDUCE)
    for _, in_step, _ in ranks:
        assert Counter(n for n, _ in in_step) == Counter({n: IN_STEP_STEPS * c for n, c in each.items()})
        assert all(t >= 0 for _, t in in_step)
    # the calibration's fitted steps: every layout timed, the slower rank's time on both
    from minimind_parallel.planning.step_costs import FIT_LAYOUTS
    assert ranks[0][2] == ranks[1][2] and len(ranks[0][2]) == len(FIT_LAYOUTS) and all(t > 0 for t in ranks[0][2])
    for i, k in enumerate(LAYOUTS):
        calls, params = ranks[1 if k.pp > 1 else 0][0][i]        # the last stage's rank
        real = Counter(("p2p", n) if kind in ("send", "recv") else (kind, n) for kind, n in calls)
        w = Workload(model=MiniMindConfig(**CONFIG), seq_len=SEQ, global_batch_size=ROWS * k.num_microbatches * k.dp,
                     world_size=2, dtype="float32")
        costed = Counter(c for x in collectives_of_step(replace(k, micro_batch_size=ROWS), w, stage_params=params)
                         for c in _as_logged(k, x))
        assert costed == real, (k, sorted((costed - real).items()), sorted((real - costed).items()))


def test_the_clock_keeps_what_a_collective_took_after_the_last_rank_arrived():
    mine = [Call("all_reduce", 4, 1.0, 1.5), Call("all_reduce", 4, 2.0, 2.2)]
    other = [Call("all_reduce", 4, 1.3, 1.5), Call("all_reduce", 4, 1.9, 2.2)]
    # the first: 0.3 s waiting for the other rank (its compute), 0.2 s after; the second: it came last
    assert after_all_arrived(mine, [other]) == pytest.approx([0.2, 0.2])
    with pytest.raises(ValueError, match="different numbers"):
        after_all_arrived(mine, [other[:1]])


def test_a_collective_inside_a_step_costs_the_links_per_call_overhead_once():
    """Link.call_s: paid once per call, whatever its ring steps (the calibration's in-step cost);
    the calibration keeps the median excess of the in-step all-reduces over the back-to-back link."""
    from minimind_parallel.planning.calibrate import per_call_overhead
    link = Link(latency_s=1e-5, bandwidth=1e9)
    slow = Link(latency_s=1e-5, bandwidth=1e9, call_s=1e-3)
    for x in (Collective(Op.ALL_REDUCE, 1e6, 4), Collective(Op.ALL_GATHER, 1e6, 4), Collective(Op.P2P, 1e6, 2)):
        assert x.seconds(slow) == pytest.approx(x.seconds(link) + 1e-3)
    assert Collective(Op.ALL_REDUCE, 1e6, 1).seconds(slow) == 0         # a one-rank group issues nothing
    back_to_back = 2 * (1e-5 + 1e6 / 2e9)                               # 2 (a + n / (2 w)) at g = 2
    times = [(1e6, back_to_back + 1e-3), (1e6, back_to_back + 3e-3), (1e6, back_to_back + 2e-3)]
    assert per_call_overhead(times, link) == pytest.approx(2e-3)
    assert per_call_overhead([(1e6, back_to_back / 2)], link) == 0
