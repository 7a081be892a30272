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
and the deferred grads exist from the stage's first W on. The MoE model: predict.py adds the first
microbatch's aux terms to every moment (moe_sizes.moe_temporaries), the walk what each unit adds
beyond them, as schedule_replay.py counts per microbatch: every finished forward its reported aux
share, every held unit its aux backward root (the last chunk: its objective), an earlier chunk's
backward its aux seed, less what the end of a unit's forward has not made yet.

The replay (`walk`) reads the sizes only through `UnitTerms` (each chunk's) and `StageTerms`
(the stage's), and only adds and subtracts them and multiplies them by counts: every moment is
a sum of those terms with integer coefficients that depend on the order alone. That is what
posted_peak.py remembers across layouts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...pipeline_parallel.order import Action, Step
from .backward_moments import backward_moments
from .moe_forward_moments import combine_beyond_forward_end
from .schedule_replay import (aux_share, backward_seed, batch_saved, forward_moment, moe_held, moe_lingering, moe_unmade,
                              targets_saved)
from .stage_sizes import StageSizes
from .zero_bubble_moments import deferred_grads, pending, weight_moments, zb_backward_moments


def _sent(s: StageSizes, action: Action) -> int:
    """The bytes a posted send keeps alive past its stand-in until released: a sent output
    (whole, its stand-in counted in held_temps) or an input grad."""
    boundary = s.b * s.nn * s.hid
    return boundary - s.b if action.step is Step.FORWARD else boundary


@dataclass(frozen=True)
class UnitTerms:
    """What a unit of one chunk adds to the moments it is alive in (bytes). The backward and W
    moments are (label, (grads, activations, temporaries)) in their order: `backward_first` at
    the chunk's first backward (its grads made: the grads term counts), `backward_later` at the
    later ones (it does not); `weight_first` at the stage's first W, `weight_later` after."""

    last: bool                  # the chunk holds the model's head (the last virtual stage)
    held_acts: int              # forwarded and not backwarded: its activations, temporaries
    held_temps: int
    param_bytes: int            # its chunk's grads, once they exist
    deferred: int               # zb: the weight grads W makes (none before the stage's first W)
    pending_x: int              # zb: (X, dY) kept from its B to its W
    pending_dy: int
    sent_forward: int           # what its forward's / backward's posted send keeps alive
    sent_backward: int
    forward_end: tuple          # the end of its forward, held units and the stage's terms aside
    backward_first: tuple
    backward_later: tuple
    weight_first: tuple
    weight_later: tuple
    # MoE (0 for a dense chunk), beyond the first microbatch's terms predict.py adds to every moment:
    moe_held: int = 0           # a held unit's aux backward root (the last chunk: its objective)
    moe_seed: int = 0           # an earlier chunk's backward: its aux loss's seed
    moe_unmade: int = 0         # the end of its forward: what those terms count that is not made yet
    moe_unmade_first: int = 0   # more, while no forward has finished on the stage
    moe_linger_acts: int = 0    # its received input past its backward, if the chunk's last forward's
    moe_linger_temps: int = 0   # (until the chunk's next forward: schedule_replay.moe_lingering)
    moe_combine: tuple = ()     # inside its top MoE layer's combine, beyond forward_end: (the chunk's first
    # forward, a later one), each None where not modelled (moe_forward_moments)


@dataclass(frozen=True)
class StageTerms:
    """The stage's own terms: the last stage's flags, the batch batch_saved files under activations
    (and the last stage's share of it, the targets, until its first forward of the head), the
    fp32 loss weights (filed once a loss scaling saves them), the batch, DDP's buckets, one loss."""

    last: bool
    weightless: bool            # the loss weight is not cast (fp32): the weights are filed as saved
    saved: int
    targets: int
    loss_weights: int
    batch: int
    ddp_buckets: int
    loss_scalar: int
    aux_share: int = 0          # MoE: each finished forward's reported aux share, beyond the first's


def unit_terms(cs: StageSizes, zb: bool) -> UnitTerms:
    """A chunk's terms, from its sizes (zb: B's moments and the W steps')."""
    inner = backward_moments(cs)
    if zb:
        inner = zb_backward_moments(cs, inner)
    moments = tuple(inner.items())
    x, dy = pending(cs) if zb else (0, 0)
    weights = (tuple(weight_moments(cs, first=True)), tuple(weight_moments(cs, first=False))) if zb else ((), ())
    unmade, unmade_first = moe_unmade(cs)
    linger_acts, linger_temps = moe_lingering(cs)
    return UnitTerms(last=cs.last, held_acts=cs.held - cs.held_temps, held_temps=cs.held_temps,
                     param_bytes=cs.param_bytes, deferred=deferred_grads(cs) if zb else 0,
                     pending_x=x, pending_dy=dy, sent_forward=_sent(cs, Action(Step.FORWARD, 0)),
                     sent_backward=_sent(cs, Action(Step.BACKWARD, 0)),
                     # forward_moment is its arguments plus the chunk's own terms
                     forward_end=forward_moment(cs, 0, 0, 0, 0), backward_first=moments, backward_later=moments,
                     weight_first=tuple(enumerate(weights[0])), weight_later=tuple(enumerate(weights[1])),
                     moe_held=moe_held(cs), moe_seed=0 if cs.last else backward_seed(cs), moe_unmade=unmade,
                     moe_unmade_first=unmade_first, moe_linger_acts=linger_acts, moe_linger_temps=linger_temps,
                     moe_combine=(combine_beyond_forward_end(cs, first=True), combine_beyond_forward_end(cs, first=False)))


def stage_terms(s: StageSizes) -> StageTerms:
    return StageTerms(last=s.last, weightless=s.weight == 0, saved=batch_saved(s),
                      targets=targets_saved(s),
                      loss_weights=4 * s.mb, batch=s.batch, ddp_buckets=s.ddp_buckets, loss_scalar=s.loss_scalar,
                      aux_share=aux_share(s))


class _Sums:
    """Two running sums (bytes), added to and taken from as units come and go."""

    def __init__(self):
        self.first = self.second = 0

    def add(self, first, second) -> None:
        self.first, self.second = self.first + first, self.second + second

    def drop(self, first, second) -> None:
        self.first, self.second = self.first - first, self.second - second


# emit(step, label, unit, (grads, activations, temporaries), units in flight)
Emit = Callable[[Step, object, tuple, tuple, int], None]


def walk(st: StageTerms, units: list[UnitTerms] | dict[tuple, UnitTerms], order: list[Action],
         releases: dict[int, int], emit: Emit) -> None:
    """Every moment of the stage's posted `order`, in order, to `emit`; `units[c]`: chunk c's terms
    (a dict: `units[(i, c)]` unit (i, c)'s own), `releases` the send release points. Only sums of
    the terms (times counts): see the module."""
    held: dict = {}                 # unit -> its terms, forwarded and not backwarded
    backwarded: set = set()         # chunks whose grads exist
    made = deferred = 0             # their grads, and the share W makes
    releasing: dict = {}            # action index -> [bytes a posted send keeps alive until then]
    sent = 0                        # what the sends not released yet keep alive
    n_fwd_last = n_fwd = 0
    moe_held = 0                    # the held units' MoE terms
    last_forward: dict = {}         # chunk -> its last forwarded unit
    lingering = _Sums()             # MoE: the received inputs kept past their backward
    lingers: dict = {}              # chunk -> its unit's (activations, temporaries) kept so
    waiting: dict = {}              # unit -> (X, dY) from its B to its W
    weighted = False                # a W has run: the deferred grads exist
    held_sums = _Sums()             # the held units' (activations, temporaries)
    waiting_sums = _Sums()          # the waiting units' (X, dY)
    zb = is_zero_bubble(order)
    per_unit = isinstance(units, dict)
    for k, action in enumerate(order):
        unit = action.unit
        u = units[unit] if per_unit else units[unit[1]]
        for v in releasing.pop(k, ()):   # released after this receive
            sent -= v
        grads = made - (0 if weighted else deferred)      # zb: the deferred weight grads from the stage's first W on
        # the last chunk's targets are saved from its first forward on (the ids from the first's)
        loss_seen = n_fwd_last > 0 or (action.step is Step.FORWARD and u.last)
        saved = st.saved - (0 if loss_seen else st.targets)
        saved += st.loss_weights if st.last and st.weightless and n_fwd_last else 0
        extra = st.batch - saved + st.ddp_buckets + (n_fwd_last * st.loss_scalar if st.last else 0) + sent
        if unit in held:           # a backward's own unit: in its moments' own terms
            del held[unit]
            held_sums.drop(u.held_acts, u.held_temps)
            moe_held -= u.moe_held
        if action.step is Step.FORWARD and unit[1] in lingers:   # its layers' new aux losses free the last one's
            lingering.drop(*lingers.pop(unit[1]))
        # MoE: the aux shares and the other held units' terms beyond the first microbatch's
        extra += max(n_fwd - 1, 0) * st.aux_share + moe_held + lingering.second
        saved += lingering.first
        x_u, dy_u = waiting.pop(unit, (0, 0)) if action.step is Step.WEIGHT else (0, 0)
        waiting_sums.drop(x_u, dy_u)
        others_acts = held_sums.first + waiting_sums.first
        others_temps = held_sums.second + waiting_sums.second
        if action.step is Step.WEIGHT:
            for j, (w_made, x_freed, temp) in (u.weight_later if weighted else u.weight_first):
                emit(Step.WEIGHT, j, unit, (grads + w_made, saved + others_acts + x_u - x_freed,
                                            extra + others_temps + dy_u + temp), len(held))
            weighted = True
            continue
        if action.step is Step.FORWARD:
            g, a, t = u.forward_end
            t -= u.moe_unmade + (u.moe_unmade_first if n_fwd == 0 else 0)
            emit(Step.FORWARD, None, unit, (grads + g, saved + a + others_acts, extra + t + others_temps), len(held) + 1)
            combine = u.moe_combine[unit[1] in last_forward] if u.moe_combine else None
            if combine is not None:
                emit(Step.FORWARD, "moe_combine", unit, (grads + g, saved + a + others_acts + combine[0],
                                                         extra + t + others_temps + combine[1]), len(held) + 1)
            held[unit] = u
            held_sums.add(u.held_acts, u.held_temps)
            moe_held += u.moe_held
            n_fwd_last += u.last
            n_fwd += 1
            last_forward[unit[1]] = unit
            sending = u.sent_forward
        else:
            extra += st.loss_scalar if u.last and st.last else u.moe_seed
            new = unit[1] not in backwarded
            for name, (new_grads, a, temp) in (u.backward_first if new else u.backward_later):
                emit(Step.BACKWARD, name, unit, (grads + new_grads if new else grads, saved + others_acts + a - u.held_temps,
                                                 extra + temp + others_temps + u.held_temps), len(held) + 1)
            if last_forward.get(unit[1]) == unit:
                lingers[unit[1]] = (u.moe_linger_acts, u.moe_linger_temps)
                lingering.add(*lingers[unit[1]])
            if new:
                backwarded.add(unit[1])
                made, deferred = made + u.param_bytes, deferred + u.deferred
            sending = u.sent_backward
            if zb:
                waiting[unit] = (u.pending_x, u.pending_dy)
                waiting_sums.add(u.pending_x, u.pending_dy)
        if releases.get(k) is not None:
            at = max(releases[k], k + 1)
            releasing.setdefault(at, []).append(sending)
            sent += sending


def replay_posted(s: StageSizes, chunks: list[StageSizes], order: list[Action],
                  releases: dict[int, int], each: list[list[StageSizes]] | None = None) -> tuple[dict, dict]:
    """Every moment of the stage's posted `order` (chunks or W steps) -> (grads, activations,
    temporaries), and how many units each finds held. `s`: the stage's sizes (batch, loss
    scalars), `chunks[c]` those of its chunk c, `releases` the send release points. `each[i][c]`:
    unit (i, c)'s own sizes (MoE: a routing per microbatch), in place of `chunks`."""
    moments, in_flight = {}, {}

    def emit(step: Step, label, unit: tuple, moment: tuple, n: int) -> None:
        i, c = unit
        name = (f"{label or 'forward_end'}[{i}.{c}]" if step is Step.FORWARD else f"weight[{i}.{c}]#{label}"
                if step is Step.WEIGHT else f"{label}[{i}.{c}]")
        moments[name], in_flight[name] = moment, n

    zb = is_zero_bubble(order)
    units = ([unit_terms(cs, zb) for cs in chunks] if each is None else
             {(i, c): unit_terms(cs, zb) for i, mine in enumerate(each) for c, cs in enumerate(mine)})
    walk(stage_terms(s), units, order, releases, emit)
    return moments, in_flight


def is_zero_bubble(order) -> bool:
    """An order with W steps: its B steps defer the weight grads."""
    return any(a.step is Step.WEIGHT for a in order)
