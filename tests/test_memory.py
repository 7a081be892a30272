"""Peak memory: the CPU tracker of a real run, the same tracker on fake tensors (--estimate) and
the analytic model agree, and the book's two derivations (chapter 4.2.1 and 4.4.2) come out of
all three, as byte arithmetic in F = b*S*B*H, the bytes of one full-sequence [S, B, H] tensor."""
import os
import random
import sys
from dataclasses import replace

import pytest
import torch

from distributed import run_ranks
from helpers import one_line_error
from minimind_parallel import ConfigError, MiniMindConfig, MiniMindForCausalLM, ParallelConfig, ProcessGroups
from minimind_parallel.memory import MemoryMeter, StorageTracker, estimate_step_memory, predict_memory
from minimind_parallel.memory.analytic import activations_by_kind
from minimind_parallel.memory.analytic.moe_sizes import RoutingPolicy
from minimind_parallel.moe import routing_histogram
from minimind_parallel.memory.estimate import fake_process_group
from minimind_parallel.parallel_model import ParallelMiniMindForCausalLM
from minimind_parallel.plan import stage_parameters

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))
import memory_model_sweep as sweep  # noqa: E402
from minimind_parallel.training import build_parallel_model, make_optimizer, train_step, wrap_data_parallel
from minimind_parallel.context_parallel import ContextLayout
from minimind_parallel.data.batches import cp_tokens, random_batch

S, B, T = 32, 2, 2
TINY = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                      vocab_size=512, tie_word_embeddings=False, max_position_embeddings=256)
MODES = {
    "tp": ParallelConfig(tp=T),
    "tp_sp": ParallelConfig(tp=T, sequence_parallel=True),
    "tp_sp_async": ParallelConfig(tp=T, sequence_parallel=True, async_communication=True),
    "tp_sp_shared": ParallelConfig(tp=T, sequence_parallel=True, shared_sp_gather=True),
    "tp_sp_async_vp": ParallelConfig(tp=T, sequence_parallel=True, async_communication=True, vocab_parallel=True),
    "tp_sp_async_lean": ParallelConfig(tp=T, sequence_parallel=True, async_communication=True, recompute="selective"),
    "ddp": ParallelConfig(dp=T),
}


def measure_real(config, layouts, seq_len, rows):
    """On each gloo rank: one warm-up step, then the meter around one step, per layout (under CP
    each rank feeds its CP rank's tokens). Shared with tests/test_context_parallel_memory.py."""
    return {name: _measure_step(config, par, seq_len, rows)[0] for name, par in layouts.items()}


def _measure_step(config, par, seq_len, rows, *, zero_routers=False):
    """measure_real's run of one layout -> (report, the model after it). `zero_routers`: every
    MoE router's weight zeroed and the learning rate 0, so every token's scores tie in both steps."""
    groups = ProcessGroups.build(par)
    torch.manual_seed(0)
    dense = MiniMindForCausalLM(config).state_dict()
    if zero_routers:
        dense = {k: v.zero_() if k.endswith(".mlp.gate.weight") else v for k, v in dense.items()}
    model = wrap_data_parallel(build_parallel_model(config, par, groups, dense, dtype=torch.bfloat16), groups)
    optimizer = make_optimizer(model, 0.0 if zero_routers else 1e-3)
    batch = random_batch(0, rows, seq_len, config.vocab_size)
    ids, targets = cp_tokens(batch, ContextLayout.of(par, seq_len), groups.cp_rank)
    train_step(model, optimizer, groups, ids, targets)
    meter = MemoryMeter("cpu", model, optimizer)
    with meter:
        train_step(model, optimizer, groups, ids, targets)
    return meter.report(), model


@pytest.fixture(scope="module")
def measured():
    ranks = run_ranks(measure_real, T, TINY, MODES, S, B)
    real = {name: max((r[name] for r in ranks), key=lambda rep: rep.peak_bytes) for name in MODES}
    estimate = {name: estimate_step_memory(TINY, par, seq_len=S, micro_batch_size=B, dtype=torch.bfloat16, iters=1)
                for name, par in MODES.items()}
    model = {name: predict_memory(TINY, par, seq_len=S, micro_batch_size=B, dtype=torch.bfloat16)
             for name, par in MODES.items()}
    return real, estimate, model


def test_tracker_counts_each_storage_once_until_it_is_freed():
    with StorageTracker() as t:
        x = torch.empty(1000)              # 4000 B
        views = [x[10:], x.view(10, 100)]  # views share the storage: no bytes
        y = x * 2                          # 4000 B more: the peak
        del x, views, y
        z = torch.empty(10)                # after the frees only these 40 B are alive
    assert t.peak_bytes == 8000 and t.live_bytes == 40
    assert t.report().breakdown["temporaries"] == 8000
    del z


def test_saved_tensors_are_activations():
    w = torch.randn(8, 8, requires_grad=True)
    with StorageTracker() as t:
        a = torch.randn(4, 8)             # temporary, saved by mm: an activation
        y = (a @ w).sum()
    assert t.report().breakdown["activations"] == 4 * 8 * 4
    del y


# The real gloo run is held to the estimate to the byte. It once needed 8 KiB of slack: gloo's
# worker thread kept a finished collective's tensors a moment past wait(), at random, so a tensor
# dropped right after a collective could be counted at the peak; every collective now returns only
# once the backend has let them go (`comm._Release`, tests/test_distributed_comm.py).


def test_estimate_equals_the_real_cpu_run(measured):
    """Same tracker, same train_step: fake tensors change no byte (incl. DDP's buckets)."""
    real, estimate, _ = measured
    for name in MODES:
        assert real[name].peak_bytes == estimate[name].peak_bytes, name
        assert real[name].breakdown == estimate[name].breakdown, name
        assert sum(real[name].breakdown.values()) == real[name].peak_bytes


def test_a_torch_build_without_the_fake_process_group_refuses_the_estimate_with_one_line(monkeypatch):
    """The fake backend's store is private to PyTorch's tests; a build without it costs --estimate
    alone, with one line (None in sys.modules: the import fails as if the module were missing)."""
    monkeypatch.setitem(sys.modules, "torch.testing._internal.distributed.fake_pg", None)
    message = one_line_error(ConfigError, estimate_step_memory, TINY, ParallelConfig(), seq_len=S, micro_batch_size=B)
    assert "--estimate needs PyTorch's fake process group" in message and torch.__version__ in message, message


def _check_model(pred, meas, name):
    """The model's peak and every category of its breakdown against a measurement: the same bytes."""
    for key, value in pred.breakdown.items():
        assert meas.breakdown[key] == value, (name, key, pred.peak_at, pred.breakdown, meas.breakdown)
    assert meas.peak_bytes == pred.peak_bytes, (name, pred.peak_at, pred.peak_bytes, meas.peak_bytes)


def test_analytic_model_matches_the_measurement(measured):
    real, estimate, model = measured
    for name in MODES:
        _check_model(model[name], estimate[name], name)
        _check_model(model[name], real[name], name)


@pytest.mark.parametrize("dtype,config", [
    (torch.float32, dict(vocab_size=128)),                # peak in the last block's MLP backward
    (torch.bfloat16, dict(vocab_size=128)),               # peak in the final norm's backward
    (torch.bfloat16, dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, vocab_size=128)),
])
def test_analytic_model_matches_estimate_elsewhere(dtype, config):
    c = MiniMindConfig(**{**TINY.__dict__, **config})
    for par in (ParallelConfig(tp=T, sequence_parallel=True, vocab_parallel=True), ParallelConfig(tp=T)):
        meas = estimate_step_memory(c, par, seq_len=S, micro_batch_size=B, dtype=dtype, iters=1)
        _check_model(predict_memory(c, par, seq_len=S, micro_batch_size=B, dtype=dtype), meas, str(par))


def book_sp_delta(L, *, S, B, H, T, b=2):
    """MiniMind Parallelism Book, section 4.2.1:
    TP only - TP+SP (basic) = L (8F(1-1/T) - 3F) + 4F(1-1/T), F = b S B H.
    Plus what the book leaves out: each RMSNorm also saves rsqrt [S, B, 1] in fp32 (4 S B bytes),
    which SP shrinks by 1/T as well: 2 per block and the final one."""
    F, rsqrt = b * S * B * H, 4 * S * B
    shrink = lambda x: x - x // T  # noqa: E731  x (1 - 1/T)
    return L * (shrink(8 * F) - 3 * F) + shrink(4 * F) + (2 * L + 1) * shrink(rsqrt)


