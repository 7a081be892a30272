"""--zero 3 (FSDP2's fully_shard over the DP x CP mesh) in the benchmark: a cell runs it, its meter
counting this rank's shards (the padded dim-0 rows FSDP2 keeps), not the DTensors' global sizes; and
its analytic memory model against the tracker on fake tensors (--estimate). (Its numbers,
checkpoints and train runs are tests/test_zero.py's.)"""
import json
import re
from dataclasses import replace

import pytest
import torch

from distributed import run_ranks
from minimind_parallel import MiniMindConfig, ParallelConfig, cli, tasks
from minimind_parallel.memory import estimate_step_memory, predict_memory
from minimind_parallel.memory.analytic.moe_sizes import RoutingPolicy
from minimind_parallel.memory.analytic.fsdp_replay import check_fully_sharded
from minimind_parallel.job import read_job, write_job
from minimind_parallel.tasks.benchmark.cells import cell_job
from minimind_parallel.tasks.benchmark.checks import check_benchmark
from minimind_parallel.tasks.benchmark.rank import run_cell
from minimind_parallel.model import MiniMindForCausalLM


BENCH = ["--num_hidden_layers", "2", "--seq_len", "32", "--hidden_size", "64", "--num_attention_heads", "8",
         "--num_key_value_heads", "4", "--vocab_size", "250", "--micro_batch_size", "2", "--dtype", "float32",
         "--warmup_iters", "1", "--benchmark_iters", "1"]


def _bench_rank(job_path):
    run_cell(read_job(job_path, lambda name: tasks.get(name).parser()), torch.device("cpu"))


def test_a_zero3_benchmark_cell_meters_this_ranks_shards(tmp_path):
    job = cli.resolve(["benchmark", "--kind", "memory", "--dp_size", "2", "--", "--modes", "zero3", *BENCH])
    (run,) = check_benchmark(job)
    report = tmp_path / "cell.json"
    cell = cell_job(job, run, report=str(report), profile_dir=None)
    run_ranks(_bench_rank, 2, write_job(cell, str(tmp_path / "job.json")))   # what the launcher hands torchrun
    result = json.loads(report.read_text())
    dense = MiniMindForCausalLM(cell.model)
    # rank 0's Shard(0) rows of every parameter: ceil(dim 0 / 2) rows (FSDP2 pads dim 0 to the mesh)
    shards = sum(-(-p.shape[0] // 2) * (p.numel() // p.shape[0]) * 4 for p in dense.parameters())
    buffers = sum(b.numel() * b.element_size() for b in dense.buffers())
    assert result["breakdown"]["params"] == shards + buffers
    # AdamW's exp_avg and exp_avg_sq of those rows (rank 0's are never padding), a float32 step per parameter
    assert result["breakdown"]["optimizer"] == 2 * shards + 4 * len(list(dense.parameters()))



def test_the_tp_sp_async_zero3_mode_is_fsdp2_over_the_tp_shards():
    job = cli.resolve(["benchmark", "--kind", "memory", "--tp_size", "2", "--dp_size", "2", "--", "--modes",
                       "tp_sp_async_zero3", *BENCH])
    (run,) = check_benchmark(job)
    par = run.par
    assert (par.tp, par.dp, par.zero, par.sequence_parallel, par.async_communication) == (2, 2, 3, True, True)


def _config(layers: int, vocab: int, tied: bool) -> MiniMindConfig:
    return MiniMindConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                          vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=256)


SP_ASYNC = dict(tp=2, sequence_parallel=True, async_communication=True)
SP_ASYNC_ONLY = dict(sequence_parallel=True, async_communication=True)
# (layout, dtype, microbatches, layers, seq_len, micro_batch_size, vocab, tied, cp_rank): where each holds its peak
FULLY_SHARDED = [
    (dict(dp=2), torch.float32, 1, 2, 32, 2, 128, False, 0),   # the top block's MLP backward, the block below prefetched
    (dict(dp=2), torch.float32, 1, 2, 32, 2, 128, True, 0),    # tied: the gathered embedding saved by the head
    (dict(dp=4), torch.bfloat16, 1, 2, 32, 2, 128, False, 0),  # dim 0 padded to 4 rows
    (dict(dp=2), torch.float32, 2, 2, 32, 2, 128, False, 0),   # accumulation: microbatch 0's sharded grads alive
    (dict(dp=4), torch.bfloat16, 3, 3, 32, 2, 128, True, 0),
    (dict(dp=4), torch.float32, 2, 4, 64, 1, 4096, True, 0),   # the loss's backward, the top block's gather waiting
    (dict(dp=2), torch.bfloat16, 2, 3, 64, 1, 4096, False, 0),
    (dict(dp=2, tp=2, sequence_parallel=True), torch.bfloat16, 2, 2, 32, 2, 128, True, 0),  # FSDP2 over TP shards
    (dict(dp=2, tp=2), torch.float32, 1, 3, 64, 1, 128, True, 0),
    (dict(dp=2, **SP_ASYNC, vocab_parallel=True), torch.bfloat16, 2, 3, 64, 1, 128, True, 0),
    (dict(dp=2, cp=2), torch.bfloat16, 2, 3, 64, 2, 128, True, 0),       # a CP attention backward
    (dict(dp=2, cp=2, cp_load_balance=False), torch.float32, 1, 2, 64, 2, 128, False, 1),
    (dict(dp=2, tp=2, cp=2, sequence_parallel=True, cp_comm_type="ring"), torch.bfloat16, 2, 3, 64, 2, 128, True, 0),
    (dict(dp=4, loss_chunks=4), torch.float32, 1, 2, 32, 2, 128, False, 0),
    (dict(dp=2, recompute="selective"), torch.bfloat16, 2, 3, 64, 2, 128, True, 0),
    # the gathered block unsaved: here and in FEW_TOKENS's --recompute full rows (fp32, every category)
    (dict(dp=2, recompute="full"), torch.bfloat16, 2, 3, 64, 2, 128, True, 0),
    # the vocab-parallel loss's forward, the top block's all-gather output still kept
    (dict(dp=2, tp=2, vocab_parallel=True), torch.float32, 1, 2, 64, 2, 2048, True, 0),
]


def test_the_memory_model_of_zero3_is_the_estimate_to_the_byte():
    """predict_memory under --zero 3 (memory/analytic/fsdp_replay.py) equals the tracker on fake
    tensors running FSDP2 on every category: dp2 and dp4, fp32 and bf16, tied and untied, with and
    without gradient accumulation, the peak in the top block and the loss; under TP (SP, async,
    VP), CP (both splits, ring), recompute and the chunked loss."""
    for layout, dtype, microbatches, layers, seq_len, mbs, vocab, tied, cp_rank in FULLY_SHARDED:
        config, par = _config(layers, vocab, tied), ParallelConfig(**layout, zero=3)
        kw = dict(seq_len=seq_len, micro_batch_size=mbs, dtype=dtype, num_microbatches=microbatches)
        estimate = estimate_step_memory(config, par, iters=1, cp_rank=cp_rank, **kw)
        model = predict_memory(config, par, **kw)   # (the worst CP rank: the contiguous split's last)
        assert (model.peak_bytes, model.breakdown) == (estimate.peak_bytes, estimate.breakdown), \
            (layout, dtype, microbatches, layers, seq_len, mbs, vocab, tied, model.peak_at)


def test_zero3_middle_blocks_are_exact_where_they_hold_the_peak():
    """Half hidden_size tokens per microbatch: a middle block's backward holds the peak, the grads
    of the block above reduce-scattered (their shard a .grad), its reduce-scatter input kept, the
    block below prefetched. The same bytes as the tracker on fake tensors (block 1 of 3 at the
    peak: FEW_TOKENS's `mlp_input_backward(block 1)` row)."""
    for layers, tied, block in ((4, False, 2),):
        config, par = _config(layers, 128, tied), ParallelConfig(dp=2, zero=3)
        kw = dict(seq_len=32, micro_batch_size=1, dtype=torch.float32)
        estimate = estimate_step_memory(config, par, iters=1, **kw)
        model = predict_memory(config, par, **kw)
        assert f"(block {block})" in model.peak_at
        assert (model.peak_bytes, model.breakdown) == (estimate.peak_bytes, estimate.breakdown), layers


def _sized(hidden: int, layers: int, heads: int, kv: int, vocab: int, tied: bool) -> MiniMindConfig:
    return MiniMindConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tied,
                          max_position_embeddings=256)


