"""A real 2-rank profile: the trace parses, names every phase, and the report counts exactly the
collectives the layers issue, phase by phase."""
import contextlib
import csv
import json
import os
import subprocess
import sys

import pytest
import torch

from distributed import run_ranks
from minimind_parallel import MiniMindConfig, ParallelConfig, ProcessGroups
from minimind_parallel.model import MiniMindForCausalLM
from minimind_parallel.distributed.ranges import span
from minimind_parallel.profiling.trace import profile_steps
from minimind_parallel.training import build_parallel_model, make_optimizer
from minimind_parallel.data.batches import random_batch

L = 2  # decoder blocks
TINY = dict(hidden_size=64, num_hidden_layers=L, num_attention_heads=8, num_key_value_heads=4, vocab_size=128,
            tie_word_embeddings=False)
MODES = {
    "tp": dict(),
    "tp_sp": dict(sequence_parallel=True),
    "tp_sp_async": dict(sequence_parallel=True, async_communication=True),
    "tp_sp_async_shared": dict(sequence_parallel=True, async_communication=True, shared_sp_gather=True),
}


def expected_counts(mode: str) -> dict:
    """Collectives per step, {kind: {phase: n}}, derived from the layers (T = 2, untied, no VP).

    Per block: 5 column-parallel linears (q, k, v, gate, up), 2 row-parallel (o, down).
    Model level: a replicated embedding and lm_head; under SP the embedding output is split (its
    backward all-gathers) and the final hidden state is gathered for the lm_head (its backward
    only keeps this rank's slice). finalize_grads: one coalesced all-reduce of the norm grads.
    """
    finalize = {"all_reduce": {"finalize_grads": 1}}
    if mode == "tp":  # f: fwd identity / bwd all-reduce per column linear; g: fwd all-reduce per row
        return {"all_reduce": {"forward": 2 * L, "backward": 5 * L, "finalize_grads": 1}}
    gathers_fwd = (2 if "shared" in mode else 5) * L       # one gather per column linear, or per region
    column_bwd = gathers_fwd                               # one dgrad reduce-scatter per gather
    regather = column_bwd if "async" in mode else 0        # recompute: re-gather the saved local shard
    return {"all_gather": {"forward": gathers_fwd + 1, "backward": regather + 2 * L + 1},
            "reduce_scatter": {"forward": 2 * L, "backward": column_bwd}, **finalize}


def profile_tp2(flags: dict, out_dir: str, *, steps: int, title: str = "") -> dict:
    """On each of 2 TP ranks: the TINY model with `flags`, one warm-up step, then `steps` profiled
    (shared with tests/test_async_communication.py)."""
    par = ParallelConfig(tp=2, **flags)
    groups = ProcessGroups.build(par)
    config = MiniMindConfig(**TINY)
    torch.manual_seed(0)
    model = build_parallel_model(config, par, groups, MiniMindForCausalLM(config).state_dict())
    ids, targets = random_batch(1, 2, 16, config.vocab_size)
    return profile_steps(model, make_optimizer(model, 1e-3), groups, ids, targets, steps=steps, warmup=1,
                         out_dir=out_dir, title=title)


def _profile_modes(out_root):
    return {mode: profile_tp2(flags, os.path.join(out_root, mode), steps=2, title=mode)["rank"]
            for mode, flags in MODES.items()}


ISSUED = {"c10d::allreduce_": "all_reduce", "c10d::_allgather_base_": "all_gather",
          "c10d::_reduce_scatter_base_": "reduce_scatter"}


def covered_us(intervals) -> float:
    """Length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def raw_trace_facts(path) -> dict:
    """What the report must agree with, read straight from a rank's trace (times in ms per step):
    the step windows, the collectives the main thread issued in them (c10d ops), the gloo worker
    events in them, the main thread's GEMM time and its time inside comm:/wait: ranges."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("step ")]
    main = steps[0]["tid"]
    inside = [e for e in events if any(s["ts"] <= e["ts"] <= s["ts"] + s["dur"] for s in steps)]
    span = lambda e: (e["ts"], e["ts"] + e["dur"])  # noqa: E731
    n = len(steps)
    issued = {}
    for e in inside:
        if e["tid"] == main and e["name"] in ISSUED:
            issued[ISSUED[e["name"]]] = issued.get(ISSUED[e["name"]], 0) + 1 / n
    return dict(steps=n, step_ms=sum(s["dur"] for s in steps) / n / 1e3, issued=issued,
                gloo_runs=sum(1 for e in inside if e["name"].startswith("gloo:") and e["tid"] != main) / n,
                gemm_ms=covered_us(span(e) for e in inside if e["tid"] == main and e["name"] == "aten::mm") / n / 1e3,
                in_comm_ms=covered_us(span(e) for e in inside if e["tid"] == main
                                      and e["name"].startswith(("comm:", "wait:"))) / n / 1e3)


