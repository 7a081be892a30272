"""The parallel plan (minimind_parallel/plan.py) and the model agree: every stage of every layout
builds exactly the plan's parameters at the plan's local shapes, each in the layer its style
names, every shard is the dense slice the plan's style names, and the grads the plan calls
partial over TP are exactly those that differ from the dense gradient before they are summed."""
from dataclasses import replace

import pytest
import torch
from torch import nn

from distributed import run_ranks
from minimind_parallel import MiniMindConfig, MiniMindForCausalLM, ParallelConfig, ProcessGroups
from minimind_parallel.data.batches import random_batch
from minimind_parallel.memory.estimate import fake_process_group
from minimind_parallel.parallel_model import ParallelMiniMindForCausalLM
from minimind_parallel.plan import (PLAN, Style, grad_is_partial, grad_is_shared_over_stages, plan_of, stage_of,
                                    stage_parameters)
from minimind_parallel.model import RMSNorm
from minimind_parallel.recompute import LeanRMSNorm
from minimind_parallel.sharding import gather_state_dict, shard_state_dict
from minimind_parallel.styles import LAYERS
from minimind_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from minimind_parallel.training import build_parallel_model
from minimind_parallel.validation import dense_slice

TINY = MiniMindConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                      vocab_size=128, max_position_embeddings=64)
TINY_MOE = replace(TINY, use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96)
LAYOUTS = {  # "moe_" layouts run the mixture-of-experts model
    "moe_single": ParallelConfig(),
    "moe_tp2_sp": ParallelConfig(tp=2, sequence_parallel=True),
    "single": ParallelConfig(),
    "tp2": ParallelConfig(tp=2),
    "tp4_sp_vp": ParallelConfig(tp=4, sequence_parallel=True, vocab_parallel=True),
    "pp2_tp2_vp": ParallelConfig(pp=2, tp=2, vocab_parallel=True),
    "pp4": ParallelConfig(pp=4),
    "pp2_tp2_sp": ParallelConfig(pp=2, tp=2, sequence_parallel=True),
}


def _config(name):
    return TINY_MOE if name.startswith("moe_") else TINY


def _rank_model(config, par, stage, tp_rank):
    """TP rank `tp_rank` of pipeline stage `stage`, built in a fake process group (no peers)."""
    with fake_process_group(stage * par.tp + tp_rank, par.world_size):
        return ParallelMiniMindForCausalLM(config, par, ProcessGroups.build(par))


def _dense_slice_by_style(key, dense, par, tp_rank):
    """What each style means, written out: column splits the output rows, row the input columns,
    vocab the vocabulary rows (with --vocab_parallel), replicated nothing."""
    style = plan_of(key).style
    if style is Style.COLUMN or (style in (Style.VOCAB_EMBEDDING, Style.VOCAB_HEAD) and par.vocab_parallel):
        rows = dense.shape[0] // par.tp
        return dense[tp_rank * rows:(tp_rank + 1) * rows]
    if style is Style.ROW:
        cols = dense.shape[1] // par.tp
        return dense[:, tp_rank * cols:(tp_rank + 1) * cols]
    return dense


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_stage_builds_the_plans_parameters_at_its_local_shapes(name, tied):
    par, config = LAYOUTS[name], replace(_config(name), tie_word_embeddings=tied)
    for stage in range(par.pp):
        model = _rank_model(config, par, stage, 0)
        built = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        assert built == list(stage_parameters(config, par, stage).items()), (name, stage)
        for n, p in model.named_parameters():
            assert getattr(p, "tp_partial_grad", False) == grad_is_partial(n, par), n
            assert getattr(p, "shared_embedding", False) == grad_is_shared_over_stages(n, config, par), n


# layout -> whether the norms are the lean ones (--recompute selective | full)
LAYER_LAYOUTS = {
    "moe_tp2_sp_async_selective": (ParallelConfig(tp=2, sequence_parallel=True, async_communication=True,
                                                  recompute="selective"), True),
    "single": (ParallelConfig(), False),
    "tp2": (ParallelConfig(tp=2), False),
    "tp2_sp_async_shared_vp_selective": (ParallelConfig(tp=2, sequence_parallel=True, async_communication=True,
                                                        shared_sp_gather=True, vocab_parallel=True,
                                                        recompute="selective"), True),
    "pp2_tp2_sp_vp_full": (ParallelConfig(pp=2, tp=2, sequence_parallel=True, vocab_parallel=True,
                                          recompute="full"), True),
}