# (model, layout, dtype, microbatches, seq_len, micro_batch_size, the moment of the peak): few tokens
# per microbatch against a block's weights, where FSDP2's own moments hold the peak
FEW_TOKENS = [
    # a block's forward copy-out: the root's all-gather output still alive beside the block's
    (_sized(128, 1, 8, 2, 2048, False), dict(dp=2), torch.float32, 1, 64, 1, "pre_forward(block 0)"),
    # the attention's q/k/v backward: every weight grad of the block in (an eighth of H tokens)
    (_sized(128, 2, 8, 4, 512, True), dict(dp=2), torch.float32, 2, 8, 2, "qkv_backward"),
    # the top block's last residual add, its gathered parameters and all-gather output alive;
    # under SP + async before it, down_proj's output reduce-scattered
    (_sized(128, 1, 8, 2, 128, False), dict(dp=2), torch.bfloat16, 1, 64, 2, "block_forward_end"),
    (_sized(128, 1, 8, 4, 128, False), dict(dp=2, tp=4, **SP_ASYNC_ONLY), torch.bfloat16, 2, 64, 2,
     "block_forward_end"),
    # SP + async: gate_proj's weight grad, both linears' scattered input grads alive
    (_sized(64, 2, 8, 8, 512, False), dict(dp=2, **SP_ASYNC), torch.bfloat16, 3, 16, 1, "mlp_input_backward"),
    # --recompute selective: inside the lean SwiGLU's forward
    (_sized(64, 1, 8, 2, 128, False), dict(dp=2, recompute="selective", loss_chunks=3, cp_load_balance=False),
     torch.float32, 2, 128, 1, "swiglu_forward"),
    # a quarter and an eighth of H tokens: gate_proj's input grad in a middle block, the first
    # block's pre-backward copy-out
    (_config(3, 128, False), dict(dp=2), torch.float32, 1, 16, 1, "mlp_input_backward(block 1)"),
    (_config(2, 128, False), dict(dp=2), torch.float32, 1, 8, 1, "pre_backward(block 0)"),
    # --recompute full, an eighth of H tokens: the re-run block's input norm's backward after q/k/v's, at its
    # weight grad's sum (bf16: the incoming grad's fp32 copy) and at its row means' grad (fp32)
    (_sized(128, 2, 4, 2, 128, False), dict(dp=2, recompute="full"), torch.bfloat16, 1, 16, 1,
     "input_norm_backward_weight(first block)"),
    (_sized(128, 2, 8, 2, 128, False), dict(dp=2, recompute="full"), torch.float32, 1, 16, 1,
     "input_norm_backward(first block)"),
    # --recompute full, half H tokens: the lean SwiGLU's gate_proj input grad, the three MLP weight grads in
    (_sized(128, 1, 4, 2, 512, True), dict(dp=2, recompute="full"), torch.float32, 1, 64, 1, "mlp_input_backward"),
    # basic SP (each linear gathers its own input), an eighth of H tokens: q's input grad, k's and v's
    # gathered inputs freed and their input grads scattered; with the shared gather the input norm's backward
    (_sized(128, 2, 8, 4, 128, False), dict(dp=2, tp=2, sequence_parallel=True), torch.float32, 2, 16, 1,
     "qkv_backward"),
    (_sized(64, 2, 4, 2, 128, False), dict(dp=2, tp=2, sequence_parallel=True, shared_sp_gather=True),
     torch.bfloat16, 2, 8, 1, "input_norm_backward["),
]


