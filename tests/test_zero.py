"""Sharded data parallelism (--zero 1 and 2, the distributed optimizer) gives the dense model's
numbers: logits, loss, the grad of every slice a rank owns, several AdamW steps (parameters
all-gathered), at dp2 and dp4, with TP (SP, async, VP), PP, CP, tied embeddings and gradient
accumulation, and so does --zero 3 (FSDP2) over DP, CP and TP (SP, async, VP); --zero 1 and 2
with the MoE model under expert parallelism; the global grad norm over the slices counts every
parameter once (float64, a clipped step; at --zero 3 with TP and with MoE experts too); the tracker,
--estimate and (--zero 1, 2) predict_memory agree to the byte; each rank's AdamW states are its
slices only; the bucket layout covers every parameter once. The layouts of one world size run in
one `run_ranks` launch. Checkpoints resume across zero levels, DP sizes and TP (FSDP2's DTensors at
--zero 3; --zero 1/2 write their slices as chunks), and a --zero 3 train run saved under TP
continues at zero 0."""
from dataclasses import replace

import pytest
import torch

from distributed import run_ranks
from minimind_parallel import MiniMindConfig, ParallelConfig, ProcessGroups
from minimind_parallel.checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint
from minimind_parallel.checkpoint.slices import sliced_targets
from minimind_parallel.data.batches import dp_rows, random_batch, split_microbatches
from minimind_parallel.distributed.loaded_types import is_dtensor
from minimind_parallel.pipeline_parallel import forward_backward
from minimind_parallel.loss_normalisation import equal_replicas_mean
from minimind_parallel.memory import MemoryMeter, estimate_step_memory, predict_memory
from minimind_parallel.memory.analytic.predict import MODELLED_ZERO_LEVELS
from minimind_parallel.memory.analytic.zero_sizes import staging_plans, zero_layouts
from minimind_parallel.model import MiniMindForCausalLM
from minimind_parallel.training import build_parallel_model, make_optimizer, train_step, unwrap, wrap_data_parallel
from minimind_parallel.validation import compare_with_dense, dense_slice, failures, format_report
from minimind_parallel.zero import DistributedOptimizer, plan_buffer
from minimind_parallel.zero.fully_shard import local, whole
from test_cli import assert_refused_before_launch
from test_expert_parallel import TINY_MOE
from test_memory import MOE_EP_MODES
from test_train import corpus, data_args, halted_run, losses, train_in_ranks  # noqa: F401  (the fixture)

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, vocab_size=128)
SMALL_BUCKETS = 0.01   # MiB: about 2600 float32 elements, so every layout has several buckets
SP_ASYNC_VP = dict(sequence_parallel=True, async_communication=True, vocab_parallel=True)

