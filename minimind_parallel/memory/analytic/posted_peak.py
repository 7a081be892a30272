"""The posted replay's peak alone, remembered across layouts: what the planner asks of the
interleaved and zb orders, to the byte what replay_posted.py's every moment gives.

posted_replay.walk reads a stage's sizes only through its terms (`UnitTerms` of each chunk,
`StageTerms`), adding them and multiplying them by counts, and branches only on the order and
on flags. So every moment is an integer row of coefficients times the vector of the terms, and
the rows depend on the order (P, stage, M, schedule, V), which chunks are of one kind, and the
flags alone: `_moments` finds them once, by walking the order with each term a separate digit
of one Python integer (base 2^32, coefficients well inside +-2^31), and a layout's moments are
then one integer matrix-vector product (numpy, int64: exact).

Two reductions keep the rows few, each exact:
- a backward's (or W's) moments share everything but their own part, so only the first of its
  largest can be the step's first largest: each chunk's list is cut to that moment (`_best`,
  by the score the peak is taken by: grads counted under DDP, not under --zero, where the grads
  are a constant buffer) before the walk;
- the virtual stages that are neither the first nor the last and have as many layers have the
  same sizes (their parameters' names aside): one kind (remembered_sizes.chunk_kinds), whose
  terms are one set of digits.
The first largest row is the peak, as `max` over the full replay's moments in their order.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from ...pipeline_parallel.order import Step
from .orders import stage_order, stage_releases
from .posted_replay import StageTerms, UnitTerms, is_zero_bubble, stage_terms, walk
from .remembered_sizes import SizesKind
from .stage_sizes import StageSizes

DIGIT = 32                                  # bits per term's coefficient
UNIT_LEAVES = 33                            # the numbers of one UnitTerms with one moment per list
STAGE_LEAVES = 7


def _b_scores(entries: tuple, grads_count: bool) -> list[int]:
    """A backward's moments' scores: grads (counted or not), activations, temporaries."""
    return [g + a + t for _, (g, a, t) in entries] if grads_count else [a + t for _, (_, a, t) in entries]


def _w_scores(entries: tuple, grads_count: bool) -> list[int]:
    """A W step's moments' scores: the grads it made (counted or not), less the inputs it freed, its temporaries."""
    if grads_count:
        return [made - x_freed + temp for _, (made, x_freed, temp) in entries]
    return [temp - x_freed for _, (_, x_freed, temp) in entries]


def _best(entries: tuple, scores: list[int]) -> tuple:
    """The first of the largest moments of one action's list (as `max` keeps the first)."""
    return (entries[scores.index(max(scores))],) if entries else ()


def _cut(u: UnitTerms, grads_count: bool) -> UnitTerms:
    """`u` with each list cut to its first largest moment (a later backward's grads are not its own)."""
    return replace(u, backward_first=_best(u.backward_first, _b_scores(u.backward_first, grads_count)),
                   backward_later=_best(u.backward_later, _b_scores(u.backward_later, False)),
                   weight_first=_best(u.weight_first, _w_scores(u.weight_first, grads_count)),
                   weight_later=_best(u.weight_later, _w_scores(u.weight_later, grads_count)))


def _one(entries: tuple) -> tuple:
    return entries[0][1] if entries else (0, 0, 0)


def _unit_leaves(u: UnitTerms) -> list[int]:
    return [u.held_acts, u.held_temps, u.param_bytes, u.deferred, u.pending_x, u.pending_dy, u.sent_forward,
            u.sent_backward, *u.forward_end, *_one(u.backward_first), *_one(u.backward_later),
            *_one(u.weight_first), *_one(u.weight_later), u.moe_held, u.moe_seed, u.moe_unmade, u.moe_unmade_first,
            u.moe_linger_acts, u.moe_linger_temps, *_combine(u)]


def _combine(u: UnitTerms) -> list[int]:
    """The MoE combine's (activations, temporaries) beyond forward_end, at the chunk's first forward
    and a later one (0 where not modelled: the walk then emits no such moment, `combines`)."""
    return [x for part in u.moe_combine for x in part] if _combines(u) else [0, 0, 0, 0]


def _combines(u: UnitTerms) -> bool:
    """Whether the walk emits the unit's top MoE layer's combine (moe_forward_moments)."""
    return bool(u.moe_combine) and u.moe_combine[0] is not None


def _stage_leaves(st: StageTerms) -> list[int]:
    return [st.saved, st.targets, st.loss_weights, st.batch, st.ddp_buckets, st.loss_scalar, st.aux_share]


