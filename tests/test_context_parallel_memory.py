"""Memory under context parallelism: the tracker on fake tensors (`--estimate`) equals the CPU
tracker of a real gloo run, for every comm type (ring's two K/V buffers, the gathered K/V, the
all-to-all buffers are real storages in both), with DDP's buckets over DP x CP; CP cuts the
activations of a rank as the sequence it holds shrinks; the analytic model (`predict_memory`)
equals both to the byte, peak and breakdown, stage by stage."""
import os
import random
import sys

import pytest
import torch

from distributed import run_ranks
from minimind_parallel import MiniMindConfig, ParallelConfig
from minimind_parallel.context_parallel import COMM_TYPES
from minimind_parallel.memory import estimate_step_memory, predict_memory
from test_memory import _check_model, measure_real

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))
import memory_model_sweep as sweep  # noqa: E402

S, B = 64, 2
TINY = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                      vocab_size=128, tie_word_embeddings=False, max_position_embeddings=256)
LAYOUTS = {comm: ParallelConfig(cp=2, cp_comm_type=comm) for comm in COMM_TYPES}


def test_estimate_equals_the_real_cpu_run_for_every_comm_type():
    ranks = run_ranks(measure_real, 2, TINY, LAYOUTS, S, B)
    for name, par in LAYOUTS.items():
        estimate = estimate_step_memory(TINY, par, seq_len=S, micro_batch_size=B, dtype=torch.bfloat16, iters=1)
        model = predict_memory(TINY, par, seq_len=S, micro_batch_size=B, dtype=torch.bfloat16)
        _check_model(model, estimate, name)
        for real in (r[name] for r in ranks):   # load-balanced: both CP ranks hold the same bytes
            assert real.peak_bytes == estimate.peak_bytes, (name, real.peak_bytes, estimate.peak_bytes)
            assert real.breakdown == estimate.breakdown, (name, real.breakdown, estimate.breakdown)


def test_cp_halves_what_a_rank_saves_for_backward():
    one = estimate_step_memory(TINY, ParallelConfig(), seq_len=S, micro_batch_size=B, dtype=torch.bfloat16, iters=1)
    for comm in COMM_TYPES:
        cp = estimate_step_memory(TINY, ParallelConfig(cp=2, cp_comm_type=comm), seq_len=S, micro_batch_size=B,
                                  dtype=torch.bfloat16, iters=1)
        assert cp.breakdown["activations"] < 0.6 * one.breakdown["activations"], comm


# ---------------------------------------------------------------- the analytic model under CP

SP_ASYNC_VP = dict(tp=2, sequence_parallel=True, async_communication=True, vocab_parallel=True)
CP_LAYOUTS = {   # name -> (ParallelConfig flags, schedule, microbatches)
    "cp2": (dict(cp=2), "1f1b", 1),
    "cp2_contiguous": (dict(cp=2, cp_load_balance=False), "1f1b", 1),
    "cp4": (dict(cp=4), "1f1b", 2),
    "tp2_cp2_sp_async_vp": (dict(cp=2, **SP_ASYNC_VP), "1f1b", 1),
    "tp2_cp2_sp_async_vp_contiguous": (dict(cp=2, cp_load_balance=False, **SP_ASYNC_VP), "1f1b", 1),
    "dp2_cp2": (dict(dp=2, cp=2), "1f1b", 2),
    "pp2_cp2": (dict(pp=2, cp=2), "1f1b", 3),
    "pp2_cp2_contiguous_gpipe": (dict(pp=2, cp=2, cp_load_balance=False), "gpipe", 3),
}


@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("comm", COMM_TYPES)
def test_model_equals_the_estimate_to_the_byte_under_cp(comm, dtype, recompute):
    """Every layout, every pipeline stage, every CP rank of the contiguous split (the balanced
    one's are alike): the model's peak and each category of its breakdown are --estimate's."""
    for name, (flags, schedule, m) in CP_LAYOUTS.items():
        par = ParallelConfig(cp_comm_type=comm, recompute=recompute, **flags)
        for stage in range(par.pp):
            for cp_rank in range(1 if par.cp_load_balance else par.cp):
                kw = dict(seq_len=S, micro_batch_size=B, dtype=dtype, num_microbatches=m, schedule=schedule,
                          stage=stage, cp_rank=cp_rank)
                _check_model(predict_memory(TINY, par, **kw), estimate_step_memory(TINY, par, iters=1, **kw),
                             f"{comm} {name} stage {stage} cp rank {cp_rank}")


