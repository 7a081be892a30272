"""The overlap report on hand-made traces whose answers are known (times in us, reports in ms)."""
import pytest

from minimind_parallel.profiling.overlap import analyze, intersect, mean_over_ranks, subtract, union

MAIN, GLOO = 1, 2


def ev(name, ts, dur, tid=MAIN, cat="cpu_op"):
    return dict(ph="X", name=name, ts=ts, dur=dur, tid=tid, pid=0, cat=cat)


def rng(name, ts, dur, tid=MAIN):
    return ev(name, ts, dur, tid, cat="user_annotation")


def report_of(*events):
    return analyze({"traceEvents": [rng("step 0", 0, 100), *events]})


def test_interval_arithmetic():
    assert union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert intersect([(0, 3), (5, 8)], [(2, 6)]) == [(2, 3), (5, 6)]
    assert subtract([(0, 10), (20, 30)], [(2, 4), (8, 22)]) == [(0, 2), (4, 8), (22, 30)]


def test_fully_overlapped_async_all_reduce():
    r = report_of(ev("aten::mm", 0, 5), ev("c10d::allreduce_", 5, 1), ev("aten::mm", 6, 94),
                  rng("gloo:all_reduce", 10, 40, tid=GLOO))
    c = r["collectives"]["all_reduce"]
    assert c["count"] == 1 and c["time_ms"] == pytest.approx(0.040)
    assert c["overlap"] == pytest.approx(1.0) and c["exposed_ms"] == pytest.approx(0.0)
    # only issuing it (1 us on the main thread) is exposed
    assert (r["compute_ms"], r["exposed_comm_ms"], r["idle_ms"]) == pytest.approx((0.099, 0.001, 0.0))


def test_fully_exposed_sync_all_reduce():
    r = report_of(ev("aten::mm", 0, 10), rng("comm:all_reduce", 10, 50), ev("c10d::allreduce_", 10, 1),
                  rng("gloo:all_reduce", 15, 43, tid=GLOO), ev("aten::add", 60, 40))
    c = r["collectives"]["all_reduce"]
    assert c["overlap"] == 0.0 and c["exposed_ms"] == pytest.approx(0.043)
    # the main thread blocked in comm:all_reduce for 50 us: exposed, not idle
    assert (r["compute_ms"], r["exposed_comm_ms"], r["idle_ms"]) == pytest.approx((0.050, 0.050, 0.0))


def test_partial_overlap_with_the_wgrad_gemm():
    """MiniMind Parallelism Book, section 4.3.2: async reduce-scatter of dgrad issued, wgrad GEMM
    runs, then wait. gloo runs
    the reduce-scatter as `gloo:all_reduce`: the kind must come from the issuing c10d op."""
    r = report_of(ev("aten::mm", 0, 10),
                  rng("comm:reduce_scatter", 10, 2), ev("c10d::_reduce_scatter_base_", 10, 1),
                  rng("async_linear.wgrad", 12, 28), ev("aten::mm", 12, 28),
                  rng("wait:reduce_scatter", 40, 20), ev("aten::add", 70, 30),
                  rng("gloo:all_reduce", 20, 40, tid=GLOO))
    assert set(r["collectives"]) == {"reduce_scatter"}
    c = r["collectives"]["reduce_scatter"]
    assert c["overlap"] == pytest.approx(0.5) and c["overlap_wgrad"] == pytest.approx(0.5) and c["overlap_dgrad"] == 0
    assert c["wait_ms"] == pytest.approx(0.020) and c["exposed_ms"] == pytest.approx(0.020)
    assert (r["compute_ms"], r["exposed_comm_ms"], r["idle_ms"]) == pytest.approx((0.068, 0.022, 0.010))