def test_zero3_is_the_estimate_to_the_byte_at_any_token_count():
    """Fewer tokens per microbatch than hidden_size (once refused), and hidden_size tokens where a
    block's weights still hold the peak: the moments FSDP2 adds in the forward (a block's copy-out,
    its last residual add, the lean SwiGLU) and the backward (q/k/v, under basic SP with k's and
    v's gathered inputs freed; SP + async's MLP input; the lean SwiGLU's MLP input and, under
    --recompute full, the re-run input norm's backward),
    each at the peak, the same bytes as the tracker on fake tensors on every category."""
    for config, layout, dtype, microbatches, seq_len, mbs, moment in FEW_TOKENS:
        par = ParallelConfig(**layout, zero=3)
        kw = dict(seq_len=seq_len, micro_batch_size=mbs, dtype=dtype, num_microbatches=microbatches)
        estimate = estimate_step_memory(config, par, iters=1, **kw)
        model = predict_memory(config, par, **kw)
        assert model.peak_at.startswith(moment), (layout, moment, model.peak_at)
        assert (model.peak_bytes, model.breakdown) == (estimate.peak_bytes, estimate.breakdown), (layout, moment)


# (MoE config, dtype, microbatches, layers, the moment of the peak) at dp2 ep1
MOE_FULLY_SHARDED = [
    (dict(), torch.float32, 1, 2, "pre_backward(block 0)"),    # the experts' gather outweighs the activations
    (dict(num_experts_per_tok=2, moe_intermediate_size=32), torch.bfloat16, 2, 2, "weighting_backward"),
    (dict(num_experts=8, moe_intermediate_size=64), torch.float32, 2, 3, "expert_gather_backward(block 1)"),
    (dict(), torch.bfloat16, 2, 2, "post_norm_backward"),      # the aux loss's saved N and load once
    # (seq_len, vocab): 8 tokens, a later forward's copy-out of block 0 with the root gathered again
    (dict(num_experts=8, num_experts_per_tok=1, moe_intermediate_size=64), torch.float32, 2, 1,
     "pre_forward(block 0)[1]", 8, 8192),
    # 8 tokens, bf16: the input norm's backward, every weight grad of the block in (fsdp_moments.py)
    (dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=256), torch.bfloat16, 2, 2,
     "input_norm_backward", 8, 2048),
]


def test_the_memory_model_of_zero3_with_moe_is_the_estimate_to_the_byte():
    """MiniMind's MoE model under --zero 3 at ep 1 (once refused):
    the first block's pre-backward copy-out, the weighting's backward, the tokens' gather backward,
    the norm after the MoE layer and, with few tokens, a later forward's copy-out (the step's aux
    tensors of this microbatch not made yet), each at the peak; the same bytes as the tracker on
    fake tensors."""
    memo = {}   # the estimate's fake dispatch remembered across the layouts (the same bytes, less time)
    for moe, dtype, microbatches, layers, moment, *sized in MOE_FULLY_SHARDED:
        seq_len, vocab = sized or (64, 128)
        config = replace(_config(layers, vocab, False), use_moe=True, **moe)
        par = ParallelConfig(dp=2, zero=3)
        kw = dict(seq_len=seq_len, micro_batch_size=1, dtype=dtype, num_microbatches=microbatches)
        estimate = estimate_step_memory(config, par, iters=1, memo=memo, **kw)
        model = predict_memory(config, par, **kw)
        assert model.peak_at.startswith(moment), (moe, model.peak_at)
        assert (model.peak_bytes, model.breakdown) == (estimate.peak_bytes, estimate.breakdown), moe


# (model, layout, dtype, microbatches, seq_len, micro_batch_size, cp_rank, the moment of the peak):
# the MoE model at ep 1 under SP, --recompute and CP
MOE_SP_RECOMPUTE_CP = [
    # SP: the MoE layer works on the rank's sequence shard, its output [Nn, H] (no down_proj [N, H]
    # reduce-scattered) at the top block's last residual add
    (replace(_sized(128, 2, 8, 4, 128, False), use_moe=True, num_experts=2, moe_intermediate_size=64),
     dict(dp=2, tp=2, sequence_parallel=True, shared_sp_gather=True, vocab_parallel=True), torch.float32, 3, 128, 2, 0,
     "weighting_backward"),
    # --recompute selective: the attention's output and the post-attention norm's still bound at that add
    (replace(_sized(64, 1, 8, 2, 128, False), use_moe=True, num_experts_per_tok=2, moe_intermediate_size=64),
     dict(tp=2, cp=2, **SP_ASYNC_ONLY, vocab_parallel=True, recompute="selective", loss_chunks=2), torch.float32, 1,
     256, 1, 1, "block_forward_end"),
    # CP rank 3 of 4: the router's 2 rows leave it an empty shard (no bytes: params, AdamW states)
    (replace(_sized(32, 1, 8, 8, 512, False), use_moe=True, num_experts=2, moe_intermediate_size=256),
     dict(tp=2, cp=4, cp_comm_type="ring", loss_chunks=4), torch.bfloat16, 5, 256, 1, 3, "pre_backward(block 0)"),
    # CP + SP: the attention's backward frees the router's input, not gate/up's (--recompute full)
    (replace(_sized(128, 2, 8, 8, 128, False), use_moe=True, num_experts_per_tok=2, moe_intermediate_size=256),
     dict(tp=2, cp=2, sequence_parallel=True, shared_sp_gather=True, vocab_parallel=True, recompute="full"),
     torch.bfloat16, 1, 256, 2, 0, "attention_backward"),
    # bf16 under basic SP and --recompute selective: the lean norms save the block's input and middle
    # residual stream, no temporaries beside the four [Nn, H] at the second microbatch's last add
    (replace(_sized(128, 1, 8, 4, 128, True), use_moe=True, num_experts=2, num_experts_per_tok=1,
             moe_intermediate_size=256),
     dict(dp=2, tp=2, sequence_parallel=True, vocab_parallel=True, recompute="selective"), torch.bfloat16, 2, 256, 1, 0,
     "block_forward_end(block 0)[1]"),
]


