"""Less pipeline bubble: Megatron-LM's interleaved 1F1B over virtual stages and ZB-H1 (Qi et al.
2023) with deferred weight gradients.

The orders: interleaved is Megatron-LM's (warm-up 2(P-p-1) + (V-1)P), zb keeps 1F1B's
activation bound (P - p microbatches forwarded, not B'd) and at most 2P - p - 1 not W'd; `order.simulate` runs every stage's
order with the runtime's rules (posted sends, waiting receives, per-link order) and finds the
formulas' bubbles. Chunk ownership comes from the plan. The deferred linears compute dgrad in B
and wgrad in W. Both schedules give the dense model's numbers (logits, loss, every gradient,
AdamW steps) at pp2 and pp4, with TP + SP + async + VP, CP, DP, tied embeddings and
--recompute selective|full; the layouts of one world size run in one launch. Bad input is one
line before launch."""
import random
from unittest import mock

import pytest
import torch

from distributed import run_ranks
from minimind_parallel import MiniMindConfig, ParallelConfig, ProcessGroups
from minimind_parallel.model import MiniMindForCausalLM
from minimind_parallel.data.batches import dp_rows, random_batch, split_microbatches
from minimind_parallel.pipeline_parallel import schedules
from minimind_parallel.pipeline_parallel.order import (Schedule, Step, backward, check_order, forward, idle_share,
                                                       schedule_order, simulate, weight)
from minimind_parallel.pipeline_parallel.releases import release_points
from minimind_parallel.pipeline_parallel.schedules import bubble_fraction
from minimind_parallel.plan import stage_chunks, stage_of, stage_parameters
from minimind_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from minimind_parallel.tensor_parallel.deferred_wgrad import WeightGradStore, attach_weight_grad_store
from minimind_parallel.training import build_parallel_model, make_optimizer, train_step
from minimind_parallel.validation import compare_with_dense, failures, format_report
from test_cli import assert_refused_before_launch

TINY = dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, vocab_size=128)
INTERLEAVED, ZB = Schedule.INTERLEAVED, Schedule.ZERO_BUBBLE


def _orders(pp, m, schedule, v=1):
    return [schedule_order(pp, p, m, schedule, v) for p in range(pp)]


def _text(order):
    return " ".join(map(str, order))


# ---------------------------------------------------------------- the orders (no ranks)

def test_interleaved_is_megatrons_order_with_its_warm_up():
    # F<microbatch>.<chunk>: groups of P microbatches per chunk, backwards from the last chunk
    assert [_text(o) for o in _orders(2, 4, INTERLEAVED, 2)] == [
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3",
        "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3"]
    for pp, m, v in [(2, 4, 2), (4, 8, 2), (4, 4, 3), (2, 2, 4)]:
        for p, order in enumerate(_orders(pp, m, INTERLEAVED, v)):
            warmup = min(2 * (pp - p - 1) + (v - 1) * pp, m * v)
            first_backward = next(k for k, a in enumerate(order) if a.step is Step.BACKWARD)
            assert first_backward == (warmup + 1 if warmup < m * v else m * v), (pp, m, v, p)   # + the steady forward