def seed_recompute_delta(L, *, S, B, H, T, b=2):
    """MiniMind Parallelism Book, section 4.4.2: basic SP - SP recompute = L (5F - 2F/T): five
    gathered inputs per block become
    the two local shards (q/k/v share one, gate/up the other)."""
    F = b * S * B * H
    return L * (5 * F - 2 * F // T)


def assert_saves(measured, more: str, less: str, want: int) -> None:
    """Mode `more` minus mode `less`: exactly `want` bytes in the real run, the estimate and the
    model."""
    for reports in measured:
        assert reports[more].peak_bytes - reports[less].peak_bytes == want


def test_basic_sp_saves_8F_minus_3F_per_block_and_the_final_norm(measured):
    assert_saves(measured, "tp", "tp_sp", book_sp_delta(TINY.num_hidden_layers, S=S, B=B, H=TINY.hidden_size, T=T))


def test_sp_recompute_saves_5F_minus_2F_over_T_per_block(measured):
    assert_saves(measured, "tp_sp", "tp_sp_async",
                 seed_recompute_delta(TINY.num_hidden_layers, S=S, B=B, H=TINY.hidden_size, T=T))


def test_shared_sp_gather_saves_3F_per_block(measured):
    """--shared_sp_gather: q/k/v and gate/up save one gathered input each, as plain TP does."""
    F = 2 * S * B * TINY.hidden_size
    assert_saves(measured, "tp_sp", "tp_sp_shared", TINY.num_hidden_layers * 3 * F)


SEED = dict(hidden_size=768, num_attention_heads=8, num_key_value_heads=4, vocab_size=6400, tie_word_embeddings=False)
MiB = 2**20


@pytest.mark.parametrize("L", [8, 16, 32, 64])
def test_seed_basic_sp_saves_6L_plus_12_MiB(L):
    """At the book's configuration (S 2048, B 2, H 768, T 2, bf16): 6L + 12 MiB, plus the rsqrt
    rows the book leaves out: (2L + 1) x 8 KiB."""
    c = MiniMindConfig(num_hidden_layers=L, **SEED)
    tp, sp = (predict_memory(c, ParallelConfig(tp=2, sequence_parallel=s), seq_len=2048, micro_batch_size=2,
                             dtype=torch.bfloat16) for s in (False, True))
    assert tp.peak_bytes - sp.peak_bytes == (6 * L + 12) * MiB + (2 * L + 1) * 8 * 1024


@pytest.mark.parametrize("L", [2, 4, 8, 16, 32])
def test_book_sp_recompute_saves_48_MiB_per_layer(L):
    c = MiniMindConfig(num_hidden_layers=L, **SEED)
    sp, rc = (predict_memory(c, ParallelConfig(tp=2, sequence_parallel=True, async_communication=a), seq_len=2048,
                             micro_batch_size=4, dtype=torch.bfloat16) for a in (False, True))
    assert sp.peak_bytes - rc.peak_bytes == 48 * L * MiB


def test_seed_deltas_from_estimate_at_the_seed_configuration():
    """The fake-tensor measurement at the book's real sizes (two layers keeps it quick)."""
    c = MiniMindConfig(num_hidden_layers=2, **SEED)
    est = {name: estimate_step_memory(c, ParallelConfig(tp=2, **flags), seq_len=2048, micro_batch_size=4,
                                      dtype=torch.bfloat16, iters=1)
           for name, flags in {"tp": {}, "sp": dict(sequence_parallel=True),
                               "rc": dict(sequence_parallel=True, async_communication=True)}.items()}
    assert est["tp"].peak_bytes - est["sp"].peak_bytes == book_sp_delta(2, S=2048, B=4, H=768, T=2)
    assert est["sp"].peak_bytes - est["rc"].peak_bytes == 48 * 2 * MiB


# ---------------------------------------------------------------- pipeline stages

PIPE = MiniMindConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                      vocab_size=512, tie_word_embeddings=False, max_position_embeddings=256)


def _stage_parameters(config, par, stage):
    """(name, shape) of every parameter of a stage's model, in the optimizer's order."""
    with fake_process_group(stage * par.tp, par.world_size):
        model = ParallelMiniMindForCausalLM(config, par, ProcessGroups.build(par))
        return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


@pytest.mark.parametrize("par", [ParallelConfig(), ParallelConfig(pp=2, tp=2, vocab_parallel=True), ParallelConfig(pp=4)])
@pytest.mark.parametrize("tied", [False, True])
def test_stage_parameters_are_each_stages_model_in_optimizer_order(par, tied):
    c = replace(PIPE, tie_word_embeddings=tied)
    for stage in range(par.pp):
        assert list(stage_parameters(c, par, stage).items()) == _stage_parameters(c, par, stage)


@pytest.mark.parametrize("par,schedule,m,dtype,tied", [
    (ParallelConfig(pp=2), "gpipe", 1, torch.float32, False),
    (ParallelConfig(pp=2), "gpipe", 2, torch.bfloat16, False),
    (ParallelConfig(pp=2), "gpipe", 5, torch.float32, True),
    (ParallelConfig(pp=2), "1f1b", 2, torch.float32, False),
    (ParallelConfig(pp=2), "1f1b", 5, torch.bfloat16, True),
    (ParallelConfig(pp=4), "gpipe", 4, torch.bfloat16, False),
    (ParallelConfig(pp=4), "1f1b", 9, torch.float32, False),
    (ParallelConfig(pp=2, tp=2, sequence_parallel=True, async_communication=True, vocab_parallel=True), "1f1b", 5,
     torch.bfloat16, True),
    (ParallelConfig(pp=2, tp=2, sequence_parallel=True, shared_sp_gather=True, vocab_parallel=True), "1f1b", 3,
     torch.float32, False),
    (ParallelConfig(pp=2, tp=2, sequence_parallel=True), "gpipe", 3, torch.bfloat16, False),
    (ParallelConfig(pp=2, dp=2), "1f1b", 3, torch.float32, True),
    (ParallelConfig(tp=2, vocab_parallel=True), "1f1b", 3, torch.float32, True),   # gradient accumulation
])
def test_every_pipeline_stage_is_predicted_to_the_byte(par, schedule, m, dtype, tied):
    """The model against the tracker on fake tensors, stage by stage: peak and every category."""
    c = replace(PIPE, tie_word_embeddings=tied)
    for stage in range(par.pp):
        kw = dict(seq_len=S, micro_batch_size=B, dtype=dtype, num_microbatches=m, schedule=schedule)
        pred = predict_memory(c, par, stage=stage, **kw)
        _check_model(pred, estimate_step_memory(c, par, iters=1, stage=stage, **kw), f"stage {stage}")


POSTED_CASES = [   # (layers, layout, schedule, microbatches, dtype, tied)
    (4, dict(pp=2, virtual_stages=2), "interleaved", 4, torch.float32, False),
    (8, dict(pp=2, virtual_stages=4), "interleaved", 2, torch.bfloat16, True),
    (16, dict(pp=4, virtual_stages=4), "interleaved", 4, torch.bfloat16, True),
    (4, dict(pp=2, virtual_stages=2, tp=2, sequence_parallel=True, async_communication=True, vocab_parallel=True),
     "interleaved", 4, torch.bfloat16, True),
    (4, dict(pp=2, virtual_stages=2, cp=2, cp_comm_type="ring"), "interleaved", 2, torch.bfloat16, True),
    (4, dict(pp=2, virtual_stages=2, dp=2, recompute="selective"), "interleaved", 4, torch.float32, True),
    (8, dict(pp=4, virtual_stages=2, tp=2, sequence_parallel=True, vocab_parallel=True, recompute="full"),
     "interleaved", 4, torch.bfloat16, False),
    # ZB-H1: B without the deferred weight grads, each unit's W-pending output grads and inputs to its W
    (4, dict(pp=2), "zb", 4, torch.float32, False),
    (4, dict(pp=2), "zb", 5, torch.bfloat16, True),
    (8, dict(pp=2), "zb", 3, torch.bfloat16, False),
    (4, dict(pp=4), "zb", 4, torch.float32, False),
    (8, dict(pp=4), "zb", 6, torch.bfloat16, True),
    (8, dict(pp=4, tp=2, vocab_parallel=True), "zb", 5, torch.bfloat16, True),
    (4, dict(pp=2, dp=2, zero=1), "zb", 4, torch.bfloat16, False),
    (4, dict(pp=2, tp=2, sequence_parallel=True), "zb", 4, torch.bfloat16, False),
    (8, dict(pp=4, tp=2, sequence_parallel=True, shared_sp_gather=True, vocab_parallel=True), "zb", 5,
     torch.float32, True),
    (8, dict(pp=4, tp=2, sequence_parallel=True, async_communication=True, vocab_parallel=True), "zb", 5,
     torch.float32, True),
    # CP: B inside each block's attention; one kv head per rank: v_proj's dY a view of the joint dK/dV
    (4, dict(pp=2, cp=2, cp_comm_type="ring"), "zb", 4, torch.float32, False),
    (4, dict(pp=2, tp=4, cp=2, cp_comm_type="all_gather", cp_load_balance=False), "zb", 4, torch.bfloat16, True),
    # the chunked loss makes the head's weight grad in B
    (4, dict(pp=2, tp=2, sequence_parallel=True, vocab_parallel=True, loss_chunks=2), "zb", 4, torch.bfloat16, False),
    # --recompute selective: down_proj's grad made in B (SwiGLU recompute), each column linear's
    # re-made input kept to W
    (4, dict(pp=2, recompute="selective"), "zb", 4, torch.float32, False),
    (4, dict(pp=2, tp=2, sequence_parallel=True, async_communication=True, vocab_parallel=True, cp=2,
             cp_comm_type="ring", recompute="selective"), "zb", 4, torch.bfloat16, True),
    # --recompute full: what the closures keep of the re-run block is a temporary
    (4, dict(pp=2, cp=2, cp_comm_type="ring", recompute="full"), "zb", 4, torch.bfloat16, False),
]


@pytest.mark.parametrize("layers,flags,schedule,m,dtype,tied", POSTED_CASES)
def test_posted_schedules_are_predicted_to_the_byte_on_every_stage(layers, flags, schedule, m, dtype, tied):
    """Interleaved's chunks (each a virtual stage's activations, the embedding on chunk 0 of stage
    0, the head on the last chunk of stage P-1, each chunk's grads from its first backward) and the
    posted sends alive until their release points (pipeline_parallel.releases): the model against
    the tracker on fake tensors, stage by stage, peak and every category."""
    c, par = replace(PIPE, num_hidden_layers=layers, tie_word_embeddings=tied), ParallelConfig(**flags)
    for stage in range(par.pp):
        kw = dict(seq_len=S, micro_batch_size=B, dtype=dtype, num_microbatches=m, schedule=schedule)
        pred = predict_memory(c, par, stage=stage, **kw)
        _check_model(pred, estimate_step_memory(c, par, iters=1, stage=stage, **kw), f"stage {stage}")


