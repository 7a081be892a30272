"""Pipeline parallelism: GPipe and 1F1B give the dense model's numbers (loss, logits, every
gradient of every stage, AdamW steps) alone and with TP/SP/async/VP and DP; tied embeddings
stay identical across the first and last stage; 1F1B holds at most P microbatches on stage 0
where GPipe holds M; bad pipeline input is refused before launch; a failing stage ends the job."""
import subprocess
import sys
from unittest import mock

import pytest
import torch

from distributed import run_ranks
from minimind_parallel import MiniMindConfig, ParallelConfig, ProcessGroups
from minimind_parallel.model import MiniMindForCausalLM
from minimind_parallel.data.batches import random_batch, split_microbatches
from minimind_parallel.pipeline_parallel import SCHEDULES, deallocate_output_tensor, forward_backward, schedule_order
from minimind_parallel.pipeline_parallel.order import Step, backward, check_order, forward
from minimind_parallel.sharding import gather_state_dict, shard_state_dict
from minimind_parallel.training import build_parallel_model, make_optimizer, train_step
from minimind_parallel.validation import compare_with_dense, error, failures, format_report
from test_cli import assert_refused_before_launch
from test_model import assert_shards_are_megatron_slices

TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=128)


def _compare(par, schedule, microbatches, tied, steps=3, perturb=None):
    groups = ProcessGroups.build(par)
    return compare_with_dense(MiniMindConfig(**TINY, tie_word_embeddings=tied), par, groups, seq_len=16,
                              micro_batch_size=2, num_microbatches=microbatches, pp_schedule=schedule,
                              optimizer_steps=steps, seed=7, perturb=perturb)


def assert_pipeline_matches_dense(par, schedule, microbatches, tied=False):
    rows = run_ranks(_compare, par.world_size, par, schedule, microbatches, tied)[0]
    names = [r.item for r in rows]
    # every stage reported: the first stage's embedding, the last layer, the last stage's head
    for item in ("step 0 loss", "step 0 logits", "grad model.embed_tokens.weight", "grad model.norm.weight",
                 "grad model.layers.3.mlp.up_proj.weight", "step 3 loss",
                 "param model.layers.0.self_attn.q_proj.weight after 3 steps"):
        assert item in names, item
    assert ("grad lm_head.weight" in names) == (not tied or par.pp > 1)  # one name per Parameter
    order = [names.index(n) for n in ("grad model.embed_tokens.weight", "grad model.norm.weight", "step 1 loss")]
    assert order == sorted(order)
    bad = failures(rows)
    assert not bad, "\n" + format_report(bad)
    # forward values and gradients at float32 round-off
    assert max(r.rel_l2 for r in rows if r.item.startswith(("step", "grad"))) < 2e-5, format_report(rows)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,microbatches", [(2, 1), (2, 2), (2, 5), (4, 1), (4, 4), (4, 9)])
def test_pipeline_schedules_give_the_dense_numbers(pp, microbatches, schedule):
    assert_pipeline_matches_dense(ParallelConfig(pp=pp), schedule, microbatches, tied=microbatches % 2 == 1)


COMBOS = {
    "tp2_pp2_sp_async_vp": ParallelConfig(tp=2, pp=2, sequence_parallel=True, async_communication=True,
                                          vocab_parallel=True),
    "tp2_pp2_sp_async_shared_vp": ParallelConfig(tp=2, pp=2, sequence_parallel=True, async_communication=True,
                                                 shared_sp_gather=True, vocab_parallel=True),
    "tp2_pp2": ParallelConfig(tp=2, pp=2),
    "dp2_pp2": ParallelConfig(dp=2, pp=2),
    "dp2_tp2_pp2_sp_vp": ParallelConfig(dp=2, tp=2, pp=2, sequence_parallel=True, vocab_parallel=True),
    "dp2_accumulation": ParallelConfig(dp=2),  # one stage: DDP with no_sync until the last microbatch
}