# name -> (layout, options of compare_with_dense)
VALIDATE = {
    "dp2 zero1": (dict(dp=2, zero=1), dict()),
    "dp2 zero2 tied accumulation": (dict(dp=2, zero=2), dict(tied=True, num_microbatches=2)),
    "cp2 zero1": (dict(cp=2, zero=1), dict()),
    "dp4 zero1 tied": (dict(dp=4, zero=1), dict(tied=True)),
    "dp4 zero2": (dict(dp=4, zero=2), dict()),
    "dp2 tp2 sp async vp zero1": (dict(dp=2, tp=2, zero=1, **SP_ASYNC_VP), dict()),
    "dp2 tp2 sp zero2 tied": (dict(dp=2, tp=2, zero=2, sequence_parallel=True), dict(tied=True)),
    "dp2 pp2 zero1 tied": (dict(dp=2, pp=2, zero=1), dict(tied=True, micro_batch_size=1, num_microbatches=4)),
    "dp2 pp2 zero2 tied": (dict(dp=2, pp=2, zero=2), dict(tied=True, micro_batch_size=1, num_microbatches=4)),
    # buckets spanning two model chunks, or filled by W steps: set-based readiness, the last fill flushed
    "dp2 pp2 v2 interleaved zero2": (dict(dp=2, pp=2, zero=2, virtual_stages=2),
                                     dict(layers=4, pp_schedule="interleaved", micro_batch_size=1, num_microbatches=2)),
    "dp2 pp2 zb zero2 tied": (dict(dp=2, pp=2, zero=2), dict(tied=True, pp_schedule="zb", micro_batch_size=1,
                                                             num_microbatches=2)),
    "dp2 cp2 zero2": (dict(dp=2, cp=2, zero=2), dict()),
    "dp2 zero3 tied": (dict(dp=2, zero=3), dict(tied=True)),
    "dp4 zero3": (dict(dp=4, zero=3), dict()),
    "dp2 cp2 zero3": (dict(dp=2, cp=2, zero=3), dict()),
    # the MoE model: the experts' slices over EDP (2 ranks; 1 beside TP: a buffer of its own rank)
    "moe dp4 ep2 zero1": (dict(dp=4, ep=2, zero=1), dict(moe=True)),
    "moe dp4 ep2 zero2": (dict(dp=4, ep=2, zero=2), dict(moe=True)),
    "moe dp2 tp2 ep2 sp zero1": (dict(dp=2, tp=2, ep=2, zero=1, sequence_parallel=True), dict(moe=True)),
    "moe dp2 tp2 ep2 sp zero2": (dict(dp=2, tp=2, ep=2, zero=2, sequence_parallel=True), dict(moe=True)),
    # FSDP2 over the EDP mesh for the experts: one rank (left to finalize_grads, as under DDP) and two
    "moe dp2 ep2 zero3": (dict(dp=2, ep=2, zero=3), dict(moe=True)),
    "moe dp4 ep2 zero3": (dict(dp=4, ep=2, zero=3), dict(moe=True)),
    # FSDP2 under 1F1B: the stage's parameters gathered over the step, its grads reduce-scattered once after it
    "dp2 pp2 zero3 tied": (dict(dp=2, pp=2, zero=3), dict(tied=True, micro_batch_size=1, num_microbatches=4)),
    "dp2 pp2 v2 interleaved zero3": (dict(dp=2, pp=2, zero=3, virtual_stages=2),
                                     dict(layers=4, pp_schedule="interleaved", micro_batch_size=1, num_microbatches=4)),
    "dp2 pp2 zb zero3": (dict(dp=2, pp=2, zero=3), dict(pp_schedule="zb", micro_batch_size=1, num_microbatches=4)),
    "dp2 tp2 sp zero3 tied": (dict(dp=2, tp=2, zero=3, sequence_parallel=True), dict(tied=True)),
    "dp2 tp2 sp async vp zero3": (dict(dp=2, tp=2, zero=3, **SP_ASYNC_VP), dict()),
}
MOE = dict(use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96)
# name -> (layout, tied, microbatches[, MoE fields]): a clipped float64 step against the dense one
CLIP = {
    "dp2 zero2 clip": (dict(dp=2, zero=2), False, 2),
    "dp2 tp2 zero1 tied clip": (dict(dp=2, tp=2, zero=1), True, 1),     # replicated embedding: TP rank 0 only
    "dp2 pp2 zero2 tied clip": (dict(dp=2, pp=2, zero=2), True, 2),     # tied copies on two stages: once
    "dp2 zero3 tied clip": (dict(dp=2, zero=3), True, 2),               # FSDP2's shards
    "moe dp4 ep2 zero2 clip": (dict(dp=4, ep=2, zero=2), False, 1, MOE),     # experts: over EDP, then over EP
    "dp2 tp2 sp zero3 tied clip": (dict(dp=2, tp=2, zero=3, sequence_parallel=True), True, 1),   # of TP shards
    "dp2 zero3 moe clip": (dict(dp=2, zero=3), False, 1, MOE),          # the experts' shards
    "moe dp4 ep2 zero3 clip": (dict(dp=4, ep=2, zero=3), False, 1, MOE),     # experts: over EDP, then over EP
    "dp2 pp2 zero3 tied clip": (dict(dp=2, pp=2, zero=3), True, 2),     # FSDP2's shards, tied copies on two stages
}


def _config(tied: bool, moe: bool = False) -> MiniMindConfig:
    return MiniMindConfig(**(TINY_MOE if moe else TINY), tie_word_embeddings=tied)


def _validate(par: ParallelConfig, opts: dict):
    opts = dict(opts)
    config = replace(_config(opts.pop("tied", False), opts.pop("moe", False)),
                     num_hidden_layers=opts.pop("layers", TINY["num_hidden_layers"]))
    return compare_with_dense(config, par, ProcessGroups.build(par), seq_len=16,
                              micro_batch_size=opts.pop("micro_batch_size", 2), optimizer_steps=3, seed=7,
                              bucket_size_mb=SMALL_BUCKETS, **opts)


def _clip(par: ParallelConfig, tied: bool, microbatches: int, moe: dict | None = None):
    """A float64 step clipped at a tenth of the norm: (norm, dense norm, worst param error, AdamW
    state elements on this rank, elements of the rank's slices, elements of its parameters).
    moe: the MoE model's fields (its experts sharded like every other parameter at ep 1)."""
    groups = ProcessGroups.build(par)
    torch.manual_seed(0)
    config = MiniMindConfig(**TINY, tie_word_embeddings=tied, **(moe or {}))
    dense = MiniMindForCausalLM(config).double()
    model = wrap_data_parallel(build_parallel_model(config, par, groups, dense.state_dict(), dtype=torch.float64),
                               groups)
    optimizer = make_optimizer(model, 1e-2, groups, SMALL_BUCKETS)
    assert isinstance(optimizer, DistributedOptimizer) == (par.zero < 3)
    batch = random_batch(1, 4 * par.dp, 16, config.vocab_size)
    dense(batch.input_ids, targets=batch.targets).objective.backward()   # the LM loss (+ the MoE aux loss)
    full = torch.nn.utils.clip_grad_norm_(dense.parameters(), float("inf")).item()
    dense_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.1 * full).item()
    make_optimizer(dense, 1e-2).step()
    stats = train_step(model, optimizer, groups, *dp_rows(batch, groups.dp_rank, par.dp),
                       num_microbatches=microbatches, grad_clip=0.1 * full)
    if par.zero == 3 and par.pp > 1:   # an evaluation's forwards (the stage kept gathered) leave FSDP2's shards behind
        forward_backward(model, groups, split_microbatches(*dp_rows(batch, groups.dp_rank, par.dp), microbatches),
                         forward_only=True)
        assert all(is_dtensor(p) for p in model.parameters()), "a stage left gathered after its forwards"
    worst = max((whole(p.detach()) - dense_slice(name, dense.get_parameter(name).detach(), par, groups.tp_rank))
                .abs().max().item() for name, p in unwrap(model).named_parameters())
    states = sum(local(v).numel() for s in optimizer.state.values() for k, v in s.items() if k != "step")
    slices = (sum(b.layout.shard_numel for b in optimizer.buffers) if par.zero < 3
              else sum(local(p).numel() for p in model.parameters()))   # FSDP2: this rank's Shard(0) rows
    return stats.grad_norm.item(), dense_norm, worst, states, slices, sum(p.numel() for p in model.parameters())


