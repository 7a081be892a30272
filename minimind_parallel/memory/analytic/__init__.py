"""The analytic memory model: bytes by category, activations by saved-tensor kind, and the peak.

Everything is derived from what our code saves for backward (checked with saved-tensor hooks,
see docs/memory.md), per rank. The peak is the largest of a few moments of the step, each a sum
of what is alive then. One file per facet; a new parallelism adds its own:

    saved_kinds.py           what autograd saves, per block and per model, by kind
    stage_sizes.py           the sizes of one pipeline stage every moment is a sum of (`StageSizes`)
    backward_moments.py      one microbatch's backward at its largest moments
    cp_attention_moments.py  context parallelism: inside a block's attention backward
    schedule_replay.py       the stage's schedule replayed (the order the runtime executes), the
                             forward ends and the optimizer step
    posted_replay.py         the posted orders (interleaved's chunks) replayed unit by unit, with
                             each send alive until its release point
    posted_peak.py           the planner's: a posted order's peak alone, its moments remembered
                             as integer rows over the replay's terms
    remembered_sizes.py      the planner's: the sizes its layouts share, made once
    orders.py                the schedule orders and release points, remembered
    predict.py               `predict_memory`: the worst moment of every stage (and CP rank)

The moments are those the tracker found on every configuration tried; tests/test_memory.py
checks the model against it to the byte, peak and breakdown, stage by stage.
"""
from .predict import MemoryPrediction, predict_memory
from .saved_kinds import activations_by_kind, as_dtype

__all__ = ["MemoryPrediction", "activations_by_kind", "as_dtype", "predict_memory"]