def test_zero_bubble_under_selective_recompute_peaks_at_the_first_blocks_input_norm():
    """With many tokens per microbatch ZB-H1's B under --recompute selective is largest at its end,
    in the first block's input norm (lean), every block's W-pending tensors held: the model lists
    that moment, equal to --estimate there."""
    c, par = replace(PIPE, num_hidden_layers=2), ParallelConfig(pp=2, tp=2, recompute="selective")
    kw = dict(seq_len=128, micro_batch_size=B, dtype=torch.float32, num_microbatches=4, schedule="zb", stage=0)
    pred = predict_memory(c, par, **kw)
    assert pred.peak_at.startswith("input_norm_backward"), pred.peak_at
    _check_model(pred, estimate_step_memory(c, par, iters=1, **kw), "stage 0")


MOE_CHUNKED = replace(PIPE, use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# a measured routing (rows per expert, each layer): stage 0's layers load EP rank 0 (experts 0 and 1)
# most, stage 1's rank 1 (layer 2, stage 0's second chunk, sends EP rank 1 236 of its 256 rows)
MEASURED_ROUTING = {f"model.layers.{i}.mlp": rows for i, rows in
                    enumerate([[120, 40, 60, 36], [20, 140, 80, 16], [10, 10, 200, 36], [64, 64, 64, 64]])}
MOE_CHUNKED_CASES = {  # (layout, dtype, routing, the EP rank measured on each stage): pp2 V2 M4
    "ep1": (ParallelConfig(pp=2, virtual_stages=2), torch.float32, RoutingPolicy.BALANCED, (0, 0)),
    "tp2 sp ep2 bf16": (ParallelConfig(pp=2, tp=2, dp=2, ep=2, sequence_parallel=True, virtual_stages=2),
                        torch.bfloat16, RoutingPolicy.BALANCED, (0, 0)),
    "vp cp2": (ParallelConfig(pp=2, tp=2, cp=2, vocab_parallel=True, virtual_stages=2), torch.float32,
               RoutingPolicy.BALANCED, (0, 0)),
    # each chunk's own rows: stage 0's worst EP rank (1) peaks inside its second chunk's combine
    "dp2 ep2 measured": (ParallelConfig(pp=2, dp=2, ep=2, virtual_stages=2), torch.float32, MEASURED_ROUTING,
                         (1, 0)),
}


def test_the_moe_model_under_model_chunks_is_predicted_to_the_byte_on_every_stage():
    """Interleaved runs the MoE model with each chunk backpropagating its own aux loss: every unit
    (microbatch, chunk) keeps its aux backward root (the last chunk: its objective) to its
    backward and its reported aux share to the step's end (posted_replay.UnitTerms' MoE terms).
    Against --estimate on every stage (stage 0 peaks in a first chunk's weighting backward, stage
    1 in the head's backward with units of both chunks held), and the planner's remembered rows
    (worst_only) give each stage the same bytes. Under a measured routing each chunk's layers take
    their own rows, and the stage's worst EP rank peaks in the combine of a skewed layer's forward
    (moe_forward_moments.py), above the end of that forward."""
    memo = {}   # what the fake dispatch remembers, shared by the cases (the same reports, faster)
    for name, (par, dtype, routing, ep_ranks) in MOE_CHUNKED_CASES.items():
        kw = dict(seq_len=S, micro_batch_size=B, dtype=dtype, num_microbatches=4, schedule="interleaved",
                  routing=routing)
        fast = predict_memory(MOE_CHUNKED, par, worst_only=True, **kw)
        for stage in range(par.pp):
            pred = predict_memory(MOE_CHUNKED, par, stage=stage, **kw)
            assert fast.per_stage[stage] == pred.peak_bytes, (name, stage)
            _check_model(pred, estimate_step_memory(MOE_CHUNKED, par, iters=1, memo=memo, stage=stage, ep_rank=ep_ranks[stage],
                                                    **kw), f"{name} stage {stage}")
            if routing is MEASURED_ROUTING and stage == 0:
                assert pred.peak_at.startswith("moe_combine"), pred.peak_at


EARLIER_SELECTIVE_CASES = {  # (model fields, dtype, sizes, the peak): pp2 stage 0 of the MoE model, selective
    "fp32": (dict(hidden_size=128, num_hidden_layers=4), torch.float32, dict(seq_len=128, micro_batch_size=2,
                                                                             num_microbatches=2), "forward_end[1]"),
    # half precision: the block's input and middle residual stream are what the lean norms save
    # (activations), no bound copies of them beside the frame's two
    "bf16 two experts": (dict(hidden_size=32, num_experts=2, moe_intermediate_size=64), torch.bfloat16,
                         dict(seq_len=64, micro_batch_size=1, num_microbatches=2), "forward_end[1]"),
    # half precision, N E > H (E + 1): the router's backward, at the post-attention norm's output
    # re-made for its weight grad, above the lean norm's own backward
    "bf16 router": (dict(hidden_size=128, num_hidden_layers=2), torch.bfloat16,
                    dict(seq_len=128, micro_batch_size=2, num_microbatches=1), "router_backward[0]"),
}


def test_an_earlier_stage_under_selective_recompute_ends_its_forward_with_the_blocks_frame_bound():
    """--recompute selective on an earlier stage: at the last residual add the block's frame still
    binds the attention's output and the post-attention norm's (neither saved), two [N, H] beyond
    `forward_end`'s usual two. With 2 tokens per unit of hidden size the MoE model peaks there; in
    half precision with more tokens per expert in the router's backward."""
    memo = {}   # what the fake dispatch remembers, shared by the cases (the same reports, faster)
    par = ParallelConfig(pp=2, recompute="selective")
    for name, (fields, dtype, sizes, peak) in EARLIER_SELECTIVE_CASES.items():
        c = MiniMindConfig(**{**dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                     vocab_size=128, tie_word_embeddings=False, max_position_embeddings=256,
                                     use_moe=True, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=16),
                              **fields})
        kw = dict(dtype=dtype, schedule="gpipe", stage=0, **sizes)
        pred = predict_memory(c, par, **kw)
        assert pred.peak_at == peak, (name, pred.peak_at)
        _check_model(pred, estimate_step_memory(c, par, iters=1, memo=memo, **kw), f"pp2 selective stage 0 {name}")


MOE_ZERO_BUBBLE_CASES = {  # (model, layout, sizes, the worst EP rank of each stage): the MoE model under zb
    # every unit's W-pending tensors are the attention's alone (router and experts whole nn.Linear,
    # their grads made in B): stage 0 peaks in a weighting backward with a unit waiting for its W
    "pp2 ep1": (MOE_CHUNKED, ParallelConfig(pp=2), dict(seq_len=S, dtype=torch.float32, num_microbatches=4), (0, 0)),
    # three units held at the first B of stages 0 and 1: the peak in the flash attention's backward,
    # o_proj's X and dY kept, its dq, dk, dv made (one layer per stage: after the aux loss's backward)
    "pp4 tp2 sp": (MiniMindConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                  vocab_size=128, tie_word_embeddings=False, max_position_embeddings=256, use_moe=True,
                                  num_experts=4, num_experts_per_tok=1, moe_intermediate_size=64),
                   ParallelConfig(pp=4, tp=2, sequence_parallel=True),
                   dict(seq_len=128, dtype=torch.float32, num_microbatches=3), (0,) * 4),
    # a measured routing (MEASURED_ROUTING)
    "pp2 dp2 ep2 measured": (MOE_CHUNKED, ParallelConfig(pp=2, dp=2, ep=2),
                             dict(seq_len=S, dtype=torch.float32, num_microbatches=4, routing=MEASURED_ROUTING),
                             (0, 1)),
    # CP ring under --recompute full: the first block's attention backward, every block above W-pending
    "pp2 cp2 ring full": (MiniMindConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=8,
                                         num_key_value_heads=4, vocab_size=512, tie_word_embeddings=False,
                                         max_position_embeddings=256, use_moe=True, num_experts=8,
                                         num_experts_per_tok=1, moe_intermediate_size=16),
                          ParallelConfig(pp=2, cp=2, cp_comm_type="ring", recompute="full"),
                          dict(seq_len=128, dtype=torch.float32, num_microbatches=4), (0, 0)),
}

MOE_ZERO_BUBBLE_PEAKS = {"pp2 ep1": "weighting_backward", "pp4 tp2 sp": "flash_attention_backward",
                         "pp2 dp2 ep2 measured": "weighting_backward",
                         "pp2 cp2 ring full": "attention_backward(first block)"}


def test_the_moe_model_under_zero_bubble_is_predicted_to_the_byte_on_every_stage():
    """ZB-H1 runs the MoE model's B with the attention's linears deferring their weight grads and
    the router's and experts' made in B (zero_bubble_moments._moe_mlp, _moe_moments): against
    --estimate on every stage, peak and every category, at ep 1 and ep 2, balanced and under a
    measured routing; the planner's remembered rows (worst_only) give each stage the same bytes."""
    memo = {}   # what the fake dispatch remembers, shared by the cases (the same reports, faster)
    for name, (c, par, sizes, ep_ranks) in MOE_ZERO_BUBBLE_CASES.items():
        kw = dict(micro_batch_size=B, schedule="zb", **sizes)
        fast = predict_memory(c, par, worst_only=True, **kw)
        peaks = set()
        for stage in range(par.pp):
            pred = predict_memory(c, par, stage=stage, **kw)
            assert fast.per_stage[stage] == pred.peak_bytes, (name, stage)
            _check_model(pred, estimate_step_memory(c, par, iters=1, memo=memo, stage=stage, ep_rank=ep_ranks[stage], **kw),
                         f"{name} stage {stage}")
            peaks.add(pred.peak_at.split("[")[0])
        assert MOE_ZERO_BUBBLE_PEAKS[name] in peaks, (name, peaks)
    # (under --zero 3: tests/test_zero3.py's MOE_ZERO_BUBBLE rows)