def combo_cases():
    for name in COMBOS:
        for schedule in (["gpipe", "1f1b"] if name in ("tp2_pp2_sp_async_vp", "dp2_pp2") else ["1f1b"]):
            yield pytest.param(COMBOS[name], schedule, id=f"{name}-{schedule}")


@pytest.mark.parametrize("par,schedule", list(combo_cases()))
def test_pipeline_with_tensor_and_data_parallel_gives_the_dense_numbers(par, schedule):
    assert_pipeline_matches_dense(par, schedule, 3, tied=True)


def _uneven_targets(schedule):
    par = ParallelConfig(pp=2)
    groups = ProcessGroups.build(par)
    config = MiniMindConfig(**TINY, tie_word_embeddings=False)
    torch.manual_seed(0)
    dense = MiniMindForCausalLM(config)
    model = build_parallel_model(config, par, groups, dense.state_dict())
    ids, targets = random_batch(3, 6, 16, config.vocab_size)
    targets[:2, 1:11] = -100                     # microbatch 0 has far fewer targets than 1 and 2
    ref = dense(ids, targets=targets)
    ref.loss.backward()
    out = forward_backward(model, groups, split_microbatches(ids, targets, 3), schedule=schedule)
    name = "model.layers.0.mlp.up_proj.weight" if groups.pp_rank == 0 else "lm_head.weight"
    grad = error(dict(model.named_parameters())[name].grad, dict(dense.named_parameters())[name].grad)[1]
    return grad, None if out.loss is None else error(out.loss, ref.loss)[1]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_microbatches_with_uneven_targets_give_the_dense_mean_over_tokens(schedule):
    (first_grad, _), (last_grad, loss) = run_ranks(_uneven_targets, 2, schedule)
    assert max(first_grad, last_grad, loss) < 2e-6


def _orders(pp, m, schedule):
    return [" ".join(map(str, schedule_order(pp, stage, m, schedule))) for stage in range(pp)]


def _most_in_flight(order):
    held = peak = 0
    for action in order:
        held += 1 if action.step is Step.FORWARD else -1
        peak = max(peak, held)
    return peak


def test_a_schedule_is_the_order_of_its_stages_actions():
    assert _orders(4, 5, "1f1b") == ["F0 F1 F2 F3 B0 F4 B1 B2 B3 B4", "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4",
                                     "F0 F1 B0 F2 B1 F3 B2 F4 B3 B4", "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4"]
    assert _orders(2, 3, "gpipe") == ["F0 F1 F2 B0 B1 B2"] * 2
    assert _orders(1, 3, "gpipe") == _orders(1, 3, "1f1b") == ["F0 B0 F1 B1 F2 B2"]   # gradient accumulation
    # 1F1B's steady state sends and receives in one exchange; GPipe's exchanges are each on their own
    # F0 | F1 B0 F2 B1 | B2: the last steady backward and the cool-down send on their own
    assert [a.paired for a in schedule_order(2, 0, 3, "1f1b")] == [False, True, True, True, False, False]
    assert not any(a.paired for a in schedule_order(2, 0, 3, "gpipe"))
    for pp in (2, 4):
        for m in (1, 3, 9):
            for stage in range(pp):
                assert _most_in_flight(schedule_order(pp, stage, m, "1f1b")) == min(pp - stage, m)
                assert _most_in_flight(schedule_order(pp, stage, m, "gpipe")) == m


@pytest.mark.parametrize("order,message", [
    ([forward(0), backward(1), forward(1), backward(0)], "got B1 at action 1"),
    ([forward(0), forward(0), backward(0)], "got F0 at action 1"),
    ([forward(0, paired=True), forward(1), backward(0), backward(1)], "a paired action is followed by the other"),
    ([forward(0)], "a schedule runs all 1 microbatches"),
])
def test_a_broken_order_is_refused(order, message):
    with pytest.raises(ValueError, match=message):
        check_order(order, 1 if len(order) == 1 else 2)