def test_zero3_with_moe_under_sp_recompute_and_cp_is_the_estimate_to_the_byte():
    """MiniMind's MoE model under --zero 3 at ep 1 with SP, --recompute selective and full, and CP
    (once refused): the top block's last residual add, the CP attention's backward and a CP rank
    that holds no rows of the router, each where it decides the peak; the same bytes as the
    tracker on fake tensors."""
    memo = {}   # the estimate's fake dispatch remembered across the layouts (the same bytes, less time)
    for config, layout, dtype, microbatches, seq_len, mbs, cp_rank, moment in MOE_SP_RECOMPUTE_CP:
        par = ParallelConfig(**layout, zero=3)
        kw = dict(seq_len=seq_len, micro_batch_size=mbs, dtype=dtype, num_microbatches=microbatches)
        estimate = estimate_step_memory(config, par, iters=1, cp_rank=cp_rank, memo=memo, **kw)
        model = predict_memory(config, par, cp_rank=cp_rank, **kw)
        assert model.peak_at.startswith(moment), (layout, moment, model.peak_at)
        assert (model.peak_bytes, model.breakdown) == (estimate.peak_bytes, estimate.breakdown), (layout, moment)


@pytest.mark.parametrize("layout, seq_len, moe, message", [
    (dict(dp=2, zero=3, recompute="selective"), 32, True,   # the MoE model alike
     "under --recompute selective is modelled at 2 x hidden_size tokens per microbatch on a rank or more; "
     "got seq_len / cp_size * micro_batch_size = 64 < 128"),
    (dict(dp=2, zero=3, recompute="selective"), 32, False,
     "under --recompute selective is modelled at 2 x hidden_size tokens per microbatch on a rank or more; "
     "got seq_len / cp_size * micro_batch_size = 64 < 128"),
    (dict(dp=2, tp=2, zero=3, sequence_parallel=True, recompute="full"), 8, False,
     "with sequence_parallel=True (async_communication=False), --recompute full and use_moe=False is modelled at "
     "hidden_size tokens per microbatch on a rank or more (fewer: the dense model, and basic SP without --recompute); "
     "got seq_len / cp_size * micro_batch_size = 16 < 64"),
    (dict(dp=2, tp=2, zero=3, sequence_parallel=True), 8, True,
     "with sequence_parallel=True (async_communication=False), --recompute none and use_moe=True is modelled at "
     "hidden_size tokens per microbatch on a rank or more (fewer: the dense model, and basic SP without --recompute); "
     "got seq_len / cp_size * micro_batch_size = 16 < 64"),
    (dict(dp=2, cp=2, zero=3, recompute="full"), 32, True,
     "with sequence_parallel=False (async_communication=False), --recompute full and use_moe=True is modelled at "
     "hidden_size tokens per microbatch on a rank or more (fewer: the dense model, and basic SP without --recompute); "
     "got seq_len / cp_size * micro_batch_size = 32 < 64"),
])
def test_zero3_layouts_the_memory_model_does_not_follow_are_refused_in_one_line(layout, seq_len, moe, message):
    config = replace(_config(2, 128, False), use_moe=moe)
    with pytest.raises(NotImplementedError, match=re.escape(message)) as refused:
        predict_memory(config, ParallelConfig(**layout), seq_len=seq_len, micro_batch_size=2)
    assert "\n" not in str(refused.value)


# (layout, dtype, microbatches, layers, seq_len, micro_batch_size, schedule, the moment of the peak, its
# breakdown too):
# the MoE model at ep 2 under --zero 3, the experts' own FSDP2 groups (fsdp_experts.py, fsdp_pipeline.py)
EXPERTS_SP_RECOMPUTE_CP_PP = [
    # --recompute full: the re-run of the MoE layer in its backward, at its experts' forward end: their
    # all-gather output (prefetched by the block's pre-backward) and the unsharded experts both alive
    (dict(dp=4, ep=2, recompute="full"), torch.bfloat16, 1, 2, 64, 2, "1f1b", "expert_rerun_forward_end", True),
    (dict(dp=2, cp=2, ep=2, recompute="full", cp_comm_type="a2a"), torch.float32, 1, 2, 128, 1, "1f1b",
     "expert_rerun_forward_end", True),
    (dict(dp=2, cp=2, ep=2), torch.float32, 2, 2, 64, 2, "1f1b", "expert_pre_backward", True),   # CP
    (dict(dp=2, tp=2, ep=2, sequence_parallel=True), torch.bfloat16, 1, 2, 64, 2, "1f1b", "head_backward", True),
    (dict(dp=4, ep=2, recompute="selective"), torch.float32, 1, 2, 128, 2, "1f1b", "expert_swiglu_backward", True),
    # under PP: each block's experts a group of their own, gathered in the stage's first forward and kept
    (dict(dp=4, pp=2, ep=2), torch.bfloat16, 2, 2, 32, 2, "1f1b", "", True),
    # ... stage 0's peak the top block's last residual add of its first forward: the block below's
    # experts saved, the top block's kept gathered, their all-gather output the one kept (4 B under without)
    (dict(dp=4, pp=2, ep=2), torch.float32, 1, 2, 32, 1, "1f1b", "", True),
    # one EDP rank: the experts whole outside FSDP2 (their grads .grad, filed as the replicated stage's)
    (dict(dp=2, pp=2, ep=2), torch.float32, 2, 2, 32, 2, "gpipe", "", False),
    # interleaved: each chunk's blocks and experts gathered from the chunk's first forward
    (dict(dp=4, pp=2, ep=2, virtual_stages=2), torch.float32, 2, 4, 32, 1, "interleaved", "", True),
    (dict(dp=2, pp=2, ep=2, virtual_stages=2), torch.bfloat16, 2, 4, 32, 2, "interleaved", "", False),
]


