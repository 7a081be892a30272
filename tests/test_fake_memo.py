"""The estimate's remembered fake dispatch (memory/fake_memo.py) and its warm-up shortcut measure
exactly what FakeTensorMode and a whole warm-up step measure: every report byte-identical, over
layouts that reach every path of a step (DDP, TP + SP + async, PP stages, ZeRO 1 and 3, CP,
selective recompute, MoE with experts over DP), also with one memo shared by all of them."""
import gc

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from minimind_parallel import MiniMindConfig, ParallelConfig, ProcessGroups
from minimind_parallel.memory import StorageTracker, estimate_step_memory
from minimind_parallel.memory.estimate import _create_optimizer_states, fake_process_group
from minimind_parallel.memory.fake_memo import Made, RememberingFakeTensorMode
from minimind_parallel.parallel_model import ParallelMiniMindForCausalLM
from minimind_parallel.training import make_optimizer

TINY = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                      vocab_size=512, tie_word_embeddings=True, max_position_embeddings=256)
MOE = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=512, use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
LAYOUTS = [  # (config, layout, estimate_step_memory's keywords)
    (TINY, ParallelConfig(dp=2), {}),
    (TINY, ParallelConfig(tp=2, sequence_parallel=True, async_communication=True, vocab_parallel=True), {}),
    (TINY, ParallelConfig(tp=2, sequence_parallel=True, recompute="selective", loss_chunks=2), {}),
    (TINY, ParallelConfig(pp=2, dp=2, zero=1), dict(stage=1, num_microbatches=2)),
    (TINY, ParallelConfig(pp=2), dict(stage=0, num_microbatches=3, schedule="gpipe")),
    (TINY, ParallelConfig(dp=2, zero=3), {}),
    (TINY, ParallelConfig(cp=2, cp_load_balance=False), dict(cp_rank=1)),
    (MOE, ParallelConfig(dp=2, ep=2), {}),
]


class _Counting(StorageTracker):
    """The tracker, also noting which ops the mode below answered (by namespace: aten, c10d)."""
    answered: set = set()

    @property
    def answer(self):
        return self._answer

    @answer.setter
    def answer(self, answer):
        def counted(func, args, kwargs):
            got = answer(func, args, kwargs)
            if got is not None:
                _Counting.answered.add(func.namespace)
            return got
        self._answer = counted if answer is not None else None


def _estimate(config, par, kw, **how):
    return estimate_step_memory(config, par, seq_len=32, micro_batch_size=2, dtype=torch.bfloat16, iters=1,
                                **kw, **how)


def _no_tensor_in_a_cycle(tracker) -> None:
    """After a step (the estimate pauses the cyclic collector): the garbage of the reference cycles
    the estimate made so far (the objects before it are frozen) holds no tensor, so a collection
    during the step would have freed none, and the pause changes no measurement."""
    gc.set_debug(gc.DEBUG_SAVEALL)   # keep what it finds, to look at
    try:
        gc.collect()
        tensors = [o for o in gc.garbage if isinstance(o, (torch.Tensor, torch.UntypedStorage))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not tensors, tensors[:3]


def test_the_remembered_fake_dispatch_measures_what_fake_tensor_mode_measures():
    shared: dict = {}
    for config, par, kw in LAYOUTS:
        plain = _estimate(config, par, kw, remember=False)
        gc.freeze()   # what exists now is not looked at: only what this estimate makes
        try:
            got = _estimate(config, par, kw, memo=shared, tracker_type=_Counting,   # what the layouts before left
                            on_step=_no_tensor_in_a_cycle)
        finally:
            gc.unfreeze()
        assert (got.peak_bytes, got.breakdown) == (plain.peak_bytes, plain.breakdown), (par, kw)
    assert _Counting.answered == {"aten", "c10d"}   # ops and collectives answered without FakeTensorMode
    remembered = [recipe for recipe in shared.values() if recipe is not None]
    assert len(remembered) > 200 and any(spec[0] is Made.VIEW for _, specs in remembered for spec in specs)


def test_a_replayed_op_makes_the_tensor_fake_tensor_mode_made():
    mode = RememberingFakeTensorMode()
    with mode:
        x = torch.empty(4, 6)
        first, first_view = x * 2, x.t()
        replayed, replayed_view = x * 2, x.t()
        reference = FakeTensor(mode, torch.empty(4, 6, device="meta"), torch.device("cpu"))
    assert mode.replayed >= 2
    for made, shown in ((replayed, first), (replayed_view, first_view)):
        assert type(made) is FakeTensor and vars(made).keys() == vars(reference).keys()
        assert {k: v for k, v in vars(made).items() if k != "fake_device"} == \
            {k: v for k, v in vars(reference).items() if k != "fake_device"}
        assert torch._C._dispatch_keys(made) == torch._C._dispatch_keys(shown)
        assert (made.shape, made.stride(), made.dtype, made.device, made.storage_offset()) == \
            (shown.shape, shown.stride(), shown.dtype, shown.device, shown.storage_offset())
    assert replayed_view.untyped_storage()._cdata == x.untyped_storage()._cdata   # a view of x's storage
    assert replayed.untyped_storage()._cdata != first.untyped_storage()._cdata   # a storage of its own


def test_a_constants_item_is_its_value_as_fake_tensor_mode_gives_it():
    mode = RememberingFakeTensorMode()
    with mode:
        step = torch.tensor(0.0)
        step += 3   # AdamW's step count
        assert step.constant is not None and step.item() == 3.0
        value, inputs, outputs = mode.answer(torch.ops.aten._local_scalar_dense.default, (step,), {})
    assert (value, inputs, outputs) == (3.0, [step], [])


def _states(warm_up):
    """AdamW's states after `warm_up(model, optimizer)` on a fake model: each one's metadata."""
    par = ParallelConfig(tp=2)
    with fake_process_group(0, 2):
        groups = ProcessGroups.build(par)
        with FakeTensorMode():
            model = ParallelMiniMindForCausalLM(TINY, par, groups)
            optimizer = make_optimizer(model, 1e-3, groups)
            warm_up(model, optimizer)
            grads = [p.grad for p in model.parameters()]
            return grads, [{k: (v.shape, v.stride(), v.dtype, v.device) for k, v in optimizer.state[p].items()}
                           for p in model.parameters()]


def _whole_step(model, optimizer):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_the_warm_up_makes_the_optimizer_states_a_whole_step_makes():
    grads, states = _states(_create_optimizer_states)
    assert all(g is None for g in grads) and all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in states)
    assert (grads, states) == _states(_whole_step)


