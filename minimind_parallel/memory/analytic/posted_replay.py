"""The posted orders replayed (interleaved's model chunks, zb's W steps): every moment of one
stage's step, unit by unit.

The moments are schedule_replay.py's, summed per (microbatch, chunk) unit instead of counted
per microbatch: each held unit keeps what its chunk's forward saved (`chunks[c]`, the sizes of
virtual stage c P + p as a stage of a P V-stage pipeline: its blocks, the received input, the
embedding on virtual stage 0, the head and loss on the last), and a chunk's grads exist from
its first backward on. Two more things are alive between actions:

- what a posted send sent, until its release point (pipeline_parallel.releases): a sent output
  whole, [S(/T), B, H], instead of its one-element stand-in, an input grad of that shape;
- zb: every unit B'd and not W'd keeps its deferred wgrads' inputs (`w_pending`) until its W.
"""
from __future__ import annotations

from dataclasses import replace

from ...pipeline_parallel.order import Action, Step
from .backward_moments import backward_moments
from .schedule_replay import _batch_saved, _forward_moment
from .stage_sizes import StageSizes


def _sent(s: StageSizes, action: Action) -> int:
    """The bytes a posted send keeps alive past its stand-in until released: a sent output
    (whole, its stand-in counted in held_temps) or an input grad."""
    boundary = s.b * s.nn * s.hid
    return boundary - s.b if action.step is Step.FORWARD else boundary


def replay_posted(s: StageSizes, chunks: list[StageSizes], order: list[Action], releases: dict[int, int],
                  w_pending=None) -> tuple[dict, dict]:
    """Every moment of the stage's posted `order` -> (grads, activations, temporaries), and how
    many units each finds held. `s`: the stage's sizes (batch, loss scalars), `chunks[c]` those of
    its chunk c, `releases` the send release points, `w_pending(chunk)` the W-pending bytes of one
    unit (None: no W steps)."""
    moments, in_flight = {}, {}
    held: dict = {}                 # unit -> chunk sizes, forwarded and not backwarded
    backwarded: set = set()         # chunks whose grads exist
    sending: dict = {}              # index of a sending action -> bytes alive until its release
    last = chunks[-1]
    n_fwd_last = 0
    inner = [backward_moments(cs) for cs in chunks]
    for k, action in enumerate(order):
        i, c = action.unit
        cs = chunks[c]
        sending = {j: v for j, v in sending.items() if releases[j] > k}   # released after this receive
        grads = sum(chunks[x].param_bytes for x in backwarded)
        # the last chunk's targets are saved from its first forward on (the ids from the first's)
        loss_seen = n_fwd_last > 0 or (action.step is Step.FORWARD and cs.last)
        saved = _batch_saved(s) - (0 if loss_seen else _batch_saved(replace(s, first=False)))
        saved += 4 * s.mb if s.last and s.weight == 0 and n_fwd_last else 0
        extra = s.batch - saved + s.ddp_buckets + (n_fwd_last * s.loss_scalar if s.last else 0)
        extra += sum(sending.values())
        held.pop(action.unit, None)       # a backward's own unit: in its moments' own terms
        others_acts = sum(u.held - u.held_temps for u in held.values())
        others_temps = sum(u.held_temps for u in held.values())
        if action.step is Step.FORWARD:
            g, a, t = _forward_moment(cs, 0, grads, saved, extra)
            moments[f"forward_end[{i}.{c}]"] = (g, a + others_acts, t + others_temps)
            in_flight[f"forward_end[{i}.{c}]"] = len(held) + 1
            held[action.unit] = cs
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
        if releases.get(k) is not None:
            sending[k] = _sent(cs, action)
    return moments, in_flight