def test_zero3_with_moe_at_ep2_under_sp_recompute_cp_and_pp_is_the_estimate_to_the_byte():
    """The experts' own FSDP2 groups (ep > 1) under SP, --recompute (full: the re-run's copy-out of the
    experts, `expert_rerun_forward_end`), CP and under PP (gpipe, 1f1b, interleaved; every stage):
    predict_memory equals the tracker on fake tensors, once refused (zb at ep > 1:
    test_the_moe_model_under_zb_with_zero3_is_the_estimate_to_the_byte_on_every_stage_and_planned)."""
    from helpers import one_line_error
    from minimind_parallel.planning import Candidate, Workload
    from minimind_parallel.planning.space import check_candidate
    memo = {}
    for layout, dtype, microbatches, layers, seq_len, mbs, schedule, moment, split in EXPERTS_SP_RECOMPUTE_CP_PP:
        config, par = replace(_config(layers, 128, False), **MOE_FIELDS), ParallelConfig(**layout, zero=3)
        kw = dict(seq_len=seq_len, micro_batch_size=mbs, dtype=dtype, num_microbatches=microbatches, schedule=schedule)
        for stage, model, estimate in _each_stage(config, par, kw, memo):
            assert model.peak_at.startswith(moment), (layout, stage, model.peak_at)
            assert model.peak_bytes == estimate.peak_bytes, (layout, stage, model.peak_at)
            assert model.breakdown == estimate.breakdown or not split, (layout, stage)
    config = replace(_config(2, 128, False), **MOE_FIELDS)
    work = Workload(model=config, seq_len=32, global_batch_size=8, world_size=8)
    check_candidate(work, Candidate(dp=4, pp=2, ep=2, zero=3, micro_batch_size=2, num_microbatches=2))   # not cut
    whole = ParallelConfig(dp=2, pp=2, ep=2, zero=3, recompute="full")   # the experts whole, under full recompute
    assert "modelled without --recompute full" in one_line_error(NotImplementedError, predict_memory, config, whole,
                                                                 seq_len=32, micro_batch_size=2, num_microbatches=2)


MOE_FIELDS = dict(use_moe=True, num_experts=4, num_experts_per_tok=2)
# (layout, dtype, microbatches, layers, seq_len, micro_batch_size, vocab, tied, schedule, MoE): zero 3 under PP
PIPELINED = [
    (dict(dp=2, pp=2), torch.bfloat16, 4, 2, 32, 2, 256, False, "1f1b", False),  # a block's backward, 2 in flight
    (dict(dp=2, pp=2), torch.float32, 2, 2, 8, 1, 8192, True, "1f1b", False),     # the embedding's backward
    (dict(dp=4, pp=2), torch.bfloat16, 3, 2, 32, 2, 256, False, "gpipe", False),
    (dict(dp=2, pp=2, tp=2, sequence_parallel=True, async_communication=True, vocab_parallel=True), torch.float32,
     2, 2, 32, 2, 256, False, "1f1b", False),
    (dict(dp=2, pp=2), torch.bfloat16, 2, 2, 32, 2, 256, False, "1f1b", True),    # the MoE model
]


def _each_stage(config, par, kw: dict, memo: dict | None = None):
    """(stage, the analytic model's prediction, the tracker's estimate on fake tensors) of every stage
    (`memo`: the estimate's fake dispatch remembered across calls, the same bytes in less time)."""
    for stage in range(par.pp):
        yield stage, predict_memory(config, par, stage=stage, **kw), estimate_step_memory(config, par, iters=1,
                                                                                          stage=stage, memo=memo, **kw)


def test_the_memory_model_of_zero3_under_pipeline_parallelism_is_the_estimate_to_the_byte():
    """predict_memory under --zero 3 with PP (memory/analytic/fsdp_pipeline.py: the replicated
    stage's replay, the stage's groups gathered from the first forward on, the unsharded grads
    temporaries, the reduces after the schedule) equals the tracker on fake tensors on every stage:
    fp32 and bf16, tied, dp2 and dp4, gpipe and 1f1b, TP (SP, async, VP) and the MoE model."""
    memo = {}   # the estimate's fake dispatch remembered across the layouts (the same bytes, less time)
    for layout, dtype, microbatches, layers, seq_len, mbs, vocab, tied, schedule, moe in PIPELINED:
        config, par = _config(layers, vocab, tied), ParallelConfig(**layout, zero=3)
        config = replace(config, **MOE_FIELDS) if moe else config
        kw = dict(seq_len=seq_len, micro_batch_size=mbs, dtype=dtype, num_microbatches=microbatches, schedule=schedule)
        for stage, model, estimate in _each_stage(config, par, kw, memo):
            assert (model.peak_bytes, model.breakdown) == (estimate.peak_bytes, estimate.breakdown), \
                (layout, dtype, microbatches, schedule, moe, stage, model.peak_at)