def _counting(dispatch, calls: list):
    """FakeTensorMode's own dispatch (RememberingFakeTensorMode's too), noting each op in `calls`."""
    def counted(self, func, types, args=(), kwargs=None):
        calls.append(func)
        return dispatch(self, func, types, args, kwargs)
    return counted


def _views(flat):
    """View ops at offsets not seen before (slices of a flat buffer, as training's _all_reduce_grads
    makes), several outputs, an alias of a dtype, a transpose of a slice."""
    x = flat[6:30]
    return [x, flat[30:42].view(3, 4), x.view(4, 6).t(), x.view(2, 12)[1], torch.as_strided(flat, (2, 3), (1, 2), 9),
            *flat[1:13].split([5, 7]), x.view(4, 6).unbind(1)[2], x.view(4, 6).expand(2, 4, 6), x.view(torch.int32)]


def test_a_view_at_a_new_offset_is_the_view_fake_tensor_mode_makes(monkeypatch):
    with FakeTensorMode():
        plain = _views(torch.empty(48))
    calls: list = []
    monkeypatch.setattr(FakeTensorMode, "__torch_dispatch__", _counting(FakeTensorMode.__torch_dispatch__, calls))
    with RememberingFakeTensorMode() as mode:
        flat = torch.empty(48)
        del calls[:]
        made = _views(flat)
    assert not calls   # each answered by the op's own Meta kernel, none by FakeTensorMode
    for got, want in zip(made, plain, strict=True):
        assert type(got) is FakeTensor and got.untyped_storage()._cdata == flat.untyped_storage()._cdata
        assert (got.shape, got.stride(), got.storage_offset(), got.dtype, got.device) == \
            (want.shape, want.stride(), want.storage_offset(), want.dtype, want.device)
        assert torch._C._dispatch_keys(got) == torch._C._dispatch_keys(want) and vars(got).keys() == vars(want).keys()
    with RememberingFakeTensorMode(mode.memo):   # remembered: replayed
        again = _views(torch.empty(48))
    assert [(t.shape, t.stride(), t.storage_offset()) for t in again] == \
        [(t.shape, t.stride(), t.storage_offset()) for t in made]


_CALLS: list = []   # FakeTensorMode's own dispatches (`_fake_tensor_mode_calls`)


def _step_counts(mode, updated):
    """AdamW's step count under `mode`: torch.tensor(0.0), then `updated(mode, step)` three times."""
    with mode:
        step = torch.tensor(0.0)
        for _ in range(3):
            updated(mode, step)
        made = list(_CALLS)
        return step, step.item(), made


def test_a_constant_is_made_and_updated_as_fake_tensor_mode_does(monkeypatch):
    want, want_value, _ = _step_counts(FakeTensorMode(), lambda mode, step: step.add_(1))
    monkeypatch.setattr(FakeTensorMode, "__torch_dispatch__", _counting(FakeTensorMode.__torch_dispatch__, _CALLS))
    for updated in (lambda mode, step: step.add_(1),   # as the warm-up runs it, and under the tracker:
                    lambda mode, step: mode.answer(torch.ops.aten.add_.Tensor, (step, 1), {})):
        mode = RememberingFakeTensorMode()
        del _CALLS[:]
        got, value, calls = _step_counts(mode, updated)
        assert not calls and value == want_value == 3.0   # made and updated without FakeTensorMode
        assert type(got) is FakeTensor and vars(got).keys() == vars(want).keys()
        mine = ("constant", "fake_mode", "_fake_device")   # its own value, mode (and the device, compared below)
        assert {k: v for k, v in vars(got).items() if k not in mine} == \
            {k: v for k, v in vars(want).items() if k not in mine} and got.fake_mode is mode
        assert torch.equal(got.constant, want.constant) and got.constant.dtype == want.constant.dtype
        assert torch._C._dispatch_keys(got) == torch._C._dispatch_keys(want)
        assert (got.shape, got.stride(), got.dtype, got.device, got.untyped_storage().nbytes()) == \
            (want.shape, want.stride(), want.dtype, want.device, want.untyped_storage().nbytes())
        assert mode.fake_tensor_converter._get_memo(got.constant) is got   # as FakeTensorMode's converter has it
