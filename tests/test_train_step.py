"""The training step's numerics against the dense model in float64: clipping by the global
grad norm counts every parameter once over TP shards, pipeline stages and tied copies; the loss
and gradient of a data-parallel step with unevenly padded rows are the dense model's mean over
every target token of the global batch (`loss_normalisation`); with as many targets on every
replica the plain step is the token-weighted one; mixed precision keeps float32 parameters."""

import pytest
import torch

from distributed import run_ranks
from minimind_parallel.config import MiniMindConfig, ParallelConfig
from minimind_parallel.context_parallel import ContextLayout
from minimind_parallel.data.batches import (IGNORE_INDEX, Batch, count_targets, cp_tokens, dp_rows, random_batch,
                                            shift_labels, split_microbatches)
from minimind_parallel.training.grad_clip import clip_grad_norm_
from minimind_parallel.groups import ProcessGroups
from minimind_parallel.training.mixed_precision import LossScaler, Precision
from minimind_parallel.model import MiniMindForCausalLM
from minimind_parallel.pipeline_parallel import forward_backward
from minimind_parallel.loss_normalisation import (backward_loss, grad_divisor, microbatch_weights, token_mean,
                                                  world_token_mean)
from minimind_parallel.training import (build_parallel_model, finalize_grads, make_optimizer, train_step, unwrap,
                                        wrap_data_parallel)
from minimind_parallel.validation import dense_slice

SEQ, VOCAB = 8, 64


def tiny(tied: bool) -> MiniMindConfig:
    return MiniMindConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=VOCAB, intermediate_size=64, tie_word_embeddings=tied)


def dense_and_parallel(par: ParallelConfig, tied: bool, dtype=torch.float64):
    groups = ProcessGroups.build(par)
    torch.manual_seed(0)
    dense = MiniMindForCausalLM(tiny(tied)).to(dtype)
    model = build_parallel_model(dense.config, par, groups, dense.state_dict(), dtype=dtype)
    return dense, wrap_data_parallel(model, groups), groups


def worst_shard_error(model, dense, groups, of) -> float:
    """max |this rank's shard of of(param) - the matching slice of the dense of(param)|."""
    worst = 0.0
    for name, p in unwrap(model).named_parameters():
        want = dense_slice(name, of(dense.get_parameter(name)), groups.par, groups.tp_rank)
        worst = max(worst, (of(p) - want).abs().max().item())
    return worst


def _clip(par, tied, microbatches):
    dense, model, groups = dense_and_parallel(par, tied)
    batch = random_batch(1, 4 * par.dp, SEQ, VOCAB)
    dense(batch.input_ids, targets=batch.targets).loss.backward()
    full_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), float("inf")).item()
    dense_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.1 * full_norm)  # clips: coefficient 0.1
    forward_backward(model, groups, split_microbatches(*dp_rows(batch, groups.dp_rank, par.dp), microbatches))
    finalize_grads(model, groups)
    norm = clip_grad_norm_(model, groups, 0.1 * full_norm)
    return norm.item(), dense_norm.item(), worst_shard_error(model, dense, groups, lambda p: p.grad)


CLIP_LAYOUTS = [
    (ParallelConfig(tp=2, sequence_parallel=True, vocab_parallel=True), False, 1),
    (ParallelConfig(tp=2), True, 1),                      # replicated lm_head/embedding: once, not twice
    (ParallelConfig(pp=2), True, 2),                      # tied copies on two stages: once
    (ParallelConfig(tp=2, pp=2, sequence_parallel=True), True, 2),
    (ParallelConfig(tp=2, dp=2), False, 1),               # DP replicas: not summed
]


@pytest.mark.parametrize("par,tied,microbatches", CLIP_LAYOUTS,
                         ids=["tp2_sp_vp", "tp2_tied", "pp2_tied", "tp2_pp2_sp_tied", "tp2_dp2"])
def test_global_norm_clipping_equals_the_dense_clip_grad_norm(par, tied, microbatches):
    for norm, dense_norm, grad_error in run_ranks(_clip, par.world_size, par, tied, microbatches):
        assert norm == pytest.approx(dense_norm, rel=1e-12, abs=0)
        assert grad_error < 1e-14