def _last_in_first_out(pp, stage, num_microbatches):
    """A schedule of this test only: all forwards, then the backwards newest first."""
    m = num_microbatches
    return [forward(i) for i in range(m)] + [backward(i) for i in reversed(range(m))]


def _under_a_new_schedule():
    """The stage's run under `_last_in_first_out`: the order it was seen to run and the
    microbatches it held (`_in_flight`), and its errors against the dense model (`_uneven_targets`)."""
    with mock.patch.dict(SCHEDULES, last_in_first_out=_last_in_first_out):
        return _in_flight(ParallelConfig(pp=2), "last_in_first_out", 3), _uneven_targets("last_in_first_out")


def test_a_new_schedule_is_one_function_and_gives_the_dense_numbers():
    (held_first, (first_grad, _)), (held_last, (last_grad, loss)) = run_ranks(_under_a_new_schedule, 2)
    assert held_first == held_last == (3, 3)      # each stage ran B2 B1 B0 (checked in _in_flight)
    assert max(first_grad, last_grad, loss) < 2e-6


def test_the_checker_catches_a_perturbed_last_stage_shard():
    par = ParallelConfig(pp=2)
    rows = run_ranks(_compare, 2, par, "1f1b", 2, False, 1, "model.layers.3.self_attn.o_proj.weight")[0]
    bad = {r.item for r in failures(rows)}
    assert {"step 0 logits", "param model.layers.3.self_attn.o_proj.weight after 1 steps"} <= bad
    assert "grad model.layers.0.self_attn.o_proj.weight" in bad  # the wrong grad travelled back to stage 0


def _tied_copies_after_steps(par, schedule):
    groups = ProcessGroups.build(par)
    config = MiniMindConfig(**TINY, tie_word_embeddings=True)
    torch.manual_seed(0)
    dense = MiniMindForCausalLM(config)
    initial = dense.lm_head.weight.detach().clone()
    model = build_parallel_model(config, par, groups, dense.state_dict())
    opt = make_optimizer(model, 1e-2)
    for step in range(5):
        ids, targets = random_batch(step, 6, 16, config.vocab_size)
        train_step(model, opt, groups, ids, targets, num_microbatches=3, schedule=schedule)
    params = dict(model.named_parameters())
    copy = params.get("model.embed_tokens.weight", params.get("lm_head.weight"))  # None on middle stages
    initial = initial.chunk(par.tp)[groups.tp_rank] if par.vocab_parallel else initial
    return groups.pp_rank, None if copy is None else copy.detach().clone(), initial


@pytest.mark.parametrize("par", [ParallelConfig(pp=2), ParallelConfig(pp=4),
                                 ParallelConfig(tp=2, pp=2, sequence_parallel=True, vocab_parallel=True)],
                         ids=["pp2", "pp4", "tp2_pp2_sp_vp"])
def test_tied_embeddings_stay_identical_across_first_and_last_stage(par):
    results = run_ranks(_tied_copies_after_steps, par.world_size, par, "1f1b")
    for tp_rank in range(par.tp):
        (first, emb, initial), (last, head, _) = results[tp_rank], results[-par.tp + tp_rank]
        assert (first, last) == (0, par.pp - 1)
        assert torch.equal(emb, head), f"tied copies diverged on TP rank {tp_rank}"
        assert not torch.equal(emb, initial), "the embedding never trained"


