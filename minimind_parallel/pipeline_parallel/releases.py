"""Where a posted order frees what it sent: each send's release point, as data.

Under the orders with chunks or W steps (interleaved, zb) every send is posted and not waited
for (`schedules.run_posted`). A sent buffer -- an output activation, an input grad -- must live
until the peer has it; freed "once the send is done" it would die at a moment that depends on
timing, and no memory model could say which microbatches' buffers are alive at a peak. So the
runtime frees each at a fixed action of its own stage's order: the first one whose receive
proves the peer has received it. That is causal, not timed: the message that action receives was
sent after (in happens-before order, Lamport 1978) the peer's receive, so waiting on the send
there returns at once -- the overlap of posted sends is kept and no wait can deadlock.

`release_points` runs every stage's order with vector clocks: each action completes one entry
of its stage's clock, each message carries its sender's clock, and a send is released at the
first receiving action whose merged clock has passed the peer's receiving action. A send that
no later message proves received is released at the end of the step (index len(order)), where
the runtime waits for every send anyway. The memory model (memory.analytic.schedule_replay)
reads the same points.
"""
from __future__ import annotations

from collections import deque

from .order import Action, Step, virtual_stage


def _link(a: Action, pp: int, stage: int, last: int, *, sending: bool) -> tuple | None:
    """The link (src stage, dst stage, step) of what action `a` of `stage` sends (`sending`) or
    receives; None when it has no such message."""
    vs = virtual_stage(a, pp, stage)
    if a.step is Step.FORWARD:
        if sending:
            return (stage, (vs + 1) % pp, a.step) if vs < last else None
        return ((vs - 1) % pp, stage, a.step) if vs > 0 else None
    if a.step is Step.BACKWARD:
        if sending:
            return (stage, (vs - 1) % pp, a.step) if vs > 0 else None
        return ((vs + 1) % pp, stage, a.step) if vs < last else None
    return None


def _receivers(orders: list[list[Action]], pp: int, last: int) -> dict:
    """link -> the indices of the receiving stage's actions that take its messages, in order."""
    out: dict = {}
    for p, order in enumerate(orders):
        for k, a in enumerate(order):
            link = _link(a, pp, p, last, sending=False)
            if link is not None:
                out.setdefault(link, deque()).append(k)
    return out


def release_points(orders: list[list[Action]], pp: int, virtual_stages: int = 1) -> list[dict[int, int]]:
    """Per stage, {index of a sending action: index of the action of the same order after whose
    receive the send is waited and its buffer freed (len(order): at the end of the step)}.
    The orders must finish under posted sends (`order.simulate` checks them)."""
    last = pp * virtual_stages - 1
    receivers = _receivers(orders, pp, last)
    links: dict = {}                                   # link -> deque of the senders' clocks
    clocks = [[0] * pp for _ in range(pp)]
    pending = [[] for _ in range(pp)]                  # per stage: (send index, peer, peer's receiving index)
    releases = [{} for _ in range(pp)]
    cursor = [0] * pp
    while any(cursor[p] < len(orders[p]) for p in range(pp)):
        progressed = False
        for p in range(pp):
            while cursor[p] < len(orders[p]):
                k, a = cursor[p], orders[p][cursor[p]]
                source = _link(a, pp, p, last, sending=False)
                if source is not None:
                    if not links.get(source):
                        break                          # waits on a message not sent yet
                    clocks[p] = [max(x, y) for x, y in zip(clocks[p], links[source].popleft())]
                    pending[p] = _release_known(pending[p], clocks[p], releases[p], k)
                clocks[p][p] = k + 1
                target = _link(a, pp, p, last, sending=True)
                if target is not None:
                    links.setdefault(target, deque()).append(list(clocks[p]))
                    pending[p].append((k, target[1], receivers[target].popleft()))
                cursor[p], progressed = k + 1, True
        if not progressed:
            raise ValueError("the stages' orders wait on each other forever (order.simulate says where)")
    for p in range(pp):
        releases[p].update({k: len(orders[p]) for k, _, _ in pending[p]})
    return releases


def _release_known(pending: list, clock: list[int], releases: dict, at: int) -> list:
    """Release at action `at` every pending send whose peer's receiving action the clock has
    passed; -> those still pending."""
    still = []
    for k, peer, received_at in pending:
        if clock[peer] > received_at:
            releases[k] = at
        else:
            still.append((k, peer, received_at))
    return still


def released_at(releases: dict[int, int]) -> dict[int, list[int]]:
    """{action index: the sending actions released after its receive} (the end: len(order))."""
    out: dict = {}
    for k, j in sorted(releases.items()):
        out.setdefault(j, []).append(k)
    return out