def uneven_batch(rows: int, seed: int = 3) -> Batch:
    """Rows padded after different lengths (MiniMind's labels: -100 at padding), shifted once."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, SEQ), generator=g)
    lengths = [SEQ, 3, 6, 2, 5, 8, 4, 7][:rows]
    labels = ids.clone()
    for r, n in enumerate(lengths):
        ids[r, n:] = 0
        labels[r, n:] = IGNORE_INDEX
    return Batch(ids, shift_labels(labels))


def _dp_step(par, microbatches, grad_clip):
    dense, model, groups = dense_and_parallel(par, tied=False)
    batch = uneven_batch(4)
    lr = 0.1
    dense_loss = dense(batch.input_ids, targets=batch.targets).loss
    dense_loss.backward()
    dense_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    torch.optim.SGD(dense.parameters(), lr=lr).step()
    mine = cp_tokens(dp_rows(batch, groups.dp_rank, par.dp), ContextLayout.of(par, SEQ), groups.cp_rank)
    stats = train_step(model, torch.optim.SGD(model.parameters(), lr=lr), groups, *mine,
                       num_microbatches=microbatches, schedule="1f1b", token_weighted_dp=True, grad_clip=grad_clip,
                       precision=Precision.of("pure", torch.float64, "cpu"))
    loss_sum = None if stats.loss is None else stats.loss * stats.targets
    loss, n = world_token_mean(loss_sum, stats.targets, groups)
    return (loss, dense_loss.item(), n, int((batch.targets != IGNORE_INDEX).sum()), stats.grad_norm.item(),
            dense_norm.item(), worst_shard_error(model, dense, groups, lambda p: p.detach()))


@pytest.mark.parametrize("par,microbatches,grad_clip", [
    (ParallelConfig(dp=2), 1, 0.0),
    (ParallelConfig(dp=2), 2, 0.05),
    (ParallelConfig(pp=2, dp=2), 2, 0.05),
    (ParallelConfig(cp=2), 1, 0.05),          # a CP rank whose tokens of a row are all padding
    (ParallelConfig(dp=2, cp=2, cp_comm_type="ring"), 2, 0.05),
], ids=["dp2", "dp2_accumulation_clip", "pp2_dp2_clip", "cp2_clip", "dp2_cp2_ring_accumulation_clip"])
def test_a_data_parallel_step_on_unevenly_padded_rows_is_the_dense_step(par, microbatches, grad_clip):
    for loss, dense_loss, n, dense_n, norm, dense_norm, param_error in run_ranks(
            _dp_step, par.world_size, par, microbatches, grad_clip):
        assert n == dense_n
        assert loss == pytest.approx(dense_loss, rel=1e-12)
        assert norm == pytest.approx(dense_norm, rel=1e-12)
        assert param_error < 1e-14


def _plain_and_weighted_steps(par):
    """Two copies of one model take a step on the same equal-count rows: the plain step (the
    benchmark's and the memory model's) and the token-weighted one (training's)."""
    groups = ProcessGroups.build(par)
    torch.manual_seed(0)
    dense = MiniMindForCausalLM(tiny(False)).to(torch.float64)
    batch = random_batch(1, 4 * par.dp, SEQ, VOCAB)   # every row seq_len - 2 targets
    mine = cp_tokens(dp_rows(batch, groups.dp_rank, par.dp), ContextLayout.of(par, SEQ), groups.cp_rank)
    params, losses = [], []
    for weighted in (False, True):
        model = wrap_data_parallel(build_parallel_model(dense.config, par, groups, dense.state_dict(),
                                                        dtype=torch.float64), groups)
        stats = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), groups, *mine, num_microbatches=2,
                           token_weighted_dp=weighted)
        params.append([p.detach().clone() for p in model.parameters()])
        losses.append(stats.loss)
        assert (stats.targets is not None) == weighted and stats.grad_norm is None and stats.stepped
    ddp_divides_by = torch.distributed.get_world_size(groups.dp_cp)
    return [torch.equal(a, b) for a, b in zip(*params)], torch.equal(*losses), ddp_divides_by, grad_divisor(par)


