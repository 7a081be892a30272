"""The planner: its candidate space against check_layout, its memory against predict_memory, its
time model's pieces on hand-checked numbers, its JSON and the commands in it, its calibration file
and its bad input. All in this process: no ranks."""
import contextlib
import csv
import gc
import json
import math
import shlex
from dataclasses import replace

import pytest
import torch

from minimind_parallel import cli
from minimind_parallel.config import ConfigError, MiniMindConfig, ParallelConfig, check_layout
from minimind_parallel.memory import predict_memory
from minimind_parallel.memory.analytic.fsdp_replay import check_fully_sharded
from minimind_parallel.memory.analytic.predict import MODELLED_ZERO_LEVELS
from minimind_parallel.planning import Candidate, Hardware, Link, Workload, enumerate_layouts, plan, step_time
from minimind_parallel.planning.hardware import GPU_PROFILES, load_calibration, save_calibration
from minimind_parallel.planning.allocator_rounding import block_excess, fresh_block, rounding_bytes
from minimind_parallel.planning.ranking import paused_collector, workspace_bytes
from minimind_parallel.pipeline_parallel.order import Schedule
from minimind_parallel.planning.space import RULES, check_candidate
from minimind_parallel.planning.time_model import (ADAMW_ACCESSES, Collective, Op, block_matmul_params, expert_params,
                                                   stage_compute)
from minimind_parallel.zero.buckets import DEFAULT_BUCKET_MB
from minimind_parallel.tasks.benchmark.checks import check_benchmark
from test_cli import assert_refused_before_launch

TINY = MiniMindConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=128, tie_word_embeddings=False)
WORK = Workload(model=TINY, seq_len=32, global_batch_size=8, world_size=4)
MOE = replace(TINY, use_moe=True, num_experts=4, num_experts_per_tok=2)
MOE_WORK = replace(WORK, model=MOE)
MOE_ARGS = ["--use_moe", "--num_experts", "4", "--num_experts_per_tok", "2"]
TINY_ARGS = ["--hidden_size", "64", "--num_hidden_layers", "4", "--num_attention_heads", "4",
             "--num_key_value_heads", "2", "--vocab_size", "128", "--seq_len", "32", "--global_batch_size", "8"]


def assert_valid_and_cuts_real(work):
    """Every enumerated layout passes check_layout; every cut is a planner rule's or check_layout's."""
    valid, cuts = enumerate_layouts(work)
    assert len(valid) > 100 and cuts
    for k in valid:
        check_layout(work.model, k.parallel, seq_len=work.seq_len)
        assert k.tp * k.pp * k.cp * k.dp == work.world_size
        assert k.dp * k.num_microbatches * k.micro_batch_size == work.global_batch_size
    for cut in cuts:
        a = {f: getattr(cut.candidate, f) for f in Candidate.GRID}
        rule = next((r for r in (rule.check(work, a) for rule in RULES) if r), None)
        if rule is not None:
            assert cut.reason == rule
            continue
        with pytest.raises(ConfigError) as e:   # check_layout's, the schedule's, or the memory model's
            check_candidate(work, cut.candidate)
        assert str(e.value) == cut.reason
    return valid, cuts


