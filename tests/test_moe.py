"""MiniMind's MoE model: the grouped experts against a faithful reimplementation of MiniMind's
MOEFeedForward loop (tests/minimind_moe_reference.py) -- outputs, aux loss and every grad."""
import json

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from minimind_parallel import ConfigError, MiniMindConfig, MiniMindForCausalLM, ParallelConfig
from minimind_parallel.config import check_layout
from minimind_parallel.data.batches import random_batch
from minimind_parallel.moe import MOEFeedForward
from minimind_parallel.moe.experts import _grouped

from helpers import one_line_error, rel_l2
from minimind_moe_reference import ReferenceMOEFeedForward, reference_aux_loss, reference_model


def moe_config(**kw):
    base = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                router_aux_loss_coef=0.05)
    return MiniMindConfig(**{**base, **kw})


def twin(config, dtype):
    torch.manual_seed(0)
    ours = MiniMindForCausalLM(config).to(dtype)
    ref = reference_model(config).to(dtype)
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ours, ref


def grads_of(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward(retain_graph=True)
    return {name: torch.zeros_like(p) if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("k, norm", [(1, True), (2, True), (3, False)])
def test_moe_model_equals_minimind_loop_in_float64(k, norm):
    """Logits, LM loss and its grads to float64 round-off; the aux loss and its grads to float32
    round-off, as MiniMind forms the load in float32 (one_hot(...).float()) and this model in the
    scores' dtype."""
    config = moe_config(num_experts_per_tok=k, norm_topk_prob=norm)
    ours, ref = twin(config, torch.float64)
    batch = random_batch(1, 3, 16, config.vocab_size, "cpu")
    out = ours(batch.input_ids, targets=batch.targets)
    want = ref(batch.input_ids, targets=batch.targets)
    want_aux = reference_aux_loss(ref)
    assert rel_l2(out.logits, want.logits) < 1e-13
    assert abs(out.loss.item() - want.loss.item()) < 1e-13
    assert out.aux_loss.item() > 0 and abs(out.aux_loss.item() / want_aux.item() - 1) < 1e-6
    lm, want_lm = grads_of(ours, out.loss), grads_of(ref, want.loss)
    aux, want_aux_grads = grads_of(ours, out.aux_loss), grads_of(ref, want_aux)
    for name in lm:
        assert rel_l2(lm[name], want_lm[name]) < 1e-12, name
        if want_aux_grads[name].abs().sum() > 0:                  # the lm_head gets no aux grad
            assert rel_l2(aux[name], want_aux_grads[name]) < 1e-6, name
    assert out.objective.item() == out.loss.item() + out.aux_loss.item()


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped_mm"])
def test_moe_layer_equals_minimind_loop_in_float32(grouped, monkeypatch):
    """The loop of GEMMs over the sorted slices, and torch._grouped_mm (CUDA's path; the CPU runs
    it in float32 too, so its numbers are checked here)."""
    config = moe_config(num_experts_per_tok=2)
    torch.manual_seed(0)
    ours = MOEFeedForward(config)
    ref = ReferenceMOEFeedForward(config)
    ref.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(2, 24, config.hidden_size)
    if grouped:
        calls = []
        monkeypatch.setattr("minimind_parallel.moe.experts.grouped_mm_fits", lambda *a: True)
        monkeypatch.setattr("minimind_parallel.moe.experts._grouped", lambda *a: calls.append(1) or _grouped(*a))
    y, want = ours(x), ref(x)
    assert not grouped or calls
    assert rel_l2(y, want) < 1e-6
    assert abs(ours.aux_loss.item() - ref.aux_loss.item()) <= 1e-6 * ref.aux_loss.item()
    g = torch.randn_like(y)
    (y * g).sum().add(ours.aux_loss).backward()
    (want * g).sum().add(ref.aux_loss).backward()
    grads = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert rel_l2(p.grad, grads[name].grad) < 1e-5, name


def test_an_expert_no_token_chose_gets_a_zero_grad_as_minimind():
    config = moe_config(num_experts_per_tok=1)
    layer = MOEFeedForward(config).double()
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[1] = 1.0                # every token to expert 1 (the largest score)
    x = torch.rand(1, 8, config.hidden_size, dtype=torch.float64) + 0.1
    layer(x).sum().backward()
    assert layer.experts["1"].up_proj.weight.grad.abs().sum() > 0
    assert torch.equal(layer.experts["0"].up_proj.weight.grad, torch.zeros_like(layer.experts["0"].up_proj.weight))


def test_aux_loss_is_zero_outside_training_and_the_dense_model_has_none():
    config = moe_config()
    model = MiniMindForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 8))
    assert model(ids).aux_loss.item() == 0.0
    assert MiniMindForCausalLM(moe_config(use_moe=False, num_experts=4, num_experts_per_tok=1,
                                          moe_intermediate_size=None, router_aux_loss_coef=5e-4))(ids).aux_loss is None


def test_state_dict_keys_are_minimind_moe_keys():
    config = moe_config(num_hidden_layers=1)
    keys = set(MiniMindForCausalLM(config).state_dict())
    assert "model.layers.0.mlp.gate.weight" in keys
    assert {f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in range(4) for p in ("gate", "up", "down")} <= keys
    assert not any(k.startswith("model.layers.0.mlp.gate_proj") for k in keys)


def test_moe_defaults_are_minimind():
    c = MiniMindConfig()
    assert (c.use_moe, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob,
            c.router_aux_loss_coef) == (False, 4, 1, c.intermediate_size, True, 5e-4)