@pytest.mark.parametrize("par", [ParallelConfig(dp=2, cp=2)], ids=["dp2_cp2"])
def test_with_as_many_targets_on_every_replica_the_plain_step_is_the_token_weighted_step(par):
    """The mean of the replicas' means is the global mean when they hold as many targets: the
    plain step takes exactly the token-weighted step (its DP share is 1), and DDP divides the
    grads by what the loss normalisation says (D x C)."""
    for same_params, same_loss, ddp_divides_by, divisor in run_ranks(_plain_and_weighted_steps, par.world_size, par):
        assert all(same_params) and same_loss
        assert ddp_divides_by == divisor == par.dp * par.cp


def test_the_microbatch_weights_are_each_microbatchs_share_and_a_rank_without_targets_has_loss_0():
    batch = uneven_batch(4)
    microbatches = split_microbatches(*batch, 2)
    weights = microbatch_weights(microbatches, torch.float32, None)        # no CP group: this rank's targets
    counts = torch.tensor([float(count_targets(t)) for _, t in microbatches])
    assert weights.dtype == torch.float32 and torch.equal(weights, counts / counts.sum())
    assert microbatch_weights(microbatches, torch.float64, None).dtype == torch.float64
    none = torch.full((2, SEQ), IGNORE_INDEX)
    assert token_mean(torch.tensor(0.0), none).item() == 0.0               # 0 targets: 0, not NaN
    row = batch.targets[:1]
    assert token_mean(2.0 * count_targets(row), row).item() == 2.0                # the sum over its own targets
    loss = torch.tensor(0.5)
    assert backward_loss(loss, 1.0, 1) is loss                             # nothing to scale: the loss itself
    assert backward_loss(loss, 2.0, 3).item() == 3.0
    assert backward_loss(loss, torch.tensor(2.0, dtype=torch.float64), 3).item() == 3.0


def test_mixed_precision_keeps_float32_parameters_and_computes_in_half():
    p = Precision.of("mixed", torch.bfloat16, "cpu")
    assert p.param_dtype == torch.float32 and p.mixed and not p.needs_loss_scaling
    with p.forward_context():
        y = torch.nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4))
    assert y.dtype == torch.bfloat16
    assert Precision.of("mixed", torch.float16, "cpu").needs_loss_scaling
    pure = Precision.of("pure", torch.bfloat16, "cpu")
    assert pure.param_dtype == torch.bfloat16 and not pure.mixed
    assert not Precision.of("mixed", torch.float32, "cpu").mixed


def test_the_loss_scaler_skips_overflowing_steps_and_grows_after_good_ones():
    s = LossScaler(init_scale=8.0, growth_interval=2)
    assert s.update(finite=False) is False and s.scale == 4.0
    assert s.update(finite=True) and s.scale == 4.0
    assert s.update(finite=True) and s.scale == 8.0
    t = LossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()


def _mixed_step(par, compute_dtype):
    dense, model, groups = dense_and_parallel(par, tied=False, dtype=torch.float32)
    precision = Precision.of("mixed", compute_dtype, "cpu")
    batch = uneven_batch(4)
    with precision.forward_context():
        dense_loss = dense(batch.input_ids, targets=batch.targets).loss
    dense_loss.backward()
    dense_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), float("inf"))
    stats = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), groups,
                       *dp_rows(batch, groups.dp_rank, par.dp), num_microbatches=1, schedule="1f1b",
                       token_weighted_dp=True, grad_clip=0.0, precision=precision,
                       scaler=LossScaler() if precision.needs_loss_scaling else None)
    loss, _ = world_token_mean(None if stats.loss is None else stats.loss * stats.targets, stats.targets, groups)
    dtypes = {p.dtype for p in model.parameters()}
    return loss, dense_loss.item(), stats.grad_norm.item(), dense_norm.item(), dtypes, stats.stepped


