"""YaRN for sequences beyond the trained length, as MiniMind's --inference_rope_scaling: the RoPE
tables equal MiniMind's precompute_freqs_cis with its rope_scaling (reimplemented below from
model/model_minimind.py), the parallel model uses them (validate in tp2 + SP equals the dense
model), generate and export take the flag, and the Hugging Face export's rope_scaling makes
transformers give our logits."""
import math

import pytest
import torch
import transformers

from distributed import run_ranks
from helpers import rel_l2
from interop_helpers import lively_model
from minimind_parallel import cli
from minimind_parallel.config import INFERENCE_ROPE_SCALING, MiniMindConfig, ParallelConfig
from minimind_parallel.groups import ProcessGroups
from minimind_parallel.interop import export_hf
from minimind_parallel.model import rope_tables
from minimind_parallel.validation import compare_with_dense, failures, format_report

MINIMIND_ROPE_SCALING = {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 2048,
                         "attention_factor": 1.0, "type": "yarn"}   # MiniMindConfig with inference_rope_scaling


def minimind_precompute_freqs_cis(dim, end=int(32 * 1024), rope_base=1e6, rope_scaling=None):
    freqs, attn_factor = 1.0 / (rope_base ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim)), 1.0
    if rope_scaling is not None:
        orig_max, factor, beta_fast, beta_slow, attn_factor = (
            rope_scaling.get("original_max_position_embeddings", 2048), rope_scaling.get("factor", 16),
            rope_scaling.get("beta_fast", 32.0), rope_scaling.get("beta_slow", 1.0),
            rope_scaling.get("attention_factor", 1.0))
        if end / orig_max > 1.0:
            inv_dim = lambda b: (dim * math.log(orig_max / (b * 2 * math.pi))) / (2 * math.log(rope_base))  # noqa: E731
            low, high = max(math.floor(inv_dim(beta_fast)), 0), min(math.ceil(inv_dim(beta_slow)), dim // 2 - 1)
            ramp = torch.clamp((torch.arange(dim // 2, device=freqs.device).float() - low) / max(high - low, 0.001),
                               0, 1)
            freqs = freqs * (1 - ramp + ramp / factor)
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    freqs_cos = torch.cat([torch.cos(freqs), torch.cos(freqs)], dim=-1) * attn_factor
    freqs_sin = torch.cat([torch.sin(freqs), torch.sin(freqs)], dim=-1) * attn_factor
    return freqs_cos, freqs_sin


@pytest.mark.parametrize("head_dim,end,theta", [(64, 32768, 1e6), (16, 4096, 1e6), (8, 8192, 5e4), (16, 2048, 1e6)])
def test_the_yarn_tables_are_miniminds(head_dim, end, theta):
    ours = rope_tables(head_dim, end, theta, scaling=INFERENCE_ROPE_SCALING)
    theirs = minimind_precompute_freqs_cis(head_dim, end, theta, MINIMIND_ROPE_SCALING)
    plain = rope_tables(head_dim, end, theta)
    for a, b, p in zip(ours, theirs, plain):
        assert torch.equal(a, b)
        assert torch.equal(a, p) == (end <= 2048)   # MiniMind stretches only a table past the original positions


def test_the_hf_export_writes_yarn_and_transformers_gives_our_logits(tmp_path):
    model = lively_model(max_position_embeddings=4096, rope_scaling=dict(INFERENCE_ROPE_SCALING))
    plain = lively_model(max_position_embeddings=4096)
    out = export_hf(model.state_dict(), model.config, str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    exact = lively_model(max_position_embeddings=4096, rope_scaling=dict(INFERENCE_ROPE_SCALING)).double()
    with torch.no_grad():
        want, got, ref, unscaled = exact(ids).logits, model(ids).logits, hf(ids).logits, plain(ids).logits
    baseline = rel_l2(got, want)
    assert 0 < baseline < 1e-5
    assert rel_l2(unscaled, got) > 1e-3                     # YaRN changes the logits ...
    assert rel_l2(ref, got) <= 10 * baseline, f"rel-L2 {rel_l2(ref, got):.2e} vs float32 round-off {baseline:.2e}"


def test_generate_validate_and_export_take_the_flag():
    for argv in (["validate", "--", "--inference_rope_scaling"],
                 ["generate", "--", "--from_weight", "x.pth", "--tokenizer_path", "t", "--prompt", "p",
                  "--inference_rope_scaling"]):
        assert cli.resolve(argv).model.rope_scaling == INFERENCE_ROPE_SCALING
    assert cli.resolve(["validate", "--"]).model.rope_scaling is None
    assert cli.resolve(["export", "--", "--checkpoint", "c", "--format", "hf", "--out", "o",
                        "--inference_rope_scaling"]).task.inference_rope_scaling


def _validate_yarn(par):
    config = MiniMindConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                            vocab_size=128, max_position_embeddings=4096, rope_scaling=dict(INFERENCE_ROPE_SCALING))
    return compare_with_dense(config, par, ProcessGroups.build(par), seq_len=32, micro_batch_size=2,
                              dtype=torch.float32, optimizer_steps=1, seed=3)


def test_validate_with_yarn_in_tp2_sp_equals_the_dense_model():
    rows = run_ranks(_validate_yarn, 2, ParallelConfig(tp=2, sequence_parallel=True))[0]
    bad = failures(rows)
    assert rows and not bad, "\n" + format_report(bad)
