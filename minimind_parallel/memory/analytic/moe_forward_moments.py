"""An MoE layer's own forward at its combine (moe/dispatch.py), on an earlier pipeline stage under
expert parallelism: the one forward moment that can outgrow the end of the forward.

The combine regroups the experts' output [M, H] (M: the rows this rank's experts received) back to
source order, a second [M, H], and makes the reverse all-to-all's receive buffer [R, H] (R = N k,
the rows this rank routed): both [M, H] alive beside everything the layer saved up to its experts.
After it, the layer saves its tail -- the combine's output and the weighted output [R, H] each, the
sorted routing weights [R] and the sort's order (int64 [R]), its aux loss's N and load -- and the
block makes its output: the end of the forward holds those and three [N, H] more (index_add_'s
zeroed output, the residual sum; measured against --estimate, StorageTracker's timeline, fp32 and
bf16, top-1 to top-4, with and without the aux loss and norm_topk_prob, TP, SP, CP, --recompute
selective; not derived). So the combine is the end of the forward, less the tail, plus 2 M H b and
the local experts' counts (int64 [E / ep], 8 E / ep - 4 B of small tensors in all: measured at
1, 2 and 4 local experts): above it when M > R + 2N (a skewed routing, or the balanced one at top-3
and above; at top-2 with one local expert by those few bytes, where it can be a stage's peak:
interleaved and zb at pp4).

Not modelled (no moment): the last stage (its forward ends at the logits, far above), --recompute
full (the forward saves nothing; the re-run inside backward has its own frame), ep 1 (no combine:
the experts' concat is the end's own bytes).
"""
from __future__ import annotations

from ...config import Recompute
from .stage_sizes import StageSizes


def combine_beyond_forward_end(s: StageSizes, *, first: bool) -> tuple[int, int] | None:
    """The stage's top MoE layer's combine against the end of the same forward: (activations,
    temporaries) to add to `forward_end`'s; None where the moment is not modelled (see above).
    `first`: the chunk's first forward of the step; a later one's combine still holds the layer's
    previous tokens per expert (int64 [E]) and aux loss, replaced at the end of its forward."""
    if not s.top_k or s.par.ep == 1 or s.last or s.par.recompute == Recompute.FULL:
        return None
    b, r, nn_, hid = s.b, s.routed_rows, s.nn, s.hid
    m, local = sum(s.expert_rows[-1]), len(s.expert_rows[-1])
    aux_saved = s.aux_backward[0]
    tail = 2 * b * r * hid + b * r + 8 * r + aux_saved
    previous = 0 if first else 8 * local * s.par.ep + (s.f if s.aux_loss_experts else s.b)
    beyond = 2 * b * m * hid - (b * r * hid + 2 * b * nn_ * hid + aux_saved) + 8 * local - 4 + previous
    return -tail, beyond + tail
