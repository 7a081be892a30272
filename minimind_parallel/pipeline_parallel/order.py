"""A pipeline schedule as data: the order of one stage's actions over M microbatches.

A schedule is a function (pp, stage, num_microbatches) -> [Action, ...], this stage's forwards
and backwards in the order it runs them, as torch.distributed.pipelining lists its `_Action`s.
The runtime executes that list (`schedules.run_order`) and the memory model replays it
(`memory.analytic.schedule_replay`), so a new schedule is one function here, its `Schedule`
member (the name `--pp_schedule` takes) and one entry of `SCHEDULES`:

    GPipe        F0 F1 .. F(M-1)  B0 B1 .. B(M-1)          holds M microbatches of activations
    1F1B         warm-up: P-p-1 forwards; steady: one forward then one backward; cool-down:
                 the remaining backwards                   holds at most P - p (stage p)
    interleaved  Megatron-LM's interleaved 1F1B over V model chunks per stage (virtual stages
                 chunk*P + p): the M*V chunk-microbatches in groups of P microbatches per chunk,
                 warm-up 2(P-p-1) + (V-1)P of them; bubble (P-1)/(V M + P-1) of a full stage
    zb           ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): each backward split
                 into B (the input grad, sent upstream at once) and W (the weight grads), W
                 deferred into the bubble; at most P - p microbatches forwarded and not B'd,
                 2P - p - 1 not W'd; bubble (P-1)/(3M + P-1) at equal F, B, W

One stage is plain gradient accumulation whatever the schedule: F0 B0 F1 B1 .. (`schedule_order`).

An action may be `paired`: its send and the next action's receive are posted as one exchange
(pipeline_parallel.p2p). Where two neighbours send to each other at the same point of their
orders -- 1F1B's steady state: stage p sends an activation down while stage p+1 sends a grad up
-- both must post send and receive together, or each waits on its own send forever. Unpaired
actions receive before and send after on their own. The orders with chunks or W steps
(interleaved, zb) post every send without waiting for it (`Action.posted`): a stage then waits
only on the receives it needs, and `simulate` proves every stage's order finishes (no stage waits
on a message its neighbour sends after waiting on it) and that between two stages the messages
are received in the order they are sent (`check_pair_orders`: by issue order alone, whatever
their kind).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum

from ..config import Choice, ConfigError, ParallelConfig


class Schedule(Choice):
    """A pipeline schedule by the name `--pp_schedule` gives it."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZERO_BUBBLE = "zb"