MOE_LINGERING_CASES = {  # (layers, vocab, layout, sizes): a received input kept past its backward
    # a middle stage of pp4 at M 8: the peak in chunk 0's backward with chunk 1's last input still kept
    "pp4 V2 stage 2": (8, 512, ParallelConfig(pp=4, virtual_stages=2),
                       dict(seq_len=128, num_microbatches=8, schedule="interleaved", stage=2)),
    # the optimizer step: each later chunk's last received input (1f1b: the last microbatch's)
    "1f1b stage 1": (4, 8192, ParallelConfig(pp=2), dict(seq_len=32, micro_batch_size=1, num_microbatches=4,
                                                         schedule="1f1b", stage=1)),
    "interleaved stage 1": (4, 8192, ParallelConfig(pp=2, virtual_stages=2),
                            dict(seq_len=32, micro_batch_size=1, num_microbatches=4, schedule="interleaved", stage=1)),
}


def test_a_chunks_last_received_input_outlives_its_backward_through_the_moe_layers_aux_loss():
    """Each MoE layer keeps its last aux loss (MiniMind's `self.aux_loss`), whose graph holds the
    chunk's received input (its grad's accumulator): the input of a chunk's last forward lives past
    that unit's backward until the chunk's next forward, or through the optimizer step
    (schedule_replay.moe_lingering). Against --estimate where that is the peak."""
    memo = {}   # what the fake dispatch remembers, shared by the cases (the same reports, faster)
    for name, (layers, vocab, par, sizes) in MOE_LINGERING_CASES.items():
        c = MiniMindConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                           vocab_size=vocab, tie_word_embeddings=False, max_position_embeddings=256, use_moe=True,
                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
        kw = {**dict(micro_batch_size=B, dtype=torch.float32), **sizes}
        pred = predict_memory(c, par, **kw)
        assert pred.peak_at.startswith("optimizer" if vocab > 512 else "weighting_backward"), (name, pred.peak_at)
        _check_model(pred, estimate_step_memory(c, par, iters=1, memo=memo, **kw), name)


