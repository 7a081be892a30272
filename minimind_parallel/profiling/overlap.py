"""The overlap report: from one rank's Chrome trace, how much communication ran while compute ran.

What is what, in the trace of a rank (profiling/trace.py writes it):

- step windows: the `step <k>` ranges; everything is measured inside them.
- main thread: the thread of the step ranges. It runs forward, backward (on CPU autograd runs
  backward on the calling thread) and the optimizer.
- compute: the union of the main thread's operator events (`cpu_op`), minus the time it spends
  inside communication: `comm:*` ranges (issue, and the blocking wait of a sync collective),
  `wait:*` ranges (blocked on an async handle) and `c10d::*` operators.
- a collective's execution span:
    gloo (CPU): ProcessGroupGloo runs each collective on a worker thread (`pt_gloo_runloop`)
      under a `gloo:<op>` event, from the moment the worker picks it up to its completion.
      That is when it really runs, not when it is enqueued. Its kind comes from the main-thread
      `c10d::` operator that issued it (gloo runs a reduce-scatter as `gloo:all_reduce`): each
      worker event is paired with the earliest unpaired compatible issue before it (FIFO).
      Send/recv run inline on the calling thread: their span is the `c10d::send` / `recv_`
      operator (and a `comm:send*` / `comm:recv*` range where the caller opens one).
    NCCL (GPU): collectives are kernels named `nccl...<Op>...` on a CUDA stream; compute is
      every other kernel.
- exposed communication: time in which some collective (or the main thread's communication
  ranges) is active and no compute is; idle: neither (framework and Python gaps, waiting for a
  peer before a collective even starts). compute + exposed + idle = step time.

Limits: a span includes the time the collective waits for the slowest peer, so "communication
time" is transfer plus skew; on CPU the worker thread competes with compute for the same cores,
so concurrency in time is not free overlap (see docs/profiling.md).
"""
from __future__ import annotations

import json

Interval = tuple[float, float]
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "send_recv", "barrier", "broadcast", "all_to_all",
         "ring_kv", "ring_dkv")
# Asynchronous p2p batches that name their own ranges (context_parallel/ring.py): in flight from
# their `comm:<kind>` issue to the end of the matching `wait:<kind>` (the n-th issue with the n-th wait).
IN_FLIGHT = ("ring_kv", "ring_dkv")
PHASES = ("forward", "backward", "weight", "finalize_grads", "optimizer")   # weight: a zero-bubble W
WGRAD, DGRAD = "async_linear.wgrad", "async_linear.dgrad"

# c10d operator (issued on the main thread) -> kind. Checked in order, by substring.
_ISSUE_KINDS = (("reduce_scatter", "reduce_scatter"), ("allgather", "all_gather"), ("all_gather", "all_gather"),
                ("allreduce", "all_reduce"), ("send", "send_recv"), ("recv", "send_recv"), ("barrier", "barrier"),
                ("broadcast", "broadcast"), ("alltoall", "all_to_all"))
# gloo worker event -> the issue kinds it can execute.
_GLOO_RUNS = {"gloo:all_reduce": ("all_reduce", "reduce_scatter"), "gloo:all_gather": ("all_gather",),
              "gloo:reduce_scatter": ("reduce_scatter",), "gloo:barrier": ("barrier",),
              "gloo:broadcast": ("broadcast",), "gloo:all_to_all": ("all_to_all",)}
_NCCL_KINDS = (("AllGather", "all_gather"), ("ReduceScatter", "reduce_scatter"), ("AllReduce", "all_reduce"),
               ("SendRecv", "send_recv"), ("Send", "send_recv"), ("Recv", "send_recv"),
               ("Broadcast", "broadcast"), ("AllToAll", "all_to_all"))


# ---- interval arithmetic on sorted, disjoint lists ---------------------------------------------

def union(intervals) -> list[Interval]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [tuple(x) for x in out]