def test_zb_splits_every_backward_and_keeps_1f1bs_activation_bound():
    assert [_text(o) for o in _orders(2, 4, ZB)] == ["F0 F1 B0 F2 B1 W0 F3 B2 W1 W2 B3 W3",
                                                     "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3"]
    for pp, m in [(2, 5), (4, 4), (4, 9)]:
        for p, order in enumerate(_orders(pp, m, ZB)):
            activations = unfinished = most_activations = most_unfinished = 0
            for a in order:
                activations += {Step.FORWARD: 1, Step.BACKWARD: -1}.get(a.step, 0)
                unfinished += {Step.FORWARD: 1, Step.WEIGHT: -1}.get(a.step, 0)
                most_activations, most_unfinished = max(most_activations, activations), max(most_unfinished, unfinished)
            # forwarded, not B'd: 1F1B's P - p; forwarded, not W'd: at most P - 1 more
            assert most_activations == min(pp - p, m), (pp, m, p, _text(order))
            assert most_unfinished <= min(2 * pp - p - 1, m), (pp, m, p, _text(order))


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8)])
def test_simulated_bubbles_are_the_formulas(pp, m):
    """Every stage's order run at once (posted sends, waiting receives) finishes, and idles for the
    formula's share: (P-1)/(M+P-1), interleaved (P-1)/(VM+P-1) (a chunk 1/V of a stage's time),
    ZB-H1 (P-1)/(3M+P-1) at equal F, B and W."""
    for schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
        assert idle_share(simulate(_orders(pp, m, schedule), pp)) == pytest.approx([bubble_fraction(pp, m)] * pp)
    for v in (2, 4):
        times = {Step.FORWARD: 1 / v, Step.BACKWARD: 2 / v}
        shares = idle_share(simulate(_orders(pp, m, INTERLEAVED, v), pp, v, times))
        assert shares == pytest.approx([bubble_fraction(pp, m, INTERLEAVED, v)] * pp)
    assert idle_share(simulate(_orders(pp, m, ZB), pp)) == pytest.approx([bubble_fraction(pp, m, ZB)] * pp)
    assert bubble_fraction(pp, m, ZB) < bubble_fraction(pp, m) and bubble_fraction(pp, m, INTERLEAVED, 2) < \
        bubble_fraction(pp, m)


def test_simulate_finds_a_deadlock_and_a_link_out_of_order():
    # stage 0 waits for the grad of microbatch 0, which stage 1 sends after the activation of 1
    fine = _orders(2, 2, Schedule.ONE_F_ONE_B)
    with pytest.raises(ValueError, match="wait on each other forever: stage 0 at B0, stage 1 at F1"):
        simulate([[forward(0), backward(0), forward(1), backward(1)], [forward(0), forward(1), backward(0), backward(1)]], 2)
    with pytest.raises(ValueError, match="stage 0 sends stage 1 its messages in another order than it receives"):
        simulate([fine[0], [forward(1), forward(0), backward(0), backward(1)]], 2)


@pytest.mark.parametrize("pp,m,schedule,v", [(2, 4, INTERLEAVED, 2), (4, 8, INTERLEAVED, 2), (2, 4, ZB, 1),
                                             (4, 6, ZB, 1)])
def test_each_send_is_released_after_a_receive_that_follows_the_peers_receive_whatever_the_timing(pp, m, schedule, v):
    """release_points: a send is freed after the receive of an action that starts, in every timing,
    after the peer has received it (so the wait there returns at once), or at the end."""
    orders = _orders(pp, m, schedule, v)
    releases = release_points(orders, pp, v)
    rng = random.Random(0)
    for _ in range(5):
        times = {step: rng.uniform(0.1, 3) for step in Step}
        spans = simulate(orders, pp, v, times)
        received = _receiving_starts(orders, spans, pp, v)
        for p, points in enumerate(releases):
            for k, j in points.items():
                if j == len(orders[p]):
                    continue
                assert spans[p][j][0] >= received[(p, k)], (p, orders[p][k], orders[p][j])
    assert any(j < len(orders[p]) for p, points in enumerate(releases) for j in points.values())


def _receiving_starts(orders, spans, pp, v):
    """(stage, index of a sending action) -> when the peer's action that receives it starts."""
    last, sends, starts = pp * v - 1, {}, {}
    for p, order in enumerate(orders):
        for k, a in enumerate(order):
            vs = a.chunk * pp + p
            if a.step is Step.FORWARD and vs < last:
                sends[(a.microbatch, vs + 1, Step.FORWARD)] = (p, k)
            elif a.step is Step.BACKWARD and vs > 0:
                sends[(a.microbatch, vs - 1, Step.BACKWARD)] = (p, k)
    for p, order in enumerate(orders):
        for k, a in enumerate(order):
            key = (a.microbatch, a.chunk * pp + p, a.step)
            if key in sends:
                starts[sends[key]] = spans[p][k][0]
    return starts


