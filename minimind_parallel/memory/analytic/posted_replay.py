"""The posted orders replayed (interleaved's model chunks): every moment of one stage's step,
unit by unit.

The moments are schedule_replay.py's, summed per (microbatch, chunk) unit instead of counted
per microbatch: each held unit keeps what its chunk's forward saved (`chunks[c]`, the sizes of
virtual stage c P + p as a stage of a P V-stage pipeline: its blocks, the received input, the
embedding on virtual stage 0, the head and loss on the last), and a chunk's grads exist from
its first backward on. And what a posted send sent is alive until its release point
(pipeline_parallel.releases): a sent output whole, [S(/T), B, H], instead of its one-element
stand-in, an input grad of that shape. Under zb (zero_bubble_moments.py) B leaves out the
deferred weight grads, a unit keeps its linears' output grads and inputs from its B to its W,
and the deferred grads exist from the stage's first W on.
"""
from __future__ import annotations

from dataclasses import replace

from ...pipeline_parallel.order import Action, Step
from .backward_moments import backward_moments
from .schedule_replay import batch_saved, forward_moment
from .stage_sizes import StageSizes
from .zero_bubble_moments import deferred_grads, pending, weight_moments, zb_backward_moments


def _sent(s: StageSizes, action: Action) -> int:
    """The bytes a posted send keeps alive past its stand-in until released: a sent output
    (whole, its stand-in counted in held_temps) or an input grad."""
    boundary = s.b * s.nn * s.hid
    return boundary - s.b if action.step is Step.FORWARD else boundary


class _Sums:
    """Two running sums of integers (bytes), added to and taken from as units come and go."""

    def __init__(self):
        self.first = self.second = 0

    def add(self, first: int, second: int) -> None:
        self.first, self.second = self.first + first, self.second + second

    def drop(self, first: int, second: int) -> None:
        self.first, self.second = self.first - first, self.second - second


def replay_posted(s: StageSizes, chunks: list[StageSizes], order: list[Action],
                  releases: dict[int, int]) -> tuple[dict, dict]:
    """Every moment of the stage's posted `order` (chunks or W steps) -> (grads, activations,
    temporaries), and how many units each finds held. `s`: the stage's sizes (batch, loss
    scalars), `chunks[c]` those of its chunk c, `releases` the send release points."""
    moments, in_flight = {}, {}
    held: dict = {}                 # unit -> chunk sizes, forwarded and not backwarded
    backwarded: set = set()         # chunks whose grads exist
    sending: dict = {}              # index of a sending action -> bytes alive until its release
    n_fwd_last = 0
    targets = batch_saved(replace(s, first=False))   # the last stage's share of batch_saved
    zb = any(a.step is Step.WEIGHT for a in order)
    inner = [backward_moments(cs) for cs in chunks]
    if zb:
        inner = [zb_backward_moments(cs, moments_c) for cs, moments_c in zip(chunks, inner)]
    waiting: dict = {}              # unit -> (X, dY) from its B to its W
    weighted = False                # a W has run: the deferred grads exist
    deferred = [deferred_grads(cs) if zb else 0 for cs in chunks]
    held_sums = _Sums()             # the held units' (activations, temporaries), kept as they come and go
    waiting_sums = _Sums()          # the waiting units' (X, dY)
    for k, action in enumerate(order):
        i, c = action.unit
        cs = chunks[c]
        sending = {j: v for j, v in sending.items() if releases[j] > k}   # released after this receive
        # zb: the deferred weight grads from the stage's first W on
        grads = sum(chunks[x].param_bytes - (0 if weighted else deferred[x]) for x in backwarded)
        # the last chunk's targets are saved from its first forward on (the ids from the first's)
        loss_seen = n_fwd_last > 0 or (action.step is Step.FORWARD and cs.last)
        saved = batch_saved(s) - (0 if loss_seen else targets)
        saved += 4 * s.mb if s.last and s.weight == 0 and n_fwd_last else 0
        extra = s.batch - saved + s.ddp_buckets + (n_fwd_last * s.loss_scalar if s.last else 0)
        extra += sum(sending.values())
        if action.unit in held:           # a backward's own unit: in its moments' own terms
            u = held.pop(action.unit)
            held_sums.drop(u.held - u.held_temps, u.held_temps)
        x_u, dy_u = waiting.pop(action.unit, (0, 0)) if action.step is Step.WEIGHT else (0, 0)
        waiting_sums.drop(x_u, dy_u)
        others_acts = held_sums.first + waiting_sums.first
        others_temps = held_sums.second + waiting_sums.second
        if action.step is Step.WEIGHT:
            for j, (made, x_freed, temp) in enumerate(weight_moments(cs, first=not weighted)):
                moments[f"weight[{i}.{c}]#{j}"] = (grads + made, saved + others_acts + x_u - x_freed,
                                                   extra + others_temps + dy_u + temp)
                in_flight[f"weight[{i}.{c}]#{j}"] = len(held)
            weighted = True
            continue
        if action.step is Step.FORWARD:
            g, a, t = forward_moment(cs, 0, grads, saved, extra)
            moments[f"forward_end[{i}.{c}]"] = (g, a + others_acts, t + others_temps)
            in_flight[f"forward_end[{i}.{c}]"] = len(held) + 1
            held[action.unit] = cs
            held_sums.add(cs.held - cs.held_temps, cs.held_temps)
            n_fwd_last += cs.last
            if releases.get(k) is not None:
                sending[k] = _sent(cs, action)
            continue
        extra += s.loss_scalar if cs.last and s.last else 0
        for name, (new_grads, a, temp) in inner[c].items():
            g = grads if c in backwarded else grads + new_grads
            moments[f"{name}[{i}.{c}]"] = (g, saved + others_acts + a - cs.held_temps,
                                           extra + temp + others_temps + cs.held_temps)
            in_flight[f"{name}[{i}.{c}]"] = len(held) + 1
        backwarded.add(c)
        if zb:
            waiting[action.unit] = pending(cs)
            waiting_sums.add(*waiting[action.unit])
        if releases.get(k) is not None:
            sending[k] = _sent(cs, action)
    return moments, in_flight