MEMORY_CONFIG = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                               vocab_size=256, tie_word_embeddings=False, max_position_embeddings=256)
# name -> (layout, microbatches, bucket MiB): a real step measured by the tracker
MEMORY = {
    "dp2 zero1 buckets": (dict(dp=2, zero=1), 1, SMALL_BUCKETS),
    "dp2 zero1 one bucket accumulation": (dict(dp=2, zero=1), 2, 25.0),
    "dp2 zero2 buckets": (dict(dp=2, zero=2), 1, SMALL_BUCKETS),
    "dp2 zero3 accumulation": (dict(dp=2, zero=3), 2, 25.0),    # FSDP2 under the tracker and on fake tensors
    "dp2 tp2 sp zero3": (dict(dp=2, tp=2, zero=3, sequence_parallel=True), 1, 25.0),
    "dp2 pp2 zero3": (dict(dp=2, pp=2, zero=3), 4, 25.0),    # each stage gathered over the schedule, both stages
}


def _measure(par: ParallelConfig, microbatches: int, bucket_mb: float):
    """One warm-up step, then the meter around one step (bfloat16, as tests/test_memory.py)."""
    groups = ProcessGroups.build(par)
    torch.manual_seed(0)
    dense = MiniMindForCausalLM(MEMORY_CONFIG).state_dict()
    model = wrap_data_parallel(build_parallel_model(MEMORY_CONFIG, par, groups, dense, dtype=torch.bfloat16), groups)
    optimizer = make_optimizer(model, 1e-3, groups, bucket_mb)
    ids, targets = random_batch(0, 2 * microbatches, 32, MEMORY_CONFIG.vocab_size)
    train_step(model, optimizer, groups, ids, targets, num_microbatches=microbatches)
    meter = MemoryMeter("cpu", model, optimizer)
    with meter:
        train_step(model, optimizer, groups, ids, targets, num_microbatches=microbatches)
    return meter.report()


def _cases(validate: list, clip: list, measure: list = ()) -> dict:
    out = {name: _validate(ParallelConfig(**VALIDATE[name][0]), VALIDATE[name][1]) for name in validate}
    out.update({name: _clip(ParallelConfig(**CLIP[name][0]), *CLIP[name][1:]) for name in clip})
    out.update({name: _measure(ParallelConfig(**MEMORY[name][0]), *MEMORY[name][1:]) for name in measure})
    return out


def _of_world(table: dict, world: int) -> list[str]:
    return [name for name, case in table.items() if ParallelConfig(**case[0]).world_size == world]


