"""The CUDA allocator model (memory/allocator.py) on crafted allocation sequences, each expected
value derived from PyTorch's c10/cuda/CUDACachingAllocator.cpp (round_size, get_allocation_size,
should_split, get_free_block, try_merge_blocks) and aten/src/ATen/cuda/CublasHandlePool.cpp
(parseChosenWorkspaceSize, getCUDABlasLtWorkspaceSize); the recorder that feeds it; and
`--estimate --device cuda` in the benchmark."""
import csv

import pytest
import torch

from minimind_parallel import MiniMindConfig, ParallelConfig, cli
from minimind_parallel.memory.allocator import (AllocationRecorder, CachingAllocatorModel, CudaSetup,
                                                cublas_workspace_bytes, cublaslt_workspace_bytes, predict_cuda_peak,
                                                replay, round_size, segment_size)
from minimind_parallel.memory import predict_memory
from minimind_parallel.memory.estimate import estimate_step_memory
from minimind_parallel.memory.tracker import StorageTracker

KiB, MiB = 1024, 2**20


def test_requests_round_to_512_bytes():
    assert [round_size(n) for n in (1, 511, 512, 513, 1024, 1025)] == [512, 512, 512, 1024, 1024, 1536]


def test_segment_sizes_by_request():
    # small pool: 2 MiB; 1-10 MiB: 20 MiB; from 10 MiB: the request rounded up to 2 MiB
    assert segment_size(512) == segment_size(MiB) == 2 * MiB
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB) == 12 * MiB


def test_small_requests_share_a_2_mib_segment_and_count_rounded():
    a = CachingAllocatorModel()
    a.malloc(1000)
    a.malloc(1000)
    assert (a.allocated, a.reserved) == (2 * 1024, 2 * MiB)   # split at >= 512 bytes left


def test_a_large_block_keeps_up_to_1_mib_it_did_not_ask_for():
    a = CachingAllocatorModel()
    block = a.malloc(11 * MiB + 1)            # rounds to 11 MiB + 512 in a 12 MiB segment
    assert a.allocated == 12 * MiB            # 1 MiB - 512 left: not > 1 MiB, so not split
    a.free(block)
    a.malloc(10 * MiB + 512 * KiB)            # 1.5 MiB left of the cached 12 MiB block: split
    assert (a.allocated, a.reserved) == (10 * MiB + 512 * KiB, 12 * MiB)


def test_expandable_segments_split_large_blocks_at_512_bytes():
    a = CachingAllocatorModel(expandable_segments=True)
    a.malloc(11 * MiB + 1)
    assert a.allocated == 11 * MiB + 512


def test_a_mid_size_request_takes_a_20_mib_segment_and_splits_it():
    a = CachingAllocatorModel()
    a.malloc(MiB + 1)
    assert (a.allocated, a.reserved) == (MiB + 512, 20 * MiB)


def test_best_fit_takes_the_smallest_free_block_that_fits():
    a = CachingAllocatorModel()
    x, y = a.malloc(12 * MiB), a.malloc(16 * MiB)
    a.free(y)
    a.free(x)
    a.malloc(11 * MiB)                         # fits both; the 12 MiB one, 1 MiB left: whole block
    assert (a.allocated, a.reserved) == (12 * MiB, 28 * MiB)
    a.malloc(15 * MiB)                         # the 16 MiB block; 1 MiB left: whole block
    assert (a.allocated, a.reserved) == (28 * MiB, 28 * MiB)


def test_freed_neighbours_merge_into_one_block():
    a = CachingAllocatorModel()
    x, y = a.malloc(2 * MiB), a.malloc(2 * MiB)   # two blocks of one 20 MiB segment, 16 MiB free after
    a.free(x)
    a.free(y)
    a.malloc(19 * MiB + 512 * KiB)                # only the merged 20 MiB block fits: no new segment
    assert (a.allocated, a.reserved) == (20 * MiB, 20 * MiB)


def test_peak_is_the_highest_allocated_since_reset():
    a = CachingAllocatorModel()
    x = a.malloc(4096)
    a.free(x)
    a.reset_peak()
    a.malloc(512)
    assert a.peak == 512