@pytest.mark.parametrize("fields, needle", [
    (dict(use_moe=False, num_experts=8, num_experts_per_tok=1, moe_intermediate_size=None), "need use_moe"),
    (dict(use_moe=False, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=16), "need use_moe"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok must be <= num_experts"),
    (dict(num_experts=0, num_experts_per_tok=0), "num_experts must be >= 1"),
    (dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef must be >= 0"),
])
def test_moe_config_constraints_are_refused_in_one_line(fields, needle):
    config = moe_config(**{"router_aux_loss_coef": 5e-4, **fields})
    assert needle in one_line_error(ConfigError, check_layout, config, ParallelConfig())


# tensor-parallel layouts of the MoE model (router and experts whole on every TP rank), one launch
MOE_TP_LAYOUTS = {
    "tp2": ParallelConfig(tp=2),
    "tp2_sp_async_vp": ParallelConfig(tp=2, sequence_parallel=True, async_communication=True, vocab_parallel=True),
    "tp2_sp_selective": ParallelConfig(tp=2, sequence_parallel=True, recompute="selective"),
    "tp2_full_chunked": ParallelConfig(tp=2, recompute="full", loss_chunks=2),
}


def _tp_layouts():
    from minimind_parallel import ProcessGroups
    from minimind_parallel.validation import compare_with_dense
    config = moe_config()
    out = {}
    for name, par in MOE_TP_LAYOUTS.items():
        rows = compare_with_dense(config, par, ProcessGroups.build(par), seq_len=16, micro_batch_size=2,
                                  dtype=torch.float64, optimizer_steps=2, seed=3)
        out[name] = rows
    return out


def test_moe_model_under_tensor_and_sequence_parallelism_equals_dense_in_float64():
    from distributed import run_ranks
    from minimind_parallel.validation import failures, format_report
    for name, rows in run_ranks(_tp_layouts, 2)[0].items():
        items = {r.item for r in rows}
        assert "step 0 aux loss" in items and "grad model.layers.1.mlp.experts.3.down_proj.weight" in items, name
        bad = failures(rows)
        assert not bad, name + "\n" + format_report(bad)


def test_the_routing_histogram_counts_every_routed_slot_per_layer_summed_over_ranks():
    """Each microbatch's tokens per expert (moe.recorded_routing: one per forward, the last one the
    layers' own `tokens_per_expert`, none for a checkpointed forward re-run inside backward), summed
    over the ranks microbatch by microbatch (the benchmark's `routing_per_microbatch`, a --routing
    file's JSON, and `tokens_per_expert`, the last microbatch's)."""
    from minimind_parallel.moe import recorded_routing, routing_histogram
    from minimind_parallel.tasks.benchmark.outputs import routing_json, routing_text
    from minimind_parallel.tasks.benchmark.rank import merged_routing, routing_result
    config = moe_config(num_experts_per_tok=2)
    model = MiniMindForCausalLM(config)
    torch.manual_seed(0)
    with recorded_routing(model) as each:
        for i in range(3):   # three microbatches, the last one's re-run inside backward
            ids = torch.randint(0, config.vocab_size, (3, 8))
            if i < 2:
                model(ids)
            else:
                checkpoint(model, ids, use_reentrant=False).logits.sum().backward()
    hist = routing_histogram(model)
    assert len(each) == 3 and each[-1] == hist and each[0] != each[1], each
    assert list(hist) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(sum(counts) == 3 * 8 * 2 and len(counts) == 4 for h in each for counts in h.values())
    other = [{"module." + k: [1, 0, 0, 1] for k in hist}] * 3      # another replica's (DDP-wrapped) counts
    result = routing_result([{"routing": each}, {"routing": other}])
    merged = result["tokens_per_expert"]
    assert merged == merged_routing([hist, other[2]]) and len(result["routing_per_microbatch"]) == 3
    assert merged["model.layers.1.mlp"] == [a + b for a, b in zip(hist["model.layers.1.mlp"], [1, 0, 0, 1])]
    assert result["routing_per_microbatch"][0] == merged_routing([each[0], other[0]])
    assert json.loads(routing_json(result["routing_per_microbatch"])) == result["routing_per_microbatch"]
    assert routing_text(merged).count("|") == 1 and routing_text({}) is None and routing_json([]) is None
    assert routing_result([{"routing": []}]) == {"tokens_per_expert": {}, "routing_per_microbatch": []}


# pipeline layouts: each stage's MoE aux loss enters backward on its own stage (one launch)
MOE_PP_LAYOUTS = {
    "pp2": (ParallelConfig(pp=2), 1),
    "pp2_tp2_sp": (ParallelConfig(pp=2, tp=2, sequence_parallel=True), 1),
}


def _pp_layouts(name):
    from minimind_parallel import ProcessGroups
    from minimind_parallel.validation import compare_with_dense
    par, microbatches = MOE_PP_LAYOUTS[name]
    return compare_with_dense(moe_config(), par, ProcessGroups.build(par), seq_len=16, micro_batch_size=2,
                              num_microbatches=microbatches, dtype=torch.float64, optimizer_steps=2, seed=3)


@pytest.mark.parametrize("name", list(MOE_PP_LAYOUTS))
def test_moe_model_under_pipeline_parallelism_equals_dense_in_float64(name):
    from distributed import run_ranks
    from minimind_parallel.validation import failures, format_report
    par = MOE_PP_LAYOUTS[name][0]
    rows = run_ranks(_pp_layouts, par.world_size, name)[0]
    items = {r.item for r in rows}
    assert "step 0 aux loss" in items and "grad model.layers.0.mlp.gate.weight" in items
    bad = failures(rows)
    assert not bad, "\n" + format_report(bad)
