"""MiniMind's MoE weight file and the Qwen3-MoE export: a `{weight}_{hidden}_moe.pth` written as
MiniMind's trainer writes it (from the faithful reimplementation of its MOEFeedForward) loads
strictly and gives its logits and aux loss; a dense file given to the MoE model and the other way
round are refused in one line; the Hugging Face folder loads in transformers as
Qwen3MoeForCausalLM with our logits."""
import os
from argparse import Namespace

import torch
import transformers  # a test dependency (pyproject's `test` extra)

from helpers import one_line_error, rel_l2
from minimind_parallel import ConfigError, MiniMindConfig, MiniMindForCausalLM
from minimind_parallel.interop import export_hf, load_minimind_state_dict, minimind_weight_name
from minimind_parallel.tasks.export import minimind_path
from minimind_moe_reference import reference_aux_loss, reference_model

MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
           max_position_embeddings=64, use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           router_aux_loss_coef=0.1)


def minimind_writes(model, path):
    """What jingyaogong/minimind's trainer writes (trainer_utils.lm_checkpoint): every tensor .half().cpu()."""
    torch.save({k: v.half().cpu() for k, v in model.state_dict().items()}, path)


def test_moe_weight_name_is_minimind_s(tmp_path):
    assert minimind_weight_name("pretrain", 768, use_moe=True) == "pretrain_768_moe.pth"
    config = MiniMindConfig(**MOE)
    assert minimind_path(Namespace(out=str(tmp_path), weight="full_sft"), config) == str(tmp_path / "full_sft_64_moe.pth")


def test_a_minimind_moe_pth_loads_strictly_with_its_logits_and_aux_loss(tmp_path):
    config = MiniMindConfig(**MOE)
    torch.manual_seed(0)
    theirs = reference_model(config)
    path = str(tmp_path / minimind_weight_name("pretrain", config.hidden_size, use_moe=True))
    minimind_writes(theirs, path)
    ours = MiniMindForCausalLM(config)
    ours.load_state_dict(load_minimind_state_dict(path, config), strict=True)
    theirs = reference_model(config)                     # the file's weights, as MiniMind loads them back
    theirs.load_state_dict({k: v.float() for k, v in torch.load(path, weights_only=True).items()}, strict=True)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    got, want = ours(ids, labels=ids), theirs(ids, labels=ids)
    assert rel_l2(got.logits, want.logits) < 1e-6 and abs(got.loss.item() - want.loss.item()) < 1e-5
    assert abs(got.aux_loss.item() / reference_aux_loss(theirs).item() - 1) < 1e-5


def test_a_dense_pth_for_the_moe_model_and_an_moe_pth_for_the_dense_one_are_refused_in_one_line(tmp_path):
    moe, dense = MiniMindConfig(**MOE), MiniMindConfig(**{**MOE, "use_moe": False, "num_experts": 4,
                                                          "num_experts_per_tok": 1, "moe_intermediate_size": None,
                                                          "router_aux_loss_coef": 5e-4})
    dense_path, moe_path = str(tmp_path / "pretrain_64.pth"), str(tmp_path / "pretrain_64_moe.pth")
    minimind_writes(MiniMindForCausalLM(dense), dense_path)
    minimind_writes(MiniMindForCausalLM(moe), moe_path)
    assert "holds a dense model" in one_line_error(ConfigError, load_minimind_state_dict, dense_path, moe)
    assert "pass --use_moe" in one_line_error(ConfigError, load_minimind_state_dict, moe_path, dense)
    eight = MiniMindConfig(**{**MOE, "num_experts": 8})
    message = one_line_error(ConfigError, load_minimind_state_dict, moe_path, eight)
    assert "mlp.gate.weight has shape [4, 64]" in message and "num_experts=8) expects [8, 64]" in message