def test_cublas_workspace_sizes():
    assert cublas_workspace_bytes((9, 0)) == 32 * MiB                     # Hopper
    assert cublas_workspace_bytes((8, 0)) == 4096 * KiB * 2 + 16 * KiB * 8  # ":4096:2:16:8"
    assert cublas_workspace_bytes((9, 0), ":4096:2:16:8") == 8 * MiB + 128 * KiB
    assert cublas_workspace_bytes((9, 0), ":0:0") == 0
    assert cublas_workspace_bytes((8, 6), "nonsense") == cublas_workspace_bytes((8, 6))
    assert cublaslt_workspace_bytes(32 * MiB) == MiB                       # 1024 KiB default
    assert cublaslt_workspace_bytes(8 * MiB, "65536") == 8 * MiB            # capped at the cuBLAS one
    assert CudaSetup().workspaces() == [32 * MiB, 32 * MiB]                 # two GEMM threads
    assert CudaSetup.from_env(env={"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0",
                                   "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) == \
        CudaSetup(cublas_workspace_config=":0:0", cublaslt_workspace_size="0", expandable_segments=True)


def _ops():
    a = torch.empty(1000, dtype=torch.uint8)
    b = torch.ones(3000, dtype=torch.uint8) + 1     # the ones() is freed, the sum kept
    del a
    return b


def test_recorder_records_allocations_and_frees_and_reports_as_the_tracker():
    keep = torch.zeros(700, dtype=torch.uint8)
    plain = StorageTracker()
    plain.mark(keep, "params")
    with plain:
        _ops()
    rec = AllocationRecorder()
    rec.mark(keep, "params")
    with rec:
        out = _ops()
        rec.end_step()
    assert rec.report() == plain.report()
    assert rec.before == [(0, 700)]
    kinds = [(e[0], e[2] if e[0] == "alloc" else None) for e in rec.events]
    assert kinds[:4] == [("alloc", 1000), ("alloc", 3000), ("alloc", 3000), ("free", None)]
    assert ("free", None) in kinds[4:] and kinds[-1] == ("step", None)
    # replayed: 700 -> 1024; at the peak 1024 (keep) + 1024 (a) + 2 x 3072
    peak, reserved = replay(rec, CudaSetup(gemm_threads=0), skip_steps=0)
    assert (peak, reserved) == (1024 + 1024 + 2 * 3072, 2 * MiB)
    del out


def test_a_storage_resized_to_nothing_and_back_is_a_free_and_an_alloc():
    """FSDP2 frees a block's gathered parameters by `resize_(0)` of their storages and allocates them
    again by `resize_(n)` (no aten op: the tracker watches `UntypedStorage.resize_`); on CUDA each is
    a free and a malloc of the caching allocator, so the replay holds the block only while it is full."""
    keep = torch.zeros(700, dtype=torch.uint8)
    rec = AllocationRecorder()
    rec.mark(keep, "params")
    with rec:
        st = keep.untyped_storage()
        st.resize_(0)                      # freed
        ones = torch.ones(3000, dtype=torch.uint8)
        st.resize_(2000)                   # allocated again, larger
        rec.end_step()
    assert rec.before == [(0, 700)]
    assert [(e[0], e[2] if e[0] == "alloc" else None) for e in rec.events] == [
        ("free", None), ("alloc", 3000), ("alloc", 2000), ("step", None)]
    assert rec.events[0] == ("free", 0)
    peak, _ = replay(rec, CudaSetup(gemm_threads=0), skip_steps=0)
    assert peak == 3072 + 2048 and rec.report().peak_bytes == 3000 + 2000   # not 1024 + 3072 + 2048
    del ones


def test_a_zero3_steps_recorded_allocations_are_the_memory_models_bytes():
    """--zero 3 (FSDP2) on fake tensors: the recorded allocations and frees, replayed at their requested
    sizes, peak at exactly predict_memory's bytes (the unsharded parameters freed after each block's
    forward and backward: without it they piled up); the allocator replay adds only block rounding."""
    c = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=256, tie_word_embeddings=False)
    par, kw = ParallelConfig(dp=2, zero=3), dict(seq_len=64, micro_batch_size=2, dtype=torch.float32)
    seen = []

    def on_step(tracker):
        tracker.end_step()
        seen.append(tracker)

    report = estimate_step_memory(c, par, iters=2, tracker_type=AllocationRecorder, on_step=on_step, **kw)
    rec = seen[0]
    live = dict(rec.before)
    peak = steps = 0
    for event in rec.events:
        if event[0] == "alloc":
            live[event[1]] = event[2]
        elif event[0] == "free":
            live.pop(event[1], None)
        else:
            steps += 1
        peak = max(peak, sum(live.values())) if steps >= 1 else 0   # after the warm-up step
    assert peak == predict_memory(c, par, device="cuda", **kw).peak_bytes == report.peak_bytes - rec.host_bytes
    allocated, _ = replay(rec, CudaSetup(gemm_threads=0))    # predict_cuda_peak's replay of the same steps
    assert 0 <= allocated - peak < 512 * 100


def test_predicted_cuda_peak_is_tensors_plus_workspaces_plus_rounding():
    c = MiniMindConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, vocab_size=128,
                       num_hidden_layers=1)
    kw = dict(seq_len=32, micro_batch_size=2, dtype=torch.float32)
    plain = predict_cuda_peak(c, ParallelConfig(), setup=CudaSetup(expandable_segments=True), **kw)
    assert plain.workspace_bytes == 64 * MiB
    # expandable segments: each live block holds its tensor rounded up to 512 bytes, no more
    assert 0 <= plain.rounding_bytes < 512 * 200
    caching = predict_cuda_peak(c, ParallelConfig(), setup=CudaSetup(capability=(8, 0)), **kw)
    assert caching.workspace_bytes == 2 * (8 * MiB + 128 * KiB) and caching.tensors_peak == plain.tensors_peak
    assert caching.rounding_bytes >= plain.rounding_bytes


def test_estimate_with_device_cuda_reports_the_allocator_peak(tmp_path, capsys):
    out = tmp_path / "b.csv"
    assert cli.main(["benchmark", "--tp_size", "2", "--device", "cuda", "--", "--estimate", "--modes", "tp_sp_async",
                     "--num_hidden_layers", "1", "--hidden_size", "64", "--num_attention_heads", "8",
                     "--num_key_value_heads", "4", "--vocab_size", "128", "--seq_len", "32", "--dtype", "float32",
                     "--cuda_capability", "8.0", "--output_csv", str(out)]) == 0
    row = next(csv.DictReader(open(out)))
    assert row["status"] == "ok"
    assert float(row["cuda_workspace_mib"]) == pytest.approx(2 * 8.125)
    assert float(row["cuda_allocated_mib"]) >= float(row["peak_mib"]) - 0.01 + 2 * 8.125
    assert "cuda allocator: max_memory_allocated" in capsys.readouterr().out


def test_a_bad_cuda_capability_is_refused_in_one_line(capsys):
    assert cli.main(["benchmark", "--tp_size", "2", "--device", "cuda", "--", "--estimate", "--modes", "tp",
                     "--num_hidden_layers", "1", "--cuda_capability", "hopper"]) == 2
    assert "--cuda_capability is MAJOR.MINOR" in capsys.readouterr().err