# (layout, dtype, microbatches, layers, seq_len, micro_batch_size, vocab, tied, schedule, MoE, stage, the moment
# of its peak): one microbatch and --recompute full under PP, where FSDP2's own moments hold the peak
PIPELINED_MOMENTS = [
    # the last stage's first cross-entropy: the top block's all-gather output alive, the loss not scaled yet
    (dict(dp=2, pp=2), torch.float32, 1, 2, 32, 2, 256, False, "1f1b", False, 1, "cross_entropy[0]"),
    # the root's reduce-scatter after the schedule: its input, its output and the embedding's unsharded grad
    (dict(dp=2, pp=4), torch.float32, 1, 4, 32, 2, 4096, False, "1f1b", False, 0, "reduce_scatter(group 0)"),
    # --recompute full: the gathered blocks are never saved (temporaries), the re-run SwiGLU's backward
    (dict(dp=2, pp=2, recompute="full"), torch.float32, 2, 2, 32, 2, 256, False, "1f1b", False, 0,
     "swiglu_backward[1]"),
    # ... and inside the first forward's SwiGLU, the block's all-gather output and copy-out alive
    (dict(dp=2, pp=2, recompute="full"), torch.float32, 1, 2, 32, 2, 256, False, "1f1b", False, 0,
     "swiglu_forward(block 0)[0]"),
    # the last stage's root: of its unsharded grads only the head's (the last) still bound; MoE: each
    # microbatch's reported aux share and the last received input alive while the groups reduce
    (dict(dp=2, pp=2), torch.float32, 1, 2, 8, 1, 8192, True, "1f1b", True, 1, "reduce_scatter(group 0)"),
]


def test_zero3_under_pipeline_parallelism_is_exact_at_one_microbatch_and_under_full_recompute():
    """The moments FSDP2 adds to a pipeline stage's step (fsdp_pipeline.py: its first forward's
    copy-outs, the top block's all-gather output to the model's return, the reduces after the
    schedule), each at the peak on its stage, the same bytes as the tracker on fake tensors on every
    category and every stage; too few tokens under --recompute refused in one line, as at pp 1."""
    memo = {}   # the estimate's fake dispatch remembered across the layouts (the same bytes, less time)
    for layout, dtype, microbatches, layers, seq_len, mbs, vocab, tied, schedule, moe, at, moment in PIPELINED_MOMENTS:
        config, par = _config(layers, vocab, tied), ParallelConfig(**layout, zero=3)
        config = replace(config, **MOE_FIELDS) if moe else config
        kw = dict(seq_len=seq_len, micro_batch_size=mbs, dtype=dtype, num_microbatches=microbatches, schedule=schedule)
        for stage, model, estimate in _each_stage(config, par, kw, memo):
            assert stage != at or model.peak_at == moment, (layout, moment, model.peak_at)
            assert (model.peak_bytes, model.breakdown) == (estimate.peak_bytes, estimate.breakdown), \
                (layout, microbatches, stage, model.peak_at)
    # few tokens under --recompute: refused in one line under PP as at pp 1 (fsdp_replay.check_fully_sharded)
    from helpers import one_line_error
    refused = one_line_error(NotImplementedError, predict_memory, _config(2, 256, False),
                             ParallelConfig(dp=2, pp=2, zero=3, recompute="selective"), seq_len=16, micro_batch_size=1,
                             num_microbatches=2)
    assert "under --recompute selective is modelled at 2 x hidden_size tokens" in refused, refused


# (layout, dtype, microbatches, layers, seq_len, micro_batch_size, vocab, tied, schedule): zero 3 under the
# posted schedules (fsdp_posted.py), pp2 with two model chunks per stage, and zb's W steps
POSTED = [
    (dict(dp=2, pp=2, virtual_stages=2), torch.float32, 2, 4, 32, 2, 256, False, "interleaved"),
    (dict(dp=2, pp=2, virtual_stages=2, recompute="full"), torch.bfloat16, 4, 4, 32, 2, 256, True, "interleaved"),
    (dict(dp=2, pp=2), torch.float32, 2, 2, 32, 2, 256, False, "zb"),
    (dict(dp=2, pp=2), torch.bfloat16, 4, 4, 32, 2, 4096, True, "zb"),   # the embedding's backward
]


def test_zero3_under_the_posted_schedules_is_the_estimate_to_the_byte_on_every_stage_and_planned():
    """predict_memory under --zero 3 with interleaved's model chunks and zb (once refused; both run:
    test_zero.py's rows equal the dense model) equals the tracker on fake tensors on every stage and
    category: the posted replay's moments with the stage's FSDP2 groups gathered from each chunk's
    first forward, the unsharded grads temporaries, the reduces after the schedule. The planner
    keeps such a layout (space.check_candidate)."""
    from minimind_parallel.pipeline_parallel.order import Schedule
    from minimind_parallel.planning import Candidate, Workload
    from minimind_parallel.planning.space import check_candidate
    memo = {}   # the estimate's fake dispatch remembered across the layouts (the same bytes, less time)
    for layout, dtype, microbatches, layers, seq_len, mbs, vocab, tied, schedule in POSTED:
        config, par = _config(layers, vocab, tied), ParallelConfig(**layout, zero=3)
        kw = dict(seq_len=seq_len, micro_batch_size=mbs, dtype=dtype, num_microbatches=microbatches, schedule=schedule)
        for stage, model, estimate in _each_stage(config, par, kw, memo):
            assert (model.peak_bytes, model.breakdown) == (estimate.peak_bytes, estimate.breakdown), \
                (layout, dtype, microbatches, schedule, stage, model.peak_at)
    work = Workload(model=_config(4, 128, True), seq_len=32, global_batch_size=8, world_size=4)
    check_candidate(work, Candidate(dp=2, pp=2, zero=3, num_microbatches=4, micro_batch_size=1,
                                    pp_schedule=Schedule.INTERLEAVED, virtual_stages=2))


# (layout, dtype, microbatches, model, seq_len, micro_batch_size, the moment at the peak of each stage): the
# MoE model under zb with zero 3, ep 1 (fsdp_posted.py over zero_bubble_moments' B and W of the MoE model)
WIDE_EXPERTS = replace(_sized(64, 4, 8, 4, 512, True), use_moe=True, num_experts=8, num_experts_per_tok=1,
                       moe_intermediate_size=256)