class Step(Enum):
    """What an action computes. Under a zero-bubble schedule BACKWARD computes the input's grad
    only and a later WEIGHT step the weight grads it deferred."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"


@dataclass(frozen=True)
class Action:
    step: Step
    microbatch: int
    chunk: int = 0          # the model chunk of this stage (interleaved: 0 .. V-1, virtual stage chunk*P + p)
    paired: bool = False    # its send and the next action's receive go in one exchange

    def __str__(self) -> str:
        return f"{self.step.value}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")

    @property
    def unit(self) -> tuple[int, int]:
        """What it runs on: (microbatch, chunk)."""
        return self.microbatch, self.chunk


def forward(i: int, *, chunk: int = 0, paired: bool = False) -> Action:
    return Action(Step.FORWARD, i, chunk, paired=paired)


def backward(i: int, *, chunk: int = 0, paired: bool = False) -> Action:
    return Action(Step.BACKWARD, i, chunk, paired=paired)


def weight(i: int, *, chunk: int = 0) -> Action:
    return Action(Step.WEIGHT, i, chunk)


def posted(order: list[Action]) -> bool:
    """Whether the runtime posts this order's sends without waiting for them (an order with chunks
    or W steps); otherwise it exchanges as `paired` says."""
    return any(a.chunk or a.step is Step.WEIGHT for a in order)


def gpipe(pp: int, stage: int, num_microbatches: int) -> list[Action]:
    """All forwards, then all backwards (in the same order); every exchange on its own."""
    m = num_microbatches
    return [forward(i) for i in range(m)] + [backward(i) for i in range(m)]


def one_f_one_b(pp: int, stage: int, num_microbatches: int) -> list[Action]:
    """Warm-up of P-p-1 forwards, steady one-forward-one-backward, cool-down of the rest. In the
    steady state a forward's output goes down with the grad of the oldest held microbatch coming
    up, and that backward's input grad goes up with the next activation coming down (paired);
    the last steady backward sends alone."""
    m = num_microbatches
    warmup = min(pp - stage - 1, m)
    order = [forward(i) for i in range(warmup)]
    for i in range(warmup, m):
        order += [forward(i, paired=True), backward(i - warmup, paired=i < m - 1)]
    return order + [backward(i) for i in range(m - warmup, m)]


def interleaved(pp: int, stage: int, num_microbatches: int, virtual_stages: int = 2) -> list[Action]:
    """Megatron-LM's interleaved 1F1B (`forward_backward_pipelining_with_interleaving`): the
    k-th of the M*V forwards runs microbatch (k // PV) P + k % P on chunk (k % PV) // P, the k-th
    backward the same microbatch on chunk V-1 - (k % PV) // P; warm-up 2(P-p-1) + (V-1)P forwards
    (all of them when that is M*V or more), then one forward and one backward, then the rest of the
    backwards. Needs M a multiple of P (check_schedule)."""
    p, v, total = pp, virtual_stages, num_microbatches * virtual_stages
    warmup = min(2 * (p - stage - 1) + (v - 1) * p, total)

    def unit(k: int, forward_step: bool) -> dict:
        group, within = divmod(k, p * v)
        chunk = within // p
        return dict(i=group * p + within % p, chunk=chunk if forward_step else v - 1 - chunk)

    def f(k: int) -> Action:
        u = unit(k, True)
        return forward(u["i"], chunk=u["chunk"])

    def b(k: int) -> Action:
        u = unit(k, False)
        return backward(u["i"], chunk=u["chunk"])

    order = [f(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [f(warmup + k), b(k)]
    return order + [b(k) for k in range(total - warmup, total)]


def zero_bubble_h1(pp: int, stage: int, num_microbatches: int) -> list[Action]:
    """ZB-H1: every stage's order from one simulated run at unit F, B and W times (`_greedy_zb`):
    a stage runs a B as soon as its grad is there (it unblocks the stage before), else a forward
    while fewer than P - p microbatches are forwarded and not B'd (1F1B's activation bound) and
    fewer than 2P - p - 1 are not W'd (up to P - 1 more held for their W), else the oldest pending W
    (filling what 1F1B leaves idle). Its bubble is ZB-H1's (P-1)(T_F + T_B - T_W): (P-1)/(3M+P-1)
    of the step at equal F, B, W (tests/test_pipeline_interleaved.py simulates it)."""
    return _greedy_zb(pp, num_microbatches)[stage]


def _greedy_zb(pp: int, m: int) -> list[list[Action]]:
    orders = [[] for _ in range(pp)]
    done_f = [[None] * m for _ in range(pp)]     # end time of F(i) on each stage
    done_b = [[None] * m for _ in range(pp)]
    next_f, busy_until = [0] * pp, [0] * pp
    pending_w = [deque() for _ in range(pp)]
    backwarded = [0] * pp
    t = 0
    while any(len(o) < 3 * m for o in orders):
        for p in range(pp):
            if busy_until[p] > t:
                continue
            ready_b = [i for i in range(m) if done_b[p][i] is None and done_f[p][i] is not None
                       and done_f[p][i] <= t and (p == pp - 1 or (done_b[p + 1][i] is not None and done_b[p + 1][i] <= t))]
            activations = next_f[p] - backwarded[p]          # forwarded, not yet B'd: 1F1B's bound P - p
            unfinished = activations + len(pending_w[p])      # and W-pending: at most 2P - p - 1 in all
            f = next_f[p]
            if ready_b:
                i = min(ready_b)
                orders[p].append(backward(i))
                done_b[p][i], busy_until[p] = t + 1, t + 1
                pending_w[p].append(i)
                backwarded[p] += 1
            elif f < m and activations < pp - p and unfinished < 2 * pp - p - 1 and (p == 0 or (done_f[p - 1][f] is not None and done_f[p - 1][f] <= t)):
                orders[p].append(forward(f))
                done_f[p][f], busy_until[p] = t + 1, t + 1
                next_f[p] += 1
            elif pending_w[p]:
                orders[p].append(weight(pending_w[p].popleft()))
                busy_until[p] = t + 1
        t += 1
    return orders


SCHEDULES = {Schedule.GPIPE: gpipe, Schedule.ONE_F_ONE_B: one_f_one_b, Schedule.INTERLEAVED: interleaved,
             Schedule.ZERO_BUBBLE: zero_bubble_h1}


def schedule_order(pp: int, stage: int, num_microbatches: int, schedule: Schedule,
                   virtual_stages: int = 1) -> list[Action]:
    """The actions of stage `stage` of `pp` under `schedule` (a name of SCHEDULES; `virtual_stages`
    model chunks per stage, interleaved only); one stage is plain gradient accumulation (1F1B
    without warm-up: F B F B ..)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    if pp == 1:
        order = one_f_one_b(pp, stage, num_microbatches)
    elif virtual_stages > 1:
        order = SCHEDULES[schedule](pp, stage, num_microbatches, virtual_stages=virtual_stages)
    else:
        order = SCHEDULES[schedule](pp, stage, num_microbatches)
    check_order(order, num_microbatches, virtual_stages)
    return order