@pytest.mark.parametrize("world", [2, 4])
def test_zero_matches_dense_and_clips_over_the_slices(world):
    validate, clip, measure = _of_world(VALIDATE, world), _of_world(CLIP, world), _of_world(MEMORY, world)
    every = run_ranks(_cases, world, validate, clip, measure, timeout=900)
    for name in measure:   # the real run's tracker, the estimate (fake tensors) and the model: the same bytes
        par, microbatches, bucket = ParallelConfig(**MEMORY[name][0]), *MEMORY[name][1:]
        kw = dict(seq_len=32, micro_batch_size=2, dtype=torch.bfloat16, num_microbatches=microbatches,
                  bucket_size_mb=bucket)
        for stage in range(par.pp):   # the worst rank of each stage (the grid is dp, pp, cp, tp)
            real = max((rank[name] for r, rank in enumerate(every) if r // (par.cp * par.tp) % par.pp == stage),
                       key=lambda r: r.peak_bytes)
            estimate = estimate_step_memory(MEMORY_CONFIG, par, iters=1, stage=stage, **kw)
            assert (real.peak_bytes, real.breakdown) == (estimate.peak_bytes, estimate.breakdown), (name, stage)
            if par.zero in (*MODELLED_ZERO_LEVELS, 3):
                model = predict_memory(MEMORY_CONFIG, par, stage=stage, **kw)
                assert (model.peak_bytes, model.breakdown) == (real.peak_bytes, real.breakdown), (name, model.peak_at)
    for name in validate:
        rows = every[0][name]
        items = {r.item for r in rows}
        assert {"step 0 loss", "grad model.layers.1.self_attn.k_proj.weight",
                "param model.layers.0.self_attn.q_proj.weight after 3 steps"} <= items, name
        bad = failures(rows)
        assert not bad, f"{name}\n" + format_report(bad)
        first = [r for r in rows if r.item.startswith(("step 0", "grad"))]
        assert max(r.rel_l2 for r in first) < 2e-6, f"{name}\n" + format_report(first)
    for name in clip:
        for norm, dense_norm, worst, states, slices, params in (rank[name] for rank in every):
            assert norm == pytest.approx(dense_norm, rel=1e-12, abs=0), name
            assert worst < 1e-12, name
            # AdamW's exp_avg and exp_avg_sq of this rank's slices only: 2 x (padded buffer / W), the
            # experts' over EDP (dp / ep ranks)
            par = ParallelConfig(**CLIP[name][0])
            assert states == 2 * slices and slices * (par.dp // par.ep) < params + 64 * 2, name


ESTIMATE_CONFIGS = {
    "untied": MEMORY_CONFIG,
    "tied": MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                           vocab_size=128, tie_word_embeddings=True, max_position_embeddings=256),
}
ESTIMATE_LAYOUTS = [  # (config, layout, microbatches, stage); each at --zero 1 and 2
    ("untied", dict(dp=4), 1, 0),
    ("untied", dict(dp=2, tp=2, sequence_parallel=True, async_communication=True), 1, 0),
    ("tied", dict(dp=2, tp=2, **SP_ASYNC_VP), 1, 0),
    ("tied", dict(dp=2, pp=2), 4, 0),
    ("tied", dict(dp=2, pp=2), 4, 1),
    ("untied", dict(cp=2), 1, 0),
    ("tied", dict(dp=2), 3, 0),
]


@pytest.mark.parametrize("zero", [1, 2])
def test_the_memory_model_of_zero_is_the_estimate_to_the_byte(zero):
    """predict_memory under --zero 1 and 2 (memory/analytic/zero_sizes.py) against the tracker on
    fake tensors, over TP (SP, async, VP), PP stages with tied copies, CP, accumulation, one bucket
    or several; bfloat16, and float32 with small buckets. --zero 2: the slices and the staging
    buffers, no parameter's grad past its hook. One fake dispatch remembered over the rows (the
    estimate's `memo`: the same reports, as the sweep does)."""
    memo: dict = {}
    for (config, layout, microbatches, stage), dtype, bucket in (
            [(case, torch.bfloat16, bucket) for case in ESTIMATE_LAYOUTS for bucket in (SMALL_BUCKETS, 25.0)]
            + [(case, torch.float32, SMALL_BUCKETS) for case in ESTIMATE_LAYOUTS[1::2]]):
        par = ParallelConfig(**layout, zero=zero)
        kw = dict(seq_len=32, micro_batch_size=2, dtype=dtype, num_microbatches=microbatches, stage=stage,
                  bucket_size_mb=bucket)
        estimate = estimate_step_memory(ESTIMATE_CONFIGS[config], par, iters=1, memo=memo, **kw)
        model = predict_memory(ESTIMATE_CONFIGS[config], par, **kw)
        assert (model.peak_bytes, model.breakdown) == (estimate.peak_bytes, estimate.breakdown), \
            (config, layout, stage, dtype, bucket, model.peak_at)
    # the MoE model under expert parallelism: the dense buffer over DP x CP, this rank's experts' over EDP
    for name in ("ep2", "tp_sp_async_vp_ep2", "cp_ring_dp_ep4"):
        config, par, kw = MOE_EP_MODES[name]
        par, kw = replace(par, zero=zero), dict(seq_len=32, micro_batch_size=2, dtype=torch.bfloat16,
                                                bucket_size_mb=SMALL_BUCKETS, **kw)
        estimate = estimate_step_memory(config, par, iters=1, memo=memo, **kw)
        model = predict_memory(config, par, **kw)
        assert (model.peak_bytes, model.breakdown) == (estimate.peak_bytes, estimate.breakdown), (name, model.peak_at)


def test_zero1_keeps_a_quarter_of_the_optimizer_states_at_dp4():
    """The done-when of the ZeRO work: at dp4 the AdamW states are a quarter of DDP's (the
    padding of each bucket to a multiple of 4 and one step counter per slice aside), to the byte
    of the model's prediction (the estimate's)."""
    kw = dict(seq_len=32, micro_batch_size=2, dtype=torch.bfloat16)
    ddp = estimate_step_memory(MEMORY_CONFIG, ParallelConfig(dp=4), iters=1, **kw).breakdown["optimizer"]
    zero = estimate_step_memory(MEMORY_CONFIG, ParallelConfig(dp=4, zero=1), iters=1, **kw)
    predicted = predict_memory(MEMORY_CONFIG, ParallelConfig(dp=4, zero=1), **kw).breakdown["optimizer"]
    assert zero.breakdown["optimizer"] == predicted
    params = sum(numel for numel in (p.numel() for p in MiniMindForCausalLM(MEMORY_CONFIG).parameters()))
    assert ddp == 2 * 2 * params + 4 * len(list(MiniMindForCausalLM(MEMORY_CONFIG).parameters()))
    assert 2 * 2 * params // 4 <= predicted - 4 <= 2 * 2 * (params + 3) // 4
    assert zero.breakdown["grads"] == zero.breakdown["params"] - 2 * MEMORY_CONFIG.max_position_embeddings * \
        MEMORY_CONFIG.head_dim * 2   # the grad buffer: the parameters' bytes (RoPE tables aside)
    two = estimate_step_memory(MEMORY_CONFIG, ParallelConfig(dp=4, zero=2), iters=1, **kw).breakdown["grads"]
    assert two == predict_memory(MEMORY_CONFIG, ParallelConfig(dp=4, zero=2), **kw).breakdown["grads"]
    assert 4 * two == zero.breakdown["grads"]   # --zero 2: this rank's slices of the grad buffer only


def test_the_buffer_follows_the_order_backward_makes_the_grads():
    """The buckets are laid out in the order autograd accumulates the grads (recorded from
    post-accumulate-grad hooks on the dense model), so under --zero 2 one bucket fills at a time."""
    for tied in (False, True):
        model = MiniMindForCausalLM(MiniMindConfig(**TINY, tie_word_embeddings=tied))
        made = []
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda _, name=name: made.append(name))
        batch = random_batch(0, 2, 16, TINY["vocab_size"])
        model(batch.input_ids, targets=batch.targets).loss.backward()
        layout = plan_buffer([(n, p.numel(), False) for n, p in model.named_parameters()], 2, 5000)
        assert len(layout.buckets) > 3
        assert [n for b in layout.buckets for n in b.names] == made


