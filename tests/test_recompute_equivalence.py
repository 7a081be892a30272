"""`--recompute selective|full` and `--loss_chunks K` give the dense model's numbers in float32
with TP, SP (async, shared gather), VP, DP and PP (both schedules): loss, logits where they exist,
every gradient and AdamW steps. Each launch combines several options to keep the suite short."""
import pytest
import torch

from distributed import run_ranks
from minimind_parallel import MiniMindConfig, ParallelConfig, ProcessGroups
from minimind_parallel.validation import DEFAULT_TOL, compare_with_dense, failures, format_report

TINY = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, vocab_size=128)
LATER_STEPS_RTOL = 2e-3   # as tests/test_equivalence.py: 10x the dense float32 model's own AdamW-step error


def _compare(par, layers, tied, schedule, microbatches, dtype):
    groups = ProcessGroups.build(par)
    config = MiniMindConfig(**TINY, num_hidden_layers=layers, tie_word_embeddings=tied)
    return compare_with_dense(config, par, groups, seq_len=16, micro_batch_size=2, num_microbatches=microbatches,
                              pp_schedule=schedule, dtype=dtype, optimizer_steps=3, seed=7)


CASES = {  # id -> (layout, layers, tied, schedule, microbatches)
    "single_selective_chunks3": (ParallelConfig(recompute="selective", loss_chunks=3), 2, False, "1f1b", 1),
    "single_full_accumulate2": (ParallelConfig(recompute="full"), 2, True, "1f1b", 2),
    "tp2_sp_async_vp_selective_chunks4": (ParallelConfig(tp=2, sequence_parallel=True, async_communication=True,
                                                         vocab_parallel=True, recompute="selective", loss_chunks=4),
                                          2, True, "1f1b", 1),
    "tp2_dp2_selective_chunks2": (ParallelConfig(tp=2, dp=2, recompute="selective", loss_chunks=2), 2, False, "1f1b", 1),
    "tp2_sp_shared_vp_full": (ParallelConfig(tp=2, sequence_parallel=True, shared_sp_gather=True, vocab_parallel=True,
                                             recompute="full"), 2, False, "1f1b", 1),
    "tp2_async_full_chunks2": (ParallelConfig(tp=2, async_communication=True, recompute="full", loss_chunks=2),
                               2, False, "1f1b", 1),
    "tp2_sp_async_pp2_full_vp_chunks4_1f1b": (ParallelConfig(tp=2, pp=2, sequence_parallel=True,
                                                             async_communication=True, vocab_parallel=True,
                                                             recompute="full", loss_chunks=4), 4, True, "1f1b", 3),
    "cp2_tp2_sp_async_full_chunks2": (ParallelConfig(cp=2, tp=2, sequence_parallel=True, async_communication=True,
                                                     recompute="full", loss_chunks=2), 2, False, "1f1b", 1),
    "pp2_dp2_selective_gpipe": (ParallelConfig(pp=2, dp=2, recompute="selective", loss_chunks=2), 4, False,
                                "gpipe", 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_recompute_and_chunked_loss_match_dense_in_float32(name):
    par, layers, tied, schedule, m = CASES[name]
    rows = run_ranks(_compare, par.world_size, par, layers, tied, schedule, m, torch.float32)[0]
    names = {r.item for r in rows}
    assert "grad model.layers.1.input_layernorm.weight" in names and "step 0 loss" in names
    assert ("step 0 logits" in names) == (par.loss_chunks == 1)   # chunked: the logits never exist whole
    bad = failures(rows)
    assert not bad, "\n" + format_report(bad)
    assert max(r.rel_l2 for r in rows if r.item.startswith(("step 0 ", "grad"))) < DEFAULT_TOL[torch.float32][1]
    assert max(r.rel_l2 for r in rows if r.item.startswith("step ")) < LATER_STEPS_RTOL


def test_float64_steps_are_exact_with_full_recompute_and_chunked_loss():
    """In float64 the lean pieces, the re-run blocks and the chunked loss agree to ~1e-12."""
    par = ParallelConfig(tp=2, sequence_parallel=True, async_communication=True, vocab_parallel=True,
                         recompute="full", loss_chunks=4)
    rows = run_ranks(_compare, par.world_size, par, 2, True, "1f1b", 1, torch.float64)[0]
    assert max(r.rel_l2 for r in rows) < 1e-10, format_report(rows)
