"""--async_communication is active and overlaps: the order of events in a real backward, and the
same order in a real gloo profile.

The book's claim (MiniMind Parallelism Book, section 4.3; Korthikanti et al. 2022): the dgrad
collective of a column-parallel linear is issued asynchronously, the wgrad GEMM runs while it is
in flight, and only then does backward wait for it. Plain TP: all-reduce of dgrad. SP recompute:
async re-gather of the saved shard, async reduce-scatter of dgrad, wait for the gather, wgrad,
wait for the reduce-scatter. Counting collectives cannot tell this from the synchronous path
(same collectives, same numbers); the order of issue, wgrad and wait can.
"""
import json
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from distributed import run_ranks
from test_profiling import TINY, profile_tp2
from test_sequence_parallel import _block
from minimind_parallel import ParallelConfig
from minimind_parallel.distributed import comm

# S * B = 24 rows: no dgrad GEMM output [S*B, H] has the shape of a column-parallel weight
# [N/T, H] (16, 8, 8, 64, 64 rows), so a GEMM with a weight's shape is a wgrad GEMM.
S, B, H = 8, 3, 32
SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS"}


class _Handle:
    def __init__(self, handle, log, kind):
        self.handle, self.log, self.kind = handle, log, kind

    def wait(self):
        out = self.handle.wait()
        self.log.append(f"{SHORT[self.kind]}<")  # returned from wait: the collective is complete
        return out


def _logging(kind, fn, log):
    """comm.<kind> that logs `XX>` when an async_op=True collective is issued (sync ones are not
    part of the book's order), and `XX<` when its handle's wait returns."""
    def wrapped(*args, async_op=False, **kwargs):
        out = fn(*args, async_op=async_op, **kwargs)
        if not async_op:
            return out
        log.append(f"{SHORT[kind]}>")
        tensor, handle = out
        return tensor, _Handle(handle, log, kind)
    return wrapped


class _WgradGemms(TorchDispatchMode):
    """Logs `W` for every matrix product whose output has the shape of a column-parallel weight."""

    def __init__(self, shapes, log):
        super().__init__()
        self.shapes, self.log = shapes, log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.matmul.default) and tuple(out.shape) in self.shapes:
            self.log.append("W")
        return out


def _backward_events(par):
    """One ParallelBlock's backward on this rank, as a string of events (see _logging, _WgradGemms)."""
    block, cos, sin = _block(par)   # the block of test_sequence_parallel.py (same sizes)
    columns = [block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj,
               block.mlp.gate_proj, block.mlp.up_proj]
    x = torch.randn(S // par.tp if par.sequence_parallel else S, B, H, requires_grad=True)
    y = block(x, cos, sin)
    log = []
    originals = {kind: getattr(comm, name) for kind, name in
                 (("all_reduce", "all_reduce"), ("all_gather", "all_gather_dim0"),
                  ("reduce_scatter", "reduce_scatter_dim0"))}
    try:
        comm.all_reduce = _logging("all_reduce", originals["all_reduce"], log)
        comm.all_gather_dim0 = _logging("all_gather", originals["all_gather"], log)
        comm.reduce_scatter_dim0 = _logging("reduce_scatter", originals["reduce_scatter"], log)
        with _WgradGemms({tuple(l.weight.shape) for l in columns}, log):
            y.square().sum().backward()
    finally:
        comm.all_reduce, comm.all_gather_dim0, comm.reduce_scatter_dim0 = originals.values()
    return " ".join(log)


# One segment per LinearWithAsyncCommunication backward (a linear, or a q/k/v or gate/up group
# under --shared_sp_gather): the wgrad GEMMs (W+) run between the issue (>) and the wait (<).
PLAIN_TP = r"(AR> (W )+AR< ?)+"
SP_RECOMPUTE = r"(AG> RS> AG< (W )+RS< ?)+"


@pytest.mark.parametrize("flags,order,functions", [
    (dict(), PLAIN_TP, 5),
    (dict(sequence_parallel=True), SP_RECOMPUTE, 5),
    (dict(sequence_parallel=True, shared_sp_gather=True), SP_RECOMPUTE, 2),
], ids=["tp_async", "sp_recompute", "sp_recompute_shared"])
def test_async_collective_is_issued_before_the_wgrad_gemm_and_waited_after_it(flags, order, functions):
    par = ParallelConfig(tp=2, async_communication=True, **flags)
    for rank, events in enumerate(run_ranks(_backward_events, 2, par)):
        assert re.fullmatch(order, events), f"rank {rank}: {events}"
        assert events.count("W") == 5, f"rank {rank}: one wgrad GEMM per column-parallel linear: {events}"
        assert events.count("<") == (1 if order == PLAIN_TP else 2) * functions, f"rank {rank}: {events}"


def test_synchronous_path_has_no_async_collective():
    """The same log without --async_communication: the checker above tells the two paths apart."""
    for events in run_ranks(_backward_events, 2, ParallelConfig(tp=2)):
        assert ">" not in events and not re.fullmatch(PLAIN_TP, events)


# ---------------------------------------------------------------- a real gloo profile

ISSUE = {"c10d::allreduce_": "all_reduce", "c10d::_allgather_base_": "all_gather",
         "c10d::_reduce_scatter_base_": "reduce_scatter"}


def _profile(flags, out_dir):
    profile_tp2(flags, out_dir, steps=1)


def _main_thread(trace_path):
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    main = next(e["tid"] for e in events if e["name"] == "step 0")
    return sorted((e for e in events if e.get("tid") == main), key=lambda e: e["ts"])


def _in_flight_around_wgrad(events, kind):
    """For every `async_linear.wgrad` range of the trace: (issue of the `kind` collective before
    it, the wgrad range, the `wait:<kind>` range after it), from the main thread's events."""
    out = []
    for i, e in enumerate(events):
        if e["name"] != "async_linear.wgrad":
            continue
        issue = next(x for x in reversed(events[:i]) if ISSUE.get(x["name"]) == kind)
        wait = next(x for x in events[i + 1:] if x["name"] == f"wait:{kind}")
        out.append((issue, e, wait))
    return out


@pytest.mark.parametrize("flags,kind", [
    (dict(async_communication=True), "all_reduce"),
    (dict(sequence_parallel=True, async_communication=True), "reduce_scatter"),
], ids=["tp_async", "sp_recompute"])
def test_profile_shows_the_dgrad_collective_in_flight_across_the_wgrad_span(tmp_path, flags, kind):
    """In the real trace of each rank, every wgrad span lies inside the time its dgrad collective
    is in flight: issued (the c10d op starts) before the wgrad span opens, waited on (the
    `wait:<kind>` range ends) after it closes, and no wait of that kind in between."""
    run_ranks(_profile, 2, flags, str(tmp_path))
    for rank in range(2):
        events = _main_thread(tmp_path / f"trace_rank{rank}.json")
        triples = _in_flight_around_wgrad(events, kind)
        assert len(triples) == 5 * TINY["num_hidden_layers"], f"rank {rank}: one per column-parallel linear"
        for issue, wgrad, wait in triples:
            wgrad_end = wgrad["ts"] + wgrad["dur"]
            assert issue["ts"] <= wgrad["ts"] and wait["ts"] >= wgrad_end, (rank, issue, wgrad, wait)
            waits_between = [e for e in events if e["name"] == f"wait:{kind}" and issue["ts"] < e["ts"] < wgrad["ts"]]
            assert not waits_between, (rank, waits_between)