def test_every_layout_passes_check_layout_and_every_cut_names_a_real_constraint():
    valid, cuts = assert_valid_and_cuts_real(WORK)
    # the zero dimension: 0 and 1 wherever dp x cp shards, never on one DP x CP rank
    assert {k.zero for k in valid} == set(MODELLED_ZERO_LEVELS) and all(k.dp * k.cp > 1 for k in valid if k.zero)
    assert {k.ep for k in valid} == {1}                    # a dense model has no experts to spread
    # every rank grid check_layout admits (plain flags) is in the space
    grids = {(k.tp, k.pp, k.cp, k.dp) for k in valid if not k.zero}
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            for cp in (1, 2, 4):
                if WORK.world_size % (tp * pp * cp):
                    continue
                par = ParallelConfig(tp=tp, pp=pp, cp=cp, dp=WORK.world_size // (tp * pp * cp))
                try:
                    check_layout(TINY, par, seq_len=WORK.seq_len)
                except ConfigError:
                    assert (tp, pp, cp, par.dp) not in grids
                    continue
                assert (tp, pp, cp, par.dp) in grids
    names = {c.constraint for c in cuts}
    assert "num_key_value_heads must be divisible by tp_size" in names   # tp 4 > 2 kv heads


def test_the_moe_space_spreads_the_experts_and_its_cuts_are_real():
    valid, cuts = assert_valid_and_cuts_real(MOE_WORK)
    assert {k.ep for k in valid} == {1, 2, 4}
    assert all((k.dp * k.cp) % k.ep == 0 and MOE.num_experts % k.ep == 0 for k in valid)
    assert any(k.zero and k.ep > 1 for k in valid)   # --zero with EP: the experts' slices over EDP
    assert any(k.zero for k in valid)
    names = {c.constraint for c in cuts}
    assert any(k.cp > 1 for k in valid)   # MoE under CP is in the memory model
    # and under interleaved's model chunks (each chunk's aux terms replayed: posted_replay.UnitTerms)
    assert any(k.pp_schedule == Schedule.INTERLEAVED for k in valid)
    # and every layout it keeps is predicted
    result = plan(MOE_WORK, GPU_PROFILES["H100"], device="cpu", budget_bytes=2**40)
    assert len(result.fitting) == len(valid)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_predicted_peak_is_predict_memory_and_on_cuda_the_workspaces(device):
    hw = GPU_PROFILES["H100"]
    result = plan(WORK, hw, device=device, budget_bytes=2**40)
    entries = result.fitting
    assert len(entries) == len(enumerate_layouts(WORK)[0])
    for e in entries[::max(1, len(entries) // 25)]:
        k = e.candidate
        pred = predict_memory(TINY, k.parallel, seq_len=WORK.seq_len, micro_batch_size=k.micro_batch_size,
                              dtype=torch.bfloat16, device=device, num_microbatches=k.num_microbatches,
                              schedule=k.pp_schedule)
        extra = workspace_bytes(hw) + rounding_bytes(pred, k.parallel) if device == "cuda" else 0
        assert e.peak_bytes == pred.peak_bytes + extra
    assert [e.tokens_per_s for e in entries] == sorted((e.tokens_per_s for e in entries), reverse=True)


def _uncached(monkeypatch):
    """The memory model with nothing remembered: each stage's parameters, counts, ZeRO buffer and
    schedule order computed from the full layout every time."""
    from minimind_parallel.memory.analytic import predict, stage_sizes, zero_sizes
    from minimind_parallel.pipeline_parallel.order import schedule_order
    from minimind_parallel.zero.buckets import bucket_numel
    monkeypatch.setattr(stage_sizes, "stage_parameter_counts", stage_sizes.build_stage_parameter_counts)
    monkeypatch.setattr(predict, "zero_layouts", lambda c, par, stage, dtype, mb, model=None: zero_sizes.build_zero_layouts(
        c, par, stage, bucket_numel(mb, dtype)) if par.zero else ())
    monkeypatch.setattr(predict, "stage_order", lambda *a: tuple(schedule_order(*a)))
    monkeypatch.setattr(predict, "stage_releases", predict.stage_releases.__wrapped__)


def _sample(work, every=7):
    """Every `every`-th layout of the space, and a pipeline of model chunks (virtual stages) per zero level."""
    valid = enumerate_layouts(work)[0][::every]
    chunks = [replace(k, pp=2, dp=2, tp=1, sequence_parallel=False, async_communication=False, shared_sp_gather=False)
              for k in valid[:2]]
    return valid, [replace(k.parallel, virtual_stages=2) for k in chunks]


def test_the_remembered_stage_sizes_and_predictions_equal_the_uncached_ones(monkeypatch):
    from minimind_parallel.memory.analytic.stage_sizes import build_stage_parameter_counts, stage_parameter_counts
    from minimind_parallel.memory.analytic.zero_sizes import build_zero_layouts, zero_layouts
    from minimind_parallel.plan import build_stage_parameters, stage_parameters
    from minimind_parallel.zero.buckets import bucket_numel
    for work in (WORK, MOE_WORK):
        c = work.model
        planned, chunked = _sample(work)
        layouts = [k.parallel for k in planned]
        # each remembered size against the same computed from the whole layout (every field set)
        for par in layouts + chunked:
            for stage in range(par.pp):
                experts = range(par.ep)   # a subset of the experts, as an EP rank holds
                assert stage_parameters(c, par, stage) == build_stage_parameters(c, par, stage)
                assert stage_parameters(c, par, stage, experts) == build_stage_parameters(c, par, stage, experts)
                assert stage_parameter_counts(c, par, stage, experts) == build_stage_parameter_counts(c, par, stage, experts)
                zeroed = replace(par, zero=1)
                assert zero_layouts(c, zeroed, stage, torch.bfloat16, 1.0) == build_zero_layouts(
                    c, zeroed, stage, bucket_numel(1.0, torch.bfloat16))
        # a model that differs in one field is another key
        assert stage_parameters(replace(c, num_hidden_layers=8), layouts[0]) != stage_parameters(c, layouts[0])
        # and the predictions, to the byte, with every breakdown and moment
        def predictions():
            return [predict_memory(c, k.parallel, seq_len=work.seq_len, micro_batch_size=k.micro_batch_size,
                                   num_microbatches=k.num_microbatches, schedule=k.pp_schedule, device=device)
                    for k in planned for device in ("cpu", "cuda")]
        remembered = predictions()
        with monkeypatch.context() as m:
            _uncached(m)
            assert predictions() == remembered


def test_the_planners_moments_alone_give_the_full_replays_prediction_to_the_byte():
    """The planner's predictions (worst_only: of each backward its largest moment; of interleaved
    and zb layouts the peak alone, posted_peak.py, the moments remembered as rows over the terms,
    one kind of middle chunk sized once) equal the full replay's of every moment of every stage:
    the peak, breakdown, moment, units in flight, under every schedule and zero level, on CPU and
    CUDA; the moments it keeps are the full replay's."""
    from dataclasses import asdict
    from minimind_parallel.pipeline_parallel.order import Schedule
    work = Workload(model=replace(TINY, num_hidden_layers=8), seq_len=32, global_batch_size=16, world_size=8)
    groups: dict = {}
    for k in enumerate_layouts(work)[0]:
        groups.setdefault((k.pp, k.pp_schedule if k.pp > 1 else None, k.virtual_stages, k.zero), []).append(k)
    sample = [k for g in groups.values() for k in g[::max(1, len(g) // 6)]]    # six of each, spread
    posted = [k for k in sample if k.pp > 1 and k.pp_schedule in (Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE)]
    assert {k.pp for k in posted} == {2, 4, 8} and {k.virtual_stages for k in posted} == {1, 2, 4}
    assert {k.zero for k in posted} == {0, 1, 2, 3} and {k.zero for k in sample} == set(MODELLED_ZERO_LEVELS)
    assert {k.pp_schedule for k in sample if k.pp > 1} == set(Schedule)
    peaks = set()
    for k in sample:
        for device in ("cpu", "cuda"):
            kw = dict(seq_len=work.seq_len, micro_batch_size=k.micro_batch_size, num_microbatches=k.num_microbatches,
                      schedule=k.pp_schedule, device=device)
            every, alone = predict_memory(work.model, k.parallel, **kw), predict_memory(work.model, k.parallel, worst_only=True, **kw)
            assert {**asdict(alone), "candidates": None, "per_stage": None} == \
                {**asdict(every), "candidates": None, "per_stage": None}, k.describe()
            assert max(alone.per_stage) == max(every.per_stage)
            assert all(every.candidates[name] == total for name, total in alone.candidates.items())
            peaks.add(every.peak_at.split("[")[0])
    assert len(peaks) > 2
    # and every action's remembered moment, forwards and W steps too, is the full replay's of its name
    for k in sample[::3]:
        for grads_count in (True, False):
            _assert_rows_are_the_replays(work, k, grads_count)


def _assert_rows_are_the_replays(work, k, grads_count):
    from minimind_parallel.memory.analytic.orders import stage_order, stage_releases
    from minimind_parallel.memory.analytic.posted_peak import posted_moments
    from minimind_parallel.memory.analytic.remembered_sizes import chunk_kinds
    from minimind_parallel.memory.analytic.posted_replay import replay_posted
    from minimind_parallel.memory.analytic.stage_sizes import chunk_sizes, stage_sizes
    kw = dict(seq_len=work.seq_len, micro_batch_size=k.micro_batch_size, num_microbatches=k.num_microbatches,
              dtype=torch.bfloat16)
    par, memo = k.parallel, {}
    for stage in range(k.pp):
        key = (k.pp, stage, k.num_microbatches, k.pp_schedule, k.virtual_stages)
        s = stage_sizes(work.model, par, stage, **kw)
        full, _ = replay_posted(s, chunk_sizes(work.model, par, stage, **kw), stage_order(*key),
                                stage_releases(k.pp, k.num_microbatches, k.pp_schedule, k.virtual_stages)[stage])
        rows = posted_moments(s, chunk_kinds(work.model, par, stage, memo, **kw), key, grads_count)
        assert len(rows) == len(stage_order(*key)) and all(full[name] == moment for name, moment in rows.items())
        assert {name.split("[")[0] for name in rows} >= {"forward_end"} | ({"weight"} if k.pp_schedule == "zb" else set())


def test_the_worst_stages_alone_give_the_same_prediction_as_every_stage():
    """The planner predicts the first, second and last stage only (`candidate_stages`): on every
    pipelined layout of an 8-stage space the peak, breakdown, moment and microbatches in flight are
    those of all the stages, and the moments it keeps (each backward's largest) are theirs. (A
    schedule of model chunks is predicted on every stage.)"""
    from dataclasses import asdict
    work = Workload(model=replace(TINY, num_hidden_layers=8), seq_len=32, global_batch_size=16, world_size=8)
    piped = [k for k in enumerate_layouts(work)[0] if k.pp > 2 and k.pp_schedule in ("gpipe", "1f1b")]
    assert {k.pp for k in piped} == {4, 8} and {k.pp_schedule for k in piped} == {"gpipe", "1f1b"}
    for k in piped[::8]:
        kw = dict(seq_len=work.seq_len, micro_batch_size=k.micro_batch_size, num_microbatches=k.num_microbatches,
                  schedule=k.pp_schedule, device="cuda")
        every, worst = predict_memory(work.model, k.parallel, **kw), predict_memory(work.model, k.parallel, worst_only=True, **kw)
        assert len(worst.per_stage) == 3 and max(worst.per_stage) == max(every.per_stage) == every.peak_bytes
        assert {**asdict(worst), "per_stage": None, "candidates": None} == \
            {**asdict(every), "per_stage": None, "candidates": None}, k.describe()
        assert all(every.candidates[name] == total for name, total in worst.candidates.items())


def test_the_space_plans_every_schedule_and_zero_level_the_memory_model_declares(monkeypatch):
    """The space has the modelled schedules and levels only; once predict.py declares
    zb and every zero level modelled, they are enumerated, interleaved with its virtual_stages dimension, under
    check_layout's and check_schedule's constraints."""
    from minimind_parallel.memory.analytic.predict import MODELLED_SCHEDULES, MODELLED_ZERO_LEVELS
    from minimind_parallel.pipeline_parallel.order import Schedule, check_schedule
    from minimind_parallel.planning import space
    valid = enumerate_layouts(WORK)[0]
    assert {k.pp_schedule for k in valid if k.pp > 1} == set(MODELLED_SCHEDULES)
    assert {k.zero for k in valid} == set(MODELLED_ZERO_LEVELS)
    assert ({k.virtual_stages for k in valid} != {1}) == (Schedule.INTERLEAVED in MODELLED_SCHEDULES)
    monkeypatch.setattr(space, "MODELLED_SCHEDULES", tuple(Schedule))
    monkeypatch.setattr(space, "MODELLED_ZERO_LEVELS", (0, 1, 2))
    work = replace(WORK, model=replace(TINY, num_hidden_layers=8), global_batch_size=12)
    valid, cuts = enumerate_layouts(work)
    piped = [k for k in valid if k.pp > 1]
    assert {k.pp_schedule for k in piped} == set(Schedule) and {k.zero for k in valid} == {0, 1, 2}
    chunked = [k for k in piped if k.pp_schedule == Schedule.INTERLEAVED]
    # every V >= 2 dividing each stage's layers (8 / pp), and M a multiple of pp (Megatron-LM's groups)
    assert {(k.pp, k.virtual_stages) for k in chunked} == {(2, 2), (2, 4), (4, 2)}
    assert all(k.num_microbatches % k.pp == 0 for k in chunked)
    assert all(k.virtual_stages == 1 for k in valid if k.pp_schedule != Schedule.INTERLEAVED or k.pp == 1)
    for k in valid:
        check_layout(work.model, k.parallel, seq_len=work.seq_len)
        if k.pp > 1:
            check_schedule(k.pp_schedule, k.parallel, k.num_microbatches)
    reasons = {c.constraint for c in cuts}
    # --zero 2 under every schedule (the posted orders: staging buffers made up front, zero/staging.py)
    assert {k.pp_schedule for k in piped if k.zero == 2} == set(Schedule)
    assert "--pp_schedule interleaved needs num_microbatches a multiple of pp_size (Megatron-LM's groups of P " \
           "microbatches per chunk)" in reasons
    # each chunked layout's commands carry its chunks
    from minimind_parallel.tasks.plan import flag_argv
    argv = flag_argv(chunked[0])
    assert argv[argv.index("--virtual_stages") + 1] == str(chunked[0].virtual_stages)


def test_the_space_plans_zero_3_where_its_replay_is_exact_and_cuts_the_rest_in_its_line():
    """--zero 3 layouts are planned where predict_memory follows FSDP2 (fsdp_replay.check_fully_sharded),
    the others cut with its one-line reason (check_candidate): few tokens per microbatch (dp4: one
    32-token row per rank, H 64) planned where it follows them, cut under SP without the async linear
    or --recompute, and the MoE model while it refuses that."""
    few = replace(WORK, global_batch_size=4)
    valid, cuts = enumerate_layouts(few)
    sharded = [k for k in valid if k.zero == 3]
    tokens = {k: few.seq_len // k.cp * k.micro_batch_size for k in sharded}
    assert sharded and not any(_refused(lambda k=k: check_fully_sharded(TINY, k.parallel, tokens[k])) for k in sharded)
    assert any(n < TINY.hidden_size for n in tokens.values())
    refused = [c for c in cuts if c.candidate.zero == 3 and c.candidate.pp == 1 and _runs(few, c.candidate)]
    assert refused and all(len(c.reason.splitlines()) == 1 for c in refused)
    for cut in refused:
        k = cut.candidate
        with pytest.raises(NotImplementedError) as e:
            check_fully_sharded(TINY, k.parallel, few.seq_len // k.cp * k.micro_batch_size)
        assert cut.reason == str(e.value)
    moe_valid, moe_cuts = enumerate_layouts(MOE_WORK)
    if _refused(lambda: check_fully_sharded(MOE, ParallelConfig(dp=4, zero=3), 2**20)):
        assert not [k for k in moe_valid if k.zero == 3] and [c for c in moe_cuts if c.candidate.zero == 3]


def test_the_cuda_peak_rounds_each_held_tensor_to_the_block_a_fresh_segment_gives_it():
    """The allocator model's first block for a request (memory/allocator.py) is `fresh_block`; a [N, I/T]
    SwiGLU output of the book's first layout (N 8192, I/T 1216, bf16: 19 MiB) holds its 20 MiB
    segment whole, a 12 MiB [N, H] input exactly 12 MiB; the peak adds each held block's excess."""
    from minimind_parallel.memory.allocator import CachingAllocatorModel
    mib = 2**20
    for n in (100, 512, 600_000, 6 * mib, 9 * mib + 123, 10 * mib + mib // 2, 11 * mib + mib // 5, 12 * mib,
              19 * mib, 8192 * 1216 * 2, 24 * mib + 1):
        assert CachingAllocatorModel().malloc(n).size == fresh_block(n), n
    assert fresh_block(8192 * 1216 * 2) == 20 * mib and fresh_block(8192 * 768 * 2) == 12 * mib
    book = MiniMindConfig(hidden_size=768, num_hidden_layers=32, num_attention_heads=8, num_key_value_heads=4,
                          vocab_size=6400, tie_word_embeddings=False)
    par = ParallelConfig(tp=2, dp=4, zero=1, async_communication=True, vocab_parallel=True, loss_chunks=8)
    pred = predict_memory(book, par, seq_len=2048, micro_batch_size=4, device="cuda")
    assert block_excess(pred.activations_by_kind, par) == 4 * mib          # the SwiGLU's four outputs
    assert rounding_bytes(pred, par) == 32 * 4 * mib                        # on each of the 32 layers
    lean = replace(par, recompute="selective")
    assert block_excess(predict_memory(book, lean, seq_len=2048, micro_batch_size=4).activations_by_kind,
                        lean) == 2 * mib                                    # gate and up, re-made the rest
    full = replace(par, recompute="full")                                   # a block holds its input alone
    assert block_excess(predict_memory(book, full, seq_len=2048, micro_batch_size=4).activations_by_kind,
                        full) == fresh_block(2 * 8192 * 768) - 2 * 8192 * 768 == 0


def test_a_budget_cuts_the_layouts_over_it_by_their_peak():
    everything = plan(WORK, GPU_PROFILES["H100"], device="cuda", budget_bytes=2**40).fitting
    peaks = sorted(e.peak_bytes for e in everything)
    budget = peaks[len(peaks) // 2]
    result = plan(WORK, GPU_PROFILES["H100"], device="cuda", budget_bytes=budget)
    assert result.fitting and result.over_budget
    assert all(e.peak_bytes <= budget for e in result.fitting) and all(e.peak_bytes > budget for e in result.over_budget)
    assert len(result.fitting) + len(result.over_budget) == len(everything)


# ---------------------------------------------------------------- the time model's pieces

LINK = Link(latency_s=1e-5, bandwidth=1e9)
SLOW = Hardware(name="test", source="hand-checked", gemm_flops=1e12, attention_flops=5e11, memory_bandwidth=1e11,
                op_overhead_s=0.0, peak_flops=2e12, intra=LINK, inter=Link(latency_s=1e-4, bandwidth=1e8),
                async_dispatch=False)


def test_a_collective_costs_its_ring_steps_latency_and_bytes():
    n = 1e6
    # all-reduce over 4: 2 x 3 steps, each a latency and a quarter of the bytes
    assert Collective(Op.ALL_REDUCE, n, 4).seconds(LINK) == pytest.approx(6 * (1e-5 + 0.25e6 / 1e9))
    assert Collective(Op.ALL_GATHER, n, 4).seconds(LINK) == pytest.approx(3 * (1e-5 + 0.25e6 / 1e9))
    assert Collective(Op.P2P, n, 2).seconds(LINK) == pytest.approx(1e-5 + 1e-3)
    assert Collective(Op.ALL_REDUCE, n, 1).seconds(LINK) == 0


def test_the_forward_gemm_time_is_the_blocks_flops_at_the_rate():
    k = Candidate(tp=2, micro_batch_size=2)
    hw = replace(SLOW, attention_flops=math.inf, memory_bandwidth=math.inf)
    fwd, bwd = stage_compute(TINY, k, WORK, hw, last=False)
    per_block = 64 * (2 * 64 + 2 * 32) + 3 * 64 * TINY.intermediate_size   # q, o + k, v + gate, up, down
    assert block_matmul_params(TINY) == per_block
    assert fwd == pytest.approx(4 * 2 * (2 * 32) * per_block / 2 / 1e12)     # layers x 2 FLOPs x tokens x params / T
    assert bwd == pytest.approx(2 * fwd)


def test_the_bubble_is_p_minus_1_microbatch_times_and_overlaps_hide_communication():
    # no memory-bound traffic: its backward is not twice its forward (BLOCK_TRAFFIC), the GEMMs' are
    hw = replace(SLOW, intra=Link(latency_s=0.0, bandwidth=math.inf), memory_bandwidth=math.inf)
    k = Candidate(pp=4, dp=1, num_microbatches=4, micro_batch_size=2)
    t = step_time(k, replace(WORK, world_size=4), hw, stage_params=1000)
    assert t.bubble == pytest.approx(3 / 4 * t.compute)      # (P - 1) / M of the compute: (4 - 1) / 4
    sync = Candidate(tp=2, dp=2, sequence_parallel=True, micro_batch_size=2)
    a = step_time(sync, WORK, SLOW, stage_params=1000)
    b = step_time(replace(sync, async_communication=True), WORK, SLOW, stage_params=1000)
    assert a.tp_exposed > 0 and b.compute == a.compute
    # async: the backward's reduce-scatters hide behind the weight grads (its re-gathers are added):
    # with weight grads slower than the reduce-scatters, only the re-gathers are left
    slow_gemm = replace(SLOW, gemm_flops=1e6)
    a, b = (step_time(x, WORK, slow_gemm, stage_params=1000) for x in (sync, replace(sync, async_communication=True)))
    assert b.tp_exposed < a.tp_exposed
    # ring: each K/V pass hides behind a block of attention; with attention free it is all exposed
    ring = Candidate(cp=4, dp=1, cp_comm_type="ring", micro_batch_size=8)
    free = replace(SLOW, attention_flops=1e20, gemm_flops=1e20, memory_bandwidth=1e20)
    r, r_free = (step_time(ring, WORK, hw, stage_params=1000) for hw in (SLOW, free))
    assert r_free.cp_exposed > r.cp_exposed


def test_interleaved_divides_the_bubble_by_its_chunks_and_zb_fills_it_with_weight_grads():
    """1F1B idles (P - 1) microbatches; interleaved over V chunks (P - 1) / V of them (Narayanan et
    al. 2021); ZB-H1 (P - 1) forwards, the weight-grad half of each backward filling the rest (Qi et al.
    2023)."""
    from minimind_parallel.pipeline_parallel.order import Schedule
    # no memory-bound traffic: its backward is not twice its forward (BLOCK_TRAFFIC), the GEMMs' are
    hw = replace(SLOW, intra=Link(latency_s=0.0, bandwidth=math.inf), memory_bandwidth=math.inf)
    k = Candidate(pp=4, dp=1, num_microbatches=4, micro_batch_size=2)
    work = replace(WORK, model=replace(TINY, num_hidden_layers=8))
    plain, chunked, zb = (step_time(x, work, hw, stage_params=1000) for x in
                          (k, replace(k, pp_schedule=Schedule.INTERLEAVED, virtual_stages=2),
                           replace(k, pp_schedule=Schedule.ZERO_BUBBLE)))
    per_mb = plain.parts["per_microbatch_ms"] / 1e3
    assert plain.bubble == pytest.approx(3 * per_mb) and chunked.bubble == pytest.approx(3 * per_mb / 2)
    assert plain.bubble / 3 < zb.bubble < plain.bubble   # B (attention's backward, every dgrad) outlasts W
    assert chunked.compute == plain.compute == zb.compute


@pytest.mark.parametrize("model, recompute", [(TINY, "none"), (TINY, "selective"), (MOE, "none")])
def test_zbs_bubble_is_its_orders_simulated_at_the_stages_own_b_and_w(model, recompute):
    """ZB-H1's bubble from the stage's own F, B and W (Qi et al. 2023: (P - 1)(T_F + T_B - T_W)),
    not B = W: the zb orders run together (`order.simulate`) at the time model's F, B = backward -
    W and W idle for exactly the predicted bubble. The MoE layer's router and experts keep their
    weight grads in B (W holds attention's alone), selective recompute the SwiGLU's down_proj."""
    from minimind_parallel.pipeline_parallel.order import Step, schedule_order, simulate
    from minimind_parallel.planning.time_model import weight_step_seconds
    hw = replace(SLOW, intra=Link(latency_s=0.0, bandwidth=math.inf))   # free exchanges: F, B, W alone
    k = Candidate(pp=4, dp=1, num_microbatches=8, micro_batch_size=2, recompute=recompute,
                  pp_schedule=Schedule.ZERO_BUBBLE)
    work = replace(WORK, model=replace(model, num_hidden_layers=8))
    t = step_time(k, work, hw, stage_params=1000)
    f, bwd = t.parts["forward_ms"] / 1e3, t.parts["backward_ms"] / 1e3
    w = weight_step_seconds(work.model, k, work, hw, last=True)
    assert 0 < w < bwd / 2
    orders = [schedule_order(4, p, 8, Schedule.ZERO_BUBBLE) for p in range(4)]
    spans = simulate(orders, 4, times={Step.FORWARD: f, Step.BACKWARD: bwd - w, Step.WEIGHT: w})
    makespan = max(end for s in spans for _, end in s)
    assert t.bubble == pytest.approx(makespan - 8 * (f + bwd))


def test_zero_1_reduce_scatters_and_all_gathers_each_bucket_instead_of_the_all_reduce():
    bucket = int(DEFAULT_BUCKET_MB * 2**20) // 2               # elements of one bf16 bucket
    params = 2 * bucket                                          # two buckets
    ddp = Candidate(dp=4, micro_batch_size=2)
    for pp in (1, 2):
        k = replace(ddp, pp=pp, dp=2, num_microbatches=2, micro_batch_size=2) if pp > 1 else ddp
        g = k.dp * k.cp
        plain, zero = (step_time(replace(k, zero=z), WORK, SLOW, stage_params=params) for z in (0, 1))
        half = bucket * 2                                        # one bucket's bytes
        per_bucket = (Collective(Op.REDUCE_SCATTER, half, g).seconds(LINK)
                      + Collective(Op.ALL_GATHER, half, g).seconds(LINK))
        assert zero.dp_exposed == pytest.approx(2 * per_bucket)  # both exposed: after the last microbatch, the step
        all_reduce = Collective(Op.ALL_REDUCE, params * 2, g).seconds(LINK)
        bwd = k.num_microbatches * plain.parts["backward_ms"] / 1e3
        assert plain.dp_exposed == pytest.approx(max(0.0, all_reduce - bwd) if pp == 1 else all_reduce)
        # on a CPU (gloo on the rank's own cores) nothing hides behind the backward
        cpu = step_time(k, WORK, replace(SLOW, overlaps_communication=False), stage_params=params)
        assert cpu.dp_exposed == pytest.approx(all_reduce)
        # AdamW steps this rank's slice, one tensor per bucket
        assert zero.optimizer == pytest.approx(params / g * ADAMW_ACCESSES * 2 / SLOW.memory_bandwidth)
        assert plain.optimizer == pytest.approx(params * ADAMW_ACCESSES * 2 / SLOW.memory_bandwidth)
        dispatch = replace(SLOW, op_overhead_s=1e-6, memory_bandwidth=math.inf)   # 10 ops per tensor stepped
        plain, zero = (step_time(replace(k, zero=z), WORK, dispatch, stage_params=params) for z in (0, 1))
        assert zero.optimizer == pytest.approx(10 * 2 * 1e-6)                        # the two buckets' slices
        assert plain.optimizer == pytest.approx(10 * (4 // pp * 11 + 2) * 1e-6)      # every parameter tensor


def test_the_experts_cost_their_routed_rows_and_ep_its_all_to_alls():
    hw = replace(SLOW, attention_flops=math.inf, memory_bandwidth=math.inf)
    k = Candidate(dp=4, micro_batch_size=2)
    top1, top2 = (stage_compute(replace(MOE, num_experts_per_tok=e), k, WORK, hw, last=False)[0] for e in (1, 2))
    tokens = 2 * 32
    # one more routed row per token: 4 layers x 2 FLOPs x tokens x one expert's matrices
    assert top2 - top1 == pytest.approx(4 * 2 * tokens * expert_params(MOE) / 1e12)
    dense_mlp = 3 * 64 * MOE.intermediate_size
    assert block_matmul_params(TINY) - block_matmul_params(MOE) == dense_mlp
    # EP per MoE layer: the counts, the tokens out and back forward and backward, the aux statistics
    ep = replace(k, ep=2)
    t, t1 = (step_time(x, MOE_WORK, SLOW, stage_params=1000) for x in (ep, k))
    rows = tokens * 2 * 64 * 2                                   # N k H b
    stats = Collective(Op.ALL_REDUCE, (2 * 4 + 1) * 4, 4).seconds(LINK)
    expect = 4 * (Collective(Op.ALL_TO_ALL, 8 * 4, 2).seconds(LINK)
                  + 4 * Collective(Op.ALL_TO_ALL, rows, 2).seconds(LINK) + stats)
    assert t.ep_exposed == pytest.approx(expect) and t1.ep_exposed == pytest.approx(4 * stats)
    # the experts' grads reduce over their EDP group (dp x cp / ep): fewer ranks than the dense grads'
    pp_ep = replace(ep, pp=2, dp=2, ep=2, num_microbatches=2)
    dense, experts = (step_time(pp_ep, MOE_WORK, SLOW, stage_params=10**6, expert_params=e) for e in (0, 10**6))
    assert experts.dp_exposed == pytest.approx(Collective(Op.ALL_REDUCE, 2e6, 1).seconds(LINK)) == 0
    assert dense.dp_exposed == pytest.approx(Collective(Op.ALL_REDUCE, 2e6, 2).seconds(LINK))


def test_a_group_wider_than_a_node_takes_the_slower_link():
    two_nodes = replace(WORK, nnodes=2)
    k = Candidate(tp=4, micro_batch_size=8)
    inside, across = (step_time(k, w, SLOW, stage_params=1000) for w in (WORK, two_nodes))
    assert across.tp_exposed > inside.tp_exposed > 0


# ---------------------------------------------------------------- the time model's counts, against OpCount

def _counted_block(c: MiniMindConfig, tokens: int):
    """OpCount of MiniMind's block, forward then backward, over one row of `tokens` tokens (float32)."""
    from minimind_parallel.model import MiniMindBlock, rope_tables
    from minimind_parallel.planning.op_count import OpCount
    torch.manual_seed(0)
    block = MiniMindBlock(c)
    cos, sin = rope_tables(c.head_dim, tokens, c.rope_theta)
    h = torch.randn(1, tokens, c.hidden_size, requires_grad=True)
    with OpCount() as n:
        n.phase = "forward"
        out = block(h, cos, sin)
        n.phase = "backward"
        out.backward(torch.ones_like(out))
    return n


@pytest.mark.parametrize("model, recompute", [(TINY, "none"), (TINY, "selective"), (MOE, "none")])
def test_a_zb_w_step_runs_the_weight_grad_gemms_the_time_model_puts_in_w(model, recompute):
    """OpCount of the parallel block's zb B and W steps (a WeightGradStore attached, TP 1): W's GEMM
    FLOPs, GEMMs and ops are `weight_step_seconds`' (at one FLOP and one op a second), B holds the
    rest of the backward's FLOPs (twice the forward's): for the MoE model W is attention's alone."""
    from minimind_parallel.model import rope_tables
    from minimind_parallel.parallel_model import ParallelBlock
    from minimind_parallel.planning.op_count import OpCount
    from minimind_parallel.planning.time_model import OPS_PER_DEFERRED_WGRAD, deferred_linears, weight_step_seconds
    from minimind_parallel.tensor_parallel.deferred_wgrad import WeightGradStore, attach_weight_grad_store
    c, k = replace(model, num_hidden_layers=1), Candidate(micro_batch_size=2, recompute=recompute)
    torch.manual_seed(0)
    block, store = ParallelBlock(c, k.parallel, None), WeightGradStore()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    attach_weight_grad_store(block, store)
    cos, sin = rope_tables(c.head_dim, WORK.seq_len, c.rope_theta)
    h = torch.randn(WORK.seq_len, 2, c.hidden_size, requires_grad=True)      # [S, B, H]
    with OpCount() as n:
        n.phase = "F"
        out = block(h, cos, sin)
        n.phase = "B"
        with store.collecting((0, 0)):
            out.backward(torch.ones_like(out))
        n.phase = "W"
        store.run((0, 0))
    work = replace(WORK, model=c)
    flops = replace(SLOW, gemm_flops=1.0, op_overhead_s=0.0)
    assert n.gemm_flops["W"] == weight_step_seconds(c, k, work, flops, last=False)
    count = deferred_linears(c, k)[0]
    assert n.gemm_ops["W"] == count and n.ops("W") - 1 == count * OPS_PER_DEFERRED_WGRAD   # and one grad's copy
    assert n.gemm_flops["B"] + n.gemm_flops["W"] == 2 * n.gemm_flops["F"] or recompute != "none"
    assert (n.gemm_flops["W"] < n.gemm_flops["B"] / 4) == c.use_moe


@pytest.mark.parametrize("shape", [dict(num_attention_heads=4, num_key_value_heads=2),                  # GQA
                                   dict(num_attention_heads=4, num_key_value_heads=4),                  # no repeat
                                   dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, hidden_size=96,
                                        intermediate_size=160)])
def test_a_blocks_memory_bound_traffic_is_the_bytes_its_ops_read_and_write(shape):
    """BLOCK_TRAFFIC, at the block's widths, is every elementwise / reduction / copy op's input and
    output bytes that OpCount sees in MiniMind's block, forward and backward, to the byte."""
    from minimind_parallel.planning.time_model import block_traffic
    c = replace(TINY, **shape)
    tokens = 24
    n = _counted_block(c, tokens)
    fwd, bwd = block_traffic(c, tokens, tp=1, sequence_parallel=False)
    assert (4 * fwd, 4 * bwd) == (n.elementwise_bytes["forward"], n.elementwise_bytes["backward"])
    # and its GEMMs are the block's matrices: 2 x tokens x params forward, twice that backward
    assert n.gemm_flops["forward"] == 2 * tokens * block_matmul_params(c)
    assert n.gemm_flops["backward"] == 2 * n.gemm_flops["forward"]


def test_adamw_reads_and_writes_its_counted_accesses_per_element():
    """ADAMW_ACCESSES: the bytes of training.make_optimizer's AdamW step (foreach off) per element."""
    from minimind_parallel.planning.op_count import OpCount
    from minimind_parallel.training import make_optimizer
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 20, bias=False))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer = make_optimizer(model, 1e-3)
    optimizer.step()
    with OpCount() as n:
        optimizer.step()
    elements = sum(p.numel() for p in model.parameters())
    # each tensor's step count (a 0-dim float32) is read and written besides its elements
    assert n.total(n.elementwise_bytes) // 4 - ADAMW_ACCESSES * elements < 4 * 8 * len(list(model.parameters()))
    assert n.total(n.elementwise_bytes) // 4 >= ADAMW_ACCESSES * elements


@pytest.mark.parametrize("cp,load_balance", [(2, True), (2, False), (4, True), (3, False)])
def test_cp_attention_costs_its_busiest_ranks_chunk_pairs(cp, load_balance):
    """chunk_pairs / blockwise_attention_flops: the visible chunk pairs of the busiest CP rank
    (context_parallel/layout.py's chunks), and the FLOPs its blockwise attention's matmuls run
    (OpCount), forward; OPS_PER_CHUNK_PAIR its ops per pair (within 10 %: merges and masks vary)."""
    from minimind_parallel.context_parallel import ContextLayout
    from minimind_parallel.context_parallel.blockwise import ChunkedAttention, visible_pairs
    from minimind_parallel.planning.op_count import OpCount
    from minimind_parallel.planning.time_model import OPS_PER_CHUNK_PAIR, blockwise_attention_flops, chunk_pairs
    seq, kv, rep, d = 48, 2, 2, 8
    layout = ContextLayout.of(ParallelConfig(cp=cp, cp_load_balance=load_balance), seq)
    every = [x for r in range(cp) for x in layout.chunks(r)]
    busiest = max(range(cp), key=lambda r: len(visible_pairs(layout.chunks(r), every)))
    pairs, share = chunk_pairs(cp, load_balance)
    assert pairs == len(visible_pairs(layout.chunks(busiest), every)) and share * seq == layout.chunk_len
    mine = layout.chunks(busiest)
    q = torch.randn(1, kv, rep, len(mine) * layout.chunk_len, d, requires_grad=True)
    k, v = (torch.randn(1, kv, 1, seq, d, requires_grad=True) for _ in range(2))
    with OpCount() as n:
        n.phase = "forward"
        out = ChunkedAttention.apply(q, k, v, mine, tuple(every))
        n.phase = "backward"
        out.backward(torch.ones_like(out))
    assert n.gemm_flops["forward"] == blockwise_attention_flops(1, seq, kv * rep * d, cp=cp, load_balance=load_balance)
    assert n.ops("forward") + n.ops("backward") == pytest.approx(pairs * OPS_PER_CHUNK_PAIR, rel=0.1)


def test_on_a_cpu_every_collective_is_exposed_and_full_recompute_reruns_the_forwards():
    """overlaps_communication False (a CPU: gloo on the rank's own cores): ring CP's K/V passes and
    async TP's backward collectives add in full; --recompute full runs the forward's collectives
    again, but for the block's last (the MLP's row-parallel reduce, whose output no op saves)."""
    from minimind_parallel.planning.time_model import (context_collectives, head_collectives, seconds,
                                                       step_collectives, tensor_collectives)
    from minimind_parallel.config import CPCommType, Recompute
    cpu = replace(SLOW, overlaps_communication=False)
    layers = TINY.num_hidden_layers
    ring = Candidate(cp=2, dp=2, micro_batch_size=2, cp_comm_type=CPCommType.RING)
    fwd, bwd = context_collectives(TINY, ring, WORK)
    assert (len(fwd), len(bwd)) == (1, 3)                    # K/V forward; K/V and twice dK/dV backward
    _, per_step, _ = step_collectives(TINY, ring, WORK)       # the loss normalisation's two scalars
    gpu_t, cpu_t = (step_time(ring, WORK, hw, stage_params=1000) for hw in (SLOW, cpu))
    assert cpu_t.cp_exposed == pytest.approx(layers * (seconds(fwd, LINK) + seconds(bwd, LINK))
                                             + seconds(per_step, LINK))
    assert gpu_t.cp_exposed < cpu_t.cp_exposed
    full = step_time(replace(ring, recompute=Recompute.FULL), WORK, cpu, stage_params=1000)
    assert full.cp_exposed == pytest.approx(layers * (2 * seconds(fwd, LINK) + seconds(bwd, LINK))
                                            + seconds(per_step, LINK))
    tp = Candidate(tp=2, dp=2, micro_batch_size=2, sequence_parallel=True, async_communication=True)
    tf, overlap, rest = tensor_collectives(TINY, tp, WORK)
    head = sum(head_collectives(TINY, tp, WORK), [])
    partial, _, _ = step_collectives(TINY, tp, WORK)
    assert step_time(tp, WORK, cpu, stage_params=1000).tp_exposed == pytest.approx(
        layers * (seconds(tf, LINK) + seconds(overlap, LINK) + seconds(rest, LINK)) + seconds(head + partial, LINK))
    again = step_time(replace(tp, recompute=Recompute.FULL), WORK, cpu, stage_params=1000).tp_exposed
    assert again == pytest.approx(step_time(tp, WORK, cpu, stage_params=1000).tp_exposed
                                  + layers * seconds(tf[:-1], LINK))


def test_zero_3_gathers_each_block_twice_and_scatters_its_grads_per_microbatch():
    """--zero 3 (FSDP2): per microbatch every unit (block, root) all-gathered for its forward, every
    block again for its backward, every unit's grads reduce-scattered; exposed on a CPU, hidden
    behind the compute on a GPU; AdamW steps this rank's 1/(dp x cp)."""
    cpu = replace(SLOW, overlaps_communication=False)
    params, layers = 40_000, TINY.num_hidden_layers
    k = Candidate(dp=4, micro_batch_size=1, num_microbatches=2, zero=3)
    units, each = layers + 1, params * 2 / (layers + 1)
    gather, scatter = (Collective(op, each, 4).seconds(LINK) for op in (Op.ALL_GATHER, Op.REDUCE_SCATTER))
    t = step_time(k, WORK, cpu, stage_params=params)
    assert t.dp_exposed == pytest.approx(2 * (units * gather + layers * gather + units * scatter))
    assert step_time(k, WORK, replace(SLOW, gemm_flops=1e6), stage_params=params).dp_exposed == 0   # hidden
    assert t.optimizer == pytest.approx(params / 4 * ADAMW_ACCESSES * 2 / SLOW.memory_bandwidth)


def _counted_fsdp2_collectives(monkeypatch) -> dict:
    """FSDP2's all-gathers and reduce-scatters (distributed/comm.py) counted from now on: their calls,
    and the bytes of the gathered outputs and of the unsharded grads they scatter."""
    from minimind_parallel.distributed import comm
    counted = {"calls": 0, "bytes": 0}

    def counting(collective, measured):
        def run(out, x, group, *args):
            counted["calls"] += 1
            counted["bytes"] += measured(out, x).numel() * measured(out, x).element_size()
            return collective(out, x, group, *args)
        return run

    monkeypatch.setattr(comm, "all_gather_into", counting(comm.all_gather_into, lambda out, x: out))
    monkeypatch.setattr(comm, "reduce_scatter_into", counting(comm.reduce_scatter_into, lambda out, x: x))
    return counted


def test_zero_3s_step_time_gathers_what_a_counted_fsdp2_step_gathers(monkeypatch):
    """The planner's --zero 3 step (ranking.evaluate) against the collectives of a fake FSDP2 step
    counted at FSDP2's all-gather and reduce-scatter hooks: the same bytes (the unsharded parameters
    gathered once in forward, the blocks' again in backward, every grad reduce-scattered once: not
    this rank's shards) and the same calls; AdamW steps this rank's shards (divided once)."""
    from minimind_parallel.config import DTYPES
    from minimind_parallel.memory.estimate import estimate_step_memory
    from minimind_parallel.planning.ranking import evaluate
    k = Candidate(dp=4, micro_batch_size=2, zero=3)
    counted = _counted_fsdp2_collectives(monkeypatch)
    dtype = DTYPES[WORK.dtype]
    estimate_step_memory(TINY, k.parallel, seq_len=WORK.seq_len, micro_batch_size=2, dtype=dtype, iters=1)
    assert counted["calls"] == 2 * TINY.num_hidden_layers + 1 + TINY.num_hidden_layers + 1
    g, b = k.dp, dtype.itemsize
    for link, expected in ((Link(latency_s=0.0, bandwidth=1e9), (g - 1) / g * counted["bytes"] / 1e9),
                           (Link(latency_s=1e-3, bandwidth=1e30), counted["calls"] * (g - 1) * 1e-3)):
        cpu = replace(SLOW, overlaps_communication=False, intra=link, inter=link)
        t = evaluate(k, WORK, cpu, "cpu", 1.0).time
        assert t.dp_exposed == pytest.approx(expected, rel=1e-9)
    shards = predict_memory(TINY, k.parallel, seq_len=WORK.seq_len, micro_batch_size=2, dtype=dtype).breakdown[
        "params"] // b - 2 * TINY.max_position_embeddings * TINY.head_dim
    assert t.optimizer == pytest.approx(shards * ADAMW_ACCESSES * b / SLOW.memory_bandwidth, rel=1e-9)


def test_a_zero_3_pipeline_stage_is_planned_with_its_gathers_counted_once(monkeypatch):
    """--zero 3 under PP (zero/fully_shard.py: reshard_after_forward False, one reduce-scatter per unit
    after the schedule): the planner plans the layout, and its step (ranking.evaluate) against the
    collectives of the last stage's fake FSDP2 step over 4 microbatches, counted at FSDP2's
    all-gather and reduce-scatter hooks: every unit gathered once and reduce-scattered once, not per
    microbatch -- the same calls and bytes."""
    from minimind_parallel.config import DTYPES
    from minimind_parallel.memory.estimate import estimate_step_memory
    from minimind_parallel.planning.ranking import evaluate
    k = Candidate(dp=2, pp=2, micro_batch_size=1, num_microbatches=4, zero=3, pp_schedule=Schedule.ONE_F_ONE_B)
    check_candidate(WORK, k)
    assert any(v.zero == 3 and v.pp == 2 for v in enumerate_layouts(WORK)[0])
    counted = _counted_fsdp2_collectives(monkeypatch)
    dtype = DTYPES[WORK.dtype]
    estimate_step_memory(TINY, k.parallel, seq_len=WORK.seq_len, micro_batch_size=1, dtype=dtype, iters=1,
                         num_microbatches=4, stage=1)
    units = TINY.num_hidden_layers // 2 + 1   # the stage's blocks and its root (the final norm, the head)
    assert counted["calls"] == 2 * units
    g = k.dp
    for link, expected in ((Link(latency_s=0.0, bandwidth=1e9), (g - 1) / g * counted["bytes"] / 1e9),
                           (Link(latency_s=1e-3, bandwidth=1e30), counted["calls"] * (g - 1) * 1e-3)):
        cpu = replace(SLOW, overlaps_communication=False, intra=link, inter=link)
        assert evaluate(k, WORK, cpu, "cpu", 1.0).time.dp_exposed == pytest.approx(expected, rel=1e-9)


def test_the_calibration_measures_at_the_workloads_shapes_and_old_files_still_load(tmp_path):
    """compute_rates at a tiny workload's block and sequence (every rate measured, positive); a
    calibration file written before the CP blockwise rate and the overlap flag existed loads with
    their defaults (a GPU's: overlapping; CP's attention at the fused rate)."""
    from minimind_parallel.planning.calibrate import Shapes, compute_rates
    rates = compute_rates("cpu", torch.float32, Shapes(model=TINY, seq=32))
    assert set(rates) == {"gemm_flops", "attention_flops", "blockwise_attention_flops", "memory_bandwidth",
                          "op_overhead_s"} and all(0 < v < math.inf for v in rates.values())
    measured = replace(SLOW, overlaps_communication=False, blockwise_attention_flops=1e9)
    save_calibration(measured, str(tmp_path / "new.json"))
    assert load_calibration(str(tmp_path / "new.json")) == measured
    old = {k: v for k, v in SLOW.to_json().items() if k not in ("overlaps_communication", "blockwise_attention_flops")}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    hw = load_calibration(str(path))
    assert hw.overlaps_communication and hw.blockwise_rate == SLOW.attention_flops


# ---------------------------------------------------------------- the task

def run_plan(tmp_path, *extra):
    out = tmp_path / "plan.json"
    code = cli.main(["plan", "--", "--world_size", "4", "--device", "cuda", "--device_memory_gib", "24",
                     *TINY_ARGS, "--output_json", str(out), *extra])
    return code, out


def test_the_json_has_every_field_and_its_commands_run(tmp_path, capsys):
    code, out = run_plan(tmp_path)
    printed = capsys.readouterr().out
    assert code == 0 and (tmp_path / "plan.png").stat().st_size > 0
    data = json.loads(out.read_text())
    layouts = data["layouts"]
    assert layouts and data["candidates"] == len(layouts) + sum(c["layouts"] for c in data["cut"])
    for row in layouts:
        assert {"tp", "pp", "cp", "dp", "ep", "zero", "flags", "predicted_peak_mib", "predicted_step_ms",
                "train_command", "estimate_command"} <= set(row)
        assert row["tp"] * row["pp"] * row["cp"] * row["dp"] == 4 and row["ep"] == 1 and row["zero"] in MODELLED_ZERO_LEVELS
    assert {r["zero"] for r in layouts} == set(MODELLED_ZERO_LEVELS)
    assert [r["predicted_step_ms"] for r in layouts] == sorted(r["predicted_step_ms"] for r in layouts)
    assert "cut:" in printed and "num_key_value_heads must be divisible by tp_size" in printed
    assert_commands_are_the_layouts(layouts)
    # the first layout's estimate: the allocator-level peak of the same cell, within 1 % of the plan's
    first = layouts[0]
    csv_path = tmp_path / "estimate.csv"
    assert cli.main([*shlex.split(first["estimate_command"])[3:], "--output_csv", str(csv_path)]) == 0
    (cell,) = list(csv.DictReader(open(csv_path)))
    assert abs(float(cell["cuda_allocated_mib"]) - first["predicted_peak_mib"]) <= 0.01 * first["predicted_peak_mib"]
    # a --zero 3 (FSDP2) row too: its estimate's tensors are the plan's to the byte (the plan's on CUDA: AdamW's
    # step counters on the host), its allocator peak within 1 %
    sharded, csv_path = next(r for r in layouts if r["zero"] == 3), tmp_path / "estimate_zero3.csv"
    assert cli.main([*shlex.split(sharded["estimate_command"])[3:], "--output_csv", str(csv_path)]) == 0
    (cell,) = list(csv.DictReader(open(csv_path)))
    tensors = sharded["predicted_peak_mib"] - sharded["breakdown_mib"]["workspaces"] - sharded["breakdown_mib"]["rounding"]
    replayed = float(cell["cuda_allocated_mib"]) - float(cell["cuda_workspace_mib"]) - float(cell["cuda_rounding_mib"])
    assert float(cell["peak_mib"]) == float(cell["predicted_mib"]) and replayed == pytest.approx(tensors, abs=1e-6)
    assert abs(float(cell["cuda_allocated_mib"]) - sharded["predicted_peak_mib"]) <= 0.01 * sharded["predicted_peak_mib"]


def assert_commands_are_the_layouts(layouts, *, moe=False):
    """Each sampled layout's train and estimate commands parse with the real parsers and resolve to it
    (both ZeRO levels and every ep among the sample)."""
    sample = layouts[:: max(1, len(layouts) // 20)]
    sample += [next(r for r in layouts if r[key] == v) for key, vs in (("zero", MODELLED_ZERO_LEVELS), ("ep", (1, 2, 4)))
               for v in vs if any(r[key] == v for r in layouts)]
    for row in sample:
        for key in ("train_command", "estimate_command"):
            argv = shlex.split(row[key])[3:]                      # after `python -m evaluation.parallel`
            launch, args = cli.parse(argv)
            assert launch.tp_size == row["tp"] and launch.pp_size == row["pp"] and launch.dp_size == row["dp"]
            assert launch.cp_size == row["cp"] and launch.ep_size == row["ep"]
            assert args.zero == row["zero"] and args.use_moe == moe
        train = cli.resolve(shlex.split(row["train_command"])[3:]).parallel
        assert (train.tp, train.pp, train.cp, train.dp, train.ep, train.zero) == tuple(row[g] for g in Candidate.GRID)
        job = cli.resolve(shlex.split(row["estimate_command"])[3:])
        (run,) = check_benchmark(job)
        assert (run.par.tp, run.par.pp, run.par.cp, run.par.dp) == (row["tp"], row["pp"], row["cp"], row["dp"])
        assert (run.par.ep, run.par.zero, run.args.use_moe) == (row["ep"], row["zero"], moe)
        assert run.sizes["micro_batch_size"] == row["flags"]["micro_batch_size"]


def test_the_layouts_over_the_memory_are_printed_with_the_least_overflow(tmp_path, capsys):
    code = cli.main(["plan", "--", "--world_size", "4", "--device", "cpu", "--device_memory_gib", "0.005", *TINY_ARGS,
                     "--output_json", str(tmp_path / "plan.json")])
    printed = capsys.readouterr().out
    least = json.loads((tmp_path / "plan.json").read_text())["cut"][-1]
    assert code == 0 and least["constraint"] == "predicted peak over the device memory"
    assert f"(e.g. {least['example']}: {least['reason']})" in printed and "the least over: " in least["reason"]


def test_the_book_plans_first_layout_estimates_within_1_percent_of_its_cuda_peak(tmp_path, capsys):
    """The done-when check on the book's model (L 32, S 2048, global batch 16) over 8 GPUs of 24 GiB: the
    first layout's estimate_command (the allocator replayed on fake tensors) gives cuda_allocated_mib
    within 1 % of its predicted_peak_mib (1.05 % under without the estimated block rounding)."""
    out, csv_path = tmp_path / "plan.json", tmp_path / "estimate.csv"
    book = ["--hidden_size", "768", "--num_hidden_layers", "32", "--num_attention_heads", "8", "--num_key_value_heads",
            "4", "--vocab_size", "6400", "--seq_len", "2048", "--global_batch_size", "16"]
    assert cli.main(["plan", "--", "--world_size", "8", "--device", "cuda", "--device_memory_gib", "24", *book,
                     "--output_json", str(out)]) == 0
    first = json.loads(out.read_text())["layouts"][0]
    assert cli.main([*shlex.split(first["estimate_command"])[3:], "--output_csv", str(csv_path)]) == 0
    (cell,) = list(csv.DictReader(open(csv_path)))
    measured, predicted = float(cell["cuda_allocated_mib"]), first["predicted_peak_mib"]
    assert abs(measured - predicted) <= 0.01 * predicted
    rounding = first["breakdown_mib"]["rounding"]
    assert abs(measured - (predicted - rounding)) > 0.01 * (predicted - rounding)   # the rounding is what brings it in


def test_a_moe_plan_spreads_the_experts_and_its_commands_run(tmp_path, capsys):
    code, out = run_plan(tmp_path, *MOE_ARGS)
    printed = capsys.readouterr().out
    assert code == 0
    data = json.loads(out.read_text())
    layouts = data["layouts"]
    assert {r["ep"] for r in layouts} == {1, 2, 4} and {r["zero"] for r in layouts} == set(MODELLED_ZERO_LEVELS) - (
        {3} if _refused(lambda: check_fully_sharded(MOE, ParallelConfig(dp=4, zero=3), 2**20)) else set())
    assert "balanced routing" in printed and "balanced routing" in data["notes"][0]
    assert_commands_are_the_layouts(layouts, moe=True)


def _runs(work, k) -> bool:
    """Whether check_layout passes layout `k`."""
    try:
        check_layout(work.model, k.parallel, seq_len=work.seq_len)
    except ConfigError:
        return False
    return True


def _refused(call) -> bool:
    """Whether `call` raises NotImplementedError (the memory model refuses what it asks)."""
    try:
        call()
    except NotImplementedError:
        return True
    return False


def test_a_calibration_file_round_trips_and_its_rates_are_the_plans(tmp_path, capsys):
    path = tmp_path / "calibration.json"
    save_calibration(SLOW, str(path))
    assert load_calibration(str(path)) == SLOW
    code, out = run_plan(tmp_path, "--calibration", str(path))
    assert code == 0
    assert Hardware.from_json(json.loads(out.read_text())["hardware"]) == SLOW


BAD = [
    ([], "plan needs --world_size N"),
    (["--world_size", "4", "--nnodes", "3"], "world_size must be divisible by nnodes; got world_size=4, nnodes=3"),
    (["--world_size", "4", "--gpu", "Z80"], "unknown --gpu 'Z80'"),
    (["--world_size", "4", "--device", "cpu"], "--device cpu needs --device_memory_gib G"),
    (["--world_size", "4", "--device_memory_gib", "0"], "device_memory_gib must be > 0 GiB"),
    (["--world_size", "4", "--global_batch_size", "0"], "global_batch_size must be >= 1"),
    (["--world_size", "4", "--num_attention_heads", "6"], "num_attention_heads must be divisible by num_key_value_heads"),
    (["--calibrate"], "--calibrate writes the rates it measures to --calibration FILE"),
    (["--world_size", "4", "--num_experts_per_tok", "2"], "mixture-of-experts fields need use_moe (--use_moe)"),
    (["--world_size", "4", "--use_moe", "--num_experts_per_tok", "8"], "num_experts_per_tok must be <= num_experts"),
    (["--world_size", "4", "--processes", "0"], "processes must be >= 1; got processes=0"),
]


@pytest.mark.parametrize("argv,message", BAD)
def test_bad_input_is_one_line(argv, message, monkeypatch, capsys, tmp_path):
    assert_refused_before_launch(["plan", "--", *argv, "--output_json", str(tmp_path / "p.json")], message,
                                 monkeypatch, capsys)
    assert not (tmp_path / "p.json").exists()


def test_an_earlier_plan_is_not_replaced(tmp_path, monkeypatch, capsys):
    (tmp_path / "plan.json").write_text("mine")
    assert_refused_before_launch(["plan", "--", "--world_size", "4", *TINY_ARGS, "--output_json",
                                  str(tmp_path / "plan.json")], "already exists; pass --overwrite", monkeypatch, capsys)
    assert (tmp_path / "plan.json").read_text() == "mine"


# ---------------------------------------------------------------- --validate's statistics and choice

def test_mape_and_spearman_on_hand_checked_numbers():
    from minimind_parallel.planning.agreement import mape, ranks, spearman
    assert mape([110, 90], [100, 100]) == pytest.approx(10.0)
    assert ranks([3.0, 1.0, 2.0, 2.0]) == [4.0, 1.0, 2.5, 2.5]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # one swap of neighbours among 4: 1 - 6 * 2 / (4 * 15) = 0.8
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


def test_validate_takes_the_top_k_and_k_others_at_random():
    from minimind_parallel.tasks.plan import validation_layouts
    result = plan(WORK, GPU_PROFILES["H100"], device="cpu", budget_bytes=2**40)
    chosen = validation_layouts(result, 3, seed=1)
    assert chosen[:3] == result.fitting[:3] and len(chosen) == 6
    assert all(e in result.fitting[3:] for e in chosen[3:]) and len({id(e) for e in chosen}) == 6
    assert validation_layouts(result, 3, seed=1) == chosen


def test_validate_times_every_layout_once_a_round_at_that_rounds_rates_and_takes_the_medians(tmp_path, monkeypatch,
                                                                                             capsys):
    """The memory cells once, then --validate_rounds rounds of every layout's throughput cell, each round
    predicted at the rates calibrated just before it; the medians are compared. --no-validate_time: the
    memory cells alone (as at world 4 on 2 cores)."""
    from minimind_parallel.planning import calibrate as calibration
    from minimind_parallel.planning.ranking import evaluate, model_flops_per_token
    from minimind_parallel.tasks import plan as plan_task
    from minimind_parallel.tasks.benchmark.outputs import Status
    calls = []

    def cell(argv, out_dir, name):
        calls.append(name)
        if name.endswith("_memory"):
            return {"status": Status.OK, "peak_mib": "1.0"}
        layout, r = map(int, name.split("_throughput_"))
        return {"status": Status.OK, "step_ms": str(10.0 * (r + 1) + layout)}

    rates = [replace(SLOW, gemm_flops=1e9 * (r + 1)) for r in range(3)]
    monkeypatch.setattr(plan_task, "run_cell", cell)
    calibrated = []

    def calibrate(device, dtype, shapes):
        calibrated.append(len(calls))            # when: after the memory cells, before each round
        # at the workload's shapes: its block and its sequence
        assert (shapes.seq, shapes.model.hidden_size, shapes.model.head_dim) == (WORK.seq_len, WORK.model.hidden_size,
                                                                                 WORK.model.head_dim)
        return rates[len(calibrated) - 1]

    monkeypatch.setattr(calibration, "calibrate", calibrate)
    code, out = run_plan(tmp_path, "--validate", "1")
    assert code == 0
    v = json.loads(out.read_text())["validation"]
    n = len(v["layouts"])
    assert n == 2 and calls == [f"{i}_memory" for i in range(n)] + [f"{i}_throughput_{r}" for r in range(3) for i in range(n)]
    assert calibrated == [2, 4, 6]
    data = json.loads(out.read_text())
    fitting = plan(WORK, GPU_PROFILES["H100"], device="cuda", budget_bytes=24 * 2**30).fitting
    for i, row in enumerate(v["layouts"]):
        k = next(e.candidate for e in fitting if e.candidate.describe() == row["layout"])
        at = [evaluate(k, WORK, hw, "cuda", model_flops_per_token(WORK)).step_ms for hw in rates]
        assert [t["predicted_step_ms"] for t in row["rounds"]] == pytest.approx(at)
        assert row["predicted_step_ms"] == pytest.approx(sorted(at)[1]) and row["measured_step_ms"] == 20.0 + i
    assert v["time_mape_pct"] > 0 and "spearman" in v and [r["hardware"]["gemm_flops"] for r in v["rounds"]] == [1e9, 2e9, 3e9]
    assert v["memory_max_abs_diff_mib"] == pytest.approx(max(abs(r["predicted_peak_mib"] - 1.0) for r in v["layouts"]))
    assert data["layouts"][0]["predicted_peak_mib"] == v["layouts"][0]["predicted_peak_mib"]
    calls.clear()
    (tmp_path / "memory").mkdir()
    code, out = run_plan(tmp_path / "memory", "--validate", "1", "--no-validate_time")
    v = json.loads(out.read_text())["validation"]
    assert code == 0 and calls == ["0_memory", "1_memory"] and "time_mape_pct" not in v and not v["rounds"]
    assert "pred ms" not in capsys.readouterr().out.split("validating")[-1]


def test_the_space_plans_zb_where_the_memory_model_replays_it():
    """zb is planned on the layouts predict_memory replays it for: the dense model's, under
    recompute too, and the MoE model's (expert parallelism too, and --zero 3 at ep 1 and 2), each predicted; the
    planner's remembered rows (worst_only) give an MoE zb layout the full replay's peak."""
    from minimind_parallel.config import Recompute
    from minimind_parallel.pipeline_parallel.order import Schedule
    valid = enumerate_layouts(WORK)[0]
    zb = [k for k in valid if k.pp_schedule == Schedule.ZERO_BUBBLE]
    assert zb and {k.recompute for k in zb} == {k.recompute for k in valid if k.pp > 1} != {Recompute.NONE}
    for k in zb:
        predict_memory(WORK.model, k.parallel, seq_len=WORK.seq_len, micro_batch_size=k.micro_batch_size,
                       num_microbatches=k.num_microbatches, schedule=k.pp_schedule, worst_only=True)
    moe_zb = [k for k in enumerate_layouts(MOE_WORK)[0] if k.pp > 1 and k.pp_schedule == Schedule.ZERO_BUBBLE]
    # --zero 3 too, at ep > 1 as at ep 1 (fsdp_posted.zero_bubble_first_forward gathers the experts' groups)
    assert moe_zb and {k.ep for k in moe_zb} > {1} and {k.ep for k in moe_zb if k.zero == 3} > {1}
    for k in moe_zb[::7] + [next(k for k in moe_zb if k.zero == 3 and k.ep == e) for e in (1, 2)]:
        kw = dict(seq_len=MOE_WORK.seq_len, micro_batch_size=k.micro_batch_size, num_microbatches=k.num_microbatches,
                  schedule=k.pp_schedule)
        fast, every = (predict_memory(MOE_WORK.model, k.parallel, worst_only=w, **kw) for w in (True, False))
        assert fast.peak_bytes == every.peak_bytes, k.describe()


def test_the_remembered_compute_gives_every_layouts_step_time_as_computed_afresh():
    """step_time with one plan's memo (last_stage_compute, by COMPUTE_FIELDS; microbatch_communication,
    by MICROBATCH_FIELDS, computed from those fields alone) equals it without, to the bit, for every
    layout of the dense and the MoE workloads, in the plan's order; a microbatch's communication is
    shared by the layouts that differ only in the zero level, the microbatches and the schedule."""
    for work in (WORK, MOE_WORK):
        memo: dict = {}
        valid, _ = enumerate_layouts(work)
        # and the contiguous CP split, which the space leaves out where the balanced one fits (DOMINATED)
        for k in valid + [replace(k, cp_load_balance=False) for k in valid if k.cp > 1]:
            fresh, remembered = (step_time(k, work, SLOW, stage_params=1000, expert_params=10, memo=m)
                                 for m in (None, memo))
            assert vars(remembered) == vars(fresh), k.describe()
        assert len(memo) < len(valid)
        assert sum(key[0] == "microbatch" for key in memo) < len(valid) / 2


def test_a_replay_remembered_for_one_zero_level_gives_the_others_their_own_prediction():
    """The gpipe / 1f1b replay is remembered on the stage's kind, which a pipeline's zero levels (and
    one stage's --zero 1 and 2) share: each level, predicted right after the others in either order,
    is the full replay's prediction to the byte (a replay taken with another level's grads counted,
    or its moments changed by the optimizer's, would differ)."""
    from dataclasses import asdict
    from minimind_parallel.pipeline_parallel.order import Schedule
    layouts = [k for k in enumerate_layouts(WORK)[0] if k.zero == 0 and k.dp * k.cp > 1
               and (k.pp == 1 or k.pp_schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B))][::5]
    assert {k.pp for k in layouts} == {1, 2} and len(layouts) > 10
    for k in layouts:
        for zeros in ((0, 1, 2), (2, 1, 0)):
            for z in zeros:
                par = replace(k, zero=z).parallel
                kw = dict(seq_len=WORK.seq_len, micro_batch_size=k.micro_batch_size,
                          num_microbatches=k.num_microbatches, schedule=k.pp_schedule, device="cuda")
                every, alone = predict_memory(WORK.model, par, **kw), predict_memory(WORK.model, par, worst_only=True, **kw)
                assert {**asdict(alone), "candidates": None, "per_stage": None} == \
                    {**asdict(every), "candidates": None, "per_stage": None}, (k.describe(), z)


def test_a_zero_3_stage_remembered_with_its_twins_gives_its_own_prediction():
    """The planner predicts --zero 3 under a pipeline from pieces the other layouts remember too
    (fsdp_remembered.py: the stage's and its chunks' kinds, which a pipeline's zero levels and a
    chunk's dp share; the replay's and the posted walk's rows; FSDP2's groups by the shapes and W).
    Zero 3 layouts of a space of every schedule, W 2 and 4, --recompute full and --loss_chunks,
    predicted in one process after its zero 0, 1 and 2 twins and, caches cleared,
    before them, is the full replay's prediction to the byte (a piece remembered without W, or the
    zero level's replay with its grads uncounted, would give it another layout's bytes); and so
    are the twins' (zero 1 and 2 share a posted stage's remembered peak, and zero 2's staging plans
    are remembered on the layouts' key and the W steps)."""
    from dataclasses import asdict
    from minimind_parallel.config import Recompute
    from minimind_parallel.memory.analytic import fsdp_pipeline, remembered_sizes
    # one KV head of 18: its k and v rows padded to W = dp x cp = 4 (so W reaches the gathered bytes)
    model = replace(TINY, head_dim=18, num_key_value_heads=1, num_hidden_layers=8)
    work = Workload(model=model, seq_len=64, global_batch_size=16, world_size=8)
    zero3 = [k for k in enumerate_layouts(work)[0] if k.zero == 3 and k.pp > 1]
    sample = zero3[::max(1, len(zero3) // 40)]
    assert {k.pp_schedule for k in sample} == set(Schedule) and {k.dp for k in sample} >= {2, 4}
    assert Recompute.FULL in {k.recompute for k in sample} and {k.loss_chunks for k in sample} > {1}
    for levels in ((0, 1, 2, 3), (3, 2, 1, 0)):
        remembered_sizes._stage_kind.cache_clear()
        remembered_sizes._chunk_kinds.cache_clear()
        fsdp_pipeline._stage_groups.cache_clear()
        for k in sample:
            for z in levels:
                par = replace(k, zero=z).parallel
                kw = dict(seq_len=work.seq_len, micro_batch_size=k.micro_batch_size,
                          num_microbatches=k.num_microbatches, schedule=k.pp_schedule, device="cuda")
                alone, every = predict_memory(work.model, par, worst_only=True, **kw), predict_memory(work.model, par, **kw)
                assert {**asdict(alone), "candidates": None, "per_stage": None} == \
                    {**asdict(every), "candidates": None, "per_stage": None}, (k.describe(), z)
                assert all(every.candidates[name] == total for name, total in alone.candidates.items())


def test_a_chunk_kind_shared_across_layouts_gives_each_chunk_its_own_terms():
    """A model chunk's kind is remembered without the step's microbatches, and but on the virtual
    stage that holds them without the loss's and the embedding's flags (remembered_sizes.chunk_kinds):
    across a spread of interleaved and zb layouts, predicted in one process so that layouts differing
    only there share kinds, every chunk's remembered terms are those of its own sizes (chunk_sizes)."""
    from minimind_parallel.memory.analytic.posted_replay import unit_terms
    from minimind_parallel.memory.analytic.remembered_sizes import chunk_kinds
    from minimind_parallel.memory.analytic.stage_sizes import chunk_sizes
    from minimind_parallel.pipeline_parallel.order import Schedule
    work = Workload(model=replace(TINY, num_hidden_layers=8), seq_len=32, global_batch_size=16, world_size=8)
    posted = [k for k in enumerate_layouts(work)[0][::3]
              if k.pp > 1 and k.pp_schedule in (Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE)]
    # and the contiguous CP split (its later ranks' attention sees more blocks: each CP rank its own kinds)
    posted += [replace(k, cp_load_balance=False) for k in posted if k.cp > 1][:4]
    owners: dict = {}
    for k in posted:
        kw = dict(seq_len=work.seq_len, micro_batch_size=k.micro_batch_size, num_microbatches=k.num_microbatches,
                  dtype=torch.bfloat16)
        zb, memo = k.pp_schedule is Schedule.ZERO_BUBBLE, {}
        for stage in range(k.pp):
            for r in range(1 if k.cp_load_balance else k.cp):
                own = chunk_sizes(work.model, k.parallel, stage, cp_rank=r, **kw)
                for kind, sizes in zip(chunk_kinds(work.model, k.parallel, stage, memo, cp_rank=r, **kw), own):
                    assert kind.terms(zb) == unit_terms(sizes, zb), (k.describe(), stage, r)
                    owners.setdefault(id(kind), set()).add((k.num_microbatches, k.loss_chunks, k.vocab_parallel))
    # kinds shared across the microbatches, the loss chunks and --vocab_parallel, each
    for field in range(3):
        assert any(len({o[field] for o in v}) > 1 for v in owners.values()), field


def test_the_jsons_rows_made_as_text_are_json_dumps_of_the_rows(tmp_path):
    """write_json makes each layout's row as text from remembered pieces (the flags', the commands'
    parts): the file is json.dumps of the whole result with layout_row's rows, to the byte, for the
    dense and the MoE plans on 2 nodes (the dense plan's rows made by write_json; the MoE plan's by
    plan(row=json_row), in the three processes that predict it, two of them forked); and a
    command's text is json.dumps of it for words that JSON escapes (quotes, backslashes, a
    non-ASCII letter)."""
    from minimind_parallel.tasks import plan as plan_task
    for extra in ([], [*MOE_ARGS, "--processes", "3"]):
        argv = ["--world_size", "4", "--nnodes", "2", "--device", "cuda", "--device_memory_gib", "24", *TINY_ARGS, *extra]
        args = plan_task.parser().parse_args(argv)
        hw = plan_task.hardware_of(args)
        rows = args.processes and plan_task.json_row(args, hw)
        result = plan(plan_task.workload_of(args), hw, device="cuda", budget_bytes=2**40, processes=args.processes,
                      row=rows)
        assert all((e.row is not None) == bool(rows) for e in result.fitting)
        path = tmp_path / "plan.json"
        plan_task.write_json(str(path), result, args, hw, 1.5, tuple(argv), {"spearman": 0.5})
        out = {"command": [*plan_task.program_name().split(), *argv], "workload": None, "hardware": hw.to_json(),
               "candidates": result.candidates, "seconds": 1.5,
               "layouts": [plan_task.layout_row(e, args, hw) for e in result.fitting]}
        written = json.loads(path.read_text())
        out["workload"] = written["workload"]
        out.update(cut=plan_task.cut_summary(result), notes=plan_task.notes(args), validation={"spearman": 0.5})
        assert path.read_text() == json.dumps(out) and len(out["layouts"]) > 100
    parts = (("python", "-m"), ("--name", 'say "hi"', "back\\slash", "caf\u00e9"), ())
    assert plan_task.json_command(parts) == json.dumps(plan_task.shell_join_parts(*parts))


def test_a_plan_predicted_by_forked_processes_is_the_plan_of_one():
    """plan(processes=3): the layouts cut in three contiguous parts, two predicted in forked children
    (planning/forked.py); every entry, its order and the cuts are those of one process."""
    hw = GPU_PROFILES["H100"]

    def entries(result):
        return [(e.candidate, e.peak_bytes, e.breakdown, vars(e.time), e.tokens_per_s, e.mfu)
                for e in result.fitting + result.over_budget]

    one, three = (plan(WORK, hw, device="cuda", budget_bytes=70_600_000, processes=n) for n in (1, 3))
    assert entries(three) == entries(one) and three.cuts == one.cuts and one.fitting and one.over_budget


def test_the_layouts_predicted_by_groups_of_shared_sizes_come_back_in_the_spaces_order():
    """plan predicts the layouts grouped by what their sizes are remembered on (each group contiguous,
    so that a forked part holds whole groups) and gives the entries back in the space's order."""
    from itertools import groupby
    from minimind_parallel.planning import ranking
    valid, _ = enumerate_layouts(WORK)
    seen: list = []
    out = ranking._in_order(valid, lambda part: seen.extend(part) or [k.describe() for k in part])
    assert out == [k.describe() for k in valid] and seen != valid and sorted(map(id, seen)) == sorted(map(id, valid))
    runs = [key for key, _ in groupby(map(ranking._sharing, seen))]
    assert len(runs) == len(set(runs)) > 1


def _recorded_forks(monkeypatch) -> list:
    """The pids of the children planning/forked.py forks from now on."""
    from minimind_parallel.planning import forked
    pids, fork = [], forked._fork

    def recorded(fn, part, started, **kw):
        before = len(started)
        try:
            fork(fn, part, started, **kw)
        finally:   # also where a signal held over the fork is raised as it ends
            pids.extend(pid for pid, _ in started[before:])
    monkeypatch.setattr(forked, "_fork", recorded)
    return pids


def test_a_forked_part_that_fails_raises_here_and_no_child_is_left(monkeypatch):
    """A child's error is raised in the parent; an error of the parent's own part ends the children
    still running (one sleeps); either way every child is reaped."""
    import os
    import time
    from minimind_parallel.planning import forked
    pids = _recorded_forks(monkeypatch)

    def child_fails(x):
        if x == 5:
            raise ValueError(f"item {x}")
        return x * x
    assert forked.forked_map(child_fails, range(4), [0, 2, 4]) == [0, 1, 4, 9]
    n = 3 * forked.THEN_BATCH   # each process's `then` over more than a batch
    assert forked.forked_map(abs, range(-n, n), [0, n, 2 * n], then=lambda v: -v) == [-abs(x) for x in range(-n, n)]
    with pytest.raises(ValueError, match="item 5"):
        forked.forked_map(child_fails, range(8), [0, 4, 8])

    def parent_fails(x):
        if x >= 4:
            time.sleep(60)
        raise KeyError(x)
    start = time.monotonic()
    with pytest.raises(KeyError):
        forked.forked_map(parent_fails, range(8), [0, 4, 8])
    assert time.monotonic() - start < 30 and len(pids) == 4
    for pid in pids:   # reaped: no child of that pid is left
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    assert forked.split([1, 1, 1, 1, 4], 2) == [0, 4, 5] and forked.split([1, 1], 3) == [0, 1, 2, 2]


def test_a_signal_in_a_planning_forks_after_fork_hook_is_raised_after_it_and_no_child_is_left(monkeypatch):
    """Ctrl-C landing while forked_map forks runs its handler inside the parent's after-fork hooks,
    where Python prints and ignores what it raises: the plan went on. forked.py holds SIGINT and
    SIGTERM over the fork (processes.signals_held) and raises them once the child is registered,
    which is then ended (it would sleep) and reaped."""
    import os
    import time
    from minimind_parallel import processes
    from minimind_parallel.planning import forked
    from helpers import sigint_after_the_next_fork
    pids = _recorded_forks(monkeypatch)
    armed = sigint_after_the_next_fork()
    start = time.monotonic()
    with pytest.raises(processes.Interrupted, match="SIGINT"), processes.signals_raise():
        armed[-1] = True   # the next fork signals from its after-fork hook
        forked.forked_map(lambda x: time.sleep(10) if x >= 2 else x, range(4), [0, 2, 4])
    assert time.monotonic() - start < 5 and len(pids) == 1
    with pytest.raises(ChildProcessError):
        os.waitpid(pids[0], os.WNOHANG)



def test_a_planning_child_ends_with_its_parent_even_when_the_parent_is_killed(tmp_path):
    """A forked_map child is SIGKILLed when the process that forked it ends, however it ends: here the
    parent is SIGKILLed, which runs none of its cleanup (processes.parent_death_signal)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    script = tmp_path / "parent.py"
    script.write_text("import os, sys, time\n"
                      "from minimind_parallel.planning import forked\n"
                      "def slow(x):\n"
                      "    open(os.path.join(sys.argv[1], str(os.getpid())), 'w').close()\n"
                      "    time.sleep(60)\n"
                      "forked.forked_map(slow, range(4), [0, 2, 4])\n")
    (tmp_path / "pids").mkdir()
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path / "pids")])
    children: list = []
    try:
        deadline = time.monotonic() + 60
        while not children:
            assert parent.poll() is None and time.monotonic() < deadline
            children = [int(p) for p in os.listdir(tmp_path / "pids") if int(p) != parent.pid]
            time.sleep(0.05)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(children[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(children[0])
    finally:
        parent.kill()
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_process_done_with_its_part_takes_the_last_items_of_anothers():
    """forked_map's parts are where each process starts: this process, done with its own two items,
    evaluates the last ones of the child's (each slow), in runs, and the results are in order."""
    import os
    import time
    from minimind_parallel.planning import forked

    def slow(x):
        time.sleep(0.01)
        return x, os.getpid()
    out = forked.forked_map(slow, range(6 * forked.RUN), [0, 2, 6 * forked.RUN])
    assert [x for x, _ in out] == list(range(6 * forked.RUN))
    here = [x for x, pid in out if pid == os.getpid()]
    assert here[:2] == [0, 1] and here[-1] == 6 * forked.RUN - 1 and len({pid for _, pid in out}) == 2


def test_a_forked_worker_returns_or_raises_here_and_its_child_is_reaped(monkeypatch, tmp_path):
    """forked_worker: fn(*args) in a child forked before the args exist (it runs prepare meanwhile),
    its result (or its error) here; where the caller fails after sending, the child still finishes
    its file whole; where it ends without sending, the child ends without calling fn; every child
    reaped; fork=False runs it here."""
    import os
    from minimind_parallel.planning import forked
    pids = _recorded_forks(monkeypatch)
    prepared = tmp_path / "prepared"
    with forked.forked_worker(lambda: prepared.write_text("yes"), lambda x: (x, os.getpid())) as worker:
        worker.send(7)
        x, pid = worker.result()
        assert x == 7 and pid not in (os.getpid(), None) and prepared.read_text() == "yes"
    with forked.forked_worker(lambda: None, lambda key: {}[key]) as worker, pytest.raises(KeyError, match="missing"):
        worker.send("missing")
        worker.result()
    path, never = tmp_path / "written", tmp_path / "never"
    with pytest.raises(ValueError, match="here first"), forked.forked_worker(lambda: None, path.write_text) as worker:
        worker.send("whole")
        raise ValueError("here first")
    with pytest.raises(ValueError, match="not sent"), forked.forked_worker(lambda: None, never.write_text):
        raise ValueError("not sent")
    assert path.read_text() == "whole" and not never.exists() and len(pids) == 4
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    with forked.forked_worker(lambda: None, lambda: os.getpid(), fork=False) as worker:
        worker.send()
        assert worker.result() == os.getpid() and len(pids) == 4


def test_a_model_key_given_to_predict_memory_is_its_model_s():
    """predict_memory(model_key=Frozen(c)) (the planner's, made once a plan) predicts what it predicts
    without one, and a key of another model is refused."""
    from minimind_parallel.memo import Frozen
    par = ParallelConfig(pp=2, virtual_stages=2)
    kw = dict(seq_len=32, micro_batch_size=1, num_microbatches=2, schedule=Schedule.INTERLEAVED, worst_only=True)
    assert predict_memory(TINY, par, **kw, model_key=Frozen(TINY)) == predict_memory(TINY, par, **kw)
    with pytest.raises(ValueError, match="model_key"):
        predict_memory(TINY, par, **kw, model_key=Frozen(replace(TINY, hidden_size=2 * TINY.hidden_size)))


def test_the_process_entry_point_is_mains_code_with_the_collector_frozen(monkeypatch):
    """`python -m evaluation.parallel` exits with main()'s code after gc.freeze (the collector kept from
    walking a plan's remembered objects at exit); plan() itself pauses it and leaves it as it was."""
    import gc
    monkeypatch.setattr(cli, "main", lambda ran: 7)
    try:
        assert cli.process_main() == 7 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    assert gc.isenabled()
    plan(WORK, GPU_PROFILES["H100"], device="cpu", budget_bytes=2**40)
    assert gc.isenabled()
    with paused_collector():   # what it made is moved to the oldest generation unwalked, nothing left frozen
        made = [[i] for i in range(5000)]
    gc.disable()   # (a collection of its own would move it too)
    try:
        assert any(o is made for o in gc.get_objects(generation=2)) and gc.get_freeze_count() == 0
    finally:
        gc.enable()
    gc.freeze()   # a process that keeps its objects frozen (cli.process_main): they join them
    try:
        frozen = gc.get_freeze_count()
        with paused_collector():
            kept = [[i] for i in range(5000)]
        assert gc.get_freeze_count() >= frozen + len(kept) and gc.isenabled()
    finally:
        gc.unfreeze()


def test_a_task_that_ends_at_once_ends_the_process_with_its_code_and_its_output_flushed(monkeypatch, capsys):
    """process_main after a task that ends_at_once (plan's): the output flushed, then os._exit with
    main()'s code (no teardown of a plan's millions of objects); after any other task it returns."""
    import os
    from minimind_parallel import tasks
    ended = []

    def exit_now(code):
        ended.append((code, capsys.readouterr().out))
        raise SystemExit(code)
    monkeypatch.setattr(os, "_exit", exit_now)
    def ran_task(name: str, code: int):
        def main(ran):
            print(name)
            ran.append(tasks.get(name))
            return code
        return main
    for name, code in (("plan", 3), ("train", 4)):
        monkeypatch.setattr(cli, "main", ran_task(name, code))
        try:
            with contextlib.suppress(SystemExit):
                assert cli.process_main() == code
        finally:
            gc.unfreeze()
    assert ended == [(3, "plan\n")] and tasks.get("plan").ends_at_once and not tasks.get("train").ends_at_once


def test_an_earlier_plans_validation_cells_are_never_read_as_this_ones(tmp_path, capsys):
    """--validate's CSVs sit beside the JSON: an earlier plan's folder is refused in one line without
    --overwrite, before any cell runs; with it, a cell's old CSV is removed before the cell runs, and
    a cell that fails (here: refused by its parser) is a failure, not the old row."""
    from minimind_parallel.tasks import plan as plan_task
    from minimind_parallel.tasks.benchmark.outputs import Status
    (tmp_path / "plan_validate").mkdir()
    code, _ = run_plan(tmp_path, "--validate", "1")
    assert code == 2 and not (tmp_path / "plan.json").exists()
    err = capsys.readouterr().err
    assert "--validate's results" in err and "--overwrite" in err
    stale = tmp_path / "plan_validate" / "0_memory.csv"
    stale.write_text("status,peak_mib\nok,1.0\n")
    row = plan_task.run_cell(["benchmark", "--kind", "memory", "--", "--no_such_flag"], str(stale.parent), "0_memory")
    assert row["status"] == Status.FAILED and not stale.exists()