def _symbolic_unit(last: bool, first_leaf: int, combine: bool = False) -> UnitTerms:
    d = [1 << (DIGIT * (first_leaf + j)) for j in range(UNIT_LEAVES)]
    return UnitTerms(last=last, held_acts=d[0], held_temps=d[1], param_bytes=d[2], deferred=d[3], pending_x=d[4],
                     pending_dy=d[5], sent_forward=d[6], sent_backward=d[7], forward_end=tuple(d[8:11]),
                     backward_first=(("first", tuple(d[11:14])),), backward_later=(("later", tuple(d[14:17])),),
                     weight_first=(("first", tuple(d[17:20])),), weight_later=(("later", tuple(d[20:23])),),
                     moe_held=d[23], moe_seed=d[24], moe_unmade=d[25], moe_unmade_first=d[26],
                     moe_linger_acts=d[27], moe_linger_temps=d[28],
                     moe_combine=((d[29], d[30]), (d[31], d[32])) if combine else ())


@dataclass(frozen=True)
class _Moments:
    """A stage's moments as rows of coefficients over the terms: grads, activations, temporaries
    (int64 [R, F]), the scores with and without the grads, and what names each row."""

    grads: np.ndarray
    acts: np.ndarray
    temps: np.ndarray
    with_grads: np.ndarray
    without_grads: np.ndarray
    rows: tuple                 # (step, "first" / "later" / None, unit, units in flight) per row
    parts: np.ndarray           # grads, acts, temps stacked: [3, R, F]