MOE_ZERO_BUBBLE = [
    # experts outweighing the attention: the copy-out of the block above the first, in zb's first forward
    (dict(dp=2, pp=2), torch.float32, 1, WIDE_EXPERTS, 64, 1, ("pre_forward(block 1)", "pre_forward(block 1)")),
    # a unit's weighting backward with W-pending units held (the router and experts make their grads in B)
    (dict(dp=2, pp=2, tp=2, sequence_parallel=True, async_communication=True), torch.bfloat16, 3,
     replace(_config(4, 256, False), **MOE_FIELDS, moe_intermediate_size=64), 64, 2, ("weighting_backward", "head_backward")),
    # CP ring: an earlier stage keeps its objective's term (only the last stage's is the CP-scaled copy)
    (dict(cp=2, pp=2, cp_comm_type="ring"), torch.float32, 1, replace(_sized(32, 2, 8, 4, 512, False), use_moe=True,
                                                                    num_experts=8, moe_intermediate_size=16), 64, 1,
     ("attention_backward", "head_backward")),
    # ep 2 over dp 4 (the experts a group of their own over 2 EDP ranks): zb's first forward gathers
    # them, the block below's experts saved, the top block's kept gathered, their all-gather output
    # the one kept (9,278 B over without)
    (dict(dp=4, pp=2, ep=2, tp=2, sequence_parallel=True, shared_sp_gather=True, recompute="selective"),
     torch.bfloat16, 1, replace(_sized(128, 2, 8, 8, 512, False), use_moe=True, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=16), 256, 1, ("weighting_backward", "head_backward")),
    # ... the top block's last residual add in zb's first forward the peak (4 B under without)
    (dict(dp=4, pp=2, ep=2, tp=2, sequence_parallel=True, async_communication=True, recompute="selective"),
     torch.float32, 1, replace(_sized(32, 2, 4, 2, 128, False), use_moe=True, num_experts=2, num_experts_per_tok=1,
                               moe_intermediate_size=64), 128, 2, ("block_forward_end(block 0)", "head_backward")),
]


def test_the_moe_model_under_zb_with_zero3_is_the_estimate_to_the_byte_on_every_stage_and_planned():
    """The MoE model under zb with --zero 3 (once refused), at ep 1 and at ep 2 over dp 4 (once
    refused too): the posted walk with FSDP2's gathered stage, and zb's first forward's moments
    where each group is gathered (fsdp_posted.zero_bubble_first_forward, under expert parallelism
    the experts' groups too; with wide experts a block's copy-out is the peak), equal the tracker on
    fake tensors on every stage and category; the planner's remembered rows (worst_only) give each
    stage the same bytes, and it keeps such a layout, at ep 2 too."""
    from minimind_parallel.pipeline_parallel.order import Schedule
    from minimind_parallel.planning import Candidate, Workload
    from minimind_parallel.planning.space import check_candidate
    memo = {}   # the estimate's fake dispatch remembered across the layouts (the same bytes, less time)
    for layout, dtype, microbatches, config, seq_len, mbs, peaks in MOE_ZERO_BUBBLE:
        par = ParallelConfig(**layout, zero=3)
        kw = dict(seq_len=seq_len, micro_batch_size=mbs, dtype=dtype, num_microbatches=microbatches, schedule="zb")
        fast = predict_memory(config, par, worst_only=True, **kw)
        for stage, model, estimate in _each_stage(config, par, kw, memo):
            assert model.peak_at.split("[")[0] == peaks[stage], (layout, stage, model.peak_at)
            assert (model.peak_bytes, model.breakdown) == (estimate.peak_bytes, estimate.breakdown), \
                (layout, dtype, stage, model.peak_at)
            assert fast.per_stage[stage] == model.peak_bytes, (layout, stage)
    work = Workload(model=WIDE_EXPERTS, seq_len=64, global_batch_size=8, world_size=4)
    check_candidate(work, Candidate(dp=2, pp=2, zero=3, num_microbatches=4, micro_batch_size=1,
                                    pp_schedule=Schedule.ZERO_BUBBLE))
    work = Workload(model=WIDE_EXPERTS, seq_len=64, global_batch_size=8, world_size=8)
    check_candidate(work, Candidate(dp=4, pp=2, ep=2, zero=3, num_microbatches=2, micro_batch_size=1,
                                    pp_schedule=Schedule.ZERO_BUBBLE))   # not cut


# (layout, dtype, microbatches, routing, the moment at the peak): zero 3 under expert parallelism; a
# routing as one EP group's tokens per expert per MoE layer: EP rank 0 (experts 0 and 1) receives the most
FEW_TOKEN_EXPERTS = replace(_sized(128, 2, 8, 8, 512, True), use_moe=True, num_experts=4, num_experts_per_tok=1,
                            moe_intermediate_size=64)
SKEWED = {"model.layers.0.mlp": [100, 60, 60, 36], "model.layers.1.mlp": [30, 130, 20, 76]}
EXPERT_SHARDED = [
    (dict(dp=2, ep=2), torch.float32, 1, RoutingPolicy.BALANCED, "expert_swiglu_backward"),   # experts whole
    (dict(dp=2, ep=2), torch.bfloat16, 2, SKEWED, "expert_swiglu_backward"),
    (dict(dp=4, ep=2), torch.float32, 2, RoutingPolicy.BALANCED, "expert_pre_backward"),  # their copy-out
    (dict(dp=4, ep=2), torch.bfloat16, 1, RoutingPolicy.BALANCED, "expert_forward_end"),  # gathered in forward
    (dict(dp=4, ep=2), torch.float32, 1, SKEWED, "expert_pre_backward"),
    (dict(dp=4, ep=4), torch.bfloat16, 2, RoutingPolicy.BALANCED, "expert_swiglu_backward"),
    # (model, seq_len, micro_batch_size): 16 tokens against H 128, the input norm's backward (the
    # experts' grads .grad where whole, reduce-scattered where sharded), every block's weight grad in
    (dict(dp=2, ep=2), torch.bfloat16, 2, RoutingPolicy.BALANCED, "input_norm_backward", FEW_TOKEN_EXPERTS, 16, 1),
    (dict(dp=4, ep=2), torch.bfloat16, 1, RoutingPolicy.BALANCED, "input_norm_backward", FEW_TOKEN_EXPERTS, 16, 1),
]


