"""`paused_collector`: Python's cyclic garbage collector paused for a block of work that makes
many objects in no reference cycle (the planner's predictions, the estimate's fake dispatch),
whose collections would each walk every object alive for nothing."""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def paused_collector():
    """Python's cyclic garbage collector paused (and then as it was): the predictions make millions of
    objects in no cycle (sizes, moments, entries), and each collection it would start walks every
    object alive -- a sixth of the plan's time. Where it turns the collector back on, the objects
    made meanwhile are moved out of the youngest generation unwalked (gc.freeze): re-enabled with
    them there, its next two collections (of the youngest, then the middle generation) would walk
    them all, about 0.7 s after a plan. Where nothing was frozen before, they are then unfrozen
    into the oldest generation (collected, as any old object, by a full collection); where the
    process keeps its objects frozen (cli.process_main), they stay frozen with them."""
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.freeze()
            if not frozen:
                gc.unfreeze()
            gc.enable()