def test_profile_counts_names_and_outputs(tmp_path):
    ranks = run_ranks(_profile_modes, 2, str(tmp_path))
    for mode in MODES:
        for rank, reports in enumerate(ranks):
            r = reports[mode]
            got = {kind: c["by_phase"] for kind, c in r["collectives"].items()}
            assert got == expected_counts(mode), f"{mode} rank {rank}"
            assert r["compute_ms"] > 0 and r["idle_ms"] >= 0
            assert abs(r["compute_ms"] + r["exposed_comm_ms"] + r["idle_ms"] - r["step_ms"]) < 1e-6
            # the report against the raw trace, not against its own arithmetic
            raw = raw_trace_facts(tmp_path / mode / f"trace_rank{rank}.json")
            assert r["steps"] == raw["steps"] and r["step_ms"] == pytest.approx(raw["step_ms"])
            assert {k: c["count"] for k, c in r["collectives"].items()} == pytest.approx(raw["issued"])
            assert raw["gloo_runs"] == sum(raw["issued"].values())     # each issued collective ran once on gloo
            assert r["compute_ms"] >= raw["gemm_ms"] - 1e-6              # GEMMs are compute ...
            assert r["compute_ms"] <= r["step_ms"] - raw["in_comm_ms"] + 1e-6  # ... time in comm:/wait: is not
            assert r["exposed_comm_ms"] >= raw["in_comm_ms"] - 1e-6      # blocked on communication: exposed
        with open(tmp_path / mode / "trace_rank1.json") as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        names = {e["name"] for e in events}
        assert {"step 0", "forward", "backward", "block 0 forward", "block 1 backward", "optimizer"} <= names
        main = next(e["tid"] for e in events if e["name"] == "step 0")
        kinds = ["comm:all_reduce"] if mode == "tp" else ["comm:all_gather", "comm:reduce_scatter"]
        assert set(kinds) <= names
        assert any(e["name"].startswith("gloo:") and e["tid"] != main for e in events)  # gloo's own threads
        if "async" in mode:
            assert {"async_linear.dgrad", "async_linear.wgrad", "wait:all_gather", "wait:reduce_scatter"} <= names
        saved = json.loads((tmp_path / mode / "report.json").read_text())
        assert len(saved["ranks"]) == 2 and saved["summary"]["collectives"].keys() == r["collectives"].keys()
        assert (tmp_path / mode / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_ranges_are_free_when_not_profiling():
    assert isinstance(span("comm:all_reduce"), contextlib.nullcontext)


def test_benchmark_kind_profile_writes_traces_reports_and_the_comparison(tmp_path):
    csv_path = tmp_path / "p.csv"
    r = subprocess.run([sys.executable, "-m", "evaluation.parallel", "benchmark", "--kind", "profile", "--tp_size", "2",
                        "--", "--modes", "tp_sp_async", "--num_hidden_layers", "1", "--seq_len", "16",
                        "--hidden_size", "64", "--vocab_size", "128", "--warmup_iters", "1", "--benchmark_iters", "1",
                        "--output_csv", str(csv_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    d = tmp_path / "p_profiles" / "tp_sp_async_num_hidden_layers1"
    assert {"trace_rank0.json", "trace_rank1.json", "report.json", "timeline.png"} <= {p.name for p in d.iterdir()}
    compared = json.loads((tmp_path / "p_profile.json").read_text())
    assert compared["tp_sp_async:1"]["collectives"]["all_gather"]["count"] == 12 * 1 + 2  # see expected_counts
    assert (tmp_path / "p_timeline.png").exists() and "tp_sp_async:1" in r.stdout


def test_benchmark_kind_profile_of_a_pipeline_traces_every_stage_with_its_microbatches(tmp_path):
    csv_path = tmp_path / "p.csv"
    r = subprocess.run([sys.executable, "-m", "evaluation.parallel", "benchmark", "--kind", "profile", "--pp_size", "2",
                        "--", "--modes", "pp", "--num_hidden_layers", "2", "--seq_len", "16", "--hidden_size", "64",
                        "--num_attention_heads", "4", "--num_key_value_heads", "2", "--vocab_size", "128",
                        "--num_microbatches", "3", "--pp_schedule", "1f1b", "--warmup_iters", "1",
                        "--benchmark_iters", "1", "--output_csv", str(csv_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    d = tmp_path / "p_profiles" / "pp_num_hidden_layers2"
    for stage in range(2):  # stage p holds block p; every microbatch goes through it forward and backward
        with open(d / f"trace_rank{stage}.json") as f:
            names = [e["name"] for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        assert names.count("forward") == names.count("backward") == 3, stage
        assert names.count(f"block {stage} forward") == names.count(f"block {stage} backward") == 3, stage
        assert f"block {1 - stage} forward" not in names and "comm:send_recv" in names
    assert len(json.loads((d / "report.json").read_text())["ranks"]) == 2
    with open(csv_path) as f:
        row = next(csv.DictReader(f))
    assert row["status"] == "ok" and row["in_flight_per_stage"] == "2 1"  # 1F1B: min(P - p, M)
    assert len(row["idle_pct_per_stage"].split()) == 2