@pytest.mark.parametrize("comm", COMM_TYPES)
def test_the_contiguous_splits_last_cp_rank_is_the_worst_and_predicted(comm):
    """Without load balance CP rank C-1's queries see every chunk: its attention backward holds
    more (ring: a block at every step, not only the first) and predict_memory's default is it.
    a2a attends over the whole sequence on every rank: all ranks alike."""
    par = ParallelConfig(cp=4, cp_comm_type=comm, cp_load_balance=False, recompute="selective")
    kw = dict(seq_len=2 * S, micro_batch_size=B, dtype=torch.bfloat16)
    first, last = (estimate_step_memory(TINY, par, iters=1, cp_rank=r, **kw) for r in (0, par.cp - 1))
    if comm == "a2a":
        assert last.peak_bytes == first.peak_bytes
    else:
        assert last.peak_bytes > first.peak_bytes
    _check_model(predict_memory(TINY, par, **kw), last, comm)
    _check_model(predict_memory(TINY, par, cp_rank=0, **kw), first, comm)


@pytest.mark.parametrize("flags,seq_len", [(dict(cp=2), S), (dict(cp=2, cp_load_balance=False), S),
                                           (dict(cp=4), 2 * S)], ids=["cp2", "cp2_contiguous", "cp4"])
@pytest.mark.parametrize("comm", COMM_TYPES)
def test_the_attention_backward_holds_the_peak_and_is_predicted(comm, flags, seq_len):
    """In bfloat16 with a small vocabulary and the lean MLP the peak is inside a block's CP
    attention backward (the blockwise score tensors, the work-dtype copies, the dK/dV
    accumulators, ring's buffers in flight): the model puts it there, to the byte."""
    par = ParallelConfig(cp_comm_type=comm, recompute="selective", **flags)
    kw = dict(seq_len=seq_len, micro_batch_size=B, dtype=torch.bfloat16)
    pred = predict_memory(TINY, par, **kw)     # the worst CP rank: the last one under the contiguous split
    worst = 0 if par.cp_load_balance else par.cp - 1
    _check_model(pred, estimate_step_memory(TINY, par, iters=1, cp_rank=worst, **kw), f"{comm} {flags}")
    assert pred.peak_at.startswith("attention_backward"), pred.peak_at


def test_cp_activations_by_kind_per_comm_type():
    """What one block saves for its attention under CP 2 (S 64, B 2, 8 heads, 4 kv heads, d 8,
    bf16): q of this rank's 64 tokens; k and v of all 128 tokens (all_gather) or of 64 tokens'
    worth (a2a: the whole sequence at half the heads; ring: the local ones); the output, its
    fp32 lse and o_proj's sequence-first copy of it; RoPE's cos/sin of the rank's 32 positions."""
    n, h, kv, d = S // 2 * B, 8, 4, 8
    for comm, kv_tokens in (("all_gather", 2 * n), ("a2a", n), ("ring", n)):
        kinds = predict_memory(TINY, ParallelConfig(cp=2, cp_comm_type=comm), seq_len=S, micro_batch_size=B,
                               dtype=torch.bfloat16).activations_by_kind
        assert kinds["block.attention_q"] == 2 * n * h * d
        assert kinds["block.attention_kv"] == 2 * 2 * kv_tokens * kv * d, comm
        assert kinds["block.attention_out"] == 2 * 2 * n * h * d + 4 * n * h
        assert kinds["model.rope"] == 2 * 2 * (S // 2) * d


@pytest.mark.parametrize("seed", range(4))
def test_random_cp_layouts_are_predicted_to_the_byte(seed):
    """A few draws of `scripts/memory_model_sweep.py --cp`: CP 1/2/4, any comm type, load
    balance on or off, with TP/SP/VP, PP, DP and --recompute none/selective."""
    rng = random.Random(seed)
    case = None
    while case is None:
        case = sweep.draw(rng, 2, cp_layouts=True)
    c, par, sizes = case
    _check_model(predict_memory(c, par, **sizes), estimate_step_memory(c, par, iters=1, **sizes), f"{par} {sizes}")