def test_the_buckets_cover_every_parameter_once_and_pad_to_the_group():
    sizes = [("a", 10, False), ("b", 7, False), ("embed", 12, True), ("c", 5, False)]
    for world in (1, 2, 3, 4):
        for bucket in (None, 1, 8, 100):
            layout = plan_buffer(sizes, world, bucket)
            assert all(b.padded_numel % world == 0 for b in layout.buckets)
            assert [b.names for b in layout.buckets if "embed" in b.names] == [("embed",)]
            owned = {name: [] for name, _, _ in sizes}
            for rank in range(world):
                offset = 0
                for b in layout.buckets:
                    for piece in b.pieces(rank):
                        owned[piece.name].append((piece.lo, piece.hi))
                    offset += b.shard_numel
                assert offset == layout.shard_numel
            for name, numel, _ in sizes:   # the ranks' parts tile [0, numel) without overlap
                parts = sorted(owned[name])
                assert parts[0][0] == 0 and parts[-1][1] == numel
                assert all(a[1] == b[0] for a, b in zip(parts, parts[1:])), (name, world, bucket, parts)
    assert len(plan_buffer(sizes, 2, None).buckets) == 3   # before, the embedding, after
    assert [b.names for b in plan_buffer(sizes, 2, 8).buckets] == [("c",), ("embed",), ("b", "a")]


@pytest.mark.parametrize("argv,message", [
    (["validate", "--", "--zero", "1"],
     "--zero 1 shards over the data-parallel x context-parallel ranks and needs dp_size x cp_size > 1; "
     "got dp_size=1, cp_size=1"),
    (["validate", "--tp_size", "2", "--", "--zero", "2"], "needs dp_size x cp_size > 1; got dp_size=1, cp_size=1"),
    (["validate", "--", "--mode", "zero1"], "needs dp_size x cp_size > 1; got dp_size=1, cp_size=1"),
    (["validate", "--dp_size", "2", "--", "--zero", "4"], "argument --zero: invalid choice: 4"),
    (["validate", "--dp_size", "2", "--", "--zero", "1", "--bucket_size_mb", "0"],
     "bucket_size_mb must be > 0 MiB; got bucket_size_mb=0"),
    (["benchmark", "--dp_size", "2", "--", "--modes", "zero2", "--bucket_size_mb", "-1", "--num_hidden_layers", "1"],
     "bucket_size_mb must be > 0 MiB; got bucket_size_mb=-1"),
], ids=["validate_dp1", "validate_tp2_dp1", "mode_dp1", "level",
                                 "bucket_zero", "benchmark_bucket"])
def test_bad_zero_input_is_one_line_and_launches_nothing(argv, message, monkeypatch, capsys):
    assert_refused_before_launch(argv, message, monkeypatch, capsys)


# --- checkpoints: a zero1 dp4 run resumes at other zero levels, DP sizes and layouts ---------------

CKPT_STEPS, CKPT_SAVE_AT = 4, 2


def _ckpt_train(model, optimizer, groups, steps, config) -> list[float]:
    """The global batch's loss of each step (None off the last stage); batch i is fixed."""
    out = []
    for i in steps:
        batch = dp_rows(random_batch(100 + i, 8, 16, config.vocab_size), groups.dp_rank, groups.par.dp)
        loss = train_step(model, optimizer, groups, *batch, num_microbatches=2, grad_clip=1.0).loss
        out.append(None if loss is None else equal_replicas_mean(loss.clone(), groups).item())
    return out


