"""The collective marker: a collective wrapped in `comm.collective` is seen by the memory
tracker through its `collective_region()`, with no knowledge of the file it lives in."""
import torch

from minimind_parallel.distributed import comm
from minimind_parallel.memory import StorageTracker


def _peak_reading(pre_existing: torch.Tensor, *, inside_collective: bool) -> int:
    with StorageTracker() as tracker:
        if inside_collective:
            with comm.collective("all_to_all"):   # any kind: a new collective needs no tracker change
                out = pre_existing + 1
        else:
            out = pre_existing + 1
    del out
    return tracker.report().peak_bytes


def test_a_buffer_first_seen_inside_a_collective_is_the_backends_and_not_counted():
    backend_buffer = torch.ones(1024)             # 4096 B the tracker never saw made
    assert _peak_reading(backend_buffer, inside_collective=True) == 4096        # the output only
    assert _peak_reading(backend_buffer, inside_collective=False) == 2 * 4096   # backdated as ours


def test_the_marker_is_left_when_the_collective_raises():
    with StorageTracker() as tracker:
        try:
            with comm.collective("all_reduce"):
                raise RuntimeError("peer lost")
        except RuntimeError:
            pass
        assert tracker._collectives == 0