def test_moe_export_loads_in_transformers_as_qwen3_moe_with_our_logits(tmp_path):
    """The weights bit-equal, the float32 logits within 10x the model's own float32 round-off (its
    float32 run against its float64 run). transformers' aux loss (output_router_logits) sums the
    counts and scores over all layers before the product; MiniMind's is the sum of each layer's
    product: equal for one layer (checked), different for more."""
    config = MiniMindConfig(**MOE)
    torch.manual_seed(0)
    model = MiniMindForCausalLM(config)
    out = export_hf(model.state_dict(), config, str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    exact = MiniMindForCausalLM(config).double()
    exact.load_state_dict(model.state_dict())
    with torch.no_grad():
        want, got, ref = exact(ids).logits, model(ids).logits, hf(ids).logits
    baseline = rel_l2(got, want)
    assert 0 < baseline < 1e-5
    assert rel_l2(ref, got) <= 10 * baseline, f"rel-L2 {rel_l2(ref, got):.2e} vs float32 round-off {baseline:.2e}"

    one = MiniMindConfig(**{**MOE, "num_hidden_layers": 1})
    model = MiniMindForCausalLM(one)
    hf = transformers.AutoModelForCausalLM.from_pretrained(export_hf(model.state_dict(), one, str(tmp_path / "hf1")))
    with torch.no_grad():
        theirs = hf(ids, output_router_logits=True).aux_loss * one.router_aux_loss_coef
        ours = model(ids).aux_loss
    assert ours.item() > 0 and abs(ours.item() / theirs.item() - 1) < 1e-5
    assert set(os.listdir(out)) >= {"config.json", "model.safetensors"}


def test_validate_refuses_a_dense_pth_with_use_moe_in_one_line_before_launch(tmp_path, monkeypatch, capsys):
    from minimind_parallel import cli, launcher
    dense = MiniMindConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           vocab_size=64)
    minimind_writes(MiniMindForCausalLM(dense), str(tmp_path / "pretrain_32.pth"))
    launched = []
    monkeypatch.setattr(launcher, "run_torchrun", lambda *a, **k: launched.append(a) or 0)
    code = cli.main(["validate", "--", "--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "4",
                     "--num_key_value_heads", "2", "--vocab_size", "64", "--seq_len", "8", "--use_moe", "--tie_word_embeddings",
                     "--from_weight", str(tmp_path / "pretrain_32.pth")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not launched and len(err.splitlines()) == 1, err
    assert "holds a dense model (model.layers.0.mlp.gate_proj.weight, no router)" in err and "drop --use_moe" in err


MOE_LIVELY = dict(use_moe=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _moe_tp2_generate(state, ids):
    from interop_helpers import lively_model
    from minimind_parallel import ProcessGroups
    from minimind_parallel.parallel_generation import build_generation_model, generate_parallel, generation_layout
    model = build_generation_model(lively_model(**MOE_LIVELY).config, ProcessGroups.build(generation_layout(2)), state)
    return generate_parallel(model, ids, max_new_tokens=12)


def test_moe_generation_on_one_rank_and_under_tp2_gives_the_same_tokens():
    """Greedy decoding with the KV cache (every step routes its one new token) against the
    faithful MiniMind loop's tokens, on one rank and under TP (router and experts on every TP rank)."""
    from distributed import run_ranks
    from interop_helpers import lively_model
    from minimind_parallel.generation import generate
    model = lively_model(**MOE_LIVELY).eval()
    ids = torch.tensor([[1, 3, 4, 5], [1, 7, 8, 9]])
    want = generate(model, ids, max_new_tokens=12)
    assert len(set(want[0, 4:].tolist())) > 3
    theirs = reference_model(model.config).eval()
    theirs.load_state_dict(model.state_dict(), strict=True)
    assert torch.equal(generate(theirs, ids, max_new_tokens=12), want)
    got = run_ranks(_moe_tp2_generate, 2, model.state_dict(), ids)
    assert torch.equal(got[0], want) and torch.equal(got[1], want)