def _ckpt_setup(par: ParallelConfig, seed: int):
    groups = ProcessGroups.build(par)
    config = MiniMindConfig(**TINY, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = wrap_data_parallel(build_parallel_model(config, par, groups, MiniMindForCausalLM(config).state_dict()),
                               groups)
    return groups, config, model, make_optimizer(model, 1e-2, groups, SMALL_BUCKETS)


def _ckpt_save(save_dir: str):
    """zero1 dp4: CKPT_SAVE_AT steps, a checkpoint, then the uninterrupted run's later losses."""
    groups, config, model, optimizer = _ckpt_setup(ParallelConfig(dp=4, zero=1), seed=0)
    _ckpt_train(model, optimizer, groups, range(CKPT_SAVE_AT), config)
    save_checkpoint(save_dir, CKPT_SAVE_AT, model=model, optimizer=optimizer, config=config, par=groups.par,
                    groups=groups, extra={})
    return _ckpt_train(model, optimizer, groups, range(CKPT_SAVE_AT, CKPT_STEPS), config)


def _ckpt_chunks(save_dir: str) -> dict:
    """{optimizer state key: [chunk elements]} of the saved index, and the parameters' elements."""
    import torch.distributed.checkpoint as dcp
    index = dcp.FileSystemReader(resolve_checkpoint(save_dir)).read_metadata().state_dict_metadata
    return {fqn: [c.sizes.numel() for c in md.chunks] for fqn, md in index.items()
            if fqn.startswith("optim.") and fqn.endswith(".exp_avg")}


def _ckpt_resume(save_dir: str, layouts: list[dict]):
    """The checkpoint loaded onto each layout (another initialisation first), the later losses."""
    out = []
    for i, layout in enumerate(layouts):
        groups, config, model, optimizer = _ckpt_setup(ParallelConfig(**layout), seed=1)
        load_checkpoint(save_dir, model=model, optimizer=optimizer, config=config, par=groups.par, groups=groups)
        losses = _ckpt_train(model, optimizer, groups, range(CKPT_SAVE_AT, CKPT_STEPS), config)
        if groups.par.zero in (1, 2):   # a load reads this rank's slices only; its own sliced save loads back bit for bit
            targets, _ = sliced_targets(resolve_checkpoint(save_dir), optimizer, config, groups.par, groups)
            held = sum(shard.tensor.numel() for t in targets.values() for shard in t["exp_avg"].local_shards())
            assert held <= sum(b.layout.shard_numel for b in optimizer.buffers), layout
            again = f"{save_dir}/again{i}"
            save_checkpoint(again, CKPT_STEPS, model=model, optimizer=optimizer, config=config, par=groups.par,
                            groups=groups, extra={})
            _, _, fresh, fresh_optimizer = _ckpt_setup(groups.par, seed=2)
            load_checkpoint(again, model=fresh, optimizer=fresh_optimizer, config=config, par=groups.par,
                            groups=groups)
            for main, loaded in zip(optimizer.inner.param_groups[0]["params"],
                                    fresh_optimizer.inner.param_groups[0]["params"], strict=True):
                assert all(torch.equal(optimizer.inner.state[main][k], fresh_optimizer.inner.state[loaded][k])
                           for k in ("step", "exp_avg", "exp_avg_sq")), layout
        out.append(losses)
    return out


def test_a_zero1_dp4_checkpoint_resumes_at_zero0_dp2_zero2_tp2_dp2_and_pp2(tmp_path):
    """Each rank writes its slices of the states as chunks of the dense tensors (nothing gathered):
    the checkpoint loads at any zero level (FSDP2's Shard(0) DTensors at zero 3), DP size and layout, and the run continues at round-off
    (float32, 2 AdamW steps); a load under --zero reads this rank's slices only, and the sliced
    saves of tp2 x dp2 (zero2, SP) and pp2 x dp2 (tied copies) load back bit for bit."""
    uninterrupted = run_ranks(_ckpt_save, 4, str(tmp_path))[0]
    # each rank wrote its slices only: every state's chunks add up to the tensor once, and a
    # parameter larger than a rank's share of its bucket is in several ranks' chunks
    chunks = _ckpt_chunks(str(tmp_path))
    config = MiniMindConfig(**TINY, tie_word_embeddings=True)
    dense = dict(MiniMindForCausalLM(config).named_parameters())
    assert {f"optim.{n}.exp_avg" for n in dense} == set(chunks)
    for name, p in dense.items():
        assert sum(chunks[f"optim.{name}.exp_avg"]) == p.numel(), name
    layout = zero_layouts(config, ParallelConfig(dp=4, zero=1), 0, torch.float32, SMALL_BUCKETS)[0]
    largest_slice = max(b.shard_numel for b in layout.buckets)
    assert max(n for c in chunks.values() for n in c) <= largest_slice < dense["model.embed_tokens.weight"].numel()
    assert len(chunks["optim.model.embed_tokens.weight.exp_avg"]) >= 4   # a part on each of the 4 ranks
    every = run_ranks(_ckpt_resume, 4, str(tmp_path), [dict(dp=2, tp=2, zero=2, sequence_parallel=True),
                                                       dict(dp=4, zero=1), dict(dp=2, pp=2, zero=1),
                                                       dict(dp=2, tp=2, zero=3, sequence_parallel=True),
                                                       dict(dp=2, pp=2, zero=3)])
    four = [next(rank[i] for rank in every if rank[i][0] is not None) for i in range(5)]   # pp2: the last stage's
    two = run_ranks(_ckpt_resume, 2, str(tmp_path), [dict(dp=2), dict(dp=2, zero=2), dict(dp=2, zero=3)])[0]
    assert four[1] == uninterrupted            # the same layout: bit for bit
    for resumed in (four[0], four[2], four[3], four[4], *two):
        assert resumed == pytest.approx(uninterrupted, rel=1e-5, abs=0), (resumed, uninterrupted)
    other_init = run_ranks(_ckpt_resume_nothing, 2)[0]
    assert other_init != pytest.approx(uninterrupted, rel=1e-3, abs=0)   # the check can fail


def _moe_ckpt_setup(par: ParallelConfig, seed: int):
    groups = ProcessGroups.build(par)
    config = MiniMindConfig(**TINY_MOE)
    torch.manual_seed(seed)
    model = wrap_data_parallel(build_parallel_model(config, par, groups, MiniMindForCausalLM(config).state_dict()),
                               groups)
    return groups, config, model, make_optimizer(model, 1e-2, groups, SMALL_BUCKETS)


def _moe_ckpt(save_dir: str, layouts: list[dict]):
    """The MoE model at zero3 dp4 ep2 (the experts' FSDP2 shards over their EDP mesh): CKPT_SAVE_AT
    steps, a checkpoint, the uninterrupted run's later losses; then the checkpoint loaded onto each
    of `layouts` (another initialisation first) and its later losses."""
    groups, config, model, optimizer = _moe_ckpt_setup(ParallelConfig(dp=4, ep=2, zero=3), seed=0)
    _ckpt_train(model, optimizer, groups, range(CKPT_SAVE_AT), config)
    save_checkpoint(save_dir, CKPT_SAVE_AT, model=model, optimizer=optimizer, config=config, par=groups.par,
                    groups=groups, extra={})
    uninterrupted = _ckpt_train(model, optimizer, groups, range(CKPT_SAVE_AT, CKPT_STEPS), config)
    resumed = []
    for layout in [*layouts, None]:   # None: the first layout without the load (what a load that did nothing gives)
        groups, config, model, optimizer = _moe_ckpt_setup(ParallelConfig(**(layout or layouts[0])), seed=1)
        if layout is not None:
            load_checkpoint(save_dir, model=model, optimizer=optimizer, config=config, par=groups.par, groups=groups)
        resumed.append(_ckpt_train(model, optimizer, groups, range(CKPT_SAVE_AT, CKPT_STEPS), config))
    return uninterrupted, resumed


def test_a_zero3_moe_checkpoint_under_expert_parallelism_resumes_at_other_layouts(tmp_path):
    """DCP saves the experts' FSDP2 shards over their EDP mesh and the dense ones over DP x CP
    (zero3 dp4 ep2) with their placements; the checkpoint loads at zero3 dp4 ep4 (experts left
    whole on their rank), at zero1 dp4 ep2 and at zero0 dp4 ep1, and the run continues at round-off."""
    layouts = [dict(dp=4, ep=2, zero=3), dict(dp=4, ep=4, zero=3), dict(dp=4, ep=2, zero=1), dict(dp=4)]
    uninterrupted, (*resumed, fresh) = run_ranks(_moe_ckpt, 4, str(tmp_path), layouts)[0]
    assert resumed[0] == uninterrupted            # the same layout: bit for bit
    for layout, losses_ in zip(layouts[1:], resumed[1:]):
        assert losses_ == pytest.approx(uninterrupted, rel=1e-5, abs=0), (layout, losses_, uninterrupted)
    assert fresh != pytest.approx(uninterrupted, rel=1e-3, abs=0)   # the check can fail


def _ckpt_resume_nothing():
    """The later steps without the checkpoint: what a load that did nothing would give."""
    groups, config, model, optimizer = _ckpt_setup(ParallelConfig(dp=2, zero=1), seed=1)
    return _ckpt_train(model, optimizer, groups, range(CKPT_SAVE_AT, CKPT_STEPS), config)


@pytest.mark.parametrize("launcher_args,zero,message", [
    ([], "1", "needs dp_size x cp_size > 1; got dp_size=1, cp_size=1"),
    ([], "3", "needs dp_size x cp_size > 1; got dp_size=1, cp_size=1"),
], ids=["dp1", "zero3_dp1"])
def test_bad_zero_input_to_train_is_one_line(corpus, launcher_args, zero, message, monkeypatch, capsys):  # noqa: F811
    assert_refused_before_launch(["train", *launcher_args, "--", *data_args(corpus), "--zero", zero], message,
                                 monkeypatch, capsys)


def test_a_zero3_run_trains_checkpoints_under_tp_and_resumes_at_zero0(corpus, tmp_path):  # noqa: F811
    flags = dict(dtype="float32", batch_size=2)
    train_in_ranks(["--dp_size", "2"], data_args(corpus, max_steps=8, out_dir=tmp_path / "whole", zero=3, **flags))
    # saved under TP: FSDP2's rows of the TP shards, gathered into the TP shards DCP writes
    halted_run(corpus, tmp_path / "ckpt", ["--tp_size", "2", "--dp_size", "2"], zero=3, sequence_parallel=True,
               **flags)
    train_in_ranks(["--dp_size", "2"], data_args(corpus, max_steps=8, save_interval=4, save_dir=tmp_path / "ckpt",
                                                 resume=True, **flags))   # --zero 0
    whole, resumed = losses(tmp_path / "whole"), losses(tmp_path / "ckpt")
    assert sorted(resumed) == list(range(1, 9))
    assert whole[8] < whole[1]
    for step in range(5, 9):
        assert resumed[step] == pytest.approx(whole[step], rel=1e-5), step


# (schedule, model chunks per stage, bucket MiB): --zero 2 under the posted orders; 0.01 MiB: several
# buckets fill at once (a block's B and W grads in one, two chunks' in one)
POSTED_ZERO2 = [("interleaved", 2, SMALL_BUCKETS), ("zb", 1, SMALL_BUCKETS), ("interleaved", 2, 25.0)]


@pytest.mark.parametrize("schedule, virtual_stages, bucket", POSTED_ZERO2)
def test_zero2_under_a_posted_schedule_makes_its_staging_buffers_up_front_and_is_predicted(schedule, virtual_stages,
                                                                                          bucket):
    """--zero 2 under interleaved (pp2 V2 dp2) and zb (pp2 dp2): a bucket whose grads come in
    several actions (two model chunks' parameters, or a block's B and W weights) stays filling while
    others fill, so it has a staging buffer of its own, made with the pool at the start
    (zero/staging.py): every step holds the same buffers, none is made mid-step (the optimizer
    refuses to), and the model equals the estimate over two steps on every stage and category (the
    planner's remembered rows give each stage's peak, and the planner keeps such a layout). One
    bucket (25 MiB) spanning the chunks: a buffer of its own, no pool."""
    from minimind_parallel.pipeline_parallel.order import Schedule, check_schedule
    from minimind_parallel.planning import Candidate, Workload
    from minimind_parallel.planning.space import check_candidate
    par = ParallelConfig(dp=2, pp=2, zero=2, virtual_stages=virtual_stages)
    check_schedule(schedule, par, 2)
    config = replace(MEMORY_CONFIG, num_hidden_layers=4)
    kw = dict(seq_len=32, micro_batch_size=2, num_microbatches=2, schedule=schedule, dtype=torch.float32,
              bucket_size_mb=bucket)
    fast = predict_memory(config, par, worst_only=True, **kw)   # the planner's remembered rows
    for stage in range(par.pp):
        model = predict_memory(config, par, stage=stage, **kw)
        estimate = estimate_step_memory(config, par, iters=2, stage=stage, **kw)
        assert (model.peak_bytes, model.breakdown) == (estimate.peak_bytes, estimate.breakdown), (stage, model.peak_at)
        assert fast.per_stage[stage] == model.peak_bytes, stage
    # small buckets: more than 3 (once refused), some with a buffer of their own beside the pool's 3
    layouts = zero_layouts(config, par, 0, torch.float32, bucket)
    (plan,) = staging_plans(config, par, 0, layouts, schedule)
    assert (len(layouts[0].buckets) > 3) == (bucket == SMALL_BUCKETS) == (plan.pool == 3 and any(plan.own)), plan
    work = Workload(model=config, seq_len=32, global_batch_size=16, world_size=4)
    check_candidate(work, Candidate(dp=2, pp=2, zero=2, num_microbatches=2, micro_batch_size=2,
                                    pp_schedule=Schedule(schedule), virtual_stages=virtual_stages))


def test_zero2_refuses_a_bucket_some_of_whose_parameters_got_no_grad():
    """A parameter backward never reached (here: every one but the embedding) would leave zeros in
    its slice unseen; under any schedule each parameter used gets a grad in the step, so a bucket
    with some grads and not others is an error, named."""
    import torch.distributed as dist
    from torch.distributed import HashStore

    from minimind_parallel.model import MiniMindForCausalLM
    from minimind_parallel.training import build_parallel_model, make_optimizer

    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        c = MiniMindConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           vocab_size=64, intermediate_size=64)
        par = ParallelConfig(zero=2)
        groups = ProcessGroups.build(par)
        model = build_parallel_model(c, par, groups, MiniMindForCausalLM(c).state_dict())
        optimizer = make_optimizer(model, 1e-3, groups=groups, bucket_size_mb=25.0)   # one bucket
        optimizer.zero_grad()
        model.model.embed_tokens(torch.arange(8)).sum().backward()
        with pytest.raises(RuntimeError, match="not all produced by backward"):
            optimizer.reduce_grads()
    finally:
        dist.destroy_process_group()