def check_schedule(schedule: Schedule, par: ParallelConfig, num_microbatches: int) -> None:
    """Raise ConfigError (one line) where the schedule cannot run the layout's stages and chunks."""
    v, p = par.virtual_stages, par.pp
    if schedule == Schedule.INTERLEAVED and p > 1:
        if v < 2:
            raise ConfigError(f"--pp_schedule interleaved needs --virtual_stages >= 2 (model chunks per stage); "
                              f"got virtual_stages={v}")
        if num_microbatches % p:
            raise ConfigError(f"--pp_schedule interleaved needs num_microbatches a multiple of pp_size (Megatron-LM's "
                              f"groups of P microbatches per chunk); got num_microbatches={num_microbatches}, "
                              f"pp_size={p}")
    elif v > 1:
        raise ConfigError(f"--virtual_stages > 1 needs --pp_schedule interleaved; got virtual_stages={v}, "
                          f"pp_schedule={schedule}")


def check_order(order: list[Action], num_microbatches: int, virtual_stages: int = 1) -> None:
    """Raise ValueError unless every microbatch is forwarded once and backwarded once after its
    forward on every chunk, W'd once after its backward when the order has W steps (all or none),
    and every paired action is followed by the other step (whose input it receives)."""
    seen = {step: set() for step in Step}
    units = {(i, c) for i in range(num_microbatches) for c in range(virtual_stages)}
    after = {Step.FORWARD: None, Step.BACKWARD: Step.FORWARD, Step.WEIGHT: Step.BACKWARD}
    for k, a in enumerate(order):
        done = seen[a.step]
        if a.unit in done or a.unit not in units or (after[a.step] and a.unit not in seen[after[a.step]]):
            raise ValueError(f"a schedule forwards each microbatch once, then backwards it once; got {a} "
                             f"at action {k} of {' '.join(map(str, order))}")
        done.add(a.unit)
        if a.paired and (k + 1 == len(order) or order[k + 1].step is a.step):
            raise ValueError(f"a paired action is followed by the other step; got {a} at action {k} of "
                             f"{' '.join(map(str, order))}")
    if (len(seen[Step.FORWARD]) != len(units) or len(seen[Step.BACKWARD]) != len(units)
            or len(seen[Step.WEIGHT]) not in (0, len(units))):
        raise ValueError(f"a schedule runs all {num_microbatches} microbatches; got {' '.join(map(str, order))}")


def virtual_stage(action: Action, pp: int, stage: int) -> int:
    """The virtual stage the action runs: chunk * P + stage (the stage itself without chunks)."""
    return action.chunk * pp + stage