def _stage_and_batch(par, microbatches):
    """This rank's stage of the TINY model and a batch of `microbatches` microbatches of 2 rows."""
    groups = ProcessGroups.build(par)
    config = MiniMindConfig(**TINY, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = build_parallel_model(config, par, groups, MiniMindForCausalLM(config).state_dict())
    return groups, model, random_batch(0, 2 * microbatches, 16, config.vocab_size)


def _in_flight(par, schedule, microbatches):
    """Microbatches held by this stage at most, (observed, the schedule's own count). Observed from
    outside the schedule: a forward pre-hook on the stage's first block counts a microbatch in, and
    a hook on that block's input counts it out when its grad is computed (the end of the
    microbatch's backward through the stage's blocks)."""
    groups, model, (ids, targets) = _stage_and_batch(par, microbatches)
    first_block = next(iter(model.model.layers.values()))
    held, observed = dict(now=0, peak=0, forwards=0, backwards=0), []

    def backwarded(i):
        def hook(_grad):
            held["now"], held["backwards"] = held["now"] - 1, held["backwards"] + 1
            observed.append(f"B{i}")
        return hook

    def forwarded(_module, args):
        observed.append(f"F{held['forwards']}")
        args[0].register_hook(backwarded(held["forwards"]))  # h [S, B, H]: its grad ends the backward
        held["now"], held["forwards"] = held["now"] + 1, held["forwards"] + 1
        held["peak"] = max(held["peak"], held["now"])
    first_block.register_forward_pre_hook(forwarded)
    step = train_step(model, make_optimizer(model, 1e-3), groups, ids, targets,
                      num_microbatches=microbatches, schedule=schedule).schedule
    assert held["forwards"] == held["backwards"] == microbatches and held["now"] == 0, held
    # the stage ran the order the memory model replays
    expected = schedule_order(par.pp, groups.pp_rank, microbatches, schedule)
    assert observed == [str(a) for a in expected], (observed, expected)
    return held["peak"], step.max_in_flight


@pytest.mark.parametrize("pp,microbatches", [(2, 5), (4, 9)])
def test_1f1b_holds_at_most_p_microbatches_where_gpipe_holds_m(pp, microbatches):
    par = ParallelConfig(pp=pp)
    one_f_one_b = run_ranks(_in_flight, pp, par, "1f1b", microbatches)
    gpipe = run_ranks(_in_flight, pp, par, "gpipe", microbatches)
    # observed from the stage's own forward and backward, and the schedule's count agrees
    assert one_f_one_b == [(pp - stage, pp - stage) for stage in range(pp)]   # stage 0: P; the last stage: 1
    assert gpipe == [(microbatches, microbatches)] * pp


class SavedActivations:
    """Measures the activation bytes autograd holds for backward (distinct floating-point
    storages; parameters, buffers and the token ids excluded): live now and at the peak. Each
    saved tensor is wrapped in a handle owned only by the autograd graph, so its bytes are
    released exactly when the graph lets it go."""

    def __init__(self, model):
        self.skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self.refs: dict[int, int] = {}
        self.now = self.peak = 0

    def pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() in self.skip or not t.is_floating_point():
            return t
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if self.refs.get(ptr, 0) == 0:
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        return _Saved(t, self, ptr, nbytes)

    def unpack(self, saved):
        return saved.t if isinstance(saved, _Saved) else saved


class _Saved:
    def __init__(self, t, meter, ptr, nbytes):
        self.t, self.meter, self.ptr, self.nbytes = t, meter, ptr, nbytes

    def __del__(self):
        self.meter.refs[self.ptr] -= 1
        if self.meter.refs[self.ptr] == 0:
            self.meter.now -= self.nbytes


def _activation_peak(par, schedule, microbatches):
    groups, model, (ids, targets) = _stage_and_batch(par, microbatches)
    meter = SavedActivations(model)
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        train_step(model, make_optimizer(model, 1e-3), groups, ids, targets,
                   num_microbatches=microbatches, schedule=schedule)
    return meter.peak, meter.now


def test_measured_activation_peak_of_stage_0_is_p_microbatches_for_1f1b_and_m_for_gpipe():
    pp, m, par = 4, 9, ParallelConfig(pp=4)
    one = run_ranks(_activation_peak, pp, par, "1f1b", 1)[0]
    one_f_one_b = run_ranks(_activation_peak, pp, par, "1f1b", m)[0]
    gpipe = run_ranks(_activation_peak, pp, par, "gpipe", m)[0]
    per_microbatch = one[0]
    assert per_microbatch > 0 and one[1] == one_f_one_b[1] == gpipe[1] == 0   # all released after the step
    assert one_f_one_b[0] == pp * per_microbatch
    assert gpipe[0] == m * per_microbatch


def test_a_sent_output_is_freed_and_still_backpropagates():
    x = torch.randn(8, 2, 4, requires_grad=True)
    out = x * 3 + x                                   # a stage ends on a residual add: saves nothing
    expected = torch.autograd.grad(out, x, torch.ones_like(out), retain_graph=True)[0]
    deallocate_output_tensor(out)
    assert out.untyped_storage().nbytes() == out.element_size() and out.shape == (8, 2, 4)
    torch.autograd.backward(out, torch.ones(8, 2, 4))
    assert torch.equal(x.grad, expected)


TINY_CLI = ["--hidden_size", "64", "--num_attention_heads", "4", "--num_key_value_heads", "2", "--vocab_size", "128",
            "--seq_len", "16", "--num_hidden_layers", "4", "--optimizer_steps", "2"]

BAD = [
    (["validate", "--pp_size", "3", "--", "--num_hidden_layers", "4"],
     "num_hidden_layers must be divisible by pp_size; got num_hidden_layers=4, pp_size=3"),
    (["validate", "--pp_size", "2", "--", "--num_microbatches", "0"], "num_microbatches must be >= 1"),
    (["validate", "--pp_size", "2", "--", "--pp_schedule", "zero_bubble"], "invalid choice: 'zero_bubble'"),
    (["validate", "--pp_size", "0", "--"], "pp size must be >= 1"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[m.split(";")[0] for _, m in BAD])
def test_bad_pipeline_input_is_one_line_and_launches_nothing(argv, message, monkeypatch, capsys):
    assert_refused_before_launch(argv, message, monkeypatch, capsys)


def run_cli(*argv, timeout=240):
    return subprocess.run([sys.executable, "-m", "evaluation.parallel", *argv], capture_output=True, text=True,
                          timeout=timeout)


def test_validate_pp_end_to_end():
    r = run_cli("validate", "--pp_size", "2", "--", *TINY_CLI, "--num_microbatches", "4", "--pp_schedule", "1f1b",
                "--mode", "pp", "--tie_word_embeddings")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "validate: PASSED" in r.stdout and "pp=2 schedule=1f1b microbatches=4" in r.stdout
    assert "grad model.layers.3.mlp.down_proj.weight" in r.stdout and "step 0 loss" in r.stdout


def test_a_stage_that_raises_ends_the_job_with_its_error():
    # Stage 0 raises before its first send; stage 1 would wait for its activation forever on its own.
    r = run_cli("validate", "--pp_size", "2", "--inject_fault", "raise:0", "--", *TINY_CLI, "--mode", "pp",
                timeout=120)
    assert r.returncode != 0
    assert "RuntimeError" in r.stderr and "injected fault on rank 0" in r.stderr


@pytest.mark.parametrize("tied", [False, True])
def test_stages_shard_and_gather_by_global_names(tied):
    torch.manual_seed(0)
    sd = MiniMindForCausalLM(MiniMindConfig(**TINY, tie_word_embeddings=tied)).state_dict()
    par = ParallelConfig(tp=2, pp=2, vocab_parallel=True)
    shards = [shard_state_dict(sd, par, t, p) for p in range(2) for t in range(2)]  # pipeline rank order
    assert "model.embed_tokens.weight" in shards[0] and "lm_head.weight" not in shards[0]
    assert {k.split(".")[2] for k in shards[3] if k.startswith("model.layers.")} == {"2", "3"}
    assert "lm_head.weight" in shards[3] and "model.norm.weight" in shards[3]
    assert_shards_are_megatron_slices(sd, shards, par.tp, par.vocab_parallel)
    assert sorted(k for s in shards[::par.tp] for k in s) == sorted(sd)  # each key on exactly one stage
    back = gather_state_dict(shards, par)
    assert sorted(back) == sorted(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