def test_orders_with_weight_steps_are_checked():
    check_order([forward(0), backward(0), weight(0)], 1)
    with pytest.raises(ValueError, match="got W0 at action 1"):
        check_order([forward(0), weight(0), backward(0)], 1)
    with pytest.raises(ValueError, match="runs all 2 microbatches"):
        check_order([forward(0), backward(0), weight(0), forward(1), backward(1)], 2)
    with pytest.raises(ValueError, match="got F0.2"):
        check_order([forward(0, chunk=2)], 1, 2)


def test_chunk_ownership_is_the_plans():
    c, par = MiniMindConfig(**TINY), ParallelConfig(pp=2, virtual_stages=2)
    assert stage_chunks(8, 2, 0, 2) == [range(0, 2), range(4, 6)]
    assert stage_chunks(8, 2, 1, 2) == [range(2, 4), range(6, 8)]
    assert [stage_of(f"model.layers.{i}.mlp.up_proj.weight", 8, 2, 2) for i in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert stage_of("model.embed_tokens.weight", 8, 2, 2) == 0 and stage_of("lm_head.weight", 8, 2, 2) == 1
    first = {k.split(".")[2] for k in stage_parameters(c, par, 0) if k.startswith("model.layers.")}
    assert first == {"0", "1", "4", "5"} and "model.embed_tokens.weight" in stage_parameters(c, par, 0)
    assert "lm_head.weight" in stage_parameters(c, par, 1)


# ---------------------------------------------------------------- deferred weight grads (in process)

def test_a_deferred_linear_computes_dgrad_in_b_and_wgrad_in_w():
    torch.manual_seed(0)
    column, row = ColumnParallelLinear(8, 6), RowParallelLinear(6, 8)
    for layer in (column, row):
        torch.nn.init.normal_(layer.weight)
    x = torch.randn(5, 2, 8, requires_grad=True)
    y = row(column(x))
    dense_x, dense_w = torch.autograd.grad(y.sum(), [x, column.weight])
    store = WeightGradStore()
    attach_weight_grad_store(column, store)
    attach_weight_grad_store(row, store)
    x.grad = None
    with store.collecting((0, 0)):
        row(column(x)).sum().backward()
    assert column.weight.grad is None and row.weight.grad is None        # B: input grads only
    assert torch.allclose(x.grad, dense_x)
    store.run((0, 0))                                                    # W
    assert torch.allclose(column.weight.grad, dense_w) and row.weight.grad is not None
    assert not store.queues


# ---------------------------------------------------------------- the dense numbers (ranks)

SP_ASYNC_VP = dict(sequence_parallel=True, async_communication=True, vocab_parallel=True)
# name -> (layout, schedule, microbatches, tied); each world size's layouts run in one launch
LAYOUTS = {
    "pp2_interleaved_v2_tied": (dict(pp=2, virtual_stages=2), INTERLEAVED, 4, True),
    "pp2_interleaved_v4": (dict(pp=2, virtual_stages=4), INTERLEAVED, 2, False),
    "pp2_interleaved_v2_selective": (dict(pp=2, virtual_stages=2, recompute="selective"), INTERLEAVED, 4, True),
    "pp2_interleaved_v2_full": (dict(pp=2, virtual_stages=2, recompute="full"), INTERLEAVED, 4, False),
    "pp2_zb_tied": (dict(pp=2), ZB, 4, True),
    "pp2_zb_m3": (dict(pp=2), ZB, 3, False),
    "pp2_zb_selective": (dict(pp=2, recompute="selective"), ZB, 4, False),
    "pp2_zb_full": (dict(pp=2, recompute="full"), ZB, 4, True),
    "pp4_interleaved_v2_tied": (dict(pp=4, virtual_stages=2), INTERLEAVED, 4, True),
    "pp4_zb_tied": (dict(pp=4), ZB, 5, True),
    "tp2_pp2_interleaved_sp_async_vp": (dict(tp=2, pp=2, virtual_stages=2, **SP_ASYNC_VP), INTERLEAVED, 2, True),
    "tp2_pp2_zb_sp_async_vp": (dict(tp=2, pp=2, **SP_ASYNC_VP), ZB, 4, True),
    "tp2_pp2_zb_sp_async_full": (dict(tp=2, pp=2, recompute="full", **SP_ASYNC_VP), ZB, 3, False),
    "tp2_pp2_zb_tp_only": (dict(tp=2, pp=2), ZB, 2, False),
    "cp2_pp2_interleaved": (dict(cp=2, pp=2, virtual_stages=2), INTERLEAVED, 2, True),
    "cp2_pp2_zb": (dict(cp=2, pp=2), ZB, 3, True),
    "dp2_pp2_interleaved": (dict(dp=2, pp=2, virtual_stages=2), INTERLEAVED, 2, True),
    "dp2_pp2_zb": (dict(dp=2, pp=2), ZB, 2, False),
}


def _validate(cases):
    """[(name, ParallelConfig, schedule, microbatches, tied)] of one world size -> {name: rows}."""
    return {name: compare_with_dense(MiniMindConfig(**TINY, tie_word_embeddings=tied), par, ProcessGroups.build(par),
                                     seq_len=16, micro_batch_size=2, num_microbatches=m, pp_schedule=schedule,
                                     optimizer_steps=2, seed=7)
            for name, par, schedule, m, tied in cases}


@pytest.mark.parametrize("world", [2, 4])
def test_interleaved_and_zb_give_the_dense_numbers(world):
    todo = [(name, ParallelConfig(**sizes), schedule, m, tied) for name, (sizes, schedule, m, tied) in LAYOUTS.items()
            if ParallelConfig(**sizes).world_size == world]
    results = run_ranks(_validate, world, todo, timeout=900)[0]
    assert sorted(results) == sorted(name for name, *_ in todo)
    for name, rows in results.items():
        items = {r.item for r in rows}
        assert {"step 0 loss", "step 0 logits", "grad model.embed_tokens.weight", "grad model.layers.7.mlp.up_proj.weight",
                "grad model.layers.2.self_attn.q_proj.weight", "step 2 loss",
                "param model.layers.5.self_attn.o_proj.weight after 2 steps"} <= items, name
        bad = failures(rows)
        assert not bad, f"{name}\n" + format_report(bad)
        first = [r for r in rows if r.item.startswith(("step 0", "grad"))]
        assert max(r.rel_l2 for r in first) < 2e-5, f"{name}\n" + format_report(first)


def _observed_steps(par, schedule, m):
    """Train one step and watch it: the actions each stage ran (hooks on each chunk's first
    block, as test_pipeline's _in_flight) and, after every backward and W, whether a linear's
    weight grad and a norm's weight grad changed."""
    groups = ProcessGroups.build(par)
    config = MiniMindConfig(**TINY, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = build_parallel_model(config, par, groups, MiniMindForCausalLM(config).state_dict())
    block = model.model.layers[model.model.chunks[0][0]]
    linear, norm = block.mlp.up_proj.weight, block.input_layernorm.weight
    seen, changes = [], []

    def grad_of(p):
        return None if p.grad is None else p.grad.clone()

    def watch(method, step):
        def wrapped(self, unit, *args):
            before = grad_of(linear), grad_of(norm)
            out = method(self, unit, *args)
            seen.append(f"{step}{unit[0]}" + (f".{unit[1]}" if unit[1] else ""))
            after = grad_of(linear), grad_of(norm)
            changes.append((step, unit[1], *[not (b is None and a is None) and (b is None or not torch.equal(a, b))
                                    for b, a in zip(before, after)]))
            return out
        return wrapped

    def forwarded(self, i, x, chunk=0):
        seen.append(f"F{i}" + (f".{chunk}" if chunk else ""))
        return plain_forward(self, i, x, chunk)

    plain_forward = schedules._Stage.forward
    ids, targets = random_batch(0, 2 * m, 16, config.vocab_size)
    with mock.patch.object(schedules._Stage, "forward", forwarded), \
            mock.patch.object(schedules._Stage, "backward", watch(schedules._Stage.backward, "B")), \
            mock.patch.object(schedules._Stage, "weight", watch(schedules._Stage.weight, "W")):
        train_step(model, make_optimizer(model, 1e-3), groups, ids, targets, num_microbatches=m, schedule=schedule)
    expected = _text(schedule_order(par.pp, groups.pp_rank, m, schedule, par.virtual_stages))
    return " ".join(seen), expected, changes


def _observed_cases(cases):
    return [_observed_steps(*case) for case in cases] + [_forward_only_loss(ParallelConfig(pp=2, virtual_stages=2))]


def _forward_only_loss(par):
    """Evaluation (held-out loss) through the chunks, no schedule: -> (loss, the dense loss) on the
    last stage, None on the other."""
    groups = ProcessGroups.build(par)
    config = MiniMindConfig(**TINY, tie_word_embeddings=False)
    torch.manual_seed(0)
    dense = MiniMindForCausalLM(config)
    model = build_parallel_model(config, par, groups, dense.state_dict())
    ids, targets = random_batch(3, 8, 16, config.vocab_size)
    out = schedules.forward_backward(model, groups, split_microbatches(ids, targets, 4), forward_only=True)
    return None if out.loss is None else (out.loss, dense(ids, targets=targets).loss.detach())


def test_each_stage_runs_its_order_and_w_computes_the_deferred_weight_grads_and_evaluation_runs_the_chunks():
    cases = [(ParallelConfig(pp=2), ZB, 3), (ParallelConfig(pp=2, virtual_stages=2), INTERLEAVED, 4)]
    per_rank = run_ranks(_observed_cases, 2, cases)
    assert per_rank[0][-1] is None
    loss, dense_loss = per_rank[1][-1]                   # forward-only through both chunks of each stage
    assert torch.allclose(loss, dense_loss, rtol=1e-5, atol=0)
    for k, (par, schedule, m) in enumerate(cases):
        for seen, expected, changes in (r[k] for r in per_rank):
            assert seen == expected
            if schedule == ZB:
                # B: the norm's weight grad (a reduction over tokens), never a linear's; W: the linear's only
                assert [c for c in changes if c[0] == "B"] == [("B", 0, False, True)] * m
                assert [c for c in changes if c[0] == "W"] == [("W", 0, True, False)] * m
            else:   # the watched block is in chunk 0: its grads grow in chunk 0's backwards only
                assert all(c[2:] == (c[1] == 0, c[1] == 0) for c in changes) and len(changes) == 2 * m


# ---------------------------------------------------------------- bad input (one line, before launch)

TINY_CLI = ["--hidden_size", "64", "--num_attention_heads", "4", "--num_key_value_heads", "2", "--vocab_size", "128",
            "--seq_len", "16"]
BAD = [
    (["validate", "--pp_size", "2", "--", *TINY_CLI, "--num_hidden_layers", "6", "--pp_schedule", "interleaved",
      "--virtual_stages", "2", "--num_microbatches", "4"],
     "num_hidden_layers must be divisible by pp_size x virtual_stages (one chunk of layers per virtual stage); "
     "got num_hidden_layers=6, pp_size=2, virtual_stages=2"),
    (["validate", "--pp_size", "2", "--", *TINY_CLI, "--num_hidden_layers", "4", "--pp_schedule", "interleaved",
      "--virtual_stages", "2", "--num_microbatches", "3"],
     "--pp_schedule interleaved needs num_microbatches a multiple of pp_size (Megatron-LM's groups of P microbatches "
     "per chunk); got num_microbatches=3, pp_size=2"),
    (["validate", "--pp_size", "2", "--", *TINY_CLI, "--num_hidden_layers", "4", "--pp_schedule", "interleaved"],
     "--pp_schedule interleaved needs --virtual_stages >= 2 (model chunks per stage); got virtual_stages=1"),
    (["validate", "--pp_size", "2", "--", *TINY_CLI, "--num_hidden_layers", "4", "--virtual_stages", "2"],
     "--virtual_stages > 1 needs --pp_schedule interleaved; got virtual_stages=2, pp_schedule=1f1b"),
    (["validate", "--pp_size", "1", "--", *TINY_CLI, "--num_hidden_layers", "4", "--pp_schedule", "interleaved",
      "--virtual_stages", "2"], "virtual_stages > 1 needs pipeline parallelism; got virtual_stages=2, pp_size=1"),
    (["validate", "--pp_size", "2", "--", *TINY_CLI, "--virtual_stages", "0"],
     "virtual_stages must be >= 1; got virtual_stages=0"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[m.split(";")[0][:60] for _, m in BAD])
def test_bad_schedule_input_is_one_line_and_launches_nothing(argv, message, monkeypatch, capsys):
    assert_refused_before_launch(argv, message, monkeypatch, capsys)


# ---------------------------------------------------------------- checkpoints across chunk layouts

CKPT_STEPS, CKPT_AT = 4, 2


def _train_steps(model, optimizer, groups, steps, schedule) -> list:
    from test_checkpoint import ROWS, SEQ
    losses = []
    for i in steps:
        batch = dp_rows(random_batch(100 + i, ROWS, SEQ, TINY["vocab_size"]), groups.dp_rank, groups.par.dp)
        losses.append(train_step(model, optimizer, groups, *batch, num_microbatches=4, schedule=schedule).loss)
    return losses


def _run(par, schedule, save_dir, *, save: bool):
    """Save after CKPT_AT steps of `schedule` on `par` (save), or load that checkpoint onto `par`
    (another initialisation); then the remaining steps. -> coords, shards at CKPT_AT, losses."""
    from test_checkpoint import _load, _save, _setup, _shards
    config = MiniMindConfig(**TINY, tie_word_embeddings=True)
    groups = ProcessGroups.build(par)
    model, optimizer = _setup(config, par, groups, seed=0 if save else 1)
    if save:
        _train_steps(model, optimizer, groups, range(CKPT_AT), schedule)
        _save(save_dir, CKPT_AT, model, optimizer, config, groups)
    else:
        _load(save_dir, model, optimizer, config, groups)
    shards = _shards(model, optimizer)
    return dict(coords=groups.coords, shards=shards,
                losses=_train_steps(model, optimizer, groups, range(CKPT_AT, CKPT_STEPS), schedule))


def _save_then_resume(save_dir, targets):
    return [_run(ParallelConfig(pp=2, virtual_stages=2), INTERLEAVED, save_dir, save=True)] + \
           [_run(par, schedule, save_dir, save=False) for par, schedule in targets]


def _assert_same_run(saved, resumed, par):
    from test_checkpoint import _dense, _global_losses
    source = ParallelConfig(pp=2, virtual_stages=2)
    for what in ("param", "exp_avg", "exp_avg_sq"):
        before, after = _dense(saved, source, what), _dense(resumed, par, what)
        assert sorted(after) == sorted(before), what
        for name in after:
            assert torch.equal(after[name], before[name]), f"{what} {name} on {par}"
    torch.testing.assert_close(_global_losses(resumed, par), _global_losses(saved, source), rtol=2e-5, atol=0)


def test_a_run_on_interleaved_stages_resumes_on_1f1b_and_on_other_stages_and_chunks(tmp_path):
    """Chunk ownership is the plan's (stage 0 of pp2 x 2 chunks holds layers 0, 1, 4, 5): DCP
    reshards it onto contiguous 1F1B stages, onto 4 chunks per stage and onto pp4 x 2 chunks."""
    same_world = [(ParallelConfig(pp=2), Schedule.ONE_F_ONE_B), (ParallelConfig(pp=2, virtual_stages=4), INTERLEAVED)]
    per_rank = run_ranks(_save_then_resume, 2, str(tmp_path / "a"), same_world)
    saved = [r[0] for r in per_rank]
    for k, (par, _) in enumerate(same_world, start=1):
        _assert_same_run(saved, [r[k] for r in per_rank], par)
    pp4 = ParallelConfig(pp=4, virtual_stages=2)
    resumed = run_ranks(_resume_only, 4, pp4, str(tmp_path / "a"))
    _assert_same_run(saved, resumed, pp4)


def _resume_only(par, save_dir):
    return _run(par, INTERLEAVED, save_dir, save=False)