@functools.lru_cache(maxsize=4096)
def _moments(order_key: tuple, pattern: tuple, lasts: tuple, stage_last: bool, weightless: bool,
             combines: tuple = ()) -> _Moments:
    """The moments of the stage `order_key` = (P, stage, M, schedule, V) whose chunk c is of kind
    pattern[c] (`lasts[kind]`: it holds the head; `combines[kind]`: its forward's MoE combine is a
    moment), on the last stage or not, its loss weight cast or not."""
    pp, stage, m, schedule, v = order_key
    order = stage_order(pp, stage, m, schedule, v)
    releases = stage_releases(pp, m, schedule, v)[stage]
    kinds = [_symbolic_unit(last, UNIT_LEAVES * k, k < len(combines) and combines[k]) for k, last in enumerate(lasts)]
    base = UNIT_LEAVES * len(lasts)
    d = [1 << (DIGIT * (base + j)) for j in range(STAGE_LEAVES)]
    st = StageTerms(last=stage_last, weightless=weightless, saved=d[0], targets=d[1], loss_weights=d[2], batch=d[3],
                    ddp_buckets=d[4], loss_scalar=d[5], aux_share=d[6])
    leaves = base + STAGE_LEAVES
    half = sum(1 << (DIGIT * j + DIGIT - 1) for j in range(leaves))   # each digit's c + 2^31 >= 0: no borrows
    rows, values = [], []

    def emit(step: Step, label, unit: tuple, moment: tuple, n: int) -> None:
        rows.append((step, label, unit, n))
        values.append(moment)

    walk(st, [kinds[k] for k in pattern], order, releases, emit)

    def decode(x: int) -> np.ndarray:
        digits = np.frombuffer((x + half).to_bytes(leaves * DIGIT // 8, "little"), dtype="<u4")
        return digits.astype(np.int64) - (1 << (DIGIT - 1))

    g, a, t = (np.array([decode(v[i]) for v in values], dtype=np.int64).reshape(len(values), leaves)
               for i in range(3))
    return _Moments(grads=g, acts=a, temps=t, with_grads=g + a + t, without_grads=a + t, rows=tuple(rows),
                    parts=np.stack((g, a, t)))


def _rows(s: StageSizes, chunks: list[SizesKind], order_key: tuple, grads_count: bool) -> tuple:
    """The stage's rows of moments, its terms (int64) and its chunks' cut terms, by kind."""
    pattern, lasts, units, leaves = _chunk_terms(tuple(chunks), _zero_bubble(order_key), grads_count)
    kinds = [units[pattern.index(k)] for k in range(len(lasts))]   # each kind's cut terms
    st = stage_terms(s)
    m = _moments(order_key, pattern, lasts, st.last, st.weightless, tuple(_combines(u) for u in kinds))
    f = np.array(leaves + _stage_leaves(st), dtype=np.int64)
    return m, f, units


@functools.lru_cache(maxsize=1 << 14)
def _chunk_terms(chunks: tuple[SizesKind, ...], zb: bool, grads_count: bool) -> tuple:
    """The chunks' kinds in order (`pattern`: each chunk's kind, by first appearance), whether each
    kind holds the head, each chunk's cut terms, and the kinds' leaves in order: the layouts of a
    stage share their chunks' kinds (remembered_sizes.chunk_kinds), one tuple of objects."""
    distinct: dict = {}
    for kind in chunks:
        distinct.setdefault(id(kind), kind)
    ids = list(distinct)
    pattern = tuple(ids.index(id(kind)) for kind in chunks)
    units, leaves = [], []
    for kind in distinct.values():
        key = ("cut", zb, grads_count)
        if key not in kind.derived:
            cut = _cut(kind.terms(zb), grads_count)
            kind.derived[key] = cut, _unit_leaves(cut)
        units.append(kind.derived[key][0])
        leaves += kind.derived[key][1]
    return pattern, tuple(u.last for u in units), [units[k] for k in pattern], leaves


@functools.lru_cache(maxsize=4096)
def _zero_bubble(order_key: tuple) -> bool:
    return is_zero_bubble(stage_order(*order_key))


def _name(row: tuple, units: list[UnitTerms]) -> str:
    """replay_posted's name of a row's moment."""
    step, label, (i, c), _ = row
    u = units[c]
    if step is Step.FORWARD:
        return f"{label or 'forward_end'}[{i}.{c}]"
    if step is Step.WEIGHT:
        return f"weight[{i}.{c}]#{(u.weight_first if label == 'first' else u.weight_later)[0][0]}"
    return f"{(u.backward_first if label == 'first' else u.backward_later)[0][0]}[{i}.{c}]"


def posted_moments(s: StageSizes, chunks: list[SizesKind], order_key: tuple, grads_count: bool) -> dict:
    """Every row's moment: each action's first largest, {name: (grads, activations, temporaries)}."""
    m, f, units = _rows(s, chunks, order_key, grads_count)
    g, a, t = (m.grads @ f).tolist(), (m.acts @ f).tolist(), (m.temps @ f).tolist()
    return {_name(row, units): (g[r], a[r], t[r]) for r, row in enumerate(m.rows)}


def posted_peak(s: StageSizes, chunks: list[SizesKind], order_key: tuple, grads_count: bool) -> tuple[dict, dict]:
    """replay_posted's first largest moment of the stage `order_key` = (P, stage, M, schedule, V),
    by the total with the grads (`grads_count`) or without (under --zero they are a constant
    buffer): ({name: (grads, activations, temporaries)}, {name: units in flight}). `chunks` as
    remembered_sizes.chunk_kinds gives them (equal kinds one object)."""
    m, f, units = _rows(s, chunks, order_key, grads_count)
    return _first_largest(m, f, units, (m.with_grads if grads_count else m.without_grads) @ f)


def _first_largest(m: _Moments, f: np.ndarray, units: list[UnitTerms], totals: np.ndarray) -> tuple[dict, dict]:
    """posted_peak's moment of the first largest of the rows' `totals`."""
    r = int(totals.argmax())
    name = _name(m.rows[r], units)
    return {name: tuple((m.parts[:, r] @ f).tolist())}, {name: m.rows[r][3]}


def remembered_rows(kind: SizesKind, chunks: list[SizesKind], order_key: tuple, grads_count: bool) -> tuple:
    """_rows of the stage `kind`'s sizes and the rows' totals by the score the peak is taken by (the
    grads counted or not), remembered on the kind by the chunks' kinds (the objects themselves: kept
    alive by the key), the order and `grads_count`: a pipeline's zero 0 layout and its zero 3 twin
    (fsdp_remembered.py, which adds FSDP2's gathered bytes to the totals) ask them once."""
    key = ("rows", tuple(chunks), order_key, grads_count)
    if key not in kind.derived:
        m, f, units = _rows(kind.sizes, chunks, order_key, grads_count)
        kind.derived[key] = m, f, units, (m.with_grads if grads_count else m.without_grads) @ f
    return kind.derived[key]


def remembered_posted_peak(kind: SizesKind, chunks: list[SizesKind], order_key: tuple,
                           grads_count: bool) -> tuple[dict, dict]:
    """posted_peak of the stage `kind`'s sizes, remembered on the kind as `remembered_rows` is: the
    layouts of one stage kind that differ only in what the peak does not read (--zero 1 and 2, which
    count no grads there) ask it once. The moments a copy: the caller adds the optimizer's."""
    key = ("posted peak", tuple(chunks), order_key, grads_count)
    if key not in kind.derived:
        kind.derived[key] = _first_largest(*remembered_rows(kind, chunks, order_key, grads_count))
    moments, in_flight = kind.derived[key]
    return dict(moments), in_flight