def test_the_memory_model_of_zero3_under_expert_parallelism_is_the_estimate_to_the_byte():
    """--zero 3 at ep_size > 1 (fsdp_experts.py: each MoE layer's experts an FSDP2 group of their own
    over the EDP ranks, gathered between the dispatch and the experts, prefetched by the block's
    pre-backward, copied out at the grad of their output, reduce-scattered before the dispatch's
    backward; whole, outside FSDP2, where the EDP group is one rank): predict_memory equals the
    tracker on fake tensors on the worst EP rank (rank 0, under SKEWED too), fp32 and bf16, balanced
    and a measured routing, dp2 ep2, dp4 ep2 and dp4 ep4, and with few tokens the input
    norm's backward (the experts' grads done by then); the planner plans it."""
    from minimind_parallel.planning import Candidate, Workload
    from minimind_parallel.planning.space import check_candidate
    config = replace(_config(2, 128, False), use_moe=True, num_experts=4, num_experts_per_tok=2)
    estimates, memo = {}, {}   # (the estimate's fake dispatch remembered across the layouts: the same bytes)
    for layout, dtype, microbatches, routing, moment, *sized in EXPERT_SHARDED:
        model_config, seq_len, mbs = sized or (config, 32, 2)
        par = ParallelConfig(**layout, zero=3)
        kw = dict(seq_len=seq_len, micro_batch_size=mbs, dtype=dtype, num_microbatches=microbatches, routing=routing)
        model = predict_memory(model_config, par, **kw)
        estimate = estimate_step_memory(model_config, par, iters=1, memo=memo, **kw)
        estimates.update({} if sized else {(str(par), dtype): estimate})
        assert model.peak_at.startswith(moment), (layout, dtype, model.peak_at)
        assert (model.peak_bytes, model.breakdown) == (estimate.peak_bytes, estimate.breakdown), (layout, dtype)
    work = Workload(model=config, seq_len=32, global_batch_size=8, world_size=4)
    for ep in (2, 4):
        check_candidate(work, Candidate(dp=4, ep=ep, zero=3, micro_batch_size=2))   # not cut
    # dp4 ep2: rank 0 holds experts 0 and 1 of each layer, sharded over its EDP group (ranks 0, 2), the
    # rest over the 4 DP ranks; AdamW's two states of rank 0's Shard(0) rows and a float32 step per parameter
    from minimind_parallel.moe.placement import expert_of
    estimate = estimates[str(ParallelConfig(dp=4, ep=2, zero=3)), torch.float32]
    mine = [(n, p) for n, p in MiniMindForCausalLM(config).named_parameters() if expert_of(n) in (None, 0, 1)]
    rows = sum(-(-p.shape[0] // (4 if expert_of(n) is None else 2)) * (p.numel() // p.shape[0]) for n, p in mine)
    assert estimate.breakdown["optimizer"] == 2 * 4 * rows + 4 * len(mine)


def test_zero_3s_step_time_gathers_the_experts_over_their_edp_ranks(monkeypatch):
    """The planner's --zero 3 step at ep_size > 1 (time_model.fully_sharded_seconds) against a fake
    FSDP2 step counted at FSDP2's all-gather and reduce-scatter hooks, each call over its own group:
    the blocks' and the root's over the 4 DP ranks, each block's experts over their 2 EDP ranks at ep 2
    and not at all at ep 4 (whole, outside FSDP2); AdamW steps this rank's shards (the experts' over EDP)."""
    from test_planning import MOE_WORK, SLOW
    from minimind_parallel.config import DTYPES
    from minimind_parallel.distributed import comm
    from minimind_parallel.planning import Candidate, Link
    from minimind_parallel.planning.ranking import evaluate
    from minimind_parallel.planning.time_model import ADAMW_ACCESSES
    dtype, work = DTYPES[MOE_WORK.dtype], MOE_WORK
    gather, scatter = comm.all_gather_into, comm.reduce_scatter_into
    for ep, expert_calls in ((2, True), (4, False)):
        k = Candidate(dp=4, ep=ep, micro_batch_size=2, zero=3)
        calls = []

        def counting(collective, measured):
            def run(out, x, group, *args):
                calls.append((group.size(), measured(out, x).numel() * measured(out, x).element_size()))
                return collective(out, x, group, *args)
            return run

        monkeypatch.setattr(comm, "all_gather_into", counting(gather, lambda out, x: out))       # the gathered
        monkeypatch.setattr(comm, "reduce_scatter_into", counting(scatter, lambda out, x: x))    # the unsharded grads
        estimate_step_memory(work.model, k.parallel, seq_len=work.seq_len, micro_batch_size=2, dtype=dtype, iters=1)
        monkeypatch.undo()
        assert any(g == 4 // ep for g, _ in calls) == expert_calls and {g for g, _ in calls} <= {4, 4 // ep}
        for link, expected in ((Link(latency_s=0.0, bandwidth=1e9), sum((g - 1) / g * n for g, n in calls) / 1e9),
                               (Link(latency_s=1e-3, bandwidth=1e30), sum(g - 1 for g, _ in calls) * 1e-3)):
            cpu = replace(SLOW, overlaps_communication=False, intra=link, inter=link)
            t = evaluate(k, work, cpu, "cpu", 1.0).time
            assert t.dp_exposed == pytest.approx(expected, rel=1e-9), (ep, link)
        shards = predict_memory(work.model, k.parallel, seq_len=work.seq_len, micro_batch_size=2, dtype=dtype
                                ).breakdown["params"] // dtype.itemsize - 2 * work.model.max_position_embeddings * \
            work.model.head_dim
        assert t.optimizer == pytest.approx(shards * ADAMW_ACCESSES * dtype.itemsize / SLOW.memory_bandwidth, rel=1e-9)