def test_an_earlier_stage_of_the_moe_model_under_cp_keeps_its_aux_root():
    """Under CP only the last stage's objective is replaced by its CP-scaled copy: an earlier
    stage's first-microbatch MoE terms are those without CP (1f1b, pp2 cp2, stage 0)."""
    par = ParallelConfig(pp=2, cp=2)
    kw = dict(seq_len=S, micro_batch_size=B, dtype=torch.float32, num_microbatches=4, schedule="1f1b", stage=0)
    pred = predict_memory(MOE_CHUNKED, par, **kw)
    _check_model(pred, estimate_step_memory(MOE_CHUNKED, par, iters=1, **kw), "pp2 cp2 stage 0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_zero_bubble_w_step_frees_each_deferred_linears_output_grad_and_input(dtype):
    """ZB-H1's W-pending tensors, per unit until its W (docs/pipeline.md): every deferred linear's
    output grad dY -- q, o, down [N, H], k, v [N, kv d], gate, up [N, I] -- and saved input X --
    q/k/v's and gate/up's shared [N, H], o's [N, H], down's [N, I] -- per block. Measured on fake
    tensors: the tracker's live bytes across each W of stage 0 (the first W also makes the weights'
    grads)."""
    from minimind_parallel.pipeline_parallel import schedules
    trackers, freed = [], []

    class Watching(StorageTracker):
        def __init__(self, **kw):
            super().__init__(**kw)
            trackers.append(self)

    def weight(stage, unit, plain=schedules._Stage.weight):
        before = dict(trackers[-1].live)
        plain(stage, unit)
        freed.append({k: before[k] - v for k, v in trackers[-1].live.items()})

    kw = dict(seq_len=S, micro_batch_size=B, dtype=dtype, num_microbatches=4, schedule="zb", stage=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(schedules._Stage, "weight", weight)
        estimate_step_memory(PIPE, ParallelConfig(pp=2), iters=1, tracker_type=Watching, **kw)
    c, b, n = PIPE, torch.empty((), dtype=dtype).element_size(), S * B
    h, i, kv = c.hidden_size, c.intermediate_size, c.num_key_value_heads * c.head_dim
    blocks = c.num_hidden_layers // 2
    d_y, x = blocks * b * n * (3 * h + 2 * kv + 2 * i), blocks * b * n * (3 * h + i)
    weights = blocks * b * (2 * h * h + 2 * kv * h + 3 * i * h)   # q, o, k, v, gate, up, down
    assert len(freed) == 4
    # the first W makes the deferred weights' grads, filed as grads when made (its post-accumulate-grad hooks)
    assert freed[0] == dict(params=0, grads=-weights, optimizer=0, activations=x, temporaries=d_y), freed[0]
    for f in freed[1:]:
        assert f == dict(params=0, grads=0, optimizer=0, activations=x, temporaries=d_y), f


def _measure_stages(cases):
    """A real gloo run of each (schedule, layout, microbatches) (a warm-up step, then the meter
    around one step)."""
    out = {}
    for schedule, par, m in cases:
        groups = ProcessGroups.build(par)
        torch.manual_seed(0)
        dense = MiniMindForCausalLM(PIPE).state_dict()
        model = build_parallel_model(PIPE, par, groups, dense, dtype=torch.bfloat16)
        optimizer = make_optimizer(model, 1e-3)
        ids, targets = random_batch(0, B * m, S, PIPE.vocab_size)
        kw = dict(num_microbatches=m, schedule=schedule)
        train_step(model, optimizer, groups, ids, targets, **kw)
        meter = MemoryMeter("cpu", model, optimizer)
        with meter:
            train_step(model, optimizer, groups, ids, targets, **kw)
        out[schedule] = meter.report()
    return out


def test_measured_stage_peaks_are_the_models_and_1f1b_holds_p_microbatches_where_gpipe_holds_m():
    """Issue 5's claim, measured on real ranks and predicted: stage 0 of 1F1B holds P microbatches
    of activations, GPipe's all M, so its peak is (M - P) microbatches' worth higher. In the same
    launch interleaved 1F1B (V = 2, its posted sends freed at their release points) is the model's
    on real ranks too, and ZB-H1's real peak is the estimate's, to the byte."""
    par, m = ParallelConfig(pp=2), 5
    chunked = ParallelConfig(pp=2, virtual_stages=2)
    cases = [("gpipe", par, m), ("1f1b", par, m), ("interleaved", chunked, 4), ("zb", par, 4)]
    real = run_ranks(_measure_stages, par.pp, cases)
    kw = dict(seq_len=S, micro_batch_size=B, dtype=torch.bfloat16)
    # zb is not modelled: its real run is held to the estimate, both freeing each send at its release point
    for stage in range(par.pp):
        estimate = estimate_step_memory(PIPE, par, iters=1, stage=stage, num_microbatches=4, schedule="zb", **kw)
        assert (real[stage]["zb"].peak_bytes, real[stage]["zb"].breakdown) == (estimate.peak_bytes, estimate.breakdown)
    cases = cases[:-1]
    pred = {s: [predict_memory(PIPE, p_, schedule=s, stage=p, num_microbatches=m_, **kw) for p in range(p_.pp)]
            for s, p_, m_ in cases}
    for schedule, stages in pred.items():
        for stage, p in enumerate(stages):
            _check_model(p, real[stage][schedule], f"{schedule} stage {stage}")
    assert [p.held_at_peak for p in pred["gpipe"]] == [m, m]
    assert [p.held_at_peak for p in pred["1f1b"]] == [par.pp, 1]
    held = pred["gpipe"][0].held_per_microbatch
    # GPipe's stage 0 holds M - P more microbatches at its peak; 1F1B's holds every grad there
    # (its peak comes after its first backward), GPipe's only those of the first backward so far
    diff = (m - par.pp) * held - (pred["1f1b"][0].breakdown["grads"] - pred["gpipe"][0].breakdown["grads"])
    assert pred["gpipe"][0].peak_bytes - pred["1f1b"][0].peak_bytes == diff
    measured = real[0]["gpipe"].peak_bytes - real[0]["1f1b"].peak_bytes
    assert measured == diff


@pytest.mark.parametrize("seed", range(6))
def test_random_layouts_are_predicted_to_the_byte(seed):
    """A few draws of scripts/memory_model_sweep.py (which runs hundreds): a random model, layout,
    schedule and stage, in the model's domain (at least 2H tokens per microbatch)."""
    rng = random.Random(seed)
    case = None
    while case is None:
        case = sweep.draw(rng, 2)
    c, par, sizes = case
    _check_model(predict_memory(c, par, **sizes), estimate_step_memory(c, par, iters=1, **sizes), f"{par} {sizes}")


# ---------------------------------------------------------------- --recompute selective

SELECTIVE_LAYOUTS = [dict(tp=2), dict(tp=2, sequence_parallel=True), dict(tp=2, sequence_parallel=True,
                     async_communication=True), dict(tp=2, sequence_parallel=True, shared_sp_gather=True),
                     dict(tp=2, sequence_parallel=True, async_communication=True, vocab_parallel=True),
                     dict(tp=2, vocab_parallel=True), dict(dp=2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [128, 512])   # 128: peaks in the blocks' backward; 512: in the head's
@pytest.mark.parametrize("flags", SELECTIVE_LAYOUTS, ids=lambda f: "_".join(f"{k}{v}" for k, v in f.items()))
def test_selective_recompute_is_predicted_to_the_byte(flags, vocab, dtype):
    c = replace(TINY, vocab_size=vocab)
    par = ParallelConfig(recompute="selective", **flags)
    kw = dict(seq_len=S, micro_batch_size=B, dtype=dtype)
    _check_model(predict_memory(c, par, **kw), estimate_step_memory(c, par, iters=1, **kw), str(par))


@pytest.mark.parametrize("par,schedule,m,dtype,tied", [
    (ParallelConfig(pp=2, recompute="selective"), "1f1b", 3, torch.bfloat16, False),
    (ParallelConfig(pp=4, recompute="selective"), "gpipe", 4, torch.bfloat16, False),
    (ParallelConfig(pp=2, dp=2, recompute="selective"), "1f1b", 3, torch.float32, True),
    (ParallelConfig(pp=2, tp=2, sequence_parallel=True, async_communication=True, vocab_parallel=True,
                    recompute="selective"), "1f1b", 5, torch.bfloat16, True),
])
def test_selective_recompute_pipeline_stages_are_predicted_to_the_byte(par, schedule, m, dtype, tied):
    c, memo = replace(PIPE, tie_word_embeddings=tied), {}   # (the fake dispatch's memo: the same reports, faster)
    for stage in range(par.pp):
        kw = dict(seq_len=S, micro_batch_size=B, dtype=dtype, num_microbatches=m, schedule=schedule)
        _check_model(predict_memory(c, par, stage=stage, **kw),
                     estimate_step_memory(c, par, iters=1, stage=stage, memo=memo, **kw), f"stage {stage}")


def _block_activations(par, **kw):
    pred = activations_by_kind(MiniMindConfig(num_hidden_layers=2, **SEED), par, **kw)
    return sum(v for k, v in pred.items() if k.startswith("block."))


def test_selective_recompute_per_block_at_the_book_section_4_4_configuration():
    """B 4, S 2048, H 768, T 2, bf16: tp_sp_async keeps 196.34 MiB per block; selective keeps
    77.34 MiB (0.394x, the target <= 0.45x): norms 12.03, q/k norms 9.19, q 6, k/v 6, attention
    output 6.06, gate/up 38; the two norm outputs the column linears would save (12 MiB) are
    re-made in backward (recompute/norm_recompute.py)."""
    kw = dict(seq_len=2048, micro_batch_size=4, dtype=torch.bfloat16)
    base = dict(tp=2, sequence_parallel=True, async_communication=True)
    today = _block_activations(ParallelConfig(**base), **kw)
    lean = _block_activations(ParallelConfig(**base, recompute="selective"), **kw)
    n, nn_, hid, inter, d = 8192, 4096, 768, 1216, 96
    assert today == 2 * (2 * 4 * nn_ * hid + 4 * nn_) + 2 * 2 * nn_ * hid + 6 * n * (2 * 4 * d + 4) + \
        2 * n * 4 * d + 2 * 2 * n * 4 * d + 2 * n * 4 * d + 4 * n * 4 + 4 * 2 * n * inter
    assert lean == 2 * (2 * nn_ * hid + 4 * nn_) + 6 * n * (2 * d + 4) + \
        2 * n * 4 * d + 2 * 2 * n * 2 * d + 2 * n * 4 * d + 4 * n * 4 + 2 * 2 * n * inter
    assert round(today / MiB, 2) == 196.34 and round(lean / MiB, 2) == 77.34
    assert lean <= 0.45 * today


def test_selective_recompute_keeps_no_norm_output_at_the_book_section_4_4_configuration():
    """The same sizes with 2 layers, measured (--estimate): selective holds 12 MiB per block less
    than the lean pieces alone would (the norm outputs the column linears save: 2 b N/T H), and
    the model's peak and breakdown are the measurement's."""
    c = MiniMindConfig(num_hidden_layers=2, **SEED)
    kw = dict(seq_len=2048, micro_batch_size=4, dtype=torch.bfloat16)
    par = ParallelConfig(tp=2, sequence_parallel=True, async_communication=True, recompute="selective")
    meas = estimate_step_memory(c, par, iters=1, **kw)
    pred = predict_memory(c, par, **kw)
    _check_model(pred, meas, "book 4.4 selective")
    lean_block = _block_activations(par, **kw)
    assert pred.activations_by_kind["block.column_input"] == 0
    # the peak is in the head's backward with every block held: its activations are the blocks',
    # the final norm's and the head's -- no norm output among them
    assert meas.breakdown["activations"] <= 2 * lean_block + sum(
        v for k, v in pred.activations_by_kind.items() if k.startswith("model."))


def test_full_recompute_keeps_one_input_per_block_and_chunked_loss_cuts_the_loss_memory():
    """At the book's section 4.4 sizes with 2 layers (the estimate): full recompute holds one
    [S/T, B, H] input per block between forward and backward; --loss_chunks 8 cuts what the head
    and loss hold at the peak (the saved log-softmax or softmax and the two [N, V] grads) by > 4x."""
    c = MiniMindConfig(num_hidden_layers=2, **SEED)
    kw = dict(seq_len=2048, micro_batch_size=4, dtype=torch.bfloat16, iters=1)
    base = dict(tp=2, sequence_parallel=True, async_communication=True)
    lean = estimate_step_memory(c, ParallelConfig(**base, recompute="selective"), **kw)
    full = estimate_step_memory(c, ParallelConfig(**base, recompute="full"), **kw)
    lean_block = _block_activations(ParallelConfig(**base, recompute="selective"), seq_len=2048, micro_batch_size=4,
                                    dtype=torch.bfloat16)
    # both peak in the head's backward, every block's activations held: full holds b S/T B H each
    held = lean.breakdown["activations"] - full.breakdown["activations"]
    assert held == 2 * (lean_block - 2 * 1024 * 4 * 768)
    chunked = estimate_step_memory(c, ParallelConfig(**base, recompute="selective", loss_chunks=8), **kw)
    n, vocab = 8192, 6400
    loss_memory = 3 * 2 * n * vocab          # log-softmax [N, V] saved + its two grads at head_backward
    saved = lean.peak_bytes - chunked.peak_bytes
    assert loss_memory - saved <= loss_memory / 4, (saved / MiB, loss_memory / MiB)


# ---------------------------------------------------------------- --loss_chunks K

CHUNKED_LAYOUTS = [dict(), dict(tp=2), dict(tp=2, sequence_parallel=True), dict(tp=2, vocab_parallel=True),
                   dict(tp=2, sequence_parallel=True, async_communication=True, vocab_parallel=True,
                        recompute="selective"), dict(dp=2), dict(pp=2), dict(cp=2, cp_comm_type="ring")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("chunks", [2, 3])     # 3: uneven chunks of the N = 64 rows (22, 21, 21)
@pytest.mark.parametrize("flags", CHUNKED_LAYOUTS, ids=lambda f: "_".join(f"{k}{v}" for k, v in f.items()) or "one")
def test_chunked_loss_is_predicted_to_the_byte(flags, chunks, dtype):
    """--loss_chunks K with a large vocabulary (the head's chunks hold the peak): every stage."""
    c = replace(TINY, vocab_size=4096, num_hidden_layers=2)
    par = ParallelConfig(loss_chunks=chunks, **flags)
    for stage in range(par.pp):
        kw = dict(seq_len=S, micro_batch_size=B, dtype=dtype, num_microbatches=2, stage=stage)
        _check_model(predict_memory(c, par, **kw), estimate_step_memory(c, par, iters=1, **kw), f"{par} stage {stage}")


@pytest.mark.parametrize("dtype,moment", [(torch.bfloat16, "forward_end"), (torch.float32, "chunked_loss_backward")])
def test_the_chunked_loss_holds_the_peak_and_is_predicted(dtype, moment):
    """H 32, V 8192, two chunks: in bfloat16 the peak is inside the loss's forward (a chunk's
    logits, their fp32 copy and the previous chunk's fp32 logits), in float32 inside its backward
    (the recomputed logits beside the previous chunk's, the input and weight grads)."""
    c = replace(TINY, hidden_size=32, vocab_size=8192)
    par = ParallelConfig(loss_chunks=2)
    kw = dict(seq_len=128, micro_batch_size=2, dtype=dtype, num_microbatches=2)
    pred = predict_memory(c, par, **kw)
    _check_model(pred, estimate_step_memory(c, par, iters=1, **kw), moment)
    assert pred.peak_at.startswith(moment), pred.peak_at


# ---------------------------------------------------------------- --recompute full

FULL_LAYOUTS = [dict(), dict(tp=2, sequence_parallel=True), dict(tp=2, sequence_parallel=True,
                async_communication=True, vocab_parallel=True), dict(dp=2), dict(pp=2), dict(cp=2, cp_comm_type="ring"),
                dict(loss_chunks=3)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("vocab", [128, 4096])   # 128: peaks in the re-run blocks' backward; 4096: in the head's
@pytest.mark.parametrize("flags", FULL_LAYOUTS, ids=lambda f: "_".join(f"{k}{v}" for k, v in f.items()) or "one")
def test_full_recompute_is_predicted_to_the_byte(flags, vocab, dtype):
    """--recompute full: each block holds its input; its backward re-makes the rest (kept by the
    checkpoint's hooks, temporaries to the tracker)."""
    c = replace(PIPE, vocab_size=vocab, tie_word_embeddings=True)
    par = ParallelConfig(recompute="full", **flags)
    for stage in range(par.pp):
        kw = dict(seq_len=S, micro_batch_size=B, dtype=dtype, num_microbatches=2, stage=stage)
        pred = predict_memory(c, par, **kw)
        _check_model(pred, estimate_step_memory(c, par, iters=1, **kw), f"{par} stage {stage}")


def test_full_recompute_holds_one_input_per_block_in_the_model():
    """The model's held bytes per microbatch under full: one [S, B, H] input per block where
    selective holds every saved kind."""
    kw = dict(seq_len=S, micro_batch_size=B, dtype=torch.float32)
    full = predict_memory(PIPE, ParallelConfig(recompute="full"), **kw)
    lean = predict_memory(PIPE, ParallelConfig(recompute="selective"), **kw)
    block = sum(v for k, v in lean.activations_by_kind.items() if k.startswith("block."))
    assert lean.held_per_microbatch - full.held_per_microbatch == PIPE.num_hidden_layers * (block - 4 * S * B * 64)


def test_a_lower_blocks_backward_on_an_earlier_stage_is_predicted():
    """Under full recompute a block's weights outweigh what it holds, so stage 0's peak is in its
    lower block, where the received grad is still bound beside the residual grad."""
    c = replace(PIPE, tie_word_embeddings=True)
    par = ParallelConfig(pp=2, recompute="full")
    kw = dict(seq_len=64, micro_batch_size=B, dtype=torch.float32, schedule="gpipe", stage=0)
    pred = predict_memory(c, par, **kw)
    _check_model(pred, estimate_step_memory(c, par, iters=1, **kw), "stage 0")
    assert pred.peak_at.startswith("swiglu_backward(first block)"), pred.peak_at


# ---------------------------------------------------------------- the mixture-of-experts model

MOE = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=2048, use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
MOE_MODES = {  # the peak in the head's backward (memory/analytic/moe_sizes.py: what is modelled)
    "tp": ParallelConfig(tp=T),
    "tp_sp": ParallelConfig(tp=T, sequence_parallel=True),
    "tp_sp_async_vp": ParallelConfig(tp=T, sequence_parallel=True, async_communication=True, vocab_parallel=True),
    "tp_sp_async_lean": ParallelConfig(tp=T, sequence_parallel=True, async_communication=True, recompute="selective"),
    "ddp": ParallelConfig(dp=T),
}


def test_analytic_model_matches_the_measurement_and_estimate_of_the_moe_model():
    """Router, experts, the sort's indices, the aux loss's statistics: every byte the MoE layers
    save, against the real gloo run and --estimate (which routes evenly; at the head's backward the
    routing-dependent temporaries of the experts are gone)."""
    ranks = run_ranks(measure_real, T, MOE, MOE_MODES, S, B)
    for name, par in MOE_MODES.items():
        pred = predict_memory(MOE, par, seq_len=S, micro_batch_size=B, dtype=torch.bfloat16)
        assert pred.peak_at.startswith("head_backward") and pred.activations_by_kind["block.moe"] > 0, name
        _check_model(pred, estimate_step_memory(MOE, par, seq_len=S, micro_batch_size=B, dtype=torch.bfloat16,
                                                iters=1), name)
        _check_model(pred, max((r[name] for r in ranks), key=lambda rep: rep.peak_bytes), name)


MOE_EP_MODES = {  # the experts over 2 and 4 of the DP (x CP) ranks, alone and beside TP, PP, CP
    "ep2": (MOE, ParallelConfig(dp=2, ep=2), {}),
    "ep4": (MOE, ParallelConfig(dp=4, ep=4), {}),
    "tp_sp_ep2": (MOE, ParallelConfig(tp=T, dp=2, ep=2, sequence_parallel=True), {}),
    "tp_sp_async_vp_ep2": (MOE, ParallelConfig(tp=T, dp=2, ep=2, sequence_parallel=True, async_communication=True,
                                               vocab_parallel=True), {}),
    "tp_sp_pp_ep2 stage 0": (MOE, ParallelConfig(tp=T, pp=2, dp=2, ep=2, sequence_parallel=True), dict(stage=0)),
    "tp_sp_pp_ep2 stage 1": (MOE, ParallelConfig(tp=T, pp=2, dp=2, ep=2, sequence_parallel=True), dict(stage=1)),
    # untied: the peak is the optimizer step, where the step's reported aux loss is alive
    "cp_ring_dp_ep4": (replace(MOE, tie_word_embeddings=False),
                       ParallelConfig(cp=2, dp=2, ep=4, cp_comm_type="ring"), {}),
    # a larger vocabulary and batch: the head's backward, where the objective scaled by cp is alive
    "cp_all_gather_ep2 head": (replace(MOE, tie_word_embeddings=False, vocab_size=8192),
                               ParallelConfig(cp=2, ep=2), dict(seq_len=128, micro_batch_size=4)),
}


def test_analytic_model_matches_the_estimate_of_expert_parallel_layouts():
    """Each EP rank's share of the experts and what its dispatch saves (the regroup's and the
    combine's int64 indices), against --estimate, whose dispatch follows the balanced policy (every
    rank sends N*k/P rows to every rank, so each receives N*k)."""
    memo = {}   # what the fake dispatch remembers, shared by the cases (the same reports, faster)
    for name, (config, par, kw) in MOE_EP_MODES.items():
        kw = {**dict(seq_len=S, micro_batch_size=B, dtype=torch.bfloat16), **kw}
        pred = predict_memory(config, par, **kw)
        assert pred.peak_at.startswith(("head_backward", "optimizer")), (name, pred.peak_at)
        assert pred.activations_by_kind["block.moe"] > 0, name
        _check_model(pred, estimate_step_memory(config, par, iters=1, memo=memo, **kw), name)


def measure_routing(configs, par, seq_len, rows):
    """On each gloo rank, per config: the measured step of the MoE model as trained, and with its
    routers zeroed (every token's scores tie, so top-k sends all of them to the same k experts),
    each with its routing: this rank's tokens per expert of the step, per MoE layer."""
    out = {}
    for cname, config in configs.items():
        for name, zero in (("trained", False), ("routers zeroed", True)):
            report, model = _measure_step(config, par, seq_len, rows, zero_routers=zero)
            out[cname, name] = report, routing_histogram(model)
    return out


# a small vocabulary against N k I_e: the peak inside an MoE layer's own backward (its experts')
MOE_SMALL_VOCAB = replace(MOE, vocab_size=128, moe_intermediate_size=256, tie_word_embeddings=False)


def test_analytic_model_predicts_a_measured_routing_and_the_worst_case():
    """One real ep-2 launch (both ranks one EP group): its tokens per expert, summed over the
    ranks, fed to predict_memory give the worst rank's peak to the byte -- the experts' saved
    tensors and the dispatch's indices follow the rows each rank receives, and where the peak is
    inside the experts' backward, the rows of each expert -- and the balanced prediction misses
    it. With the routers zeroed every token lands on one rank's experts: the worst case."""
    par = ParallelConfig(dp=2, ep=2)
    kw = dict(seq_len=S, micro_batch_size=B, dtype=torch.bfloat16)
    configs = {"head": MOE, "experts": MOE_SMALL_VOCAB}
    ranks = run_ranks(measure_routing, 2, configs, par, S, B)
    routed_rows = par.ep * S * B * MOE.num_experts_per_tok      # the EP group's N k per layer
    peaks = {"head": ("head_backward",), "experts": ("expert_", "post_norm_backward")}
    for (cname, name) in ranks[0]:
        config = configs[cname]
        meas = max((r[cname, name][0] for r in ranks), key=lambda rep: rep.peak_bytes)
        histogram = {}
        for _, counts in (r[cname, name] for r in ranks):
            for layer, c in counts.items():
                histogram[layer] = [a + b for a, b in zip(histogram.get(layer, [0] * len(c)), c)]
        assert len(histogram) == config.num_hidden_layers and all(sum(c) == routed_rows for c in histogram.values())
        pred = predict_memory(config, par, routing=histogram, **kw)
        assert pred.peak_at.startswith(peaks[cname]) and "histogram" in pred.routing, (cname, name, pred.peak_at)
        _check_model(pred, meas, (cname, name))
        assert predict_memory(config, par, **kw).peak_bytes != meas.peak_bytes, (cname, name)
        if name == "routers zeroed":
            assert all(c[:2] == [0, 0] or c[2:] == [0, 0] for c in histogram.values()), histogram
            worst = predict_memory(config, par, routing=RoutingPolicy.WORST, **kw)
            assert worst.routing.startswith("worst case"), worst.routing
            _check_model(worst, meas, (cname, "worst case"))


MOE_BACKWARD_MODES = {  # the peak inside the MoE layer's backward: its experts', or the norm's after it
    "one rank bf16": (ParallelConfig(), torch.bfloat16, {}),
    # the post-attention norm's backward, the aux loss's saved N and load counted once (in block.moe)
    "one rank bf16 top-1 one layer": (ParallelConfig(), torch.bfloat16, dict(num_experts_per_tok=1, num_hidden_layers=1)),
    "one rank fp32 one layer": (ParallelConfig(), torch.float32, dict(num_hidden_layers=1)),
    "tp2 fp32 (first block)": (ParallelConfig(tp=T), torch.float32, {}),
    "tp2 three layers fp32 (first block)": (ParallelConfig(tp=T), torch.float32, dict(num_hidden_layers=3)),
    "ep2 fp32": (ParallelConfig(dp=2, ep=2), torch.float32, {}),
    "ep4": (ParallelConfig(dp=4, ep=4), torch.bfloat16, {}),
    "ep2 selective": (ParallelConfig(dp=2, ep=2, recompute="selective"), torch.bfloat16, {}),
    "pp2 ep2 stage 0": (ParallelConfig(pp=2, dp=2, ep=2), torch.bfloat16, dict(stage=0)),
    # a middle stage, narrow experts: the post-attention norm's backward (the aux loss's N and load freed once)
    "pp4 stage 1": (ParallelConfig(pp=4), torch.bfloat16, dict(num_hidden_layers=4, num_experts=2, num_experts_per_tok=1,
                                                            moe_intermediate_size=16, stage=1)),
    "full (first block)": (ParallelConfig(recompute="full"), torch.bfloat16, {}),
    # --recompute full in bf16, narrow experts: the post-attention norm's backward in the re-run block
    # (its weight grad not accumulated yet, its row means and rsqrt alive, one [Nn, H] fewer)
    "full bf16 top-1 narrow (first block)": (ParallelConfig(recompute="full"), torch.bfloat16,
                                             dict(num_experts_per_tok=1, moe_intermediate_size=16)),
    # under SP the router and experts' grads are TP-partial: finalize_grads sums them in one flat copy
    "tp2 sp": (ParallelConfig(tp=T, sequence_parallel=True), torch.bfloat16, {}),
}


def test_the_moe_layers_own_backward_is_predicted_to_the_byte():
    """A small vocabulary against N k I_e: the peak is an expert's backward (the last expert's
    down_proj or SwiGLU, every other expert's weight grads made), the post-attention norm's after
    the layer, or under SP the TP-partial grads' sum; against --estimate (the balanced routing)."""
    memo = {}   # what the fake dispatch remembers, shared by the cases (the same reports, faster)
    for name, (par, dtype, kw) in MOE_BACKWARD_MODES.items():
        kw = dict(kw)
        stage = kw.pop("stage", None)
        config = replace(MOE_SMALL_VOCAB, **kw)
        sizes = dict(seq_len=S, micro_batch_size=B, dtype=dtype)
        pred = predict_memory(config, par, stage=stage, **sizes)
        want = ("partial_grad_sum",) if par.sequence_parallel else ("expert_", "post_norm_backward", "router_backward")
        assert pred.peak_at.startswith(want), (name, pred.peak_at)
        _check_model(pred, estimate_step_memory(config, par, iters=1, memo=memo, stage=stage or 0, **sizes), name)


def test_a_routing_histogram_that_does_not_fit_the_layout_is_refused_in_one_line():
    par, kw = ParallelConfig(dp=2, ep=2), dict(seq_len=S, micro_batch_size=B, dtype=torch.bfloat16)
    rows = par.ep * S * B * MOE.num_experts_per_tok
    short = {"model.layers.0.mlp": [rows, 0, 0, 0], "model.layers.1.mlp": [rows - 1, 0, 0, 0]}
    message = one_line_error(ValueError, predict_memory, MOE, par, routing=short, **kw)
    assert "summing to ep x tokens x k = 256; got 4 summing to 255" in message, message
    message = one_line_error(ValueError, predict_memory, MOE, par, routing={"model.layers.0.mlp": [rows, 0, 0, 0]}, **kw)
    assert "no counts for MoE layer(s) [1]" in message, message


TIED_GRAD_SUM_MODES = {  # a large tied vocabulary: the step's last backward moment is the tied grads' sum
    "full": ParallelConfig(recompute="full"),
    "cp2 all-gather": ParallelConfig(cp=2),
    "cp2 ring": ParallelConfig(cp=2, cp_comm_type="ring"),
}


@pytest.mark.parametrize("moe", [False, True])
def test_the_tied_grads_sum_is_predicted_to_the_byte(moe):
    """After the first MoE layer's aux loss has run its backward, the grad of the stage's summed
    aux loss is gone: at the tied grads' sum (--recompute full, CP) as at the embedding's backward."""
    dense = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           vocab_size=4096, tie_word_embeddings=True)
    c = replace(MOE, vocab_size=4096, tie_word_embeddings=True) if moe else dense
    kw = dict(seq_len=S, micro_batch_size=B, dtype=torch.bfloat16)
    for name, par in TIED_GRAD_SUM_MODES.items():
        pred = predict_memory(c, par, **kw)
        assert pred.peak_at.startswith("tied_grad_sum"), (name, pred.peak_at)
        _check_model(pred, estimate_step_memory(c, par, iters=1, **kw), name)


MOE_MICROBATCH_CASES = {  # (model fields, layout, sizes): several microbatches of the MoE model
    "one rank, gpipe M3": (dict(vocab_size=2048), ParallelConfig(), dict(num_microbatches=3, schedule="gpipe",
                                                                         dtype=torch.float32)),
    "pp2 last stage, gpipe M3": (dict(vocab_size=2048, num_hidden_layers=4), ParallelConfig(tp=T, pp=2, dp=2),
                                 dict(num_microbatches=3, schedule="gpipe", dtype=torch.float32, stage=1)),
    "pp2 first stage, 1f1b M3": (dict(vocab_size=512, hidden_size=32, num_hidden_layers=4, num_experts=2,
                                      num_experts_per_tok=1, moe_intermediate_size=64),
                                 ParallelConfig(tp=T, pp=2, dp=2, ep=2, sequence_parallel=True),
                                 dict(num_microbatches=3, schedule="1f1b", seq_len=128, micro_batch_size=1, stage=0)),
}


def test_each_microbatch_of_the_moe_model_adds_its_aux_share_and_its_objective_or_aux_root():
    """Each finished forward's reported aux share lives to the step's end, each held microbatch's
    objective (last stage) or aux backward root (earlier stage, made after its forward) to its
    backward: against --estimate at a head's backward and an earlier stage's forward end."""
    memo = {}   # what the fake dispatch remembers, shared by the cases (the same reports, faster)
    for name, (fields, par, sizes) in MOE_MICROBATCH_CASES.items():
        c = replace(MOE, **fields)
        kw = {**dict(seq_len=S, micro_batch_size=B, dtype=torch.bfloat16), **sizes}
        pred = predict_memory(c, par, **kw)
        # a later microbatch's moment, or several held: more than one microbatch's scalars alive
        later = not pred.peak_at.endswith("[0]") or pred.held_at_peak > 1
        assert pred.peak_at.startswith(("head_backward", "forward_end")) and later, (name, pred.peak_at)
        _check_model(pred, estimate_step_memory(c, par, iters=1, memo=memo, **kw), name)


MOE_SMALL_TERM_CASES = {  # (model fields, layout, sizes): the MoE step's small terms, to the byte
    # each layer's token count N is a fill, not torch.tensor (which on fake tensors keeps a real copy)
    "gpipe M3, the count N": (dict(vocab_size=128, moe_intermediate_size=64, num_experts=8), ParallelConfig(),
                              dict(num_microbatches=3, schedule="gpipe", seq_len=128, micro_batch_size=1)),
    # VP: the forward's moment is inside the loss, before the aux share and the objective exist
    "vp, inside the loss": (dict(hidden_size=32, vocab_size=2048, num_experts=2, num_experts_per_tok=1,
                                 moe_intermediate_size=64), ParallelConfig(tp=T, vocab_parallel=True),
                            dict(dtype=torch.float32)),
    # ep2: the dispatch's fake regroup index holds no real copy of its values either
    "ep2 M3, the regroup index": (dict(hidden_size=128, num_hidden_layers=1, vocab_size=8192, num_experts=4,
                                       num_experts_per_tok=1, moe_intermediate_size=256), ParallelConfig(dp=2, ep=2),
                                  dict(num_microbatches=3, dtype=torch.float32, seq_len=128)),
    # basic SP + selective: the router's input is the post-attention norm's output shard, re-made in backward
    "sp selective, the router's input": (dict(hidden_size=32, num_hidden_layers=1, vocab_size=512, num_experts=2,
                                              moe_intermediate_size=64, num_attention_heads=8, num_key_value_heads=8),
                                         ParallelConfig(tp=T, sequence_parallel=True, recompute="selective"),
                                         dict(dtype=torch.float32)),
}


def test_the_moe_steps_small_terms_are_predicted_to_the_byte():
    """The aux loss's token count, the dispatch's index, the last stage's aux share and objective
    (not made yet inside the loss) and the router's re-made input against --estimate."""
    memo = {}   # what the fake dispatch remembers, shared by the cases (the same reports, faster)
    for name, (fields, par, sizes) in MOE_SMALL_TERM_CASES.items():
        c = replace(MOE, **fields)
        kw = {**dict(seq_len=S, micro_batch_size=B, dtype=torch.bfloat16), **sizes}
        pred = predict_memory(c, par, **kw)
        _check_model(pred, estimate_step_memory(c, par, iters=1, memo=memo, **kw), name)


# a narrow MoE model whose balanced combine can be a stage's peak (top-2 of two experts, E / ep = 1)
MOE_COMBINE = MiniMindConfig(hidden_size=16, num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=1,
                             vocab_size=128, tie_word_embeddings=False, max_position_embeddings=512, use_moe=True,
                             num_experts=2, num_experts_per_tok=2, moe_intermediate_size=8)
SKEWED_CASES = {  # (model, layout, sizes, routing, the moment): an earlier stage's own moments
    # every token on EP rank 0's experts (M = 2 R): the combine's backward, three [M, H] live
    "gpipe pp2 dp2 ep2 worst": (replace(MOE_CHUNKED, num_hidden_layers=2), ParallelConfig(pp=2, dp=2, ep=2),
                                dict(seq_len=S, micro_batch_size=B, dtype=torch.float32, num_microbatches=1,
                                     schedule="gpipe"), RoutingPolicy.WORST, "combine_backward[0]"),
    # the first forward's end, before the stage's summed aux loss is made (tp4 pp2 M1 bf16, ep 1)
    "1f1b pp2 tp4 M1 bf16": (MiniMindConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=8,
                                            num_key_value_heads=8, vocab_size=128, tie_word_embeddings=False,
                                            max_position_embeddings=256, use_moe=True, num_experts=2,
                                            num_experts_per_tok=1, moe_intermediate_size=64),
                             ParallelConfig(tp=4, pp=2), dict(seq_len=64, micro_batch_size=1, dtype=torch.bfloat16,
                                                              num_microbatches=1, schedule="1f1b"),
                             RoutingPolicy.BALANCED, "forward_end[0]"),
    # no aux loss (router_aux_loss_coef 0): no backward root held per microbatch, the sum not kept
    "gpipe pp2 dp2 ep2 M2 coef 0": (replace(MOE_CHUNKED, num_hidden_layers=2, router_aux_loss_coef=0.0),
                                    ParallelConfig(pp=2, dp=2, ep=2),
                                    dict(seq_len=S, micro_batch_size=B, dtype=torch.float32, num_microbatches=2,
                                         schedule="gpipe"), RoutingPolicy.BALANCED, "weighting_backward[0]"),
    # the balanced routing's combine (moe_forward_moments) as stage 0's peak, pp4 dp2 ep2 M4: one
    # local expert at top-2 (E 2), its counts int64 [E / ep] (8 B over before), fp32, selective
    "interleaved pp4 V2 one local expert": (replace(MOE_COMBINE, router_aux_loss_coef=0.0),
                                            ParallelConfig(pp=4, dp=2, ep=2, virtual_stages=2, recompute="selective"),
                                            dict(seq_len=128, micro_batch_size=1, dtype=torch.float32,
                                                 num_microbatches=4, schedule="interleaved"),
                                            RoutingPolicy.BALANCED, "moe_combine[3.1]"),
    # four local experts at top-3 (E 8): 16 B under before
    "interleaved pp4 V2 top-3 of 8": (replace(MOE_COMBINE, num_experts=8, num_experts_per_tok=3,
                                              router_aux_loss_coef=0.0),
                                      ParallelConfig(pp=4, dp=2, ep=2, virtual_stages=2, recompute="selective"),
                                      dict(seq_len=128, micro_batch_size=1, dtype=torch.float32,
                                           num_microbatches=4, schedule="interleaved"),
                                      RoutingPolicy.BALANCED, "moe_combine[3.1]"),
    # zb, --zero 1, bf16 without an aux loss: the constant 0 aux losses and their reported shares in
    # the model dtype (schedule_replay.aux_share, moe_sizes.moe_temporaries' b): 14 B over before
    "zb pp4 zero1 bf16 coef 0": (replace(MOE_COMBINE, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=2, router_aux_loss_coef=0.0),
                                 ParallelConfig(pp=4, dp=2, ep=2, zero=1),
                                 dict(seq_len=64, micro_batch_size=2, dtype=torch.bfloat16, num_microbatches=4,
                                      schedule="zb"), RoutingPolicy.BALANCED, "moe_combine[3.0]"),
}


def test_an_earlier_stages_combine_backward_and_first_forward_end_are_predicted_to_the_byte():
    """Stage 0 against --estimate where the peak is the combine's backward of a rank whose experts
    receive every token (moe_backward_moments' combine_backward), where it is the end of the
    step's first forward (nothing of the stage's summed aux loss made yet: schedule_replay.moe_unmade),
    without an aux loss (moe_sizes.moe_temporaries, schedule_replay.moe_held), and inside the
    combine of a forward under the balanced routing (moe_forward_moments), where the planner's
    moments alone (posted_peak.py, worst_only) give the same peak as the full replay."""
    memo = {}   # what the fake dispatch remembers, shared by the cases (the same reports, faster)
    for name, (c, par, sizes, routing, moment) in SKEWED_CASES.items():
        pred = predict_memory(c, par, stage=0, routing=routing, **sizes)
        assert pred.peak_at == moment, (name, pred.peak_at)
        if moment.startswith("moe_combine"):
            assert predict_memory(c, par, worst_only=True, **sizes).per_stage[0] == pred.peak_bytes, name
        _check_model(pred, estimate_step_memory(c, par, iters=1, memo=memo, stage=0, routing=routing, **sizes), name)


def test_the_estimate_follows_the_worst_case_and_a_given_histogram_as_the_model_does():
    """--estimate on fake tensors cannot route: each MoE layer's dispatch and experts take the rows
    from the routing given (moe/fake_routing.py), so the estimate of the worst case and of a skewed
    histogram (each EP rank's; the worst one) equals the model to the byte, inside the experts'
    backward where each expert's rows count, and differs from the balanced one."""
    par, kw = ParallelConfig(dp=2, ep=2), dict(seq_len=S, micro_batch_size=B, dtype=torch.float32)
    histogram = {"model.layers.0.mlp": [100, 60, 50, 46], "model.layers.1.mlp": [10, 20, 200, 26]}
    memo = {}   # what the fake dispatch remembers, shared by the cases (the same reports, faster)
    balanced = estimate_step_memory(MOE_SMALL_VOCAB, par, iters=1, memo=memo, **kw).peak_bytes
    for routing, ep_ranks in ((RoutingPolicy.WORST, [0]), (histogram, [0, 1])):
        pred = predict_memory(MOE_SMALL_VOCAB, par, routing=routing, **kw)
        assert pred.peak_at.startswith("expert_"), pred.peak_at
        est = max((estimate_step_memory(MOE_SMALL_VOCAB, par, iters=1, memo=memo, routing=routing, ep_rank=r, **kw)
                   for r in ep_ranks), key=lambda rep: rep.peak_bytes)
        _check_model(pred, est, pred.routing)
        assert est.peak_bytes != balanced, pred.routing


def test_a_routing_per_microbatch_is_predicted_as_the_estimate_follows_it():
    """A list of histograms, one per microbatch: each held microbatch saves by its own routing and
    its experts' backward moments are its own (schedule_replay's `each`); the estimate's fake
    dispatch takes microbatch i's (moe/feed_forward: the layer's forwards in turn). GPipe M3 at
    dp2 ep2, every EP rank estimated: the worst equals the model to the byte, and the prediction
    is none of the single histograms' (each taken for every microbatch)."""
    par = ParallelConfig(dp=2, ep=2)
    kw = dict(seq_len=S, micro_batch_size=B, dtype=torch.float32, num_microbatches=3, schedule="gpipe")
    each = [{"model.layers.0.mlp": [200, 20, 20, 16], "model.layers.1.mlp": [180, 50, 10, 16]},
            {"model.layers.0.mlp": [10, 10, 200, 36], "model.layers.1.mlp": [64, 64, 64, 64]},
            {"model.layers.0.mlp": [100, 60, 50, 46], "model.layers.1.mlp": [10, 20, 200, 26]}]
    pred = predict_memory(MOE_SMALL_VOCAB, par, routing=each, **kw)
    est = max((estimate_step_memory(MOE_SMALL_VOCAB, par, iters=1, routing=each, ep_rank=r, **kw) for r in (0, 1)),
              key=lambda rep: rep.peak_bytes)
    _check_model(pred, est, pred.routing)
    assert pred.routing.startswith("the given histograms, one per microbatch"), pred.routing
    singles = {predict_memory(MOE_SMALL_VOCAB, par, routing=h, **kw).peak_bytes for h in each}
    assert pred.peak_bytes not in singles, (pred.peak_bytes, singles)
    # one per microbatch (one line otherwise), and not under --zero 3: one line
    message = one_line_error(ValueError, predict_memory, MOE_SMALL_VOCAB, par, routing=each[:2], **kw)
    assert "routing histograms: one per microbatch, num_microbatches=3; got 2" in message, message
    message = one_line_error(NotImplementedError, predict_memory, MOE_SMALL_VOCAB, replace(par, zero=3),
                             routing=each, **kw)
    assert "a routing per microbatch is modelled without --zero 3" in message, message


def test_a_routing_per_microbatch_under_model_chunks_gives_each_unit_its_own_rows():
    """Interleaved with a routing per microbatch: each unit (microbatch, chunk) saves by its
    microbatch's rows of its chunk's layers (posted_replay's per-unit terms), and the estimate's
    fake dispatch takes each layer's forwards in turn. pp2 V2 dp2 ep2 M4, stage 0's both EP ranks
    against --estimate (one peaks in a combine's backward, the other in a weighting's); the
    prediction is none of the single histograms' (each taken for every microbatch)."""
    par = ParallelConfig(pp=2, dp=2, ep=2, virtual_stages=2)
    kw = dict(seq_len=S, micro_batch_size=B, dtype=torch.bfloat16, num_microbatches=4, schedule="interleaved",
              stage=0)
    each = [MEASURED_ROUTING] + [{f"model.layers.{i}.mlp": rows for i, rows in enumerate(layers)} for layers in (
        [[200, 20, 20, 16], [10, 10, 200, 36], [64, 64, 64, 64], [20, 140, 80, 16]],
        [[64, 64, 64, 64], [120, 40, 60, 36], [10, 10, 30, 206], [100, 60, 50, 46]],
        [[10, 20, 200, 26], [64, 64, 64, 64], [180, 50, 10, 16], [10, 10, 200, 36]])]
    pred = predict_memory(MOE_CHUNKED, par, routing=each, **kw)
    est = max((estimate_step_memory(MOE_CHUNKED, par, iters=1, routing=each, ep_rank=r, **kw) for r in (0, 1)),
              key=lambda rep: rep.peak_bytes)
    _check_model(pred, est, pred.peak_at)
    singles = {predict_memory(MOE_CHUNKED, par, routing=h, **kw).peak_bytes for h in each}
    assert pred.peak_bytes not in singles, (pred.peak_bytes, singles)


WEIGHTING_CASES = {  # (model fields, layout, sizes): the peak in the weighting's backward, every grad made
    # few tokens and narrow experts, an earlier pipeline stage at a later microbatch
    "pp2 stage 0": (dict(hidden_size=32, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=16),
                    ParallelConfig(pp=2), dict(num_microbatches=3, stage=0)),
    # --recompute full: the re-run block's tensors beside it
    "full": (dict(num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4, num_experts=8,
                  moe_intermediate_size=256), ParallelConfig(recompute="full"),
             dict(num_microbatches=2, seq_len=128, micro_batch_size=1)),
}


def test_the_weighting_backward_of_an_moe_layer_is_predicted_to_the_byte():
    """The MoE layer's first backward moment, the weighting's (the grads of the weighted output,
    the experts' output and their product, [R, H] each), against --estimate."""
    memo = {}   # what the fake dispatch remembers, shared by the cases (the same reports, faster)
    for name, (fields, par, sizes) in WEIGHTING_CASES.items():
        c = replace(MOE, vocab_size=128, tie_word_embeddings=False, **fields)
        kw = {**dict(seq_len=S, micro_batch_size=B, dtype=torch.float32), **sizes}
        pred = predict_memory(c, par, **kw)
        assert pred.peak_at.startswith("weighting_backward"), (name, pred.peak_at)
        _check_model(pred, estimate_step_memory(c, par, iters=1, memo=memo, **{"stage": 0, **kw}), name)