def test_only_step_windows_count_and_times_are_per_step():
    events = [rng("step 0", 0, 100), rng("step 1", 200, 100), ev("c10d::barrier", 150, 1),
              rng("gloo:barrier", 150, 40, tid=GLOO), rng("forward", 0, 100), rng("forward", 200, 100)]
    for t0 in (0, 200):
        events += [ev("c10d::_allgather_base_", t0 + 10, 1), rng("gloo:all_gather", t0 + 20, 30, tid=GLOO),
                   ev("aten::mm", t0 + 30, 70)]
    r = analyze({"traceEvents": events})
    assert set(r["collectives"]) == {"all_gather"}      # the barrier between the steps is left out
    c = r["collectives"]["all_gather"]
    assert c["count"] == 1 and c["by_phase"] == {"forward": 1}
    assert c["overlap_by_phase"] == {"forward": pytest.approx(20 / 30)}
    assert c["time_ms"] == pytest.approx(0.030) and c["overlap"] == pytest.approx(20 / 30)
    assert r["step_ms"] == pytest.approx(0.100)


def test_gpu_trace_uses_nccl_kernels():
    r = report_of(ev("gemm_kernel", 0, 60, tid=7, cat="kernel"),
                  ev("ncclDevKernel_AllGather_RING_LL", 40, 40, tid=8, cat="kernel"))
    c = r["collectives"]["all_gather"]
    assert c["overlap"] == pytest.approx(0.5)
    assert (r["compute_ms"], r["exposed_comm_ms"], r["idle_ms"]) == pytest.approx((0.060, 0.020, 0.020))


def test_peer_wait_splits_a_span_into_waiting_for_the_late_rank_and_transfer():
    base = dict(steps=1, step_ms=1.0, compute_ms=0.5, exposed_comm_ms=0.5, idle_ms=0.0)
    coll = dict(count=2, time_ms=0.1, overlap=0.0, overlap_dgrad=0.0, overlap_wgrad=0.0, exposed_ms=0.1, wait_ms=0.0,
                by_phase={}, overlap_by_phase={})
    # rank 0 starts both collectives 30 us before rank 1; each ends at the same time on both
    r0 = dict(base, collectives={"all_gather": coll}, spans=[("all_gather", 0, 50), ("all_gather", 100, 150)])
    r1 = dict(base, collectives={"all_gather": coll}, spans=[("all_gather", 30, 50), ("all_gather", 130, 150)])
    got = mean_over_ranks([r0, r1])["collectives"]["all_gather"]["peer_wait_ms"]
    assert got == pytest.approx((30 + 30) * 1e-3 / 2)  # rank 0 waited 2 x 30 us, rank 1 none; mean of ranks
    r1["spans"] = [("all_gather", 30, 50), ("reduce_scatter", 130, 150)]  # sequences differ: no pairing
    assert "peer_wait_ms" not in mean_over_ranks([r0, r1])["collectives"]["all_gather"]


def test_ring_transfers_are_in_flight_from_issue_to_wait_and_overlap_the_block():
    """Ring attention (context_parallel/ring.py): the K/V batch is issued (comm:ring_kv with its
    c10d send/recv), the block is computed, then the batch is waited on. The transfer counts as
    in flight over all of it, so the block's 80 us are its overlap; the send/recv ops inside its
    issue are not counted again as a pipeline send_recv."""
    r = report_of(rng("comm:ring_kv", 0, 10), ev("c10d::send", 1, 4), ev("c10d::recv_", 5, 4),
                  rng("ring.block_forward", 10, 80), ev("aten::bmm", 10, 80),
                  rng("wait:ring_kv", 90, 10))
    assert set(r["collectives"]) == {"ring_kv"}
    c = r["collectives"]["ring_kv"]
    assert c["count"] == 1 and c["time_ms"] == pytest.approx(0.100)
    assert c["overlap"] == pytest.approx(0.8) and c["wait_ms"] == pytest.approx(0.010)
    assert (r["compute_ms"], r["exposed_comm_ms"], r["idle_ms"]) == pytest.approx((0.080, 0.020, 0.0))
