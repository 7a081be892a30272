"""The dense model against an independent implementation of the same architecture: Hugging Face
transformers' Qwen3 (MiniMind-3 is Qwen3's layout: q/k RMSNorm per head, GQA, RoPE, SwiGLU, tied
embeddings). The dense model is the ground truth of every parallel test and shares its numeric
helpers (RMSNorm, RoPE, repeat_kv, attention) with the parallel model, so an error in a helper
shows only here.

Qwen3 is built from a config (no download) and loaded with our state dict by name (MiniMind-3's
keys are Qwen3's). Tolerance: transformers casts to float32 inside RMSNorm and the eager softmax,
so a float64 comparison is limited by float32 round-off anyway; the comparison runs in float32
and is held to K x the dense model's own float32 error (its float32 run against its float64
run on the same weights and ids), measured here.
"""
import pytest
import torch
import torch.nn.functional as F
import transformers  # a test dependency (pyproject's `test` extra)

from helpers import rel_l2
from minimind_parallel import MiniMindConfig, MiniMindForCausalLM

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
            max_position_embeddings=64)
# Two float32 implementations that each carry the dense model's float32 round-off e (measured
# against float64) differ by up to about 2e plus reordering; 10x leaves room for that and for
# transformers' different but equally exact op order, while a real error (a flipped rotation,
# a missing norm, a wrong head grouping) is O(1) relative, five orders above.
K = 10


def qwen3(c: MiniMindConfig, attn_implementation: str):
    config = transformers.Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=False, attention_dropout=0.0,
        attn_implementation=attn_implementation)
    return transformers.Qwen3ForCausalLM(config)


def loss_of(logits, ids):
    """Next-token cross entropy written here: logits[:, :-1] against ids[:, 1:]."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    loss_of(logits, ids).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("flash,attn_implementation", [(True, "sdpa"), (False, "eager")])
def test_dense_model_matches_transformers_qwen3_logits_and_every_grad(tied, flash, attn_implementation):
    c = MiniMindConfig(**TINY, tie_word_embeddings=tied, flash_attn=flash)
    torch.manual_seed(0)
    ours = MiniMindForCausalLM(c)
    ref = qwen3(c, attn_implementation)
    ref.load_state_dict(ours.state_dict(), strict=True)
    assert (ref.lm_head.weight is ref.model.embed_tokens.weight) == tied
    ids = torch.randint(0, c.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))

    exact = MiniMindForCausalLM(c).double()
    exact.load_state_dict(ours.state_dict())
    want_logits, want_grads = logits_and_grads(exact, ids)
    got_logits, got_grads = logits_and_grads(ours, ids)
    ref_logits, ref_grads = logits_and_grads(ref, ids)
    assert set(ref_grads) == set(got_grads)

    baseline = rel_l2(got_logits, want_logits)  # the dense model's own float32 error
    assert 0 < baseline < 1e-5
    err = rel_l2(got_logits, ref_logits)
    assert err <= K * baseline, f"logits: rel-L2 {err:.2e} vs {K} x float32 round-off {baseline:.2e}"
    for name, want in want_grads.items():
        baseline = rel_l2(got_grads[name], want)
        err = rel_l2(got_grads[name], ref_grads[name])
        assert err <= K * baseline, f"grad {name}: rel-L2 {err:.2e} vs {K} x float32 round-off {baseline:.2e}"


@pytest.mark.parametrize("tied", [True, False])
def test_loss_on_unshifted_labels_equals_transformers_qwen3_on_the_same_labels(tied):
    """`model(ids, labels=labels).loss` as a transformers user calls it: Qwen3 shifts the same labels,
    ignores the same -100s; within 10x the dense model's own float32 error on the loss. The kept
    logits of `logits_to_keep` are Qwen3's too."""
    c = MiniMindConfig(**TINY, tie_word_embeddings=tied)
    torch.manual_seed(0)
    ours = MiniMindForCausalLM(c)
    ref = qwen3(c, "sdpa")
    ref.load_state_dict(ours.state_dict(), strict=True)
    exact = MiniMindForCausalLM(c).double()
    exact.load_state_dict(ours.state_dict())
    ids = torch.randint(0, c.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100                                   # a prompt not learned, as SFT masks it
    labels[1, 20:] = -100
    mask = torch.ones_like(ids)
    with torch.no_grad():
        got = ours(ids, mask, labels=labels).loss
        want = exact(ids, mask, labels=labels).loss
        theirs = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
        unmasked = ref(input_ids=ids, labels=ids).loss
        kept, ref_kept = ours(ids, logits_to_keep=4).logits, ref(input_ids=ids, logits_to_keep=4).logits
    baseline = abs(got.double() - want).item()
    assert abs(theirs.double() - got.double()).item() <= K * max(baseline, 1e-7 * want.item())
    assert abs(unmasked - theirs).item() > 1e-3             # the -100s matter: ignoring them is seen
    assert kept.shape == (2, 4, c.vocab_size)
    assert rel_l2(kept, ref_kept) <= K * rel_l2(kept, exact(ids).logits[:, -4:].detach())