def intersect(xs: list[Interval], ys: list[Interval]) -> list[Interval]:
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(xs: list[Interval], ys: list[Interval]) -> list[Interval]:
    out = []
    for a, b in xs:
        for c, d in ys:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def length(xs) -> float:
    return sum(b - a for a, b in xs)


def _inside(t: float, xs: list[Interval]) -> bool:
    return any(a <= t <= b for a, b in xs)


def _share(spans: list[list[Interval]], xs: list[Interval]) -> float:
    """The fraction of the spans' total length that lies inside xs."""
    total = sum(length(s) for s in spans)
    return sum(length(intersect(s, xs)) for s in spans) / total if total else 0.0


# ---- reading a trace ----------------------------------------------------------------------------

def _span(e) -> Interval:
    return (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))


def _kind(name: str, table) -> str | None:
    return next((kind for key, kind in table if key in name), None)


def collectives(events: list[dict], main_tid) -> list[dict]:
    """[{kind, span, issue}] of every collective in the trace, `issue` the time it was issued."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:  # GPU: NCCL kernels
        return [dict(kind=_kind(e["name"], _NCCL_KINDS) or "other", span=_span(e), issue=_span(e)[0])
                for e in kernels if "nccl" in e["name"].lower()]
    main = sorted((e for e in events if e.get("tid") == main_tid), key=lambda e: e["ts"])
    issues = [dict(kind=_kind(e["name"], _ISSUE_KINDS), span=_span(e), issue=float(e["ts"]), paired=False)
              for e in main if e["name"].startswith("c10d::")]
    out = []
    for w in sorted((e for e in events if e["name"] in _GLOO_RUNS and e.get("tid") != main_tid),
                    key=lambda e: e["ts"]):
        start = float(w["ts"])
        issue = next((i for i in issues if not i["paired"] and i["issue"] <= start
                      and i["kind"] in _GLOO_RUNS[w["name"]]), None)
        if issue is None:  # issued outside the dispatcher (e.g. DDP's reducer): trust gloo's name
            out.append(dict(kind=_GLOO_RUNS[w["name"]][0], span=_span(w), issue=start))
        else:
            issue["paired"] = True
            out.append(dict(kind=issue["kind"], span=_span(w), issue=issue["issue"]))
    # send/recv run inline on the caller: the c10d op, stretched to an enclosing comm:send/recv range
    ranges = [_span(e) for e in main if e["name"].startswith(("comm:send", "comm:recv"))]
    in_flight = in_flight_transfers(main)
    issued_async = [c["issue_span"] for c in in_flight]
    out += [dict(kind=c["kind"], span=c["span"], issue=c["issue"]) for c in in_flight]
    for i in issues:
        if i["kind"] == "send_recv" and not any(a <= i["issue"] <= b for a, b in issued_async):
            a, b = i["span"]
            b = max([b] + [d for c, d in ranges if c <= a <= d])
            out.append(dict(kind="send_recv", span=(a, b), issue=a))
    return out


def in_flight_transfers(main: list[dict]) -> list[dict]:
    """[{kind, span, issue, issue_span}] of the asynchronous p2p batches of IN_FLIGHT kinds on
    the main thread (`main`, in time order): each from its issue to the end of its wait."""
    out = []
    for kind in IN_FLIGHT:
        issued = [_span(e) for e in main if e["name"] == f"comm:{kind}"]
        waited = [_span(e) for e in main if e["name"] == f"wait:{kind}"]
        for (a, b), (_, end) in zip(issued, waited):
            out.append(dict(kind=kind, span=(a, max(b, end)), issue=a, issue_span=(a, b)))
    return out


def analyze(trace: dict, *, timeline_step: int = -1) -> dict:
    """The overlap report of one rank's trace (a Chrome trace dict). Times in ms per step."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "ts" in e]
    steps = sorted((e for e in events if e["name"].startswith("step ") and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    if not steps:
        raise ValueError("no `step <k>` ranges in the trace")
    main_tid = steps[0]["tid"]
    windows = union(_span(e) for e in steps)
    main = [e for e in events if e.get("tid") == main_tid]

    def named(*prefixes) -> list[Interval]:
        return union(_span(e) for e in main if e["name"].startswith(prefixes))

    in_comm = named("comm:", "wait:", "c10d::")
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:
        busy = union(_span(e) for e in kernels if "nccl" not in e["name"].lower())
    else:
        busy = subtract(union(_span(e) for e in main if e.get("cat") == "cpu_op"), in_comm)
    compute = intersect(busy, windows)
    wgrad, dgrad = intersect(named(WGRAD), windows), intersect(named(DGRAD), windows)
    phases = {p: intersect(named(p), windows) for p in PHASES}

    colls = [c for c in collectives(events, main_tid) if intersect([c["span"]], windows)]
    comm_active = intersect(union([c["span"] for c in colls] + in_comm), windows)
    n, ms = len(steps), 1e-3 / len(steps)  # us summed over steps -> ms per step
    step_us, compute_us = length(windows), length(compute)
    exposed_us = length(subtract(comm_active, compute))
    report = dict(steps=n, step_ms=step_us * ms, compute_ms=compute_us * ms, exposed_comm_ms=exposed_us * ms,
                  idle_ms=(step_us - compute_us - exposed_us) * ms, collectives={})
    for kind in KINDS:
        mine = [c for c in colls if c["kind"] == kind]
        if not mine:
            continue
        spans = [[c["span"]] for c in mine]
        total = sum(length(s) for s in spans)
        in_phase = {p: [s for c, s in zip(mine, spans) if _inside(c["issue"], phases[p])] for p in PHASES}
        report["collectives"][kind] = dict(
            count=len(mine) / n, time_ms=total * ms, overlap=_share(spans, compute),
            overlap_dgrad=_share(spans, dgrad), overlap_wgrad=_share(spans, wgrad),
            exposed_ms=(1 - _share(spans, compute)) * total * ms,
            wait_ms=length(intersect(named(f"wait:{kind}"), windows)) * ms,
            by_phase={p: len(ss) / n for p, ss in in_phase.items() if ss},
            overlap_by_phase={p: _share(ss, compute) for p, ss in in_phase.items() if ss})
    report["spans"] = [(c["kind"], *c["span"]) for c in sorted(colls, key=lambda c: c["issue"])]
    report["timeline"] = _timeline(_span(steps[timeline_step]), compute, wgrad, phases, colls)
    return report


def _timeline(window: Interval, compute, wgrad, phases, colls) -> dict:
    """Intervals of one step, in ms from its start, for timeline.py."""
    def clip(xs):
        return [((a - window[0]) / 1e3, (b - window[0]) / 1e3) for a, b in intersect(union(xs), [window])]

    return dict(step_ms=(window[1] - window[0]) / 1e3, compute=clip(compute), wgrad=clip(wgrad),
                phases={p: clip(v) for p, v in phases.items()},
                comm={k: clip([c["span"] for c in colls if c["kind"] == k]) for k in KINDS
                      if any(c["kind"] == k for c in colls)})


def analyze_file(path: str) -> dict:
    with open(path) as f:
        return analyze(json.load(f))


# ---- tables -------------------------------------------------------------------------------------

def format_report(report: dict, title: str = "") -> str:
    r = report
    lines = [f"{title}step {r['step_ms']:.2f} ms = compute {r['compute_ms']:.2f} + exposed comm "
             f"{r['exposed_comm_ms']:.2f} + idle {r['idle_ms']:.2f}",
             f"{'collective':<15}{'count':>7}{'time ms':>10}{'overlap':>9}{'w/ dgrad':>10}{'w/ wgrad':>10}"
             f"{'exposed ms':>12}"
             f"{'wait() ms':>11}{'peer wait':>11}  by phase"]
    for kind, c in r["collectives"].items():
        share = c["overlap_by_phase"]
        phases = " ".join(f"{p}={v:g}" + (f" ({share[p]:.0%} ovl)" if share.get(p) else "")
                          for p, v in c["by_phase"].items())
        peer = f"{c['peer_wait_ms']:.2f}" if "peer_wait_ms" in c else "-"
        lines.append(f"{kind:<15}{c['count']:>7g}{c['time_ms']:>10.2f}{c['overlap']:>9.0%}"
                     f"{c['overlap_dgrad']:>10.0%}{c['overlap_wgrad']:>10.0%}"
                     f"{c['exposed_ms']:>12.2f}{c['wait_ms']:>11.2f}{peer:>11}  {phases}")
    return "\n".join(lines)


def peer_wait(reports: list[dict]) -> dict[str, float]:
    """ms per step, per kind, that a collective's span spent waiting for a later peer to start it:
    the n-th collective of every rank is the same call, so max(start over ranks) - own start is
    the wait and end - max(start) the transfer. Valid when the ranks share a clock (one machine);
    {} when the ranks' collective sequences differ (e.g. several TP groups under DP)."""
    seqs = [r["spans"] for r in reports]
    if any([k for k, *_ in s] != [k for k, *_ in seqs[0]] for s in seqs):
        return {}
    out: dict[str, float] = {}
    for same_call in zip(*seqs):
        latest = max(start for _, start, _ in same_call)
        for kind, start, end in same_call:
            out[kind] = out.get(kind, 0.0) + min(latest, end) - start
    return {k: v * 1e-3 / reports[0]["steps"] / len(reports) for k, v in out.items()}


def mean_over_ranks(reports: list[dict]) -> dict:
    """Times and shares averaged over ranks (counts are the same on every rank of a TP layout),
    with each kind's `peer_wait_ms` (see peer_wait) when the ranks can be lined up."""
    first = reports[0]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    out = {k: mean([r[k] for r in reports]) for k in ("step_ms", "compute_ms", "exposed_comm_ms", "idle_ms")}
    out["steps"], out["collectives"] = first["steps"], {}
    waits = peer_wait(reports) if all("spans" in r for r in reports) else {}
    for kind, c in first["collectives"].items():
        present = [r["collectives"][kind] for r in reports if kind in r["collectives"]]
        out["collectives"][kind] = dict(
            count=c["count"], by_phase=c["by_phase"],
            overlap_by_phase={p: mean([x["overlap_by_phase"].get(p, 0.0) for x in present]) for p in c["by_phase"]},
            **{k: mean([x[k] for x in present])
               for k in ("time_ms", "overlap", "overlap_dgrad", "overlap_wgrad", "exposed_ms", "wait_ms")})
        if kind in waits:
            out["collectives"][kind]["peer_wait_ms"] = waits[kind]
    return out


def format_comparison(summaries: dict[str, dict]) -> str:
    """One row per mode: the step split, then per collective count / time / overlap share."""
    kinds = [k for k in KINDS if any(k in s["collectives"] for s in summaries.values())]
    head = f"{'mode':<22}{'step ms':>9}{'compute':>9}{'exposed':>9}{'idle':>8}" + "".join(
        f"  {k + ' n/ms/ovl':>26}" for k in kinds)
    lines = [head, "-" * len(head)]
    for mode, s in summaries.items():
        cells = ""
        for k in kinds:
            c = s["collectives"].get(k)
            cells += f"  {c['count']:>8g} {c['time_ms']:>8.2f} {c['overlap']:>7.0%}" if c else f"  {'-':>26}"
        lines.append(f"{mode:<22}{s['step_ms']:>9.2f}{s['compute_ms']:>9.2f}{s['exposed_comm_ms']:>9.2f}"
                     f"{s['idle_ms']:>8.2f}{cells}")
    return "\n".join(lines)