def simulate(orders: list[list[Action]], pp: int, virtual_stages: int = 1, times: dict | None = None) -> list[list]:
    """Run every stage's order at once with the runtime's rules for posted orders: a send never
    waits, a forward waits for its input activation and a backward for its output's grad (from the
    neighbouring virtual stage), every link (stage -> stage, activation or grad) delivers in send
    order and must be received in that order. `times`: seconds of each Step (default 1 each; an
    order without W steps: B 2, the whole backward). -> per stage, [(start, end), ...] of its
    actions. Raises ValueError when the stages would wait on each other forever or two stages'
    messages are received in another order than sent (check_pair_orders)."""
    check_pair_orders(orders, pp, virtual_stages)
    has_w = any(a.step is Step.WEIGHT for o in orders for a in o)
    times = times or {Step.FORWARD: 1, Step.BACKWARD: 1 if has_w else 2, Step.WEIGHT: 1}
    last = pp * virtual_stages - 1
    links: dict = {}                      # (src, dst, step) -> deque of (unit, arrival time)
    spans = [[] for _ in orders]
    clock, cursor = [0.0] * pp, [0] * pp
    while any(cursor[p] < len(orders[p]) for p in range(pp)):
        progressed = False
        for p in range(pp):
            while cursor[p] < len(orders[p]):
                a = orders[p][cursor[p]]
                vs = virtual_stage(a, pp, p)
                start = clock[p]
                source = ((vs - 1) % pp if a.step is Step.FORWARD and vs > 0 else
                          (vs + 1) % pp if a.step is Step.BACKWARD and vs < last else None)
                if source is not None:
                    queue = links.get((source, p, a.step))
                    if not queue:
                        break                                       # waits on a message
                    arrival = queue.popleft()[1]              # the unit check_pair_orders proved
                    start = max(start, arrival)
                end = start + times[a.step]
                spans[p].append((start, end))
                clock[p], cursor[p], progressed = end, cursor[p] + 1, True
                target = ((vs + 1) if a.step is Step.FORWARD and vs < last else
                          (vs - 1) if a.step is Step.BACKWARD and vs > 0 else None)
                if target is not None:
                    unit = (a.microbatch, target // pp)
                    links.setdefault((p, target % pp, a.step), deque()).append((unit, end))
        if not progressed:
            stuck = ", ".join(f"stage {p} at {orders[p][cursor[p]]}" for p in range(pp) if cursor[p] < len(orders[p]))
            raise ValueError(f"the stages' orders wait on each other forever: {stuck}")
    return spans


def check_pair_orders(orders: list[list[Action]], pp: int, virtual_stages: int = 1) -> None:
    """Raise ValueError unless, between every two stages, the messages one sends (activations and
    grads together, in its order) are the ones the other receives, in its order: matching by issue
    order alone (as NCCL does, ignoring tags) pairs them right too."""
    last = pp * virtual_stages - 1
    sent, received = {}, {}
    for p, order in enumerate(orders):
        for a in order:
            vs = virtual_stage(a, pp, p)
            if a.step is Step.FORWARD:
                if vs > 0:
                    received.setdefault(((vs - 1) % pp, p), []).append((a.step, a.microbatch, vs - 1))
                if vs < last:
                    sent.setdefault((p, (vs + 1) % pp), []).append((a.step, a.microbatch, vs))
            elif a.step is Step.BACKWARD:
                if vs < last:
                    received.setdefault(((vs + 1) % pp, p), []).append((a.step, a.microbatch, vs + 1))
                if vs > 0:
                    sent.setdefault((p, (vs - 1) % pp), []).append((a.step, a.microbatch, vs))
    for pair in sorted(set(sent) | set(received)):
        if sent.get(pair, []) != received.get(pair, []):
            raise ValueError(f"stage {pair[0]} sends stage {pair[1]} its messages in another order than it "
                             f"receives them")


def idle_share(spans: list[list]) -> list[float]:
    """Each stage's idle share of the step (makespan) in a `simulate`d run."""
    makespan = max(end for s in spans for _, end in s)
    return [1 - sum(end - start for start, end in s) / makespan for s in spans]
