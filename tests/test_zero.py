"""Sharded data parallelism (--zero 1 and 2, the distributed optimizer) gives the dense model's
numbers: logits, loss, the grad of every slice a rank owns, several AdamW steps (parameters
all-gathered), at dp2 and dp4, with TP (SP, async, VP), PP, CP, tied embeddings and gradient
accumulation; the global grad norm over the slices counts every parameter once (float64, a
clipped step); each rank's AdamW states are its slices only; the bucket layout covers every
parameter once. The layouts of one world size run in one `run_ranks` launch."""
import pytest
import torch

from distributed import run_ranks
from minimind_parallel import MiniMindConfig, ParallelConfig, ProcessGroups
from minimind_parallel.data.batches import dp_rows, random_batch
from minimind_parallel.model import MiniMindForCausalLM
from minimind_parallel.training import build_parallel_model, make_optimizer, train_step, unwrap, wrap_data_parallel
from minimind_parallel.validation import compare_with_dense, dense_slice, failures, format_report
from minimind_parallel.zero import DistributedOptimizer, plan_buffer
from test_cli import assert_refused_before_launch

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
    "dp2 cp2 zero2": (dict(dp=2, cp=2, zero=2), dict()),
}
# name -> (layout, tied, microbatches): a clipped float64 step against the dense one
CLIP = {
    "dp2 zero2 clip": (dict(dp=2, zero=2), False, 2),
    "dp2 tp2 zero1 tied clip": (dict(dp=2, tp=2, zero=1), True, 1),     # replicated embedding: TP rank 0 only
    "dp2 pp2 zero2 tied clip": (dict(dp=2, pp=2, zero=2), True, 2),     # tied copies on two stages: once
}


def _validate(par: ParallelConfig, opts: dict):
    opts = dict(opts)
    config = MiniMindConfig(**TINY, tie_word_embeddings=opts.pop("tied", False))
    return compare_with_dense(config, par, ProcessGroups.build(par), seq_len=16,
                              micro_batch_size=opts.pop("micro_batch_size", 2), optimizer_steps=3, seed=7,
                              bucket_size_mb=SMALL_BUCKETS, **opts)


def _clip(par: ParallelConfig, tied: bool, microbatches: int):
    """A float64 step clipped at a tenth of the norm: (norm, dense norm, worst param error, AdamW
    state elements on this rank, elements of the rank's slices, elements of its parameters)."""
    groups = ProcessGroups.build(par)
    torch.manual_seed(0)
    config = MiniMindConfig(**TINY, tie_word_embeddings=tied)
    dense = MiniMindForCausalLM(config).double()
    model = wrap_data_parallel(build_parallel_model(config, par, groups, dense.state_dict(), dtype=torch.float64),
                               groups)
    optimizer = make_optimizer(model, 1e-2, groups, SMALL_BUCKETS)
    assert isinstance(optimizer, DistributedOptimizer)
    batch = random_batch(1, 4 * par.dp, 16, config.vocab_size)
    dense(batch.input_ids, targets=batch.targets).loss.backward()
    full = torch.nn.utils.clip_grad_norm_(dense.parameters(), float("inf")).item()
    dense_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.1 * full).item()
    make_optimizer(dense, 1e-2).step()
    stats = train_step(model, optimizer, groups, *dp_rows(batch, groups.dp_rank, par.dp),
                       num_microbatches=microbatches, grad_clip=0.1 * full)
    worst = max((p.detach() - dense_slice(name, dense.get_parameter(name).detach(), par, groups.tp_rank))
                .abs().max().item() for name, p in unwrap(model).named_parameters())
    states = sum(v.numel() for s in optimizer.state.values() for k, v in s.items() if k != "step")
    slices = sum(b.layout.shard_numel for b in optimizer.buffers)
    return stats.grad_norm.item(), dense_norm, worst, states, slices, sum(p.numel() for p in model.parameters())


def _cases(validate: list, clip: list) -> dict:
    out = {name: _validate(ParallelConfig(**VALIDATE[name][0]), VALIDATE[name][1]) for name in validate}
    out.update({name: _clip(ParallelConfig(**CLIP[name][0]), *CLIP[name][1:]) for name in clip})
    return out


def _of_world(table: dict, world: int) -> list[str]:
    return [name for name, case in table.items() if ParallelConfig(**case[0]).world_size == world]


@pytest.mark.parametrize("world", [2, 4])
def test_zero_matches_dense_and_clips_over_the_slices(world):
    validate, clip = _of_world(VALIDATE, world), _of_world(CLIP, world)
    every = run_ranks(_cases, world, validate, clip, timeout=900)
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
            # AdamW's exp_avg and exp_avg_sq of this rank's slices only: 2 x (padded buffer / W)
            assert states == 2 * slices and slices * ParallelConfig(**CLIP[name][0]).dp < params + 64 * 2, name


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
], ids=["validate_dp1", "validate_tp2_dp1", "mode_dp1", "level", "bucket_zero", "benchmark_bucket"])
def test_bad_zero_input_is_one_line_and_launches_nothing(argv, message, monkeypatch, capsys):
    assert_refused_before_launch(argv, message, monkeypatch, capsys)