@pytest.mark.parametrize("par,compute_dtype", [
    (ParallelConfig(tp=2, sequence_parallel=True, async_communication=True, vocab_parallel=True), torch.bfloat16),
    (ParallelConfig(tp=2, sequence_parallel=True, async_communication=True), torch.float16),
    (ParallelConfig(pp=2), torch.bfloat16),
], ids=["tp2_sp_async_vp_bf16", "tp2_sp_async_fp16_scaled", "pp2_bf16"])
def test_mixed_precision_steps_match_the_dense_model_under_autocast(par, compute_dtype):
    for loss, dense_loss, norm, dense_norm, dtypes, stepped in run_ranks(_mixed_step, par.world_size, par,
                                                                         compute_dtype):
        assert dtypes == {torch.float32} and stepped
        assert loss == pytest.approx(dense_loss, rel=1e-2)     # half-precision matmuls: round-off of ~1e-3
        assert norm == pytest.approx(dense_norm, rel=5e-2)


# ---------------------------------------------------------------- steps that are not taken

def single_model(tied=False):
    """A one-rank parallel model in float32 parameters, AdamW, and a fixed batch."""
    groups = ProcessGroups.single()
    torch.manual_seed(0)
    dense = MiniMindForCausalLM(tiny(tied))
    model = build_parallel_model(dense.config, groups.par, groups, dense.state_dict(), dtype=torch.float32)
    return model, make_optimizer(model, 1e-3), groups, uneven_batch(4)


def training_state(model, optimizer) -> dict:
    """Copies of every parameter and every AdamW state tensor."""
    state = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k, v in optimizer.state.get(p, {}).items():
            state[f"{k} {n}"] = v.clone()
    return state


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_float16_step_whose_grads_overflow_is_skipped_and_the_scale_halved_until_one_proceeds():
    model, optimizer, groups, batch = single_model()
    precision = Precision.of("mixed", torch.float16, "cpu")
    scaler = LossScaler(init_scale=2.0 ** 8)

    def step():
        return train_step(model, optimizer, groups, *batch, num_microbatches=1, schedule="1f1b",
                          token_weighted_dp=True, grad_clip=1.0, precision=precision, scaler=scaler)
    assert step().stepped   # a first step at a small scale: AdamW has state now
    scaler.scale = 2.0 ** 40   # float16 activation grads overflow (> 65504) at this scale
    skipped = 0
    while True:
        before, scale = training_state(model, optimizer), scaler.scale
        stats = step()
        if stats.stepped:
            break
        skipped += 1
        assert not torch.isfinite(stats.grad_norm) and stats.nonfinite == ()   # the scaler's to handle
        assert same_state(training_state(model, optimizer), before)   # parameters and AdamW states untouched
        assert scaler.scale == scale / 2 and scaler.good_steps == 0
        assert skipped < 40
    assert skipped >= 10   # 2**40 -> a scale float16 holds takes many halvings
    assert torch.isfinite(stats.grad_norm) and torch.isfinite(stats.loss)
    after = training_state(model, optimizer)
    assert not torch.equal(after["param model.norm.weight"], before["param model.norm.weight"])
    assert all(torch.isfinite(v).all() for v in after.values())


def test_a_step_whose_loss_or_grad_norm_is_not_finite_is_not_taken_and_says_which():
    model, optimizer, groups, batch = single_model()
    exact = Precision.of("pure", torch.float32, "cpu")

    def step():
        return train_step(model, optimizer, groups, *batch, num_microbatches=1, schedule="1f1b",
                          token_weighted_dp=True, grad_clip=1.0, precision=exact)
    assert step().stepped and step().nonfinite == ()
    weight = unwrap(model).get_parameter("model.layers.0.mlp.up_proj.weight")
    hook = weight.register_hook(lambda g: g * float("inf"))   # the loss finite, one grad not
    before = training_state(model, optimizer)
    stats = step()
    assert stats.nonfinite == ("grad norm",) and not stats.stepped and torch.isfinite(stats.loss)
    assert same_state(training_state(model, optimizer), before)
    hook.remove()
    with torch.no_grad():   # a flipped exponent bit: the loss goes NaN, and every grad with it
        unwrap(model).get_parameter("model.norm.weight")[3] = float("inf")
    before = training_state(model, optimizer)
    stats = step()
    assert stats.nonfinite == ("loss", "grad norm") and not stats.stepped
    after = training_state(model, optimizer)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k].nan_to_num(), before[k].nan_to_num()) for k in after)