def _layer_the_style_names(style, par, lean):
    """What each style builds, written out: column / row-parallel linears; the embedding and the
    lm_head vocab-parallel with --vocab_parallel, else torch's; MiniMind's RMSNorm or the lean one."""
    return {Style.COLUMN: ColumnParallelLinear, Style.ROW: RowParallelLinear,
            Style.VOCAB_EMBEDDING: VocabParallelEmbedding if par.vocab_parallel else nn.Embedding,
            Style.VOCAB_HEAD: ColumnParallelLinear if par.vocab_parallel else nn.Linear,
            Style.NORM: LeanRMSNorm if lean else RMSNorm, Style.ROUTER: nn.Linear, Style.EXPERT: nn.Linear}[style]


def test_every_style_builds_a_layer():
    assert set(LAYERS) == set(Style)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("name", list(LAYER_LAYOUTS))
def test_every_parameter_sits_in_the_layer_its_style_names(name, tied):
    """Each parameter has a plan row, and the module holding it is the layer the row's style
    names, with the layout's TP features: SP on every TP layer, the async linear and the shared
    all-gather on the column-parallel ones."""
    (par, lean), config = LAYER_LAYOUTS[name], replace(_config(name), tie_word_embeddings=tied)
    for stage in range(par.pp):
        model = _rank_model(config, par, stage, 0)
        for key, _ in model.named_parameters():
            style = plan_of(key).style                      # KeyError: a parameter without a row
            layer = model.get_submodule(key.rpartition(".")[0])
            assert type(layer) is _layer_the_style_names(style, par, lean), (key, type(layer))
            if isinstance(layer, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
                assert layer.sequence_parallel == par.sequence_parallel, key
            if isinstance(layer, ColumnParallelLinear):
                assert layer.async_communication == par.async_communication, key
                assert layer.shared_input == (par.shared_sp_gather and style is Style.COLUMN), key


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_shard_is_the_dense_slice_the_plan_names(name):
    par, config = LAYOUTS[name], replace(_config(name), tie_word_embeddings=False)
    torch.manual_seed(0)
    dense = MiniMindForCausalLM(config).state_dict()
    # the plan names every dense parameter, and its entries (those of this model) name nothing else
    assert {plan_of(k).pattern for k in dense} == {e.pattern for e in PLAN if e.applies(config)}
    shards = []
    for stage in range(par.pp):
        for t in range(par.tp):
            model = _rank_model(config, par, stage, t)
            shard = shard_state_dict(dense, par, t, stage)
            model.load_state_dict(shard, strict=True)   # every key of the stage, at its shape
            for key, value in model.state_dict().items():
                assert stage_of(key, TINY.num_hidden_layers, par.pp) == stage, key
                assert torch.equal(value, _dense_slice_by_style(key, dense[key], par, t)), (key, stage, t)
            shards.append(shard)
    back = gather_state_dict(shards, par)
    assert sorted(back) == sorted(dense) and all(torch.equal(back[k], dense[k]) for k in dense)


def _partial_grads(par, base):
    """Dense and parallel model from the same float64 weights, one backward on the same batch, no
    grad finalisation: which local grads differ from the dense slice, and what the plan says."""
    groups = ProcessGroups.build(par)
    config = replace(base, tie_word_embeddings=False, num_hidden_layers=2)
    torch.manual_seed(0)
    dense = MiniMindForCausalLM(config).double()
    model = build_parallel_model(config, par, groups, dense.state_dict(), dtype=torch.float64)
    ids, targets = random_batch(0, 2, 16, config.vocab_size)
    dense(ids, targets=targets).objective.backward()     # the LM loss (+ the MoE aux loss)
    model(ids, targets).objective.backward()
    grads = dict(dense.named_parameters())
    differs = {n: not torch.allclose(p.grad, dense_slice(n, grads[n].grad, par, groups.tp_rank), rtol=1e-9,
                                     atol=0) for n, p in model.named_parameters()}
    return differs, {n: grad_is_partial(n, par) for n in differs}


@pytest.mark.parametrize("par, base", [(ParallelConfig(tp=2), TINY),
                                       (ParallelConfig(tp=2, sequence_parallel=True, vocab_parallel=True), TINY),
                                       (ParallelConfig(tp=2), TINY_MOE),
                                       (ParallelConfig(tp=2, sequence_parallel=True), TINY_MOE)],
                         ids=["tp2", "tp2_sp_vp", "moe_tp2", "moe_tp2_sp"])
def test_the_grads_the_plan_calls_partial_are_those_that_differ_from_dense(par, base):
    for differs, partial in run_ranks(_partial_grads, par.tp, par, base):
        assert differs == partial
        assert any(partial.values())
