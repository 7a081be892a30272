"""Generation with a KV cache: the tokens of recomputing the whole sequence each step, the tokens of
transformers' greedy `generate` on the exported model, and top-p sampling that is reproducible and
never leaves the nucleus."""
import dataclasses
import math

import pytest
import torch
import transformers  # a test dependency (pyproject's `test` extra)

from helpers import one_line_error
from interop_helpers import lively_model, write_word_tokenizer
from minimind_parallel import ConfigError
from minimind_parallel.data.tokenizer import load_tokenizer
from minimind_parallel.generation import KVCache, forward_cached, generate, generate_text, prompt_ids, sample_next
from minimind_parallel.interop import export_hf

PROMPT = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def generate_without_cache(model, ids, steps, *, temperature=0.0, top_p=1.0, seed=0):
    """The reference: run the whole sequence through the model's own forward for every new token."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        logits = model(ids).logits[:, -1]
        token = sample_next(logits, temperature=temperature, top_p=top_p, generator=generator)
        ids = torch.cat([ids, token[:, None]], dim=1)
    return ids


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("flash", [True, False])
def test_kv_cache_greedy_gives_the_tokens_and_logits_of_full_recompute(tied, flash):
    model = lively_model(tie_word_embeddings=tied, flash_attn=flash)
    steps = 20
    want = generate_without_cache(model, PROMPT, steps)
    got = generate(model, PROMPT, max_new_tokens=steps)
    assert torch.equal(got, want)
    assert len(set(got[:, PROMPT.shape[1]:].flatten().tolist())) > 8  # the model does not just repeat itself

    cache = KVCache.allocate(model, 2, want.shape[1])  # and each cached step's logits at round-off
    with torch.no_grad():
        full = model(want).logits
        for end in [PROMPT.shape[1]] + list(range(PROMPT.shape[1] + 1, want.shape[1] + 1)):
            step = forward_cached(model, want[:, cache.length:end], cache)
            torch.testing.assert_close(step, full[:, end - 1], rtol=1e-5, atol=1e-5)


def test_kv_cache_sampling_draws_the_tokens_of_full_recompute_for_the_same_seed():
    model = lively_model()
    want = generate_without_cache(model, PROMPT, 16, temperature=0.8, top_p=0.9, seed=7)
    assert torch.equal(generate(model, PROMPT, max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7), want)


def test_greedy_generation_equals_transformers_generate_on_the_export(tmp_path):
    model = lively_model()
    hf = transformers.AutoModelForCausalLM.from_pretrained(export_hf(model.state_dict(), model.config,
                                                                     str(tmp_path / "hf")))
    steps = 20
    want = hf.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=steps, min_new_tokens=steps,
                       do_sample=False, pad_token_id=0)
    assert torch.equal(generate(model, PROMPT, max_new_tokens=steps), want)


def test_transformers_tokenizer_and_greedy_generate_on_the_export_give_our_text_token_for_token(tmp_path):
    """What a transformers user runs on the export: `tok(prompt)` (bos first, as our prompt and the
    training rows start) then greedy `generate`, decoded: our tokens and our text."""
    tok_dir = write_word_tokenizer(str(tmp_path / "tok"))
    tok = load_tokenizer(tok_dir)
    model = lively_model(vocab_size=tok.vocab_size).eval()
    out = export_hf(model.state_dict(), model.config, str(tmp_path / "hf"), tokenizer_dir=tok_dir)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    prompt = "the cat sat on"
    inputs = hf_tok(prompt, return_tensors="pt")
    ids = prompt_ids(tok, prompt, vocab_size=model.config.vocab_size)
    assert inputs.input_ids[0, 0].item() == tok.bos_id and inputs.input_ids[0].tolist() == ids
    theirs = hf.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=tok.eos_id,
                         pad_token_id=tok.pad_id)
    ours = generate(model, torch.tensor([ids]), max_new_tokens=8, eos_id=tok.eos_id)
    assert len(set(ours[0, len(ids):].tolist())) > 2                 # the model wanders, the test can tell
    assert theirs.tolist() == ours.tolist()
    text = hf_tok.decode(theirs[0, len(ids):], skip_special_tokens=True)
    assert text == generate_text(model, tok, prompt, max_new_tokens=8)


def test_generation_stops_at_eos_and_fills_finished_rows_with_it():
    model = lively_model()
    free = generate(model, PROMPT, max_new_tokens=12)[:, PROMPT.shape[1]:]
    eos = free[0, 3].item()
    stop = [row.index(eos) if eos in row else None for row in free.tolist()]
    got = generate(model, PROMPT, max_new_tokens=12, eos_id=eos)[:, PROMPT.shape[1]:]
    assert got.shape[1] == (12 if None in stop else max(stop) + 1)
    for row, s in enumerate(stop):
        if s is None:
            assert torch.equal(got[row], free[row, :got.shape[1]])
        else:
            assert torch.equal(got[row, :s + 1], free[row, :s + 1])
            assert (got[row, s:] == eos).all()


def test_sampling_is_reproducible_for_a_seed_and_differs_across_seeds():
    model = lively_model()
    runs = [generate(model, PROMPT, max_new_tokens=16, temperature=1.0, top_p=0.95, seed=s) for s in (5, 5, 6)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("top_p,nucleus", [(0.45, {0}), (0.75, {0, 1}), (0.9, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_draws_only_inside_the_nucleus_in_proportion(top_p, nucleus):
    """Probabilities 0.5, 0.3, 0.15, 0.05 on shuffled ids: the nucleus for top_p is the smallest set of
    the most likely tokens whose mass reaches top_p; draws land only there, renormalised within it."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    ids = torch.tensor([9, 2, 14, 5])  # rank r has token ids[r] in a vocabulary of 16
    logits = torch.full((16,), -math.inf).index_put((ids,), probs.log())
    draws = sample_next(logits.expand(8000, 16), temperature=1.0, top_p=top_p,
                        generator=torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {ids[r].item() for r in nucleus}
    mass = probs[sorted(nucleus)].sum()
    for r in nucleus:
        share = (draws == ids[r]).double().mean().item()
        assert abs(share - probs[r].item() / mass) < 0.02, (r, share)


def test_temperature_reshapes_the_distribution_and_zero_is_argmax():
    logits = torch.tensor([2.0, 1.0, 0.0])
    for t in (0.5, 2.0):
        draws = sample_next(logits.expand(8000, 3), temperature=t, top_p=1.0, generator=torch.Generator().manual_seed(1))
        want = torch.softmax(logits / t, dim=0)
        got = torch.bincount(draws, minlength=3).double() / 8000
        assert (got - want).abs().max() < 0.02, (t, got, want)
    assert sample_next(torch.tensor([[0.1, 3.0, 2.9]]), temperature=0.0, top_p=0.5, generator=None).tolist() == [1]


def test_generate_text_is_text_in_text_out_and_stops_at_eos(tmp_path):
    tok = load_tokenizer(write_word_tokenizer(str(tmp_path / "tok")))
    model = lively_model(vocab_size=tok.vocab_size)  # every id decodes to a word
    prompt = "the cat sat on"
    ids = [tok.bos_id] + tok.tokenizer.encode(prompt).ids
    tokens = generate(model, torch.tensor([ids]), max_new_tokens=6)[0, len(ids):].tolist()
    text = generate_text(model, tok, prompt, max_new_tokens=6)
    assert text == tok.tokenizer.decode(tokens, skip_special_tokens=True) and text.strip()

    # The same tokenizer with eos declared as the third generated token: the text ends before it.
    eos = tokens[2]
    stopping = dataclasses.replace(tok, eos_id=eos)
    assert generate_text(model, stopping, prompt, max_new_tokens=6) == tok.tokenizer.decode(
        tokens[:tokens.index(eos)], skip_special_tokens=True)


def test_bad_generation_arguments_are_refused_with_one_line(tmp_path):
    model = lively_model()
    tok = load_tokenizer(write_word_tokenizer(str(tmp_path / "tok")))
    cases = [
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (dict(max_new_tokens=4, temperature=-1.0), "temperature must be >= 0"),
        (dict(max_new_tokens=4, top_p=0.0), "top_p must be in (0, 1]"),
        (dict(max_new_tokens=60), "prompt length + max_new_tokens must be <= max_position_embeddings; got 7 + 60 > 64"),
    ]
    for kwargs, expected in cases:
        assert expected in one_line_error(ConfigError, generate, model, PROMPT, **kwargs)
    assert "at least one token" in one_line_error(ConfigError, generate_text, model, tok, "", max_new_tokens=2,
                                                  add_bos=False)
    small = lively_model(vocab_size=8)
    assert "has 15 tokens, more than the model's vocab_size=8" in one_line_error(
        ConfigError, generate_text, small, tok, "the cat", max_new_tokens=2)
