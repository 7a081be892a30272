"""A pipeline schedule as data: the order of one stage's actions over M microbatches.

A schedule is a function (pp, stage, num_microbatches) -> [Action, ...], this stage's forwards
and backwards in the order it runs them, as torch.distributed.pipelining lists its `_Action`s.
The runtime executes that list (`schedules.run_order`) and the memory model replays it
(`memory.analytic.schedule_replay`), so a new schedule is one function here, its `Schedule`
member (the name `--pp_schedule` takes) and one entry of `SCHEDULES`:

    GPipe   F0 F1 .. F(M-1)  B0 B1 .. B(M-1)          holds M microbatches of activations
    1F1B    warm-up: P-p-1 forwards; steady: one forward then one backward; cool-down:
            the remaining backwards                   holds at most P - p (stage p)

One stage is plain gradient accumulation whatever the schedule: F0 B0 F1 B1 .. (`schedule_order`).

An action may be `paired`: its send and the next action's receive are posted as one exchange
(pipeline_parallel.p2p). Where two neighbours send to each other at the same point of their
orders -- 1F1B's steady state: stage p sends an activation down while stage p+1 sends a grad up
-- both must post send and receive together, or each waits on its own send forever. Unpaired
actions receive before and send after on their own.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..config import Choice


class Schedule(Choice):
    """A pipeline schedule by the name `--pp_schedule` gives it."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"


class Step(Enum):
    """What an action computes. A zero-bubble schedule would split BACKWARD into the input's
    grad and a later weight-grad step."""

    FORWARD = "F"
    BACKWARD = "B"


@dataclass(frozen=True)
class Action:
    step: Step
    microbatch: int
    chunk: int = 0          # the model chunk of this stage (interleaved schedules; one chunk today)
    paired: bool = False    # its send and the next action's receive go in one exchange

    def __str__(self) -> str:
        return f"{self.step.value}{self.microbatch}"


def forward(i: int, *, paired: bool = False) -> Action:
    return Action(Step.FORWARD, i, paired=paired)


def backward(i: int, *, paired: bool = False) -> Action:
    return Action(Step.BACKWARD, i, paired=paired)


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


SCHEDULES = {Schedule.GPIPE: gpipe, Schedule.ONE_F_ONE_B: one_f_one_b}


def schedule_order(pp: int, stage: int, num_microbatches: int, schedule: Schedule) -> list[Action]:
    """The actions of stage `stage` of `pp` under `schedule` (a name of SCHEDULES); one stage is
    plain gradient accumulation (1F1B without warm-up: F B F B ..)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    order = (SCHEDULES[schedule] if pp > 1 else one_f_one_b)(pp, stage, num_microbatches)
    check_order(order, num_microbatches)
    return order


def check_order(order: list[Action], num_microbatches: int) -> None:
    """Raise ValueError unless every microbatch is forwarded once and backwarded once after its
    forward, and every paired action is followed by the other step (whose input it receives)."""
    forwarded, backwarded = set(), set()
    for k, a in enumerate(order):
        done = forwarded if a.step is Step.FORWARD else backwarded
        if a.microbatch in done or not 0 <= a.microbatch < num_microbatches or (
                a.step is Step.BACKWARD and a.microbatch not in forwarded):
            raise ValueError(f"a schedule forwards each microbatch once, then backwards it once; got {a} "
                             f"at action {k} of {' '.join(map(str, order))}")
        done.add(a.microbatch)
        if a.paired and (k + 1 == len(order) or order[k + 1].step is a.step):
            raise ValueError(f"a paired action is followed by the other step; got {a} at action {k} of "
                             f"{' '.join(map(str, order))}")
    if len(forwarded) != num_microbatches or len(backwarded) != num_microbatches:
        raise ValueError(f"a schedule runs all {num_microbatches} microbatches; got {' '.join(map(str, order))}")