def test_a_dropped_zero2_optimizer_frees_its_buffers_and_group_without_the_collector():
    """--zero 2's grad hooks on the parameters hold their buffer weakly: dropping the optimizer and
    the model frees the buffers, and with them their process group, at once (no reference cycle
    through the hooks), so `destroy_process_group` destroys the group and joins its gloo threads
    -- a group left alive past it was torn down in the interpreter's finalization, where a rank
    aborted at exit (distributed/teardown.py). The buffer's group is a real one-rank gloo group."""
    import gc
    import weakref

    import torch.distributed as dist
    from torch.distributed import HashStore

    from helpers import gloo_threads

    gc.collect()
    before, collecting = gloo_threads(), gc.isenabled()
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    gc.disable()
    try:
        c = MiniMindConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           vocab_size=64, intermediate_size=64)
        par = ParallelConfig(zero=2)
        groups = ProcessGroups.build(par)
        groups.dp_cp = groups.edp = dist.new_group([0])   # what the buffers reduce over
        model = build_parallel_model(c, par, groups, MiniMindForCausalLM(c).state_dict())
        optimizer = make_optimizer(model, 1e-3, groups=groups, bucket_size_mb=25.0)
        ids = torch.randint(0, 64, (2, 8))
        train_step(model, optimizer, groups, ids, ids, num_microbatches=1)   # the hooks fill, reduce, step
        (buffer,) = optimizer.buffers
        assert buffer.group is groups.dp_cp and not buffer._pending and not buffer._filling
        dropped = weakref.ref(buffer)
        del model, optimizer, groups, buffer
        assert dropped() is None
        dist.destroy_process_group()
        assert gloo_threads() == before
    finally:
        if collecting:
            gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()
